"""A collective kind is one registration (collectives.CollectiveKind) plus its torch implementation: a `gather`
(the ranks' parts of a Sliced tensor joined on the root, zeros elsewhere) defined here and nowhere else is built by
the DSL with its layout rule, computed by the reference backend, run by the torch backend on 2 Gloo ranks to the
reference's result, and seen by traffic, schedule tokens, calibration and the profiler's recorder; removed, every
one of them forgets it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist

import cocoweave as cw
from cocoweave import collectives
from cocoweave.backends import reference
from cocoweave.backends.inputs import make_inputs
from cocoweave.backends.torch.codegen import generate
from cocoweave.backends.torch.worker import run_schedules
from cocoweave.cluster.profiling import recorder
from cocoweave.equivalence.compare import compare_results
from cocoweave.errors import CocoweaveError, ProgramError
from cocoweave.ir import registry as R
from cocoweave.ir.layout import Local
from cocoweave.ir.ops import collective_operand, collective_result, refuse
from cocoweave.perf import calibrate
from cocoweave.plan import lower
from cocoweave.schedule.schedule import Schedule


def gather(x: Any, root: int = 0, axis: str | None = None) -> cw.Value:
    """The layout rule: a Sliced operand's parts joined on rank `root` of the axis; the result is Local there (the
    root holds the whole tensor, the other ranks zeros)."""
    x, i, ax, p = collective_operand("gather", x, axis)
    if not p.is_sliced:
        raise refuse("gather", x, f"needs a Sliced operand (the parts to join), got {p!r}")
    return collective_result("gather", x, {"dim": p.dim, "root": root, "axis": ax}, i, Local)


def _meaning(v: Any, parts: list[torch.Tensor], combine: Any) -> list[torch.Tensor]:
    whole = torch.cat(parts, dim=v.attrs["dim"])
    return [whole if r == v.attrs["root"] else torch.zeros_like(whole) for r in range(len(parts))]


def gather_parts(ctx: Any, x: torch.Tensor, dim: int, total: int, root: int, group: Any, out: Any,
                 async_op: bool = False) -> torch.Tensor:
    """The torch backend's gather: torch.distributed.gather, then the parts joined along `dim` on the root."""
    shape = list(x.shape)
    shape[dim] = total
    res = ctx.buffer(out, shape, x.dtype)
    me, n = dist.get_rank(group), dist.get_world_size(group)
    got = [torch.empty_like(x) for _ in range(n)] if me == root else None
    dist.gather(x.contiguous(), got, dst=root if group is None else dist.get_global_rank(group, root), group=group)
    return res.copy_(torch.cat(got, dim)) if got is not None else res.zero_()


def _register() -> collectives.CollectiveKind:
    """The one registration: the kind, and the torch backend's implementation on the library algorithm."""
    kind = collectives.register_kind(collectives.CollectiveKind(
        "gather", "G", gather, _meaning, attrs=("dim", "root", "axis"),
        rebuild=lambda p, args, a: gather(args[0], a["root"], a["axis"]),
        call=lambda v, shape: ((v.attrs["dim"], shape[v.attrs["dim"]], v.attrs["root"]), ()),
        moved=lambda p: 1 / p, steps=lambda p: 1,
        benchmark=lambda b: lambda: dist.gather(b.part, [torch.empty_like(b.part) for _ in range(b.p)]
                                                if b.rank == 0 else None, 0),
        recorded={"gather": (0, True)}, chunkable=False))
    collectives.implement("torch", collectives.DEFAULT, gather=gather_parts)
    return kind


@contextmanager
def _registered() -> Iterator[collectives.CollectiveKind]:
    """The kind registered for a while (a test, or a rank's run), then removed."""
    kind = _register()
    try:
        yield kind
    finally:
        collectives.unregister_kind("gather")


@pytest.fixture
def gathering() -> Iterator[collectives.CollectiveKind]:
    with _registered() as kind:
        yield kind


def _program(root: int = 1) -> cw.Program:
    p = cw.Program("gathered")
    x = p.tensor("x", (4, 3), "float32", cw.Sliced(0))
    p.output(gather(x * 2.0, root), "y")
    return p


def test_the_dsl_builds_it_with_its_layout_rule(gathering):
    p = _program()
    y = dict(p.outputs)["y"]
    assert (y.op, y.layout, y.attrs["dim"], y.attrs["root"]) == ("gather", Local, 0, 1)
    assert "gather" in R.names(R.COLLECTIVE)
    q = cw.Program("local")
    with pytest.raises(ProgramError, match=r"gather\(.*\): needs a Sliced operand"):
        gather(q.tensor("x", (4, 3), "float32", cw.Local))


