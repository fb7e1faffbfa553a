"""Layout, shape and dtype inference: every rule of DESIGN.md and every error."""

import pytest

import cocoweave as cw
from cocoweave.errors import ProgramError


def prog():
    return cw.Program("t")


# -- elementwise ------------------------------------------------------------------------------
@pytest.mark.parametrize("la, lb, want", [
    (cw.Replicated, cw.Replicated, cw.Replicated),
    (cw.Local, cw.Local, cw.Local),
    (cw.Sliced(0), cw.Sliced(0), cw.Sliced(0)),
    (cw.Replicated, cw.Local, cw.Local),
    (cw.Local, cw.Replicated, cw.Local),
    (cw.Replicated, cw.Sliced(1), cw.Sliced(1)),
    (cw.Sliced(1), cw.Replicated, cw.Sliced(1)),
])
def test_elementwise_layouts_propagate(la, lb, want):
    p = prog()
    a, b = p.tensor("a", (4, 6), "float32", la), p.tensor("b", (4, 6), "float32", lb)
    assert (a + b).layout == want
    assert (a * 2.0).layout == la


def test_sliced_dims_are_aligned_through_broadcasting():
    p = prog()
    x = p.tensor("x", (2, 3, 8), "float16", cw.Sliced(2))
    b = p.tensor("b", (8,), "float16", cw.Sliced(0))
    assert (x + b).layout == cw.Sliced(2)


def test_sliced_along_different_dims_is_an_error():
    p = prog()
    a, b = p.tensor("a", (4, 6), "float32", cw.Sliced(0)), p.tensor("b", (4, 6), "float32", cw.Sliced(1))
    with pytest.raises(ProgramError, match=r"add\(`a`: float32\[4, 6\] Sliced\(0\), `b`: float32\[4, 6\] "
                                           r"Sliced\(1\)\): operands are sliced along different dimensions"):
        a + b


def test_local_with_sliced_is_an_error():
    p = prog()
    a, b = p.tensor("a", (4,), "float32", cw.Local), p.tensor("b", (4,), "float32", cw.Sliced(0))
    with pytest.raises(ProgramError, match="a Local operand cannot combine with a Sliced one"):
        a * b


def test_sliced_dim_cannot_be_broadcast():
    p = prog()
    a = p.tensor("a", (1, 6), "float32", cw.Sliced(0))
    b = p.tensor("b", (4, 6), "float32", cw.Replicated)
    with pytest.raises(ProgramError, match="sliced along dimension 0, which is broadcast"):
        a + b


def test_shapes_must_broadcast_and_errors_name_the_line():
    p = prog()
    a, b = p.tensor("a", (4,), "float32"), p.tensor("b", (5,), "float32")
    with pytest.raises(ProgramError, match=r"test_ops.py:\d+: add\(.*shapes do not broadcast"):
        a + b


def test_symbolic_sizes_broadcast_by_name():
    p = prog()
    a, b = p.tensor("a", ("B", "H"), "float32"), p.tensor("b", ("H",), "float32")
    assert (a + b).shape == ("B", "H")
    c = p.tensor("c", ("K",), "float32")
    with pytest.raises(ProgramError, match="do not broadcast"):
        a + c


def test_dtype_promotion_is_torch_like_and_scalars_are_weak():
    p = prog()
    h, f = p.tensor("h", (4,), "float16"), p.tensor("f", (4,), "float32")
    lr = p.scalar("lr")
    assert (h + f).dtype == "float32"
    assert (h * lr).dtype == "float16"
    assert (h * 0.5).dtype == "float16"
    assert (h < f).dtype == "bool"
    assert cw.cast(f, "bf16").dtype == "bfloat16"
    i = p.tensor("i", (4,), "int32")
    assert (i / 2).dtype == "float32"
    assert cw.sqrt(i).dtype == "float32"


def test_scalar_arithmetic_stays_scalar():
    p = prog()
    b1, step = p.scalars("b1 step")
    s = 1 - b1**step
    assert s.is_scalar and s.shape == ()


