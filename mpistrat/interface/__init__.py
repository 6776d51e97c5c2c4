"""What the layers below ``distribute/`` know of a strategy: the protocols a strategy, its
``extended`` and a replica context satisfy (``protocols``), and which strategy and context a
thread is in (``modes``); and what a checkpoint saves of each kind of value (``saved_entry``),
which ``checkpoint/`` reads and ``input/`` and ``training/`` implement.

This folder sits above ``collectives/``, so the protocols name the collectives' own types, and
below ``input/``, ``training/`` and ``checkpoint/``, which use a strategy only through it.
"""
