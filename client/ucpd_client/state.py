"""Flattening nested training state into named tensors and plain values, and back in place.

Dicts are walked (keys joined with ``.``; non-string keys become strings), as are lists and
tuples that contain tensors (their indices become keys). Tensors — and DTensors — are leaves
that travel through shared memory; every other leaf (step counters, RNG states as Python
objects, data-loader positions, hyper-parameters) is a *plain value*, pickled into the commit.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_has_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(v) for v in obj)
    return False


def walk(state: Any, prefix: str = "") -> Iterator[tuple[str, Any, Any, Any]]:
    """Yield (flat name, leaf, container, key) for every leaf, so a leaf can be replaced."""
    if isinstance(state, dict):
        items = state.items()
    else:
        items = enumerate(state)
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, dict) or (isinstance(value, (list, tuple)) and _has_tensor(value)):
            yield from walk(value, name + ".")
        else:
            yield name, value, state, key


def split(state: dict) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split nested state into ({name: tensor}, {name: plain value})."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict of tensors and values, got {type(state).__name__}")
    tensors, values = {}, {}
    for name, leaf, _, _ in walk(state):
        if isinstance(leaf, torch.Tensor):
            tensors[name] = leaf
        else:
            values[name] = leaf
    return tensors, values


def assign_values(state: dict, values: dict[str, Any]) -> list[str]:
    """Put restored plain values back into ``state`` in place; returns names it could not place."""
    missing = []
    for name, leaf, container, key in walk(state):
        if isinstance(leaf, torch.Tensor) or name not in values:
            continue
        if isinstance(container, tuple):
            missing.append(name)  # tuples cannot change in place
            continue
        container[key] = values[name]
    return missing
