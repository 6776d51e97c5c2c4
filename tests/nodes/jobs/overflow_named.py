"""HIERARCHICAL with fp16 compression: one rank's value overflows 16 bits. Each rank prints the
error it got, one line: ``rank R: ErrorType: message``.

Its node's sum overflows between the nodes' leaders, whose communicator numbers only the leaders:
the error must name ranks of the strategy, as every other error does.
"""

import sys

import numpy as np

import mpistrat

culprit = int(sys.argv[1])
strategy = mpistrat.MPIStrategy(
    communication_options=mpistrat.CommunicationOptions(implementation="HIERARCHICAL", compression="fp16")
)
rank = strategy.extended.rank
value = np.full(8, 1e5 if rank == culprit else 1.0, np.float32)
try:
    strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", value))
    print(f"rank {rank}: no error", flush=True)
except mpistrat.MpistratError as exc:
    print(f"rank {rank}: {type(exc).__name__}: {exc}", flush=True)
