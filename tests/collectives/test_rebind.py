"""``Collectives.rebind``, as a recovery after a rank's death calls it, without a death: what work it
keeps and what it abandons."""

from __future__ import annotations

from mpi4py import MPI

from mpistrat.collectives import Collectives


def test_rebind_abandons_work_begun_over_the_lost_communicator_and_keeps_the_rest():
    c = Collectives(MPI.COMM_SELF.Dup())
    done: list[str] = []

    def abandon() -> None:  # as a background save does: its entries go with it
        done.append("abandoned")
        c.pending.pop("save", None)
        c.after_step.pop("save", None)

    c.pending["save"], c.after_step["save"], c.abandon["save"] = done.clear, done.clear, abandon
    c.pending["window"] = c.after_step["window"] = lambda: done.append("window")  # a save for later
    old = c.comm
    c.rebind(MPI.COMM_SELF.Dup())
    old.Free()
    assert done == ["abandoned"] and not c.abandon
    assert list(c.pending) == ["window"] and list(c.after_step) == ["window"]
    c.step_ended()
    assert done == ["abandoned", "window"] and c.seq == 0
    c.comm.Free()
