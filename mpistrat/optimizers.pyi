"""For type checkers: `mpistrat.optimizers` is `mpistrat.training.optimizers`"""

from mpistrat.training.optimizers import *  # noqa: F403
from mpistrat.training.optimizers import __all__ as __all__
