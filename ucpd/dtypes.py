"""Tensor element types by name, without torch.

Dtypes travel as torch's names without the ``torch.`` prefix. The daemon never does
arithmetic on elements: it moves them, so every dtype is stored and copied as the unsigned
integer of its width (bfloat16 and float8 have no numpy type).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import PlacementMismatch


@dataclass(frozen=True)
class DType:
    name: str  # torch name, e.g. "bfloat16"
    itemsize: int  # bytes per element
    safetensors: str  # safetensors header code, e.g. "BF16"

    @property
    def storage(self) -> np.dtype:
        """The numpy dtype used to move elements of this type (same width, no conversion)."""
        return np.dtype(f"u{self.itemsize}") if self.itemsize in (1, 2, 4, 8) else np.dtype(f"V{self.itemsize}")


_ALL = [
    DType("float64", 8, "F64"),
    DType("float32", 4, "F32"),
    DType("float16", 2, "F16"),
    DType("bfloat16", 2, "BF16"),
    DType("float8_e4m3fn", 1, "F8_E4M3"),
    DType("float8_e5m2", 1, "F8_E5M2"),
    DType("int64", 8, "I64"),
    DType("int32", 4, "I32"),
    DType("int16", 2, "I16"),
    DType("int8", 1, "I8"),
    DType("uint8", 1, "U8"),
    DType("uint16", 2, "U16"),
    DType("uint32", 4, "U32"),
    DType("uint64", 8, "U64"),
    DType("bool", 1, "BOOL"),
    DType("complex64", 8, "C64"),
]
BY_NAME = {d.name: d for d in _ALL}
BY_SAFETENSORS = {d.safetensors: d for d in _ALL}


def dtype(name: str) -> DType:
    """Look up a dtype by its torch name; raises PlacementMismatch for an unknown one."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise PlacementMismatch(
            f"unknown dtype {name!r}; supported: {', '.join(sorted(BY_NAME))}"
        ) from None
