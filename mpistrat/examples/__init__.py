"""Runnable examples: ``mpiexec -n 2 python -m mpistrat.examples.digits``."""
