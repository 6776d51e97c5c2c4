"""Training state: variables (plain, mirrored, sync-on-read), optimizers over flat (and sharded)
buffers, metrics and losses. The public namespaces are ``mpistrat.optimizers`` and ``mpistrat.metrics``.
"""

# Imported with the package, before any variable is made: it tells variables.py which class
# `Variable(...)` makes inside a strategy's scope (mirrored or sync-on-read).
from mpistrat.training import distributed_variables  # noqa: F401
