"""The one rule that names the leaves of nested training state, for the client's snapshots and
for ``ucpd convert``'s ``torch.save`` imports alike (so a converted file and a snapshot of the
same state name every tensor and value the same way).

Dicts are walked, their keys joined with ``.`` (non-string keys become strings); an empty dict
is a leaf (a plain value, so a restore puts it back). Lists and tuples are walked only when they
hold a tensor somewhere (their indices become keys); otherwise they are leaves. ``is_tensor``
says what a tensor is, so this module needs no torch.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator


def holds_tensor(obj: Any, is_tensor: Callable[[Any], bool]) -> bool:
    if is_tensor(obj):
        return True
    if isinstance(obj, dict):
        return any(holds_tensor(v, is_tensor) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(holds_tensor(v, is_tensor) for v in obj)
    return False


def walk(state: Any, is_tensor: Callable[[Any], bool], prefix: str = "") -> Iterator[tuple[str, Any, Any, Any]]:
    """Yield (flat name, leaf, container, key) for every leaf of the dict, list or tuple
    ``state``, so that a caller can also replace a leaf in place."""
    items = state.items() if isinstance(state, dict) else enumerate(state)
    for key, value in items:
        name = f"{prefix}{key}"
        if (isinstance(value, dict) and value) or (isinstance(value, (list, tuple)) and holds_tensor(value, is_tensor)):
            yield from walk(value, is_tensor, name + ".")
        else:
            yield name, value, state, key
