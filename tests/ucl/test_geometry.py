"""Box and view geometry: intersect, difference, flat-range decomposition, coalescing."""

from math import prod

import numpy as np
from hypothesis import given, settings, strategies as st

from ucpd.ucl import (
    GBox,
    View,
    coalesce,
    contiguous_strides,
    contiguous_view,
    difference,
    flat_range_boxes,
    format_box,
    intersect,
    view_of_box,
    volume,
)
from ucpd.ucl.geometry import contains


def test_intersect_and_volume():
    a = GBox((0, 0), (4, 4))
    b = GBox((2, 3), (4, 4))
    assert intersect(a, b) == GBox((2, 3), (2, 1))
    assert intersect(a, GBox((4, 0), (1, 4))) is None
    assert volume(GBox((), ())) == 1
    assert intersect(GBox((), ()), GBox((), ())) == GBox((), ())
    assert volume(GBox((1, 2), (3, 0))) == 0


def test_difference_examples():
    a = GBox((0, 0), (4, 4))
    assert difference(a, a) == []
    assert difference(a, GBox((9, 9), (1, 1))) == [a]
    parts = difference(a, GBox((1, 1), (2, 2)))
    assert len(parts) == 4 and sum(volume(p) for p in parts) == 12
    assert difference(GBox((), ()), GBox((), ())) == []


def test_format_box():
    assert format_box(GBox((0, 256), (128, 256))) == "[0:128, 256:512]"
    assert format_box(GBox((), ())) == "[]"


def test_view_basics():
    v = contiguous_view((3, 4))
    assert v == View(0, (3, 4), (4, 1)) and v.is_contiguous and v.extent == 12
    s = v.sub((1, 1), (2, 2))
    assert s == View(5, (2, 2), (4, 1)) and not s.is_contiguous and s.extent == 11
    assert v.sub((1, 0), (2, 4)).is_contiguous
    assert View(7, (0, 3), (3, 1)).extent == 7
    assert view_of_box((3, 4), GBox((2, 0), (1, 4)), base=10) == View(18, (1, 4), (4, 1))
    assert contiguous_strides(()) == ()


def test_coalesce():
    a, b = coalesce(View(0, (2, 3, 4), (12, 4, 1)), View(5, (2, 3, 4), (12, 4, 1)))
    assert a == View(0, (24,), (1,)) and b == View(5, (24,), (1,))
    a, b = coalesce(View(0, (2, 3, 4), (12, 4, 1)), View(0, (2, 3, 4), (24, 4, 1)))
    assert a.shape == (2, 12) and b == View(0, (2, 12), (24, 1))
    (s,) = coalesce(View(3, (), ()))
    assert s == View(3, (1,), (1,))
    (s,) = coalesce(View(3, (1, 5, 1), (0, 1, 0)))
    assert s == View(3, (5,), (1,))


boxes2 = st.tuples(
    st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(0, 6)),
    st.tuples(st.integers(1, 5), st.integers(1, 5), st.integers(1, 5)),
).map(lambda t: GBox(*t))


@settings(max_examples=150, deadline=None)
@given(boxes2, boxes2)
def test_difference_partitions(a, b):
    parts = difference(a, b)
    inter = intersect(a, b)
    assert len(parts) <= 6
    assert sum(volume(p) for p in parts) + (volume(inter) if inter else 0) == volume(a)
    grid = np.zeros((12, 12, 12), int)
    for p in parts + ([inter] if inter else []):
        assert contains(a, p)
        grid[tuple(slice(o, o + n) for o, n in zip(*p))] += 1
    assert grid.max() <= 1  # disjoint
    if inter:
        for p in parts:
            assert intersect(p, b) is None


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=0, max_size=4), st.data())
def test_flat_range_boxes(shape, data):
    shape = tuple(shape)
    total = prod(shape)
    start = data.draw(st.integers(0, total))
    stop = data.draw(st.integers(start, total))
    boxes = flat_range_boxes(shape, start, stop)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    flat = np.arange(total).reshape(shape)
    got = []
    for b in boxes:
        block = flat[tuple(slice(o, o + n) for o, n in zip(*b))].reshape(-1)
        assert (np.diff(block) == 1).all()  # contiguous in flat order
        got.extend(block.tolist())
    assert got == list(range(start, stop))
