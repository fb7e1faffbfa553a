"""The reference backend's semantics of every operation against plain torch on the logical tensors,
at world sizes 1, 2, 3, 4 and 8 with sizes that do not divide evenly."""

import importlib.util
from pathlib import Path

import pytest
import torch

import cocoweave as cw
from cocoweave import rng
from cocoweave.backends import adasum, reference
from cocoweave.backends.inputs import gather_logical, make_inputs
from cocoweave.equivalence.compare import compare, logical_inputs
from cocoweave.errors import InputError, ProgramError

WORLDS = [1, 2, 3, 4, 8]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run(p, world, seed=0, sizes=None):
    ins = make_inputs(p, world, sizes, seed=seed)
    return logical_inputs(p, ins), reference.run(p, ins, sizes)


def output(p, results, name="out0"):
    v = dict(p.outputs)[name]
    return gather_logical(v, [r.outputs[name] for r in results if name in r.outputs])


def assert_close(actual, expected):
    d = compare(actual, expected.to(actual.dtype))
    assert d.ok, f"max abs error {d.max_abs}, max rel error {d.max_rel}"


LAYOUT_PAIRS = [
    (cw.Replicated, cw.Replicated), (cw.Sliced(0), cw.Replicated), (cw.Replicated, cw.Sliced(1)),
    (cw.Sliced(1), cw.Sliced(1)), (cw.Local, cw.Replicated), (cw.Local, cw.Local),
]
BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "maximum": torch.maximum,
          "minimum": torch.minimum, "lt": torch.lt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("la, lb", LAYOUT_PAIRS)
@pytest.mark.parametrize("op", sorted(BINARY))
def test_binary_elementwise(op, la, lb, world):
    p = cw.Program("t")
    a, b = p.tensor("a", (5, 7), "float32", la), p.tensor("b", (5, 7), "float32", lb)
    p.output(getattr(cw, op)(a, b))
    x, res = run(p, world)
    assert_close(output(p, res), BINARY[op](x["a"], x["b"]))


@pytest.mark.parametrize("world", WORLDS)
def test_broadcasting_a_replicated_bias_onto_a_slice(world):
    p = cw.Program("t")
    x = p.tensor("x", (2, 3, 9), "float32", cw.Sliced(2))
    b = p.tensor("b", (9,), "float32")
    c = p.tensor("c", (3, 1), "float32")
    p.output(x * b + c)
    v, res = run(p, world)
    assert_close(output(p, res), v["x"] * v["b"] + v["c"])


UNARY = {"neg": torch.neg, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "exp": torch.exp, "abs": torch.abs}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("layout", [cw.Replicated, cw.Sliced(0), cw.Local])
@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary_elementwise_and_scalars(op, layout, world):
    p = cw.Program("t")
    a = p.tensor("a", (7,), "float32", layout, init="positive")
    s, t = p.scalars("s t")
    p.output(getattr(cw, op)(a) * (1 - s**t) + cw.where(a > 0.5, a, -a) ** 2)
    x, res = run(p, world)
    expected = UNARY[op](x["a"]) * (1 - x["s"] ** x["t"]) + torch.where(x["a"] > 0.5, x["a"], -x["a"]) ** 2
    assert_close(output(p, res), expected)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_rounds_once_per_operation(dtype):
    p = cw.Program("t")
    a, b = p.tensor("a", (9, 3), dtype, cw.Sliced(0)), p.tensor("b", (9, 3), dtype)
    p.output(cw.cast(a * b + 1.5, "float32"))
    x, res = run(p, 4)
    out = output(p, res)
    assert out.dtype == torch.float32
    expected = ((x["a"].float() * x["b"].float()).to(x["a"].dtype).float() + 1.5).to(x["a"].dtype).float()
    assert torch.equal(out, expected)


# -- dropout: the mask depends on the logical index only --------------------------------------
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("layout", [cw.Sliced(0), cw.Sliced(1), cw.Replicated])
def test_dropout_does_not_depend_on_world_size_or_slicing(layout, world):
    p = cw.Program("t")
    x = p.tensor("x", (6, 13), "float32", layout)
    p.output(cw.dropout(x, 0.3, seed=7))
    v, res = run(p, world)
    expected = rng.dropout(v["x"], rng.logical_index((6, 13)), 0.3, 7)
    assert torch.equal(output(p, res), expected)
    kept = (expected != 0).float().mean().item()
    assert 0.5 < kept < 0.9


def test_dropout_of_local_tensors_depends_on_the_rank():
    p = cw.Program("t")
    x = p.tensor("x", (64, 64), "float32", cw.Local)
    p.output(cw.dropout(x, 0.5, seed=1))
    v, res = run(p, 3)
    masks = [r.outputs["out0"] != 0 for r in res]
    for r in range(3):
        expected = rng.dropout(v["x"][r], rng.logical_index((64, 64)), 0.5, 1, rank=r)
        assert torch.equal(res[r].outputs["out0"], expected)
    assert not torch.equal(masks[0], masks[1])