def test_where_needs_bool_condition():
    p = prog()
    a = p.tensor("a", (4,), "float32")
    assert cw.where(a > 0, a, 0.0).layout == cw.Replicated
    with pytest.raises(ProgramError, match="the condition must be bool"):
        cw.where(a, a, 0.0)


def test_values_have_no_truth_value():
    p = prog()
    a = p.tensor("a", (4,), "float32")
    with pytest.raises(ProgramError, match="no truth value"):
        if a > 0:
            pass


# -- dropout ----------------------------------------------------------------------------------
def test_dropout_keeps_layout_and_checks_p():
    p = prog()
    a = p.tensor("a", (4, 5), "float16", cw.Sliced(1))
    assert cw.dropout(a, 0.1, seed=3).layout == cw.Sliced(1)
    with pytest.raises(ProgramError, match=r"probability must be a number in \[0, 1\)"):
        cw.dropout(a, 1.0)
    i = p.tensor("i", (4,), "int64")
    with pytest.raises(ProgramError, match="needs floating-point operands"):
        cw.dropout(i, 0.1)


# -- reductions -------------------------------------------------------------------------------
def test_reduction_over_sliced_dim_gives_local_partial():
    p = prog()
    a = p.tensor("a", (4, 6, 8), "float32", cw.Sliced(1))
    assert cw.sum(a).layout == cw.Local and cw.sum(a).shape == ()
    assert cw.norm(a, dim=1).layout == cw.Local
    assert cw.max(a, dim=2).layout == cw.Sliced(1)
    assert cw.sum(a, dim=0).layout == cw.Sliced(0)
    assert cw.sum(a, dim=0, keepdim=True).layout == cw.Sliced(1)
    assert cw.sum(a, dim=(0, 2)).shape == (6,)
    with pytest.raises(ProgramError, match="dimension 3 is out of range"):
        cw.sum(a, dim=3)


def test_reductions_keep_replicated_and_local():
    p = prog()
    r, loc = p.tensor("r", (4,), "float32"), p.tensor("l", (4,), "float32", cw.Local)
    assert cw.norm(r).layout == cw.Replicated
    assert cw.sum(loc).layout == cw.Local


# -- matmul -----------------------------------------------------------------------------------
@pytest.mark.parametrize("la, lb, want", [
    (cw.Sliced(2), cw.Sliced(0), cw.Local),
    (cw.Replicated, cw.Sliced(1), cw.Sliced(2)),
    (cw.Sliced(0), cw.Replicated, cw.Sliced(0)),
    (cw.Sliced(1), cw.Replicated, cw.Sliced(1)),
    (cw.Local, cw.Replicated, cw.Local),
    (cw.Replicated, cw.Replicated, cw.Replicated),
])
def test_matmul_layout_rules(la, lb, want):
    p = prog()
    x, w = p.tensor("x", (2, 3, 8), "float16", la), p.tensor("w", (8, 5), "float16", lb)
    y = cw.matmul(x, w)
    assert y.layout == want and y.shape == (2, 3, 5)


@pytest.mark.parametrize("la, lb", [
    (cw.Sliced(2), cw.Replicated), (cw.Replicated, cw.Sliced(0)), (cw.Local, cw.Sliced(1)),
    (cw.Sliced(0), cw.Sliced(1)),
])
def test_matmul_without_a_rule_is_an_error(la, lb):
    p = prog()
    x, w = p.tensor("x", (2, 3, 8), "float16", la), p.tensor("w", (8, 5), "float16", lb)
    with pytest.raises(ProgramError, match="no layout rule applies"):
        cw.matmul(x, w)


def test_matmul_shapes():
    p = prog()
    x, w = p.tensor("x", (3, 8), "float32"), p.tensor("w", (7, 5), "float32")
    with pytest.raises(ProgramError, match=r"inner dimensions differ \(8 vs 7\)"):
        x @ w


