"""Training state: variables (plain, mirrored, sync-on-read), optimizers over flat (and sharded)
buffers, metrics and losses. The public namespaces are ``mpistrat.optimizers`` and ``mpistrat.metrics``.
"""