def test_dropout_with_a_runtime_seed():
    p = cw.Program("t")
    x = p.tensor("x", (32,), "float32", cw.Sliced(0))
    seed = p.scalar("seed", default=5)
    p.output(cw.dropout(x, 0.5, seed=seed))
    v, res = run(p, 3)
    assert torch.equal(output(p, res), rng.dropout(v["x"], rng.logical_index((32,)), 0.5, 5))


# -- reductions -------------------------------------------------------------------------------
REDUCE = {"sum": lambda t, d, k: torch.sum(t, d, keepdim=k), "max": lambda t, d, k: torch.amax(t, d, keepdim=k),
          "min": lambda t, d, k: torch.amin(t, d, keepdim=k),
          "norm": lambda t, d, k: torch.linalg.vector_norm(t, dim=d, keepdim=k)}
COMBINE_PARTIALS = {"sum": lambda s: s.sum(0), "max": lambda s: s.amax(0), "min": lambda s: s.amin(0),
                    "norm": lambda s: s.pow(2).sum(0).sqrt()}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("layout", [cw.Replicated, cw.Sliced(0), cw.Sliced(1)])
@pytest.mark.parametrize("dims", [None, 0, 1, (0, 1)])
@pytest.mark.parametrize("op", sorted(REDUCE))
def test_reductions(op, dims, layout, world):
    p = cw.Program("t")
    x = p.tensor("x", (5, 6), "float32", layout)
    y = getattr(cw, op)(x, dim=dims, keepdim=dims == 1)
    p.output(y)
    v, res = run(p, world)
    d = (0, 1) if dims is None else dims
    expected = REDUCE[op](v["x"], d, dims == 1)
    got = output(p, res)
    if y.layout.is_local:  # a reduction over the sliced dim: per-rank partials of the logical result
        got = COMBINE_PARTIALS[op](got)
    assert_close(got, expected)


# -- matmul and layer norm --------------------------------------------------------------------
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("la, lb", [(cw.Sliced(2), cw.Sliced(0)), (cw.Replicated, cw.Sliced(1)),
                                    (cw.Sliced(0), cw.Replicated), (cw.Sliced(1), cw.Replicated),
                                    (cw.Replicated, cw.Replicated), (cw.Local, cw.Replicated)])
def test_matmul(la, lb, world):
    p = cw.Program("t")
    x, w = p.tensor("x", (3, 5, 11), "float32", la), p.tensor("w", (11, 6), "float32", lb)
    y = cw.matmul(x, w)
    p.output(y)
    v, res = run(p, world)
    got = output(p, res)
    if y.layout.is_local and not la.is_local:  # partial sums over the sliced inner dimension
        got = got.sum(0)
    assert_close(got, torch.matmul(v["x"], v["w"]))


@pytest.mark.parametrize("world", WORLDS)
def test_layer_norm(world):
    p = cw.Program("t")
    x = p.tensor("x", (7, 10), "float32", cw.Sliced(0))
    g, b = p.tensor("g", (10,), "float32"), p.tensor("b", (10,), "float32")
    p.output(cw.layer_norm(x, g, b, eps=1e-6))
    v, res = run(p, world)
    assert_close(output(p, res), torch.nn.functional.layer_norm(v["x"], (10,), v["g"], v["b"], 1e-6))


# -- communication ----------------------------------------------------------------------------
STACKED = {"sum": lambda s: s.sum(0), "avg": lambda s: s.mean(0), "max": lambda s: s.amax(0),
           "min": lambda s: s.amin(0)}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("op", sorted(STACKED))
def test_all_reduce_and_reduce_scatter(op, world):
    p = cw.Program("t")
    g = p.tensor("g", (5, 3), "float32", cw.Local)
    p.output(cw.all_reduce(g, op), "ar")
    p.output(cw.reduce_scatter(g, op, dim=0), "rs")
    p.output(cw.all_gather(cw.reduce_scatter(g, op, dim=1)), "rs_ag")
    v, res = run(p, world)
    expected = STACKED[op](v["g"])
    for name in ("ar", "rs", "rs_ag"):
        assert_close(output(p, res, name), expected)
    assert all(torch.equal(r.outputs["ar"], res[0].outputs["ar"]) for r in res)


@pytest.mark.parametrize("world", WORLDS)
def test_broadcast_and_reduce(world):
    root = world - 1
    p = cw.Program("t")
    g = p.tensor("g", (4,), "float32", cw.Local)
    p.output(cw.broadcast(g, root), "b")
    p.output(cw.reduce(g, "sum", root), "r")
    v, res = run(p, world)
    for r in range(world):
        assert torch.equal(res[r].outputs["b"], v["g"][root])
        assert_close(res[r].outputs["r"], v["g"].sum(0) if r == root else v["g"][r])


