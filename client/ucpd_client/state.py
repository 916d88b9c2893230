"""Flattening nested training state into named tensors and plain values, and back in place.

Names follow ``ucpd.state_names`` (dicts walked with keys joined by ``.``, an empty dict is a
value; lists and tuples walked only when they hold tensors), the rule ``ucpd convert`` uses too. Tensors — and DTensors — are leaves
that travel through shared memory; every other leaf (step counters, RNG states as Python
objects, data-loader positions, hyper-parameters) is a *plain value*, pickled into the commit.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from ucpd import state_names


def _is_tensor(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor)


def walk(state: Any, prefix: str = "") -> Iterator[tuple[str, Any, Any, Any]]:
    """Yield (flat name, leaf, container, key) for every leaf, so a leaf can be replaced
    (``ucpd.state_names``: the same rule as ``ucpd convert``'s)."""
    return state_names.walk(state, _is_tensor, prefix)


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
