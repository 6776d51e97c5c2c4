"""For type checkers: `mpistrat.cluster_resolver` is `mpistrat.distribute.cluster_resolver`"""

from mpistrat.distribute.cluster_resolver import *  # noqa: F403
from mpistrat.distribute.cluster_resolver import __all__ as __all__