def test_broadcast_root_outside_group_is_an_input_error():
    p = cw.Program("t")
    p.output(cw.broadcast(p.tensor("g", (4,), "float32", cw.Local), root=5))
    with pytest.raises(InputError, match="root 5 is outside its group of 2 ranks"):
        run(p, 2)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_send_to_next_pipeline_stage(world):
    p = cw.Program("t")
    s0, s1 = p.pipeline(2)
    x = p.tensor("x", (5, 3), "float32", cw.Local, group=s0)
    y = cw.all_reduce(x)
    p.output(cw.send(cw.reduce_scatter(x, dim=0), s1), "sliced")
    p.output(cw.send(y, s1), "full")
    v, res = run(p, world)
    half = world // 2
    assert all(not r.outputs for r in res[:half])
    assert_close(output(p, res, "full"), v["x"].sum(0))
    assert_close(output(p, res, "sliced"), v["x"].sum(0))


def test_pipeline_program_refuses_a_world_that_does_not_split():
    p = cw.Program("t")
    s0, s1 = p.pipeline(2)
    p.output(cw.send(cw.all_reduce(p.tensor("x", (4,), "float32", cw.Local, group=s0)), s1))
    with pytest.raises(ProgramError, match="world size 3 cannot be split"):
        reference.run(p, [{}, {}, {}])


