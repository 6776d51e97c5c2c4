"""Run a job's rank as a child that this process outlives by SECONDS: ``mpiexec -n N python
tests/faults/linger.py SECONDS script.py args...``.

MPICH's ``mpiexec`` ends every rank at once when one dies; ``srun`` without ``--kill-on-bad-exit``
(and Slurm's default) leaves the others running. Under this wrapper the launcher sees the
wrapper, not the rank: a rank killed leaves the others running for SECONDS, as ``srun`` would. The
wrapper imports nothing of MPI; the rank inherits its environment (the launcher's PMI connection).
"""

import os
import sys
import time

seconds, script, *args = sys.argv[1:]
pid = os.fork()
if pid == 0:
    os.execv(sys.executable, [sys.executable, script, *args])
_, status = os.waitpid(pid, 0)
code = os.waitstatus_to_exitcode(status)
if code != 0:  # a rank that failed: the others go on without it for a while
    time.sleep(float(seconds))
sys.exit(code if code >= 0 else 128 - code)