def test_layer_norm_refuses_sliced_last_dim():
    p = prog()
    x = p.tensor("x", (4, 8), "float32", cw.Sliced(0))
    g = p.tensor("g", (8,), "float32")
    assert cw.layer_norm(x, g, g).layout == cw.Sliced(0)
    y = p.tensor("y", (4, 8), "float32", cw.Sliced(1))
    with pytest.raises(ProgramError, match="last dimension, which is sliced"):
        cw.layer_norm(y)
    with pytest.raises(ProgramError, match=r"must have shape \[8\]"):
        cw.layer_norm(x, p.tensor("bad", (4,), "float32"))


# -- communication ----------------------------------------------------------------------------
def test_collective_layout_rules():
    p = prog()
    g = p.tensor("g", (6, 4), "float32", cw.Local)
    assert cw.all_reduce(g, "avg").layout == cw.Replicated
    rs = cw.reduce_scatter(g, "sum", dim=1)
    assert rs.layout == cw.Sliced(1)
    assert cw.all_gather(rs).layout == cw.Replicated
    assert cw.broadcast(g, root=1).layout == cw.Replicated
    assert cw.reduce(g, "max", root=0).layout == cw.Local


def test_collective_errors():
    p = prog()
    r = p.tensor("r", (6,), "float32")
    g = p.tensor("g", (6,), "float32", cw.Local)
    with pytest.raises(ProgramError, match=r"all_reduce\(`r`: float32\[6\] Replicated\): needs a Local operand"):
        cw.all_reduce(r)
    with pytest.raises(ProgramError, match="unknown reduction 'prod'"):
        cw.all_reduce(g, "prod")
    with pytest.raises(ProgramError, match="unknown reduction 'adasum'"):
        cw.reduce_scatter(g, "adasum")
    with pytest.raises(ProgramError, match="needs a Sliced operand"):
        cw.all_gather(r)
    s = p.tensor("s", (6, 2), "float32", cw.Sliced(0))
    with pytest.raises(ProgramError, match="gathers along the sliced dimension 0, not 1"):
        cw.all_gather(s, dim=1)
    with pytest.raises(ProgramError, match="Local or Replicated operand"):
        cw.broadcast(s)
    with pytest.raises(ProgramError, match="not a scalar"):
        cw.all_reduce(p.scalar("lr"))


def test_send_moves_between_pipeline_stages():
    p = prog()
    s0, s1 = p.pipeline(2)
    x = p.tensor("x", (4, 8), "float16", cw.Sliced(1), group=s0)
    y = cw.send(x, s1)
    assert y.group == s1 and y.layout == cw.Sliced(1)
    with pytest.raises(ProgramError, match="already lives on `stage0`"):
        cw.send(x, s0)
    z = p.tensor("z", (4, 8), "float16", group=s1)
    with pytest.raises(ProgramError, match="different process groups"):
        x + z
    assert (y + z).group == s1


def test_pipeline_group_needs_divisible_world():
    p = prog()
    s0, _ = p.pipeline(2)
    assert list(s0.ranks(4)) == [0, 1]
    with pytest.raises(ProgramError, match="world size 3 cannot be split into 2 equal pipeline stages"):
        s0.ranks(3)


# -- inputs and updates -----------------------------------------------------------------------
def test_input_declaration_errors():
    p = prog()
    p.tensor("a", (4,), "float32")
    with pytest.raises(ProgramError, match="an input named `a` already exists"):
        p.tensor("a", (4,), "float32")
    with pytest.raises(ProgramError, match="unknown dtype 'float8'"):
        p.tensor("b", (4,), "float8")
    with pytest.raises(ProgramError, match=r"Sliced\(2\) is out of range for a 1-dim tensor"):
        p.tensor("c", (4,), "float32", cw.Sliced(2))
    with pytest.raises(ProgramError, match="dimension -1 must be"):
        p.tensor("d", (-1,), "float32")
    assert p.tensor("e", (4, 5), "float32", cw.Sliced(-1)).layout == cw.Sliced(1)


