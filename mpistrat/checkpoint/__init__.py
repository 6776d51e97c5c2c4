"""Checkpoints: what every rank does (``checkpoint.py``), the files on disk (``format.py``),
numbered saves (``manager.py``) and preemption (``preemption.py``, public as ``mpistrat.preemption``).

>>> from mpistrat.checkpoint import Checkpoint
>>> import mpistrat
>>> Checkpoint is mpistrat.Checkpoint
True
"""

from mpistrat.checkpoint.checkpoint import Checkpoint, CheckpointLoadStatus, latest_checkpoint

__all__ = ["Checkpoint", "CheckpointLoadStatus", "latest_checkpoint"]
