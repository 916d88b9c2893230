"""Helpers shared by the format tests."""

from __future__ import annotations

import numpy as np

from ucpd.dtypes import BY_NAME
from ucpd.format import REPLICATED, TensorSource

RNG = np.random.default_rng(1234)


def rand_bytes(dtype: str, shape: tuple[int, ...], rng: np.random.Generator = RNG) -> np.ndarray:
    """Random bytes shaped as ``dtype``'s storage (any bit pattern: elements are never interpreted)."""
    dt = BY_NAME[dtype]
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    return rng.integers(0, 256, n, dtype=np.uint8).view(dt.storage).reshape(shape)


def source(name: str, arr: np.ndarray, dtype: str, pattern=REPLICATED, callable_fill: bool = True) -> TensorSource:
    """A TensorSource over ``arr`` (storage-typed); by callable fill or as a buffer."""
    raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    if callable_fill:
        def fill(out: np.ndarray) -> None:
            out[:] = raw
        return TensorSource(name, dtype, tuple(arr.shape), pattern, fill)
    return TensorSource(name, dtype, tuple(arr.shape), pattern, raw)


def sample_state(rng: np.random.Generator = RNG) -> dict[str, tuple[str, np.ndarray]]:
    """A small mixed state: several dtypes, a scalar, empty tensors, many small ones."""
    state = {
        "embed.weight": ("bfloat16", rand_bytes("bfloat16", (64, 32), rng)),
        "layers.0.w": ("float32", rand_bytes("float32", (32, 48), rng)),
        "layers.0.b": ("float16", rand_bytes("float16", (48,), rng)),
        "optim/layers.0.w/exp_avg": ("float32", rand_bytes("float32", (32, 48), rng)),
        "count": ("int64", rand_bytes("int64", (), rng)),
        "mask": ("bool", (rand_bytes("uint8", (7,), rng) & 1)),
        "empty": ("float32", rand_bytes("float32", (0, 5), rng)),
        "fp8": ("float8_e4m3fn", rand_bytes("float8_e4m3fn", (9,), rng)),
    }
    for i in range(20):
        state[f"small.{i}"] = ("int8", rand_bytes("int8", (i + 1,), rng))
    return state


def sources_of(state, callable_fill: bool = True) -> list[TensorSource]:
    return [source(n, a, d, callable_fill=callable_fill) for n, (d, a) in state.items()]
