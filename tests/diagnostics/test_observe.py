"""Straggler attribution, the timeline and its merged trace, under real mpiexec (and serially)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from mpi4py import MPI

import mpistrat
from mpistrat import config
from mpistrat.diagnostics import timeline
from mpistrat.tools import heatmap
from mpistrat.tools import merge_timelines as merge_tool
from tests.conftest import all_ranks_agree, setting_warning

SCHEMA = json.loads((Path(__file__).parents[1] / "support" / "chrome_trace.schema.json").read_text())
STEPS = 50
# the steps and the closing one: strategy.run's closing handshake carries the last all_reduce's arrivals
TALLIED = STEPS + 1
LATE = 0.020  # seconds rank 2 sleeps before each all_reduce


def _loop(strategy: mpistrat.MPIStrategy, late_rank: int | None) -> None:
    rank = strategy.extended.collectives.rank

    def step():
        if rank == late_rank:
            time.sleep(LATE)
        return mpistrat.get_replica_context().all_reduce("sum", np.ones(4, np.float32))

    for _ in range(STEPS):
        assert strategy.run(step).tolist() == [strategy.num_replicas_in_sync] * 4
    # A collective's arrivals are learned in the next handshake: one more, on time, tallies the last step.
    strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", np.zeros(1)))


def test_a_rank_that_sleeps_before_each_step_is_named_last():
    world = MPI.COMM_WORLD
    if world.Get_size() < 3:
        pytest.skip("needs 3 ranks (rank 2 is the late one)")
    strategy = mpistrat.MPIStrategy(world)
    _loop(strategy, late_rank=2)
    table = strategy.extended.stragglers()
    row = table.rows[2]
    ok = (
        table.collectives == TALLIED
        and row.times_last >= 0.9 * STEPS
        and 10.0 <= row.mean_ms <= 40.0  # the 20 ms it slept, give or take the machine's noise
        and table.flagged == [2]
    )
    all_ranks_agree(world, ok, str(table))
    # Every rank learned the same tally (it travels in the handshakes' MAX)
    everyone = world.allgather([(r.times_last, r.total_ms) for r in table.rows])
    all_ranks_agree(world, all(t == everyone[0] for t in everyone), str(everyone))
    strategy.experimental_finalize()


def test_without_a_late_rank_nobody_is_flagged():
    world = MPI.COMM_WORLD
    if world.Get_size() < 3:
        pytest.skip("the 3- and 4-rank case of the test above")
    strategy = mpistrat.MPIStrategy(world)
    _loop(strategy, late_rank=None)
    table = strategy.extended.stragglers()
    all_ranks_agree(world, table.collectives == TALLIED and table.flagged == [], str(table))
    strategy.experimental_finalize()


def test_with_the_check_off_nothing_is_tallied(world):
    strategy = mpistrat.MPIStrategy(
        world.comm, communication_options=mpistrat.CommunicationOptions(check=False)
    )
    ctx_sum = lambda: mpistrat.get_replica_context().all_reduce("sum", np.ones(2))  # noqa: E731
    for _ in range(3):
        strategy.run(ctx_sum)
    table = strategy.extended.stragglers()
    all_ranks_agree(world.comm, table.collectives == 0 and not table.flagged, str(table))
    strategy.experimental_finalize()


def test_the_merged_trace_is_a_valid_chrome_trace_with_every_rank(world):
    comm = world.comm
    directory = comm.bcast(tempfile.mkdtemp(prefix="mpistrat-timeline-") if comm.Get_rank() == 0 else None)
    try:
        mpistrat.start_timeline(directory)
        strategy = mpistrat.MPIStrategy(comm)
        for _ in range(5):
            with mpistrat.trace("step"):
                strategy.run(
                    lambda: mpistrat.get_replica_context().all_reduce("sum", np.ones(256, np.float32))
                )
        strategy.experimental_finalize()
    finally:
        mpistrat.stop_timeline()
    comm.Barrier()
    ok, why = True, ""
    if comm.Get_rank() == 0:
        trace = merge_tool.merge(directory)
        try:
            jsonschema.validate(trace, SCHEMA)
        except jsonschema.ValidationError as exc:
            ok, why = False, f"not a Chrome trace: {exc.message}"
        events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        for r in range(comm.Get_size()):
            mine = [e for e in events if e["pid"] == r]
            kinds = {e["cat"] for e in mine}
            reduces = [e for e in mine if e["name"] == "all_reduce"]
            if kinds != {"handshake", "collective", "span"} or len(reduces) != 5:
                ok, why = False, f"rank {r}: categories {kinds}, {len(reduces)} all_reduce events"
            elif any(
                e["args"]["bytes"] != 256 * 4 or "test_observe.py" not in e["args"]["site"] for e in reduces
            ):
                ok, why = False, f"rank {r}: {reduces[0]['args']}"
        # One node, one clock: the alignment must find (almost) no offset between the ranks.
        shift = merge_tool.offsets(merge_tool.load(directory)[1])
        if max(abs(s) for s in shift.values()) > 0.05:
            ok, why = False, f"offsets {shift}"
        heatmap.imposed_grid(trace)  # every rank's handshakes are there to draw
    all_ranks_agree(comm, comm.bcast(ok), comm.bcast(why))


def test_a_timeline_cut_part_way_merges_its_complete_lines_and_says_so(world, tmp_path, capsys):
    """What "the timeline stopped" leaves: a write that failed part-way cuts the file's last line.
    ``mpistrat timeline`` and ``mpistrat plot`` merge every complete line and say one was cut."""
    from mpistrat.tools import plot

    comm = world.comm
    directory = comm.bcast(tempfile.mkdtemp(prefix="mpistrat-timeline-") if comm.Get_rank() == 0 else None)
    try:
        mpistrat.start_timeline(directory)
        strategy = mpistrat.MPIStrategy(comm)
        for _ in range(6):
            strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", np.ones(8, np.float32)))
        strategy.experimental_finalize()
    finally:
        mpistrat.stop_timeline()
    comm.Barrier()
    ok, why = True, ""
    if comm.Get_rank() == 0:
        last = Path(directory) / f"rank-{comm.Get_size() - 1:05d}.jsonl"
        whole = last.read_bytes()
        last.write_bytes(whole[: whole.rstrip(b"\n").rfind(b"\n") + 20])  # 19 bytes of the last line
        complete = sum(1 for line in last.read_text().splitlines()[1:] if _is_json(line))
        out = tmp_path / "trace.json"
        code = merge_tool.main([directory, "-o", str(out)])
        said = capsys.readouterr()
        events = [e for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X"]
        mine = [e for e in events if e["pid"] == comm.Get_size() - 1]
        if code != 0 or len(mine) != complete or "its last line was cut" not in said.err + said.out:
            ok, why = False, f"exit {code}, {len(mine)} of {complete} events, said {said.err + said.out!r}"
        code = plot.main([directory, "-o", str(tmp_path / "wait.png")])
        said = capsys.readouterr()
        if code != 0 or "its last line was cut" not in said.err + said.out:
            ok, why = False, f"plot: exit {code}, said {said.err + said.out!r}"
    all_ranks_agree(comm, comm.bcast(ok), comm.bcast(why))


def _is_json(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def test_a_span_is_nothing_while_the_timeline_is_off():
    assert mpistrat.trace("a") is mpistrat.trace("b")  # one shared do-nothing context


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("MPISTRAT_FLIGHT_RECORDS", "many"),
        ("MPISTRAT_STRAGGLER_SUMMARY", "sometimes"),
        ("MPISTRAT_STRAGGLER_MS", "-1"),
    ],
)
def test_a_bad_setting_names_the_variable_and_gives_the_default(name, value):
    config._warned.discard((name, value))
    with setting_warning(f"{name}='{value}' is not"):
        got = config.read(name, {name: value})
    assert got == config.SETTINGS[name].default


def test_offsets_align_shifted_clocks_through_a_shared_rank():
    """Ranks 0 and 2 share no communicator; rank 1 shares one with each. Clocks: +0, +5, -3 s."""
    hs = merge_tool._hs
    events = {
        0: [hs(1, 10.0, 0.1, comm="a"), hs(2, 11.0, 0.1, comm="a")],
        1: [hs(1, 15.05, 0.05, comm="a"), hs(2, 16.0, 0.1, comm="a"), hs(1, 17.0, 0.2, comm="b")],
        2: [hs(1, 9.1, 0.1, comm="b")],
    }
    shift = merge_tool.offsets(events)
    assert shift[0] == 0.0 and shift[1] == pytest.approx(5.0) and shift[2] == pytest.approx(-3.0)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
def test_a_timeline_that_cannot_be_written_stops_instead_of_raising(tmp_path):
    """Its writes happen inside collectives: an error on one rank there would strand the others."""
    timeline.start_timeline(str(tmp_path))
    writer = timeline.writer
    writer._file.close()
    writer._file = open("/dev/full", "w")  # noqa: SIM115 - every write fails: no space left
    for i in range(timeline.FLUSH_EVERY + 1):
        writer.add("span", "x", float(i), float(i) + 1)
    assert timeline.writer is None
    timeline.stop_timeline()  # nothing left to do, and no error


def test_a_straggler_is_named_by_its_world_rank_too_on_a_sub_communicator(group):
    """World rank 3, rank 1 of the odd half, must not read as "rank 1 was the last to arrive"."""
    from mpistrat.diagnostics.stragglers import StragglerRow, Stragglers

    table = group.strategy.extended.stragglers()
    worlds = group.comm.allgather(MPI.COMM_WORLD.Get_rank())  # the reference: each rank says
    all_ranks_agree(group.comm, [row.world for row in table.rows] == worlds, f"{table.rows} against {worlds}")
    late = StragglerRow(1, 9, 0.9, 90.0, 10.0, 20.0, True, world=3)
    said = Stragglers(10, [StragglerRow(0, 1, 0.1, 0.0, 0.0, 0.0, False, world=1), late])
    assert said.summary().startswith("rank 1 (world 3) was the last to arrive in 90% of 10")
    assert "world" in str(said).splitlines()[1]
    same = StragglerRow(1, 9, 0.9, 90.0, 10.0, 20.0, True, world=1)
    assert Stragglers(10, [same]).summary().startswith("rank 1 was the last")


def test_a_few_collectives_at_many_ranks_flag_nobody_and_the_table_stays_short():
    """128 ranks, 9 collectives: a rank last once is chance (P = 1 - (127/128)^9 = 0.07), not evidence."""
    from mpistrat.diagnostics.stragglers import Tally

    tally = Tally(0, 128, min_mean_ms=1.0)
    for r in range(9):
        tally.times_last[r], tally.total_us[r], tally.worst_us[r] = 1, 50_000, 50_000
    tally._collectives = 9
    table = tally.table()
    assert table.flagged == [] and table.summary() == ""
    lines = str(table).splitlines()
    assert (
        len(lines) == 2 + 5 + 1
        and lines[-1] == "  ... 123 other ranks, each the last to arrive 1 times or fewer"
    )
    # a real straggler over 60 collectives is still named, with the rows it needs
    tally.times_last[:] = 0
    tally.times_last[77], tally.total_us[77] = 60, 60 * 20_000
    tally._collectives = 60
    table = tally.table()
    assert table.flagged == [77] and "rank 77 was the last to arrive in 100% of 60" in table.summary()
    assert sum("<- straggler" in line for line in str(table).splitlines()) == 1