def test_the_reference_backend_computes_it(gathering):
    program = _program()
    inputs = make_inputs(program, 2, {}, seed=3)
    got = reference.run(program, inputs, {})
    whole = torch.cat([inputs[0]["x"], inputs[1]["x"]]) * 2.0
    assert torch.equal(got[1].outputs["y"], whole)
    assert torch.equal(got[0].outputs["y"], torch.zeros_like(whole))


def test_codegen_calls_its_registered_implementation(gathering):
    source = generate(lower(Schedule(_program())), 0, 2, {})
    assert 'ctx.gather_parts(v2, 0, 4, 1, ctx.group("world"), out="%3")' in source  # dim, whole size, root, group
    assert 'ctx.span("G", 1)' in source


def _run_gather(rank: int, world_size: int, inputs: Any) -> Any:
    """On a rank: the same one registration, the program built and run, the kind removed again."""
    from cocoweave.preflight.record import recording

    with _registered(), recording() as rec:
        result = run_schedules(rank, world_size, [Schedule(_program())], inputs, {})[0]
    return result, [(op.kind, op.numel) for op in rec.other]


def test_the_torch_backend_runs_it_and_it_equals_the_reference(gathering, local_world):
    program = _program()
    inputs = make_inputs(program, 2, {}, seed=5)
    want = reference.run(program, inputs, {}, whole_state=True)
    got, seen = zip(*local_world(2).run(_run_gather, inputs))
    assert compare_results(program, list(got), want).ok
    assert all(("gather", 6) in ops for ops in seen)  # pre-flight's recording sees the new kind: one 2x3 part
    assert torch.count_nonzero(got[1].outputs["y"]) > 0  # the root's result is not the zeros of the others


def test_traffic_tokens_calibration_and_the_recorder_see_it(gathering, tmp_path):
    assert (collectives.moved("gather", 4), collectives.steps("gather", 4)) == (0.25, 1)
    assert Schedule(_program()).stages[-1].label == "G"
    benches = calibrate._collectives(2, 0, 8, torch.device("cpu"))
    assert benches["gather/library"][0] == pytest.approx(0.5 * 4 * 8)  # 1/p of the 32 bytes, the kind's formula
    assert recorder.watched()["gather"] == ("gather", 0, True)
    from cocoweave.cluster.planning.llm.comm import priced
    from cocoweave.cluster.profiling.host_scaling import known_kind
    from cocoweave.collectives.pricing import Link

    assert known_kind("gather") == "gather"  # the profiler's model prices its 1/p, not a whole message
    assert priced("gather", 4e6, 4, Link("test", 1e9, 0.0))[0] == pytest.approx(1e-3)  # the planner too: 1/4 of 4 MB
    rec = recorder.StepRecorder(tmp_path / "r.jsonl", steps=1, warmup=0)
    rec.collective("gather", lambda tensor, gather_list=None, dst=0, group=None: None)(torch.ones(3))
    assert rec.collectives["gather/p1"][:2] == [1, 12]


def test_unregistering_forgets_it():
    _register()
    collectives.unregister_kind("gather")
    assert "gather" not in R.REGISTRY and "gather" not in [k.name for k in collectives.all_kinds()]
    with pytest.raises(collectives.UnknownKindError, match="unknown collective kind 'gather'"):
        collectives.kind("gather")
    with pytest.raises(CocoweaveError, match="unknown collective 'gather'"):
        collectives.moved("gather", 2)
    assert not collectives.get(collectives.DEFAULT).implements("gather")
    assert "gather_parts" not in collectives.implementations("torch")
    assert "gather" not in recorder.watched()
    assert "gather/library" not in calibrate._collectives(2, 0, 8, torch.device("cpu"))
    with pytest.raises(ProgramError, match="unknown operation 'gather'"):
        R.apply("gather", cw.Program("p").tensor("x", (4,), "float32", cw.Sliced(0)))


def test_registrations_are_checked(gathering):
    with pytest.raises(CocoweaveError, match="'gather' is already registered"):
        collectives.register_kind(gathering)
    with pytest.raises(CocoweaveError, match="has token 'AR', as 'all_reduce' does"):
        collectives.register_kind(collectives.CollectiveKind("other", "AR", gather, _meaning, gathering.call))
