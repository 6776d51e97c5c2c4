"""Two threads of one rank calling collectives of one strategy at once.

Their collectives would pair up differently on different ranks (a fatal "Message truncated",
or a mismatch error blaming the arguments). The second thread gets ``ContextError`` naming both.
"""

import threading
import time

import numpy as np
import pytest

import mpistrat
from mpistrat import ContextError
from tests.conftest import RankChecks, all_ranks_agree


@pytest.mark.mpi(min_size=2)
def test_a_second_thread_inside_a_collective_is_refused_naming_both(world):
    strategy = world.strategy
    caught: list[BaseException] = []

    def second():
        time.sleep(0.5)  # the main thread is waiting in its all_reduce by now
        try:
            strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", np.ones(2, np.float32)))
        except BaseException as exc:
            caught.append(exc)

    thread = threading.Thread(target=second, name="metrics-logger")
    if world.rank == 0:
        thread.start()
    else:
        time.sleep(2.0)  # keep rank 0's main thread inside the all_reduce meanwhile
    total = strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", np.ones(3, np.float32)))
    if world.rank == 0:
        thread.join(timeout=30)
    message = str(caught[0]) if caught else ""
    checks = RankChecks()
    checks.that(total.tolist() == [world.size] * 3 and total.dtype == np.float32)
    if world.rank == 0:
        checks.that(len(caught) == 1 and isinstance(caught[0], ContextError))
        checks.that(
            "thread 'metrics-logger'" in message and "thread 'MainThread' is inside all_reduce" in message
        )
    checks.agree(world.comm, f"{total} {caught!r}")
    again = strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", np.float32(1)))
    all_ranks_agree(world.comm, float(again) == world.size, f"{again}")


def test_one_thread_after_another_is_fine(group):
    """Handing a strategy to a worker thread (created in one thread, used in another) is allowed."""
    results = []

    def work():
        results.append(group.strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", 2.0)))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    all_ranks_agree(group.comm, results == [2.0 * group.size], f"{results}")
