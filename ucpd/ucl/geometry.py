"""Box and strided-view geometry: the arithmetic under resharding.

Everything here is pure integer arithmetic on tuples; nothing touches tensor data.

- A :class:`GBox` is a hyper-rectangle ``offsets .. offsets+lengths`` of an n-dim array
  (global or local coordinates). Zero-dim boxes (``GBox((), ())``) describe scalars and have
  volume 1.
- A :class:`View` is a strided window, in *elements*, into a flat contiguous buffer: element
  ``idx`` (a tuple) of the window lives at ``offset + sum(idx[k] * strides[k])``. Strides are
  never negative; a stride of 0 is allowed on a dim of length 1 (stacked dims).

All functions are safe to call from any thread.
"""

from __future__ import annotations

from math import prod
from typing import NamedTuple

Shape = tuple[int, ...]


class GBox(NamedTuple):
    """An axis-aligned box: ``offsets[k] <= i_k < offsets[k] + lengths[k]`` on every dim k."""

    offsets: Shape
    lengths: Shape

    @property
    def ndim(self) -> int:
        return len(self.offsets)

    @property
    def volume(self) -> int:
        return prod(self.lengths)

    @property
    def ends(self) -> Shape:
        return tuple(o + n for o, n in zip(self.offsets, self.lengths))

    def __str__(self) -> str:
        return format_box(self)


class View(NamedTuple):
    """A strided window into a flat buffer, all quantities in elements (see module doc)."""

    offset: int
    shape: Shape
    strides: Shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def extent(self) -> int:
        """One past the largest element index the window touches (``offset`` if it is empty)."""
        if self.numel == 0:
            return self.offset
        return self.offset + 1 + sum((n - 1) * s for n, s in zip(self.shape, self.strides))

    @property
    def is_contiguous(self) -> bool:
        """True when the window is one run of ``numel`` consecutive elements in row-major order."""
        expected = 1
        for n, s in zip(reversed(self.shape), reversed(self.strides)):
            if n == 1:
                continue
            if s != expected:
                return False
            expected *= n
        return True

    def sub(self, rel_offsets: Shape, lengths: Shape) -> View:
        """The sub-window starting at ``rel_offsets`` (relative to this window) of ``lengths``."""
        return View(
            self.offset + sum(o * s for o, s in zip(rel_offsets, self.strides)),
            tuple(lengths),
            self.strides,
        )

    def shifted(self, delta: int) -> View:
        """The same window ``delta`` elements further into the buffer."""
        return View(self.offset + delta, self.shape, self.strides)


def contiguous_strides(shape: Shape) -> Shape:
    """Row-major (C order) strides, in elements, of an array of ``shape``."""
    strides = [0] * len(shape)
    acc = 1
    for k in range(len(shape) - 1, -1, -1):
        strides[k] = acc
        acc *= shape[k]
    return tuple(strides)


def contiguous_view(shape: Shape, base: int = 0) -> View:
    """The view of a whole C-contiguous array of ``shape`` that starts at element ``base``."""
    return View(base, tuple(shape), contiguous_strides(shape))


def full_box(shape: Shape) -> GBox:
    """The box covering all of an array of ``shape``."""
    return GBox((0,) * len(shape), tuple(shape))


def volume(box: GBox) -> int:
    """Number of elements in ``box`` (1 for a zero-dim box)."""
    return prod(box[1])


def intersect(a: GBox, b: GBox) -> GBox | None:
    """The common part of two boxes of equal ndim, or None when it is empty."""
    offs = []
    lens = []
    for ao, al, bo, bl in zip(a[0], a[1], b[0], b[1]):
        lo = ao if ao > bo else bo
        hi = min(ao + al, bo + bl)
        if hi <= lo:
            return None
        offs.append(lo)
        lens.append(hi - lo)
    return GBox(tuple(offs), tuple(lens))


def contains(outer: GBox, inner: GBox) -> bool:
    """True when every element of ``inner`` lies in ``outer``."""
    return all(
        oo <= io and io + il <= oo + ol
        for oo, ol, io, il in zip(outer[0], outer[1], inner[0], inner[1])
    )


