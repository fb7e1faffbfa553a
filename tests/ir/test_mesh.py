"""Meshes: named axes, a placement per axis, per-axis layout inference and its errors; one axis is the original
model."""

import pytest

import cocoweave as cw
from cocoweave.errors import ProgramError
from cocoweave.ir.mesh import Mesh


def mesh2():
    p = cw.Program("m")
    p.mesh(x=2, y=3)
    return p


def test_ranks_sit_row_major_and_lines_run_along_one_axis():
    m = Mesh(("x", "y"), (2, 3))
    assert [m.coords(r) for r in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert all(m.rank(m.coords(r)) == r for r in range(6))
    assert m.axis_groups(1) == [[0, 1, 2], [3, 4, 5]]
    assert m.axis_groups(0) == [[0, 3], [1, 4], [2, 5]]
    assert m.line(4, 0) == [1, 4] and m.line(4, 1) == [3, 4, 5]


def test_mesh_is_declared_first_with_positive_sizes():
    p = cw.Program("m")
    p.tensor("a", (4,))
    with pytest.raises(ProgramError, match="declare the mesh before any tensor"):
        p.mesh(x=2)
    with pytest.raises(ProgramError, match="mesh axis `x` must have a positive int size"):
        cw.Program("m").mesh(x=0)
    with pytest.raises(ProgramError, match="axis name 'world'"):
        cw.Program("m").mesh(world=2)
    q = cw.Program("m")
    q.pipeline(2)
    with pytest.raises(ProgramError, match="cannot also be a mesh"):
        q.mesh(x=2)


def test_layouts_bind_to_the_mesh_by_name_or_position():
    p = mesh2()
    a = p.tensor("a", (4, 6), "float32", cw.Layout(y=cw.Sliced(-1)))
    assert a.layout == cw.Layout(x=cw.Replicated, y=cw.Sliced(1))
    b = p.tensor("b", (4, 6), "float32", (cw.Sliced(0), cw.Local))
    assert b.layout == cw.Layout(x=cw.Sliced(0), y=cw.Local)
    assert p.tensor("c", (4,), "float32", cw.Local).layout == cw.Layout(x=cw.Local, y=cw.Local)
    assert repr(b.layout) == "Layout(x=Sliced(0), y=Local)"
    with pytest.raises(ProgramError, match=r"say which axis slices it, e\.g\. cw\.Layout\(y=Sliced\(0\)\)"):
        p.tensor("d", (4,), "float32", cw.Sliced(0))
    with pytest.raises(ProgramError, match="has no axis 'z'"):
        p.tensor("e", (4,), "float32", cw.Layout(z=cw.Sliced(0)))
    with pytest.raises(ProgramError, match="has 1 placements for the 2 axes"):
        p.tensor("f", (4,), "float32", cw.Layout(cw.Sliced(0)))
    with pytest.raises(ProgramError, match=r"has 2 shares for the 3 ranks of axis `y`"):
        p.tensor("g", (4,), "float32", cw.Layout(y=cw.Sliced(0, shares=(1, 2))))
    with pytest.raises(ProgramError, match="the program has no mesh"):
        cw.Program("n").tensor("h", (4,), "float32", cw.Layout(x=cw.Sliced(0)))


def test_shares_are_positive_ints_and_equal_shares_are_the_plain_split():
    assert cw.Sliced(0, shares=(2, 2)) == cw.Sliced(0)
    assert repr(cw.Sliced(1, shares=[3, 1])) == "Sliced(1, shares=(3, 1))"
    with pytest.raises(ProgramError, match="shares must be a sequence of positive ints"):
        cw.Sliced(0, shares=(1, 0))


def test_one_axis_mesh_is_the_original_model():
    p = cw.Program("one")
    p.mesh(tp=4)
    x = p.tensor("x", (8, 4), "float32", cw.Layout(tp=cw.Sliced(0)))
    assert x.layout == cw.Sliced(0)
    y = cw.all_gather(x, axis="tp")
    assert y.layout == cw.Replicated and y.attrs["axis"] is None
    assert str(p).splitlines()[0] == "program one  mesh: tp=4"
    assert "all_gather(x, dim=0)  : float32[8, 4] Replicated" in str(p)


def test_elementwise_and_matmul_work_per_axis():
    p = mesh2()
    a = p.tensor("a", (4, 6), "float32", cw.Layout(x=cw.Sliced(0)))
    b = p.tensor("b", (4, 6), "float32", cw.Layout(x=cw.Local))
    w = p.tensor("w", (6, 8), "float32", cw.Layout(y=cw.Sliced(1)))
    assert (a * 2.0 + p.tensor("r", (6,), "float32")).layout == cw.Layout(x=cw.Sliced(0), y=cw.Replicated)
    with pytest.raises(ProgramError, match="a Local operand cannot combine with a Sliced one along axis `x`"):
        a + b
    c = cw.matmul(a, w)
    assert c.layout == cw.Layout(x=cw.Sliced(0), y=cw.Sliced(1))
    k = p.tensor("k", (4, 6), "float32", cw.Layout(x=cw.Sliced(1), y=cw.Sliced(0)))
    v = p.tensor("v", (6, 8), "float32", cw.Layout(x=cw.Sliced(0)))
    assert cw.matmul(k, v).layout == cw.Layout(x=cw.Local, y=cw.Sliced(0))
    with pytest.raises(ProgramError, match=r"no layout rule applies \(Sliced\(0\) x Sliced\(1\) along axis `y`\)"):
        cw.matmul(p.tensor("s", (4, 6), "float32", cw.Layout(y=cw.Sliced(0))), w)
    uneven = p.tensor("u", (4, 6), "float32", cw.Layout(x=cw.Sliced(0, shares=(3, 1))))
    with pytest.raises(ProgramError, match="sliced along dimension 0 along axis `x` in different shares"):
        a + uneven


def test_a_dimension_sliced_by_two_axes_nests_in_mesh_order():
    p = mesh2()
    x = p.tensor("x", (12, 4), "float32", cw.Layout(x=cw.Sliced(0), y=cw.Sliced(0)))
    inner = cw.all_gather(x, axis="y")
    assert inner.layout == cw.Layout(x=cw.Sliced(0), y=cw.Replicated)
    with pytest.raises(ProgramError, match="dimension 0 is also sliced by axis `y`, after axis `x`"):
        cw.all_gather(x, axis="x")
    g = p.tensor("g", (12, 4), "float32", cw.Layout(x=cw.Local, y=cw.Sliced(0)))
    with pytest.raises(ProgramError, match="scatter along `y` first"):
        cw.reduce_scatter(g, "sum", 0, axis="x")
    r = p.tensor("r", (12, 4), "float32", cw.Layout(y=cw.Sliced(0)))
    with pytest.raises(ProgramError, match="`r` is sliced along dimension 0 by axis `y` but not by axis `x`"):
        r + x


def test_collectives_name_their_axis():
    p = mesh2()
    g = p.tensor("g", (6, 4), "float32", cw.Layout(y=cw.Local))
    with pytest.raises(ProgramError, match="say which mesh axis it runs over: axis= one of x, y"):
        cw.all_reduce(g)
    with pytest.raises(ProgramError, match=r"needs a Local operand \(per-rank values to combine\), got Replicated "
                                           r"along axis `x`"):
        cw.all_reduce(g, axis="x")
    with pytest.raises(ProgramError, match="has no axis 'z'"):
        cw.all_reduce(g, axis="z")
    ar = cw.all_reduce(g, "avg", axis="y", weights=(1, 2, 3))
    assert ar.layout == cw.Layout(x=cw.Replicated, y=cw.Replicated) and ar.attrs["weights"] == (1, 2, 3)
    rs = cw.reduce_scatter(g, "sum", 1, axis="y", shares=(1, 1, 2))
    assert rs.layout == cw.Layout(y=cw.Sliced(1, shares=(1, 1, 2)))
    assert cw.all_gather(rs, axis="y").layout == ar.layout
    assert cw.slice(ar, 0, axis="x").layout == cw.Layout(x=cw.Sliced(0))
    with pytest.raises(ProgramError, match="weights make a weighted average; use op='avg'"):
        cw.all_reduce(g, "sum", axis="y", weights=(1, 2, 3))
    with pytest.raises(ProgramError, match=r"shares \(1, 2\) name 2 ranks, the axis has 3"):
        cw.reduce_scatter(g, "sum", 0, axis="y", shares=(1, 2))
    text = str(p)
    assert "all_reduce(g, op=avg, axis='y', weights=(1, 2, 3))" in text
    assert "reduce_scatter(g, op=sum, dim=1, axis='y', shares=(1, 1, 2))" in text
    with pytest.raises(ProgramError, match="the program has no mesh"):
        cw.all_reduce(cw.Program("n").tensor("l", (4,), "float32", cw.Local), axis="x")


def test_the_world_must_fit_the_mesh_and_the_shares():
    p = mesh2()
    p.output(p.tensor("a", (6,), "float32", cw.Layout(y=cw.Sliced(0))), "a")
    p.check_world(6)
    with pytest.raises(ProgramError, match=r"world size 4 does not fit the mesh x=2, y=3 of process group `world` "
                                           r"\(it needs 6 ranks\)"):
        p.check_world(4)
    q = cw.Program("q")
    q.output(cw.reduce_scatter(q.tensor("g", (6,), "float32", cw.Local), "sum", 0, shares=(3, 1)), "s")
    q.check_world(2)
    with pytest.raises(ProgramError, match="has shares for 2 ranks, but process group `world` has 3 ranks"):
        q.check_world(3)


def test_fingerprint_tells_meshes_apart():
    def build(**axes):
        p = cw.Program("f")
        p.mesh(**axes)
        p.output(p.tensor("a", (4,), "float32"), "a")
        return p

    assert build(x=2, y=2).fingerprint() == build(x=2, y=2).fingerprint()
    assert build(x=2, y=2).fingerprint() != build(x=4, y=1).fingerprint()
    assert build(x=2, y=2).fingerprint() != build(a=2, b=2).fingerprint()
