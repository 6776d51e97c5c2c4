"""Checkpoints: the API (``checkpoint.py``, what is tracked: ``tracking.py``, what a restore
matched: ``status.py``), numbered saves (``manager.py``), preemption (``preemption.py``, public as
``mpistrat.preemption``); a save (``saving.py``, ``background.py``) and a restore
(``restoring.py``) over MPI-IO (``mpiio.py``), who moves which bytes (``pieces.py``), the file
(``format.py``, format 1: ``legacy.py``; the checksums: ``crc.py``) and the directory's files
(``files.py``).

>>> from mpistrat.checkpoint import Checkpoint
>>> import mpistrat
>>> Checkpoint is mpistrat.Checkpoint
True
"""

from mpistrat.checkpoint.checkpoint import Checkpoint, CheckpointLoadStatus, latest_checkpoint

__all__ = ["Checkpoint", "CheckpointLoadStatus", "latest_checkpoint"]