def test_update_rules():
    p = prog()
    w = p.tensor("w", (4,), "float32")
    h = p.tensor("h", (4,), "float16")
    with pytest.raises(ProgramError, match="the new value is float16 but the state is float32; use cw.cast"):
        p.update(w, h)
    with pytest.raises(ProgramError, match="the new value must have the state's shape"):
        p.update(w, p.tensor("x", (5,), "float32"))
    with pytest.raises(ProgramError, match="the new value is Local but the state is Replicated"):
        p.update(w, p.tensor("g", (4,), "float32", cw.Local))
    with pytest.raises(ProgramError, match="must be a tensor input"):
        p.update(w * 2, w)
    w1 = p.update(w, w * 2)
    assert w1.name == "w'" and p.updates["w"] is w1
    with pytest.raises(ProgramError, match="already updated once"):
        p.update(w, w * 3)


def test_values_of_another_program_are_refused():
    a = cw.Program("a").tensor("x", (4,), "float32")
    b = cw.Program("b").tensor("y", (4,), "float32")
    with pytest.raises(ProgramError, match="belongs to program `a`, not `b`"):
        b + a


def test_all_to_all_moves_the_slicing_to_another_dimension():
    p = prog()
    x = p.tensor("x", (8, 6, 3), "float32", cw.Sliced(0))
    y = cw.all_to_all(x, 1)
    assert y.layout == cw.Sliced(1) and y.shape == x.shape and y.dtype == "float32"
    assert cw.all_to_all(x, -1, shares=(1, 2)).layout == cw.Sliced(2, shares=(1, 2))
    with pytest.raises(ProgramError, match=r"all_to_all\(`x`.*is already sliced along dimension 0"):
        cw.all_to_all(x, 0)
    with pytest.raises(ProgramError, match="needs a Sliced operand .* got Local; slice a Replicated one"):
        cw.all_to_all(p.tensor("g", (4, 4), "float32", cw.Local), 1)
    with pytest.raises(ProgramError, match="dimension 3 is out of range for a 3-dim tensor"):
        cw.all_to_all(x, 3)


def test_all_to_all_on_a_mesh_runs_along_one_axis():
    p = prog()
    p.mesh(ep=2, dp=2)
    x = p.tensor("x", (8, 6, 4), "float32", cw.Layout(ep=cw.Sliced(0), dp=cw.Sliced(2)))
    y = cw.all_to_all(x, 1, axis="ep")
    assert y.layout == cw.Layout(ep=cw.Sliced(1), dp=cw.Sliced(2))
    with pytest.raises(ProgramError, match="say which mesh axis it runs over"):
        cw.all_to_all(x, 1)
    with pytest.raises(ProgramError, match=r"shares \(1, 2, 3\) name 3 ranks, the axis has 2"):
        cw.all_to_all(x, 1, axis="ep", shares=(1, 2, 3))
    with pytest.raises(ProgramError, match="dimension 2 is also sliced by axis `dp`, after axis `ep`"):
        cw.all_to_all(x, 2, axis="ep")


def test_batched_matmul_applies_one_matrix_per_batch_index():
    p = prog()
    x = p.tensor("x", (2, 4, 6, 5), "float32", cw.Sliced(1))
    w = p.tensor("w", (4, 5, 3), "float32", cw.Sliced(0))
    y = cw.matmul(x, w)
    assert y.shape == (2, 4, 6, 3) and y.layout == cw.Sliced(1)
    whole = p.tensor("ww", (4, 5, 3), "float32")
    with pytest.raises(ProgramError, match="sliced along batch dimension 1 but `ww` is whole; slice `ww` along its "
                                           "dimension 0 too"):
        cw.matmul(x, whole)
    assert cw.matmul(p.tensor("r", (2, 4, 6, 5), "float32", cw.Sliced(2)), whole).layout == cw.Sliced(2)
    with pytest.raises(ProgramError, match=r"the batch dimensions differ \(\[4\] vs \[3\]\)"):
        cw.matmul(x, p.tensor("w3", (3, 5, 3), "float32"))
    with pytest.raises(ProgramError, match="needs a tensor of shape"):
        cw.matmul(p.tensor("v", (5,), "float32"), whole)
    with pytest.raises(ProgramError, match="batch dimension is sliced in different shares"):
        cw.matmul(x, p.tensor("w4", (4, 5, 3), "float32", cw.Sliced(0, shares=(1, 3))))
