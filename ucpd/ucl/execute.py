"""The executor: run a CopyPlan over flat buffers.

Buffers are 1-D, C-contiguous numpy arrays of a dtype's storage type
(``ucpd.dtypes.DType.storage``: unsigned integers of the element width). Elements are moved,
never converted. Every block copy goes through :func:`_copy_block`, which uses
``ucpd.native.copy`` (multi-threaded, releases the GIL) for large contiguous blocks and
``ucpd.native.copy_window`` for large strided ones (resharded layouts: column shards and the
like) when the native module is built, and ``np.copyto`` otherwise.

:func:`execute_torch` does the same on torch CPU tensors through zero-copy numpy views (numpy has
no bfloat16). torch is imported only there, so ``ucpd.ucl`` works without torch.

Thread safety: concurrent calls are safe when their destination windows do not overlap.
"""

from __future__ import annotations

import math
from typing import Any, Hashable, Mapping

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..dtypes import BY_NAME, DType
from ..errors import PlacementMismatch
from .geometry import View
from .plan import CopyPlan

NATIVE_MIN_BYTES = 1 << 20  # contiguous blocks at least this large go to ucpd.native.copy
NATIVE_WINDOW_MIN_BYTES = 256 << 10  # strided blocks at least this large: ucpd.native.copy_window

_native_copy: Any = None  # None: not looked up yet; False: unavailable; else the function
_native_copy_window: Any = None  # the same for ucpd.native.copy_window


def _native() -> Any:
    global _native_copy
    if _native_copy is None:
        try:
            from .. import native  # built concurrently; absent in a pure-Python checkout

            _native_copy = native.copy
        except (ImportError, AttributeError, OSError):
            _native_copy = False
    return _native_copy


def _native_window() -> Any:
    global _native_copy_window
    if _native_copy_window is None:
        try:
            from .. import native

            _native_copy_window = native.copy_window
        except (ImportError, AttributeError, OSError):
            _native_copy_window = False
    return _native_copy_window


