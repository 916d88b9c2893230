"""Shared helpers for the native kernel tests: random bytes at odd addresses."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(12345)


def random_bytes(rng: np.random.Generator, n: int, offset: int = 0) -> np.ndarray:
    """``n`` random bytes whose first byte sits ``offset`` bytes past a 64-byte boundary."""
    base = np.empty(n + 64 + offset, dtype=np.uint8)
    start = (-base.ctypes.data) % 64 + offset
    view = base[start : start + n]
    view[:] = rng.integers(0, 256, size=n, dtype=np.uint8)
    assert n == 0 or view.ctypes.data % 64 == offset % 64
    return view


def zeros_at(n: int, offset: int = 0) -> np.ndarray:
    """A zeroed writable buffer of ``n`` bytes starting ``offset`` bytes past a 64-byte boundary."""
    base = np.zeros(n + 64 + offset, dtype=np.uint8)
    start = (-base.ctypes.data) % 64 + offset
    return base[start : start + n]
