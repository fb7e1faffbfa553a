"""Generated Triton kernels of fused computation stages (TRITON_INTERPRET=1 on CPU): every schedule of every
example equals the reference backend with kernels="triton", and random elementwise chains equal the torch path."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cocoweave as cw
from cocoweave import rng
from cocoweave.backends import reference
from cocoweave.backends.inputs import make_inputs
from cocoweave.backends.torch.executable import Executable
from cocoweave.backends.torch.worker import run_schedules
from cocoweave.equivalence.compare import compare, compare_results
from cocoweave.errors import BackendError
from cocoweave.ir.loader import load_example
from cocoweave.kernels.codegen import MAX_BLOCK, NoKernel, build_fused_kernels, kernel_spec
from cocoweave.plan import lower
from cocoweave.schedule.enumerate import enumerate_schedules
from cocoweave.schedule.schedule import Schedule

EXAMPLES = {  # sizes that split unevenly over 2 and 3 ranks
    "adam": ("adam.py:adam", {"N": 101}),
    "lamb": ("lamb.py:lamb", {"N": 101}),
    "layer": ("model_parallel.py:layer", {"B": 5, "S": 2, "H": 3}),
    "boundary": ("pipeline_parallel.py:boundary", {"B": 5, "S": 2, "H": 3}),
}


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    """A one-rank Gloo group in this process (the torch backend's collectives need a process group)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def check_example(name: str, world_size: int, run: Callable) -> int:
    """Every schedule of example `name` with generated kernels equals the reference; returns how many
    schedules ran at least one generated kernel."""
    spec, sizes = EXAMPLES[name]
    program = load_example(spec, **sizes)
    schedules = enumerate_schedules(program)
    inputs = make_inputs(program, world_size, sizes, seed=3)
    expected = reference.run(program, inputs, sizes, whole_state=True)
    results = run(run_schedules, schedules, inputs, sizes, "cpu", "triton")
    for i, s in enumerate(schedules):
        diff = compare_results(program, [r[i] for r in results], expected)
        assert diff.ok, f"{name} schedule {s.name} on {world_size} ranks: {diff}"
    return sum(bool(build_fused_kernels(lower(s), 0, world_size, sizes, "cpu")) for s in schedules)


@pytest.mark.parametrize("name", ["adam", "lamb", "layer"])
def test_every_schedule_on_one_rank_equals_the_reference(name: str, one_rank: None) -> None:
    assert check_example(name, 1, lambda fn, *args: [fn(0, 1, *args)]) > 0


def test_every_schedule_on_two_and_three_ranks_equals_the_reference(local_world: Callable) -> None:
    for name in ["adam", "lamb", "layer", "boundary"]:
        assert check_example(name, 2, local_world(2).run) > 0, name
    assert check_example("layer", 3, local_world(3).run) > 0  # B = 5 rows split 2, 2, 1


def test_adam_fused_stage_is_one_kernel_called_from_the_step(one_rank: None) -> None:
    program = load_example("adam.py:adam", N=101)
    plan = lower(next(s for s in enumerate_schedules(program) if s.name == "AR-C"))
    exe = Executable(plan, 0, 1, {"N": 101}, kernels="triton")
    (index, source), = exe.kernel_sources().items()
    assert f"ctx.fused({index})(" in exe.source
    # one kernel (its body an inlined device function, called unmasked on full blocks): 4 reads and 3 writes
    assert source.count("_kernel(") == 1 and source.count("tl.load(") == 4 and source.count("tl.store(") == 3
    assert source.count("in place") == 3  # m, v and w are written over, like the hand-written Adam kernel
    kernel = exe.ctx.fused(index)
    assert kernel.path.read_text() == source and len(kernel.outputs) == 3
    inputs = make_inputs(program, 1, {"N": 101}, seed=0)[0]
    state = exe.run(dict(inputs)).state
    assert all(state[n] is inputs[n] for n in "mvw")
    assert Executable(plan, 0, 1, {"N": 101}, kernels="torch").kernel_sources() == {}


def test_sliced_stage_narrows_replicated_operands_and_draws_the_logical_mask() -> None:
    program = load_example("model_parallel.py:layer", B=3, S=2, H=5)
    plan = lower(next(s for s in enumerate_schedules(program) if s.name == "MM-RS-C-AG"))
    index = next(i for i, s in enumerate(plan.stages) if s.label == "C")
    source = kernel_spec(plan, index, 1, 3, {"B": 3, "S": 2, "H": 5}).source
    assert "tl.load(b_ptr + i % 5, mask=mask)" in source  # the bias broadcasts along rows
    assert "tl.load(r_ptr + i + 10, mask=mask)" in source  # rank 1's rows of the whole residual
    assert "index0 = (i + 10).to(tl.uint32)" in source  # dropout hashes logical indices


@pytest.mark.parametrize("name, schedule, reason", [
    ("lamb", "AR-C", "is a norm"),
    ("layer", "ol(MM,AR,C,2)", "not a fused computation"),
])
def test_stages_left_to_torch_ops(name: str, schedule: str, reason: str) -> None:
    spec, sizes = EXAMPLES[name]
    plan = lower(next(s for s in enumerate_schedules(load_example(spec, **sizes)) if s.name == schedule))
    for i in range(len(plan.stages)):
        if reason in str(_no_kernel(plan, i, sizes)):
            return
    pytest.fail(f"no stage of {schedule} is refused because it {reason}")


def test_dropout_keys_follow_the_runtime_seed_and_the_rank_of_local_tensors() -> None:
    """A Local tensor's mask mixes in the rank (cocoweave.rng); a seed given at run time is hashed per call."""
    p = cw.Program("noise")
    x = p.tensor("x", (3, 7), "float32", cw.Local)
    seed = p.scalar("seed", "int64")
    p.output(cw.dropout(x, 0.5, seed=seed) * 2, "y")
    s = Schedule(p)
    s.fuse(s.stages[0])
    plan = lower(s)
    kernels = {r: build_fused_kernels(plan, r, 2, {}, "cpu")[0] for r in range(2)}
    ones = torch.ones(3, 7)
    for r, kernel in kernels.items():
        for sd in (5, 6):
            (y,) = kernel(ones, sd)
            keep = rng.keep_mask(rng.logical_index((3, 7)), rng.dropout_key(sd, r), rng.keep_threshold(0.5))
            assert torch.equal(y != 0, keep), (r, sd)


def test_index_arithmetic_is_64_bit_past_2_31_elements() -> None:
    program = load_example("adam.py:adam", N=3 * 2**30)
    plan = lower(next(s for s in enumerate_schedules(program) if s.name == "AR-C"))
    source = kernel_spec(plan, 1, 0, 1, {"N": 3 * 2**30}).source
    assert "tl.program_id(0).to(tl.int64)" in source and f"i < {3 * 2**30})" in source


def test_index_arithmetic_is_64_bit_when_the_last_block_would_pass_2_31() -> None:
    """start + BLOCK of the last block overflows int32 for sizes within one block of 2^31 (it would take the
    unmasked path and write past the end): such sizes get int64 indices too."""
    for n in (2**31 - 1, 2**31 - 100, 2**31 - MAX_BLOCK):
        program = load_example("adam.py:adam", N=n)
        plan = lower(next(s for s in enumerate_schedules(program) if s.name == "AR-C"))
        assert "tl.program_id(0).to(tl.int64)" in kernel_spec(plan, 1, 0, 1, {"N": n}).source, n
    program = load_example("adam.py:adam", N=2**31 - 4097 - 4096)
    plan = lower(next(s for s in enumerate_schedules(program) if s.name == "AR-C"))
    assert "start = tl.program_id(0) * BLOCK" in kernel_spec(plan, 1, 0, 1, {"N": 2**31 - 8193}).source


def test_generated_math_is_correctly_rounded_or_libdevices() -> None:
    """No approximate exp, exp2/log2 pow or rsqrt in generated kernels: torch computes these exactly enough that
    ex2.approx.ftz (error growing with |x|, subnormals flushed) would show."""
    p = cw.Program("math")
    a = p.tensor("a", (100,), "float32")
    p.output(cw.exp(-cw.abs(a)) + (cw.abs(a) + 0.5) ** p.scalar("s") + (cw.abs(a) + 1) ** -0.5 + cw.rsqrt(a)
             + cw.sigmoid(a) * cw.silu(a) + cw.silu_grad(a, a), "y")
    s = Schedule(p)
    s.fuse(s.stages[0])
    source = kernel_spec(lower(s), 0, 0, 1, {}).source
    for approximate in ("tl.exp(", "tl.exp2(", "tl.log2(", "tl.rsqrt("):
        assert approximate not in source
    assert "precise_exp(" in source and "precise_pow(" in source and "tl.div_rn(1.0, tl.sqrt_rn(" in source
    assert source.count("precise_exp(") == 4  # exp, sigmoid's, silu's and silu_grad's sigmoid (computed once)


def test_precompile_compiles_the_launch_the_step_will_make(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, kernels compile when the executable is built, not at their first launch inside a step (where the
    first step compiled every bucket serially inside the collectives' timeout): Triton's warmup gets dtypes where
    the launch passes tensors, the same scalars' kinds, grid, BLOCK and FMA setting."""
    from cocoweave.kernels import codegen
    from cocoweave.kernels.codegen import FusedKernel

    spec, sizes = EXAMPLES["adam"]
    plan = lower(next(s for s in enumerate_schedules(load_example(spec, **sizes)) if s.name == "AR-C"))
    kernel = FusedKernel(kernel_spec(plan, 1, 0, 1, sizes), torch.device("cpu"), "precompile-test")
    seen = []
    monkeypatch.setattr(kernel, "_fn", type("Jit", (), {"warmup": lambda self, *a, **kw: seen.append((a, kw))})())
    kernel.precompile()
    assert seen == []  # interpreted: nothing to compile
    monkeypatch.setattr(codegen, "interpreted", lambda: False)
    kernel.precompile()
    (args, kwargs), = seen
    tensors = [v for v, kind in zip(kernel.spec.inputs, kernel.spec.kinds) if kind == "tensor"]
    assert [a for a in args if isinstance(a, torch.dtype)] == [torch.float32] * (len(tensors) + len(kernel.outputs))
    assert kwargs == {"grid": (1,), "BLOCK": 128, "num_warps": 1, "enable_fp_fusion": False}


def test_kernels_on_cpu_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    spec, sizes = EXAMPLES["adam"]
    plan = lower(next(s for s in enumerate_schedules(load_example(spec, **sizes)) if s.name == "AR-C"))
    assert build_fused_kernels(plan, 0, 1, sizes, "cpu")  # generating needs neither a GPU nor the interpreter
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(BackendError, match="TRITON_INTERPRET=1"):
        Executable(plan, 0, 1, sizes, kernels="triton")


def _no_kernel(plan, index: int, sizes: dict) -> NoKernel | None:
    try:
        kernel_spec(plan, index, 0, 1, sizes)
    except NoKernel as e:
        return e
    return None


SM90_SCRIPT = """
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from sm90_compile import compile_sm90, record_launches
import cocoweave as cw
from cocoweave import rng
from cocoweave.backends.inputs import make_inputs
from cocoweave.kernels.codegen import FusedKernel, kernel_spec
from cocoweave.ir.loader import load_example
from cocoweave.plan import lower
from cocoweave.schedule.enumerate import enumerate_schedules
from cocoweave.schedule.schedule import Schedule

def launch(plan, index, sizes, inputs):
    kernel = FusedKernel(kernel_spec(plan, index, 0, 1, sizes), torch.device("cpu"), "sm90-" + plan.fingerprint)
    kernel(*(inputs[v.name] if v.name in inputs else 0.5 for v in kernel.inputs))

def calls():
    adam = load_example("adam.py:adam", N=1 << 20)
    plan = lower(next(s for s in enumerate_schedules(adam) if s.name == "AR-C"))
    g = torch.empty(1 << 20)
    launch(plan, 1, {"N": 1 << 20}, {**make_inputs(adam, 1, {"N": 1 << 20})[0], plan.stages[0].values[0].name: g})
    p = cw.Program("epilogue")
    y, r = (p.tensor(n, (64, 3072), "bfloat16") for n in "yr")
    p.output(cw.dropout(y + p.tensor("b", (3072,), "bfloat16"), 0.1, seed=0) + r)
    s = Schedule(p)
    s.fuse(s.stages[0])
    launch(lower(s), 0, {}, make_inputs(p, 1, {})[0])

for fn, args in record_launches(calls):
    print(json.dumps(compile_sm90(fn, args)))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None, reason="no CUDA backend")
def test_generated_kernels_compile_for_sm90_like_the_hand_written_ones() -> None:
    """Adam's generated kernel makes the same 16-byte loads and stores as kernels/adam.py (4 reads, 3 writes
    per element; 8 elements per thread where the hand-written kernel takes 16, so half as many of each, on the
    full-block and masked paths); the bf16 bias + dropout + residual epilogue reads x, bias and residual and
    writes once."""
    here = Path(__file__).resolve().parent
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([str(here.parents[1] / "src"), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", SM90_SCRIPT, str(here)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    adam, epilogue = (json.loads(line) for line in run.stdout.splitlines())
    assert adam["accesses"] == {"ld.global.v4.b32": 16, "st.global.v4.b32": 12}, adam  # _adam_kernel's 32, 24
    assert set(epilogue["accesses"]) == {"ld.global.v4.b32", "st.global.v4.b32"}, epilogue
    assert adam["spills"] == epilogue["spills"] == 0


# -- random elementwise chains: the generated kernel against the torch path --------------------------------
SHAPES = [("A", "B"), ("B",), ("A", 1), ()]
DTYPES = ["float32", "float16", "bfloat16"]
OPS = ["add", "sub", "mul", "maximum", "minimum", "neg", "abs", "div", "sqrt", "exp", "sigmoid", "silu", "silu_grad",
       "where", "dropout", "cast", "scalar", "pow", "square"]


def build_chain(data: st.DataObject) -> tuple[cw.Program, int]:
    """A program of 2-3 inputs (random dtypes and broadcastable shapes) and 1-6 elementwise operations,
    each result an output. The operations are continuous and keep magnitudes small, so that rounding
    differences stay differences of a few units in the last place."""
    p = cw.Program("chain")
    vals = [p.tensor(f"x{k}", data.draw(st.sampled_from(SHAPES)), data.draw(st.sampled_from(DTYPES)), init="unit")
            for k in range(data.draw(st.integers(2, 3)))]
    s = p.scalar("s")
    depth = data.draw(st.integers(1, 6))
    for k in range(depth):
        op = data.draw(st.sampled_from(OPS))
        a, b = data.draw(st.sampled_from(vals)), data.draw(st.sampled_from(vals))
        if op in ("add", "sub", "mul", "maximum", "minimum"):
            r = getattr(cw, op)(a, b)
        elif op in ("neg", "abs", "sigmoid", "silu"):
            r = getattr(cw, op)(a)
        elif op == "silu_grad":
            r = cw.silu_grad(a, b)
        elif op == "div":
            r = a / (cw.abs(b) + 1)
        elif op == "sqrt":
            r = cw.sqrt(cw.abs(a) + 0.5)
        elif op == "exp":
            r = cw.exp(-cw.abs(a))
        elif op == "where":
            r = cw.where(a > b, a, b)
        elif op == "dropout":
            r = cw.dropout(a, data.draw(st.sampled_from([0.0, 0.25, 0.5])), seed=data.draw(st.integers(0, 2**32 - 1)))
        elif op == "cast":
            r = cw.cast(a, data.draw(st.sampled_from(DTYPES)))
        elif op == "scalar":
            r = a * s + 0.5
        elif op == "pow":
            r = (cw.abs(a) + 0.5) ** s
        else:
            r = a**2
        p.output(r, f"y{k}")
        vals.append(r)
    return p, depth


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_elementwise_chains_equal_the_torch_path(data: st.DataObject) -> None:
    program, depth = build_chain(data)
    sizes = {"A": data.draw(st.integers(1, 4)), "B": data.draw(st.integers(1, 37))}
    schedule = Schedule(program)
    for stage in list(schedule.stages):
        schedule.fuse(stage)
    plan = lower(schedule)
    inputs = make_inputs(program, 1, sizes, seed=data.draw(st.integers(0, 1000)))[0]
    triton_exe = Executable(plan, 0, 1, sizes, kernels="triton")
    assert triton_exe.kernel_sources(), "the chain should be one generated kernel"
    got = triton_exe.run(dict(inputs)).outputs
    expected = Executable(plan, 0, 1, sizes, kernels="torch").run(dict(inputs)).outputs
    # fp32 and fp16 round exactly like torch; the interpreter rounds fp32 -> bf16 toward zero (the GPU
    # rounds to nearest), so a chain through bf16 is within a few bf16 units of its largest value
    bf16 = any(v.dtype == "bfloat16" for v in program.values if not v.is_scalar)
    scale = max([1.0] + [float(t.float().abs().max()) for t in expected.values() if t.numel()])
    for name, e in expected.items():
        g = got[name]
        assert g.dtype == e.dtype and g.shape == e.shape, name
        if bf16:
            torch.testing.assert_close(g.float(), e.float(), atol=depth * 2**-7 * scale**2, rtol=0, msg=name)
        else:
            assert compare(g, e).ok, (name, compare(g, e))