def _copy_block(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy ``src`` into ``dst`` (equal shapes and item sizes). The one place bytes move."""
    if dst.flags.c_contiguous and src.flags.c_contiguous:
        if dst.nbytes >= NATIVE_MIN_BYTES:
            copy = _native()
            if copy:
                copy(dst.reshape(-1), src.reshape(-1))
                return
    elif dst.nbytes >= NATIVE_WINDOW_MIN_BYTES:
        copy_window = _native_window()
        if copy_window:  # strided windows (strides >= 0, checked by window()): multi-threaded
            copy_window(dst, src)
            return
    np.copyto(dst, src, casting="no")


def _check_buffer(arr: Any, what: str) -> np.ndarray:
    if not isinstance(arr, np.ndarray):
        raise PlacementMismatch(f"{what} must be a numpy array, got {type(arr).__name__}")
    if arr.ndim != 1 or (arr.size > 1 and arr.strides[0] != arr.itemsize) or arr.itemsize not in (1, 2, 4, 8):
        raise PlacementMismatch(
            f"{what} must be a 1-D contiguous array, got shape {arr.shape} strides {arr.strides}"
        )
    return arr


def window(arr: np.ndarray, view: View, *, writeable: bool = False) -> np.ndarray:
    """The numpy window ``view`` of the 1-D buffer ``arr`` (bounds-checked; zero-copy)."""
    off, shape, strides = view
    if off < 0 or any(s < 0 for s in strides) or view.extent > arr.shape[0]:
        raise PlacementMismatch(
            f"window {tuple(view)} exceeds a buffer of {arr.shape[0]} elements"
        )
    if view.is_contiguous:
        return arr[off : off + math.prod(shape)].reshape(shape)
    item = arr.itemsize
    return as_strided(
        arr[off:], shape=shape, strides=tuple(s * item for s in strides), writeable=writeable
    )


def execute(
    plan: CopyPlan,
    srcs: Mapping[Hashable, np.ndarray],
    dst: np.ndarray,
    *,
    dtype: str | DType | None = None,
) -> None:
    """Run ``plan``: copy every source window into ``dst`` and write every fill.

    ``srcs`` maps the plan's source keys to 1-D buffers; ``dst`` is a writable 1-D buffer; all
    of the same item size. ``dtype`` (a torch dtype name) is needed only to encode a non-zero
    fill value; without it a fill value must be an integer bit pattern. Raises
    PlacementMismatch for a missing source, an item-size mismatch or a window outside its
    buffer (nothing is written before the checks pass).
    """
    _check_buffer(dst, "destination")
    if not dst.flags.writeable:
        raise PlacementMismatch("destination buffer is read-only")
    item = dst.itemsize
    dst = dst.view(f"u{item}")
    checked: dict[Hashable, np.ndarray] = {}
    windows = []
    for c in plan.copies:
        arr = checked.get(c.src_key)
        if arr is None:
            try:
                raw = srcs[c.src_key]
            except KeyError:
                raise PlacementMismatch(f"the plan reads source {c.src_key!r}, which was not given") from None
            arr = _check_buffer(raw, f"source {c.src_key!r}")
            if arr.itemsize != item:
                raise PlacementMismatch(
                    f"source {c.src_key!r} has {arr.itemsize}-byte elements, the destination "
                    f"{item}-byte elements"
                )
            arr = arr.view(dst.dtype)
            checked[c.src_key] = arr
        windows.append((window(dst, c.dst_view, writeable=True), window(arr, c.src_view)))
    fills = [(window(dst, f.view, writeable=True), f.value) for f in plan.fills]
    for d, s in windows:
        _copy_block(d, s)
    bits: dict[Any, Any] = {}
    for d, value in fills:
        key = (type(value), value)
        if key not in bits:
            bits[key] = np.array(fill_bits(value, dtype, item), dtype=d.dtype)
        d[...] = bits[key]


# ---------------------------------------------------------------------------------------------
# fill values


def fill_bits(value: int | float, dtype: str | DType | None, itemsize: int) -> int:
    """The storage bit pattern (an unsigned int of ``itemsize`` bytes) of a fill ``value``.

    With ``dtype`` None the value must be an integer (taken as the element's bits, negative ints
    in two's complement) or a positive zero.
    """
    if isinstance(dtype, DType):
        dtype = dtype.name
    bitsize = 8 * itemsize
    if dtype is None:
        if isinstance(value, float):
            if value == 0.0 and math.copysign(1.0, value) > 0:
                return 0
            raise PlacementMismatch(
                f"fill value {value!r} needs the tensor's dtype to be encoded; pass dtype="
            )
        if not -(1 << (bitsize - 1)) <= value < (1 << bitsize):
            raise PlacementMismatch(f"fill value {value} does not fit {itemsize}-byte elements")
        return value % (1 << bitsize)
    d = BY_NAME.get(dtype)
    if d is None:
        raise PlacementMismatch(f"unknown dtype {dtype!r}")
    if d.itemsize != itemsize:
        raise PlacementMismatch(f"dtype {dtype} has {d.itemsize}-byte elements, buffers {itemsize}")
    if dtype == "bool":
        return 1 if value else 0
    if dtype == "bfloat16":
        b = int(np.array(value, dtype=np.float32).view(np.uint32))
        return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    if dtype.startswith("float8"):
        return _fp8_bits(float(value), dtype)
    try:
        arr = np.array(value, dtype=np.dtype(dtype))
    except (OverflowError, ValueError, TypeError) as exc:
        raise PlacementMismatch(f"fill value {value!r} cannot be a {dtype}: {exc}") from None
    if arr.dtype.kind in "iu" and arr != value:
        raise PlacementMismatch(f"fill value {value!r} is not exactly a {dtype}")
    return int(arr.view(f"u{itemsize}"))


def _fp8_decode(code: int, ebits: int, mbits: int, fn: bool) -> float:
    sign = -1.0 if code >> 7 else 1.0
    e = (code >> mbits) & ((1 << ebits) - 1)
    m = code & ((1 << mbits) - 1)
    bias = (1 << (ebits - 1)) - 1
    emax = (1 << ebits) - 1
    if fn and e == emax and m == (1 << mbits) - 1:
        return math.nan
    if not fn and e == emax:
        return sign * math.inf if m == 0 else math.nan
    if e == 0:
        return sign * m * 2.0 ** (1 - bias - mbits)
    return sign * (1 + m / (1 << mbits)) * 2.0 ** (e - bias)


def _fp8_bits(value: float, dtype: str) -> int:
    ebits, mbits, fn = (4, 3, True) if dtype == "float8_e4m3fn" else (5, 2, False)
    for code in range(256):
        x = _fp8_decode(code, ebits, mbits, fn)
        if x == value and math.copysign(1.0, x) == math.copysign(1.0, value):
            return code
    raise PlacementMismatch(f"fill value {value!r} is not exactly representable as {dtype}")


# ---------------------------------------------------------------------------------------------
# torch


_INT_BY_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def storage_view(t: Any) -> np.ndarray:
    """A zero-copy 1-D numpy view of a C-contiguous CPU tensor, as its storage type."""
    if isinstance(t, np.ndarray):
        return t.reshape(-1).view(f"u{t.itemsize}") if t.ndim != 1 else t.view(f"u{t.itemsize}")
    import torch

    if t.device.type != "cpu":
        raise PlacementMismatch(f"a {t.device.type} tensor cannot be a CPU copy buffer; copy it to the host first")
    if not t.is_contiguous():
        raise PlacementMismatch("tensor buffers must be contiguous; call .contiguous() first")
    size = t.element_size()
    flat = t.detach().reshape(-1)
    if flat.dtype.itemsize != size or size not in _INT_BY_SIZE:  # pragma: no cover
        raise PlacementMismatch(f"unsupported element size {size}")
    return flat.view(getattr(torch, _INT_BY_SIZE[size])).numpy().view(f"u{size}")


def execute_torch(plan: CopyPlan, srcs: Mapping[Hashable, Any], dst: Any) -> None:
    """:func:`execute` on torch CPU tensors (or numpy arrays) of any dtype, zero-copy."""
    d = storage_view(dst)
    views = {}
    for key in plan.keys():
        if key in srcs:
            views[key] = storage_view(srcs[key])
    name = str(dst.dtype).removeprefix("torch.") if not isinstance(dst, np.ndarray) else None
    execute(plan, views, d, dtype=name if name in BY_NAME else None)
