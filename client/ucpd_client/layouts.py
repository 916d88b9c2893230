"""Placements for common parallel layouts: ``ucpd.ucl.layouts``, re-exported for trainers.

The helpers are pure UCL and live in ``ucpd/ucl/layouts.py`` (spec files use them too);
``from ucpd_client import layouts as L`` keeps working and gives the same names — the helpers
and what that module itself offers (``L.Replicated``, ``L.Shard``, ``L.InvalidPlacement``, ...).
"""

from ucpd.ucl import layouts as _impl
from ucpd.ucl.layouts import __all__  # noqa: F401

globals().update({k: v for k, v in vars(_impl).items() if not k.startswith("__")})
del _impl