def difference(a: GBox, b: GBox) -> list[GBox]:
    """``a`` minus ``b`` as at most ``2 * ndim`` disjoint boxes (``[a]`` when they do not meet).

    Slabs are cut dim by dim: on dim k, the parts of ``a`` below and above ``b`` (restricted to
    ``b``'s range on the dims before k).
    """
    inter = intersect(a, b)
    if inter is None:
        return [a] if volume(a) > 0 else []
    out: list[GBox] = []
    offs = list(a[0])
    lens = list(a[1])
    for k in range(len(offs)):
        ao, al = offs[k], lens[k]
        io, il = inter[0][k], inter[1][k]
        if io > ao:
            lens[k] = io - ao
            out.append(GBox(tuple(offs), tuple(lens)))
        if io + il < ao + al:
            offs[k] = io + il
            lens[k] = ao + al - (io + il)
            out.append(GBox(tuple(offs), tuple(lens)))
        offs[k], lens[k] = io, il
    return out


def flat_range_boxes(shape: Shape, start: int, stop: int) -> list[GBox]:
    """Decompose the flat (row-major) element range ``[start, stop)`` of an array of ``shape``
    into boxes, each one contiguous in flat order, listed in flat order.

    At most ``2 * ndim - 1`` boxes (one for a 0-dim array). Used to resolve ``Flat`` fragments.
    """
    total = prod(shape)
    start = max(start, 0)
    stop = min(stop, total)
    if start >= stop:
        return []
    return _range_boxes(tuple(shape), start, stop)


def _range_boxes(shape: Shape, start: int, stop: int) -> list[GBox]:
    # Precondition: 0 <= start < stop <= prod(shape), and no dim is 0.
    if not shape:
        return [GBox((), ())]
    rest = shape[1:]
    inner = prod(rest)
    if start % inner == 0 and stop % inner == 0:
        i0, i1 = start // inner, stop // inner
        return [GBox((i0,) + (0,) * len(rest), (i1 - i0,) + rest)]
    i0, r0 = divmod(start, inner)
    i1, r1 = divmod(stop, inner)
    if i0 == i1:
        return [GBox((i0,) + b[0], (1,) + b[1]) for b in _range_boxes(rest, r0, r1)]
    out: list[GBox] = []
    if r0:
        out.extend(GBox((i0,) + b[0], (1,) + b[1]) for b in _range_boxes(rest, r0, inner))
        i0 += 1
    if i1 > i0:
        out.append(GBox((i0,) + (0,) * len(rest), (i1 - i0,) + rest))
    if r1:
        out.extend(GBox((i1,) + b[0], (1,) + b[1]) for b in _range_boxes(rest, 0, r1))
    return out


def view_of_box(shape: Shape, box: GBox, base: int = 0) -> View:
    """The window of ``box`` inside a C-contiguous array of ``shape`` starting at ``base``."""
    strides = contiguous_strides(shape)
    return View(base + sum(o * s for o, s in zip(box[0], strides)), tuple(box[1]), strides)


def coalesce(*views: View) -> tuple[View, ...]:
    """Jointly simplify equally-shaped views without changing the elements they pair up.

    Dims of length 1 are dropped and neighbouring dims are merged wherever every view allows
    it, so two contiguous views become 1-D. The result has at least one dim. Views with a dim
    of length 0 are returned unchanged (callers skip empty windows).
    """
    shape = views[0][1]
    if 0 in shape:
        return views
    keep = [k for k, n in enumerate(shape) if n != 1]
    if not keep:
        return tuple(View(v[0], (1,), (1,)) for v in views)
    new_shape = [shape[keep[-1]]]
    new_strides = [[v[2][keep[-1]]] for v in views]
    for k in reversed(keep[:-1]):
        n = shape[k]
        if all(v[2][k] == new_shape[0] * st[0] for v, st in zip(views, new_strides)):
            new_shape[0] *= n
        else:
            new_shape.insert(0, n)
            for v, st in zip(views, new_strides):
                st.insert(0, v[2][k])
    shp = tuple(new_shape)
    return tuple(View(v[0], shp, tuple(st)) for v, st in zip(views, new_strides))


def format_box(box: GBox) -> str:
    """Python slice notation, e.g. ``[0:128, 256:512]`` (``[]`` for a scalar)."""
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(box[0], box[1])) + "]"
