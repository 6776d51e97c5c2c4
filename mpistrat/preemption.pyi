"""For type checkers: `mpistrat.preemption` is `mpistrat.checkpoint.preemption`"""

from mpistrat.checkpoint.preemption import *  # noqa: F403
from mpistrat.checkpoint.preemption import __all__ as __all__