def test_adasum_properties():
    a = torch.tensor([1.0, 0.0, 0.0])
    b = torch.tensor([0.0, 2.0, 0.0])
    assert torch.allclose(reference.combine("adasum", [a, b]), a + b)  # orthogonal: the sum
    assert torch.allclose(reference.combine("adasum", [a, a, a, a]), a)  # identical: the input
    x = [torch.randn(10, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    pair = adasum.adasum_pair
    assert torch.allclose(reference.combine("adasum", x), pair(pair(x[0], x[1]), pair(x[2], x[3])))
    assert torch.allclose(reference.combine("adasum", x[:3]), pair(pair(x[0], x[1]), x[2]))
    zero = torch.zeros(3)
    assert torch.equal(adasum.adasum_pair(zero, a), a)  # a tiny norm keeps the coefficient at 1


# -- inputs -----------------------------------------------------------------------------------
def test_bad_inputs_get_clear_errors():
    p = cw.Program("t")
    p.tensor("x", (5, "H"), "float32", cw.Sliced(0))
    with pytest.raises(InputError, match=r"size H is not bound; pass sizes=\{'H': ...\}"):
        make_inputs(p, 2)
    ins = make_inputs(p, 2, {"H": 3})
    assert ins[0]["x"].shape == (3, 3) and ins[1]["x"].shape == (2, 3)
    bad = [dict(i) for i in ins]
    bad[1]["x"] = torch.zeros(3, 3)
    with pytest.raises(InputError, match=r"rank 1: input `x` has shape \[3, 3\], expected \[2, 3\]"):
        reference.run(p, bad, {"H": 3})
    bad[1]["x"] = torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(InputError, match="rank 1: input `x` is torch.float64, expected torch.float32"):
        reference.run(p, bad, {"H": 3})
    del bad[1]["x"]
    with pytest.raises(InputError, match="rank 1: input `x` of program `t` is missing"):
        reference.run(p, bad, {"H": 3})
    bad[1]["x"], bad[1]["y"] = ins[1]["x"], 1.0
    with pytest.raises(InputError, match="rank 1: `y` is not an input"):
        reference.run(p, bad, {"H": 3})


def test_inputs_are_not_modified():
    p = cw.Program("t")
    w = p.tensor("w", (4,), "float32")
    p.update(w, w * 2)
    ins = make_inputs(p, 2)
    before = ins[0]["w"].clone()
    res = reference.run(p, ins)
    assert torch.equal(ins[0]["w"], before) and torch.equal(res[0].state["w"], before * 2)


# -- the paper's workloads --------------------------------------------------------------------
def load(name, func, **sizes):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, func)(**sizes)


@pytest.mark.parametrize("world", WORLDS)
def test_model_parallel_layer_matches_single_process_torch(world):
    p = load("model_parallel", "layer", B=2, S=3, H=20)
    v, res = run(p, world)
    y = torch.matmul(v["x"].float(), v["w"].float()).half()
    z = rng.dropout((y.float() + v["b"].float()).half().float(), rng.logical_index((2, 3, 20)), 0.1, 0).half()
    assert_close(output(p, res, "out"), (z.float() + v["r"].float()).half())


@pytest.mark.parametrize("world", WORLDS)
def test_adam_matches_torch_optim_adam(world):
    p = load("adam", "adam", N=37)
    ins = make_inputs(p, world, scalars={"lr": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "step": 1})
    res = reference.run(p, ins)
    v = logical_inputs(p, ins)
    w = torch.nn.Parameter(v["w"].clone())
    opt = torch.optim.Adam([w], lr=0.01, betas=(0.9, 0.999), eps=1e-8)
    w.grad = v["g"].mean(0)
    opt.step()  # first step from zero state: compare only w, with m = v = 0 inputs below
    ins0 = [dict(i, m=torch.zeros(37), v=torch.zeros(37)) for i in ins]
    res = reference.run(p, ins0)
    assert_close(res[world - 1].state["w"], w.detach())


# -- meshes and uneven shares -----------------------------------------------------------------------------------
@pytest.mark.parametrize("shares", [(3, 1), (1, 2, 5)])
def test_uneven_reduce_scatter_all_gather_and_slice(shares):
    world = len(shares)
    p = cw.Program("t")
    g = p.tensor("g", (11, 3), "float32", cw.Local)
    r = p.tensor("r", (11, 3), "float32")
    rs = cw.reduce_scatter(g, "sum", 0, shares=shares)
    p.output(rs, "rs")
    p.output(cw.all_gather(rs * 2.0 + r), "ag")
    p.output(cw.slice(r, 0, shares=shares), "sl")
    v, res = run(p, world)
    sizes = [len(t) for t in torch.arange(11).split(cw.ir.layout.split_sizes(11, shares))]
    assert [tuple(x.outputs["rs"].shape) for x in res] == [(n, 3) for n in sizes]
    assert_close(output(p, res, "rs"), v["g"].sum(0))
    assert_close(output(p, res, "ag"), v["g"].sum(0) * 2 + v["r"])
    assert_close(output(p, res, "sl"), v["r"])


def test_weighted_average_weights_each_rank_by_its_count():
    p = cw.Program("t")
    g = p.tensor("g", (5,), "float32", cw.Local)
    p.output(cw.all_reduce(g, "avg", weights=(3, 1)), "ar")
    p.output(cw.reduce_scatter(g, "avg", 0, weights=(3, 1), shares=(3, 1)), "rs")
    v, res = run(p, 2)
    want = (3 * v["g"][0] + v["g"][1]) / 4
    assert_close(output(p, res, "ar"), want)
    assert_close(output(p, res, "rs"), want)


def test_collectives_on_a_mesh_run_along_one_axis():
    p = cw.Program("t")
    p.mesh(x=2, y=3)
    g = p.tensor("g", (6, 4), "float32", cw.Local)
    along_y = cw.all_reduce(g, "sum", axis="y")
    p.output(along_y, "y")
    p.output(cw.all_reduce(along_y, "sum", axis="x"), "xy")
    p.output(cw.all_gather(cw.reduce_scatter(g, "max", 1, axis="x"), axis="x"), "mx")
    ins = make_inputs(p, 6)
    res = reference.run(p, ins)
    for r in range(6):
        i, j = divmod(r, 3)
        assert_close(res[r].outputs["y"], sum(ins[3 * i + k]["g"] for k in range(3)))
        assert_close(res[r].outputs["xy"], sum(ins[k]["g"] for k in range(6)))
        assert_close(res[r].outputs["mx"], torch.maximum(ins[j]["g"], ins[3 + j]["g"]))


def test_mesh_inputs_are_parts_of_one_logical_tensor_per_local_rank():
    p = cw.Program("t")
    p.mesh(x=2, y=2)
    a = p.tensor("a", (4, 6), "float32", cw.Layout(x=cw.Sliced(1), y=cw.Sliced(1, shares=(1, 2))))
    loc = p.tensor("l", (3,), "float32", cw.Layout(x=cw.Local))
    p.output(a + 1.0, "out0")
    p.output(loc, "l")
    ins = make_inputs(p, 4)
    assert [tuple(i["a"].shape) for i in ins] == [(4, 1), (4, 2), (4, 1), (4, 2)]
    assert torch.equal(ins[0]["l"], ins[1]["l"]) and not torch.equal(ins[0]["l"], ins[2]["l"])
    v, res = run(p, 4)
    assert_close(output(p, res), v["a"] + 1)


def test_logical_value_of_a_local_and_sliced_mesh_tensor_stacks_every_rank():
    p = cw.Program("t")
    p.mesh(x=2, y=2)
    v = p.tensor("g", (5, 2), "float32", cw.Layout(x=cw.Local, y=cw.Sliced(0, shares=(2, 3))))
    ins = make_inputs(p, 4)
    whole = gather_logical(v, [i["g"] for i in ins])
    assert whole.shape == (4, 5, 2)
    assert torch.equal(whole[0], whole[1]) and torch.equal(whole[0, :2], ins[0]["g"])
    assert torch.equal(whole[2, 2:], ins[3]["g"])
