"""Load a script of ``benchmarks/`` as a module (tests run its functions through the real code)."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_benchmark(relpath: str, name: str):
    """``benchmarks/<relpath>`` as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", relpath))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
