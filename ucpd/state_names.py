"""The one rule that names the leaves of nested training state, for the client's snapshots and
for ``ucpd convert``'s ``torch.save`` imports alike (so a converted file and a snapshot of the
same state name every tensor and value the same way).

Dicts are walked, their keys joined with ``.`` (non-string keys become strings); an empty dict
is a leaf (a plain value, so a restore puts it back). Lists and tuples are walked only when they
hold a tensor somewhere (their indices become keys); otherwise they are leaves. ``is_tensor``
says what a tensor is, so this module needs no torch.

``skeleton`` and ``fill`` are the same rule for integrations that pickle the structure of a
state and snapshot its tensors by name (DeepSpeed's engine, Lightning's checkpoint IO): each
tensor is replaced by a :class:`Ref` of the name ``walk`` gives it, and put back from it.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterator


def holds_tensor(obj: Any, is_tensor: Callable[[Any], bool]) -> bool:
    if is_tensor(obj):
        return True
    if isinstance(obj, dict):
        return any(holds_tensor(v, is_tensor) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(holds_tensor(v, is_tensor) for v in obj)
    return False


def _descends(value: Any, is_tensor: Callable[[Any], bool]) -> bool:
    return (isinstance(value, dict) and bool(value)) or (isinstance(value, (list, tuple)) and holds_tensor(value, is_tensor))


def walk(state: Any, is_tensor: Callable[[Any], bool], prefix: str = "") -> Iterator[tuple[str, Any, Any, Any]]:
    """Yield (flat name, leaf, container, key) for every leaf of the dict, list or tuple
    ``state``, so that a caller can also replace a leaf in place."""
    items = state.items() if isinstance(state, dict) else enumerate(state)
    for key, value in items:
        name = f"{prefix}{key}"
        if _descends(value, is_tensor):
            yield from walk(value, is_tensor, name + ".")
        else:
            yield name, value, state, key


class Ref:
    """Where a tensor was in a :func:`skeleton`: its name."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self):
        return (Ref, (self.name,))

    def __repr__(self) -> str:
        return f"Ref({self.name!r})"


def skeleton(state: Any, is_tensor: Callable[[Any], bool], reserved: tuple[str, ...] = ()) -> tuple[Any, dict[str, Any]]:
    """``(copy, tensors)``: a copy of ``state``'s containers with each tensor leaf replaced by a
    :class:`Ref` of its name (``walk``'s; a name two paths spell alike, as a key ``"a.b"`` and
    ``a["b"]`` do, or one in ``reserved``, gets ``~`` until it is new), and the tensors by name. Dicts keep their type and
    attributes (an ``OrderedDict``, Lightning's ``AttributeDict``), named tuples theirs; a state
    that is a tensor itself is named ``tensor``."""
    tensors: dict[str, Any] = {}

    def leaf(name: str, value: Any) -> Any:
        if not is_tensor(value):
            return value
        while name in tensors or name in reserved:
            name += "~"
        tensors[name] = value
        return Ref(name)

    def copied(obj: Any, prefix: str) -> Any:
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        out = {key: copied(v, f"{prefix}{key}.") if _descends(v, is_tensor) else leaf(f"{prefix}{key}", v)
               for key, v in items}
        return _rebuilt(obj, out)

    if isinstance(state, (dict, list, tuple)):
        return copied(state, ""), tensors
    return leaf("tensor", state), tensors


def fill(skel: Any, tensors: dict[str, Any]) -> Any:
    """``skel`` (a :func:`skeleton`'s copy, unpickled) with each :class:`Ref` replaced by
    ``tensors[its name]``; dicts are filled in place."""
    if isinstance(skel, Ref):
        return tensors[skel.name]
    if isinstance(skel, dict):
        for k, v in skel.items():
            skel[k] = fill(v, tensors)
        return skel
    if isinstance(skel, (list, tuple)):
        items = {i: fill(v, tensors) for i, v in enumerate(skel)}
        if isinstance(skel, tuple) and all(items[i] is v for i, v in enumerate(skel)):
            return skel  # nothing of ours in it (a torch.Size, say): as it was
        return _rebuilt(skel, items)
    return skel


def _rebuilt(obj: Any, items: dict) -> Any:
    """``obj``'s container type over ``items`` (its keys, or its indices in order)."""
    if isinstance(obj, dict):
        out = copy.copy(obj)  # its type and attributes
        out.update(items)
        return out
    if isinstance(obj, list):
        return list(items.values())
    if hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*items.values())
    return type(obj)(items.values())
