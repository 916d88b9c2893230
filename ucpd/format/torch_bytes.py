"""torch tensors as the universal format's bytes and back, zero-copy: what the conversions
(``convert``, ``deepspeed``) share. torch is imported inside the functions, when a conversion
first needs it: the format's core never imports it."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from ..dtypes import BY_NAME
from ..errors import FormatError


def torch_module():
    """torch, imported when a conversion first needs it (FormatError saying how to install it)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is present wherever conversions are used
        raise FormatError("this conversion needs PyTorch (pip install torch)") from None
    return torch


def dtype_name(t: Any) -> str:
    name = str(t.dtype).removeprefix("torch.")
    if name not in BY_NAME:
        raise FormatError(f"dtype {name} is not supported by the universal format")
    return name


def tensor_bytes(t: Any) -> np.ndarray:
    """A zero-copy uint8 numpy view of a CPU tensor's bytes (made contiguous if needed)."""
    torch = torch_module()
    if t.layout != torch.strided or t.is_quantized:
        raise FormatError(f"only dense tensors can be stored, got layout {t.layout}")
    t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return np.empty(0, np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


def tensor_from_array(arr: np.ndarray, dtype: str) -> Any:
    """A zero-copy torch tensor over a (possibly read-only) storage-typed numpy array."""
    torch = torch_module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only mmap views: we never write them
        flat = np.ascontiguousarray(arr).reshape(-1)  # (ascontiguousarray makes 0-d arrays 1-d)
        return torch.from_numpy(flat).view(getattr(torch, dtype)).reshape(arr.shape)
