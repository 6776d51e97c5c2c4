"""For type checkers: `mpistrat.metrics` is `mpistrat.training.metrics`"""

from mpistrat.training.metrics import *  # noqa: F403
from mpistrat.training.metrics import __all__ as __all__
