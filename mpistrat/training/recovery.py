"""What training state does after a rank's death: replicated values taken from one survivor.

The strategy's recovery (``distribute/recovery.py``) settles which survivor holds the step the
others go on from (its ``source``); a mirrored variable or an optimizer's flat buffers then take
that survivor's values, in place (:func:`broadcast_in_place`).

>>> import numpy as np
>>> from mpi4py import MPI
>>> x = np.arange(3.0)
>>> broadcast_in_place(MPI.COMM_SELF, x, 0); x
array([0., 1., 2.])
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from mpistrat.comm import mpi, packing

__all__ = ["broadcast_in_place"]


def broadcast_in_place(comm: MPI.Intracomm, array: Any, root: int) -> None:
    """``root``'s values of ``array`` on every rank of ``comm``, written into ``array`` (a contiguous
    NumPy or CuPy array; device arrays travel through the host)."""
    if packing.array_module(array) is np:
        mpi.bcast(comm, array.reshape(-1), root)
        return
    host = array.get()
    mpi.bcast(comm, host.reshape(-1), root)
    array.set(host)
