"""What the layers below ``distribute/`` know of a strategy: the protocols a strategy, its
``extended`` and a replica context satisfy (``protocols``), and which strategy and context a
thread is in (``modes``).

This folder sits above ``collectives/``, so the protocols name the collectives' own types, and
below ``input/``, ``training/`` and ``checkpoint/``, which use a strategy only through it.
"""
