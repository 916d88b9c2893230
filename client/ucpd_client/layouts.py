"""Placements for common parallel layouts: ``ucpd.ucl.layouts``, re-exported for trainers.

The helpers are pure UCL and live in ``ucpd/ucl/layouts.py`` (spec files use them too);
``from ucpd_client import layouts as L`` keeps working and gives the same functions.
"""

from ucpd.ucl.layouts import *  # noqa: F401,F403
from ucpd.ucl.layouts import __all__  # noqa: F401
