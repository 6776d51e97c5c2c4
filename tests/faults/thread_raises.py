"""A thread raises on rank 1; the job ends instead of the others waiting for rank 1."""

import threading
import time

import numpy as np

import mpistrat

strategy = mpistrat.MPIStrategy()
if strategy.extended.rank == 1:

    def work():
        raise OSError("loader thread failed on rank 1")

    thread = threading.Thread(target=work, name="loader")
    thread.start()
    thread.join()
    time.sleep(60)
strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", np.ones(2)))
