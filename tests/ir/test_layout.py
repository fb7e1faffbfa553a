"""Parts of a tensor: equal parts are torch.tensor_split's, shares split in proportion, axes nest in mesh order."""

import torch
from hypothesis import given
from hypothesis import strategies as st

import cocoweave as cw
from cocoweave.ir.layout import (
    Position,
    largest_position,
    part_bounds,
    share_bounds,
    shares_from_speeds,
    split_sizes,
)


@given(st.integers(0, 40), st.integers(1, 9))
def test_equal_parts_are_tensor_split_sizes(size, parts):
    want = [len(t) for t in torch.arange(size).tensor_split(parts)]
    assert split_sizes(size, parts) == want == split_sizes(size, [5] * parts)
    assert [share_bounds(size, parts, i)[1] - share_bounds(size, parts, i)[0] for i in range(parts)] == want


@given(st.integers(0, 60), st.lists(st.integers(1, 6), min_size=1, max_size=5))
def test_shares_split_in_proportion_and_cover_the_tensor(size, shares):
    sizes = split_sizes(size, shares)
    assert sum(sizes) == size
    for n, s in zip(sizes, shares):
        assert abs(n - size * s / sum(shares)) < 1 + 1e-9


def test_uneven_shares_three_to_one():
    assert split_sizes(10, (3, 1)) == [8, 2]
    assert share_bounds(10, (3, 1), 1) == (8, 10)


def test_parts_nest_in_mesh_order():
    layout = cw.Layout(cw.Sliced(0), cw.Sliced(0, shares=(1, 3)))
    bounds = {(i, j): part_bounds(layout, (16, 4), Position((i, j), (2, 2)))[0] for i in range(2) for j in range(2)}
    assert bounds == {(0, 0): (0, 2), (0, 1): (2, 8), (1, 0): (8, 10), (1, 1): (10, 16)}
    assert largest_position(layout, (16, 4), (2, 2)).coords == (0, 1)
    assert part_bounds(cw.Sliced(1), (3, 5), Position((1,), (2,))) == [(0, 3), (3, 5)]


def test_shares_follow_measured_speeds():
    assert shares_from_speeds([2.0, 1.0], resolution=3) == (2, 1)
    assert shares_from_speeds([1 / 0.011, 1 / 0.022]) == (43, 21)
    assert shares_from_speeds([1.0, 1e-9], resolution=10) == (10, 1)  # every rank keeps a part
