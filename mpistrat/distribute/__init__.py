"""Strategies: ``Strategy`` and ``MPIStrategy`` (``strategy_base.py``, ``strategy.py``), the default
strategy (``default.py``), ``StrategyExtended``, ``ReplicaContext``, merge_call (``merge.py``), the
cross-replica reductions (``reductions.py``) and tf's cluster resolvers.
"""
