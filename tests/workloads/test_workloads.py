"""The workload programs: every schedule of each computes what the program as written computes
(reference backend, world sizes 1-4), the optimizer programs follow torch's formulas, and the
examples/ files still expose them under their old names."""

from __future__ import annotations

import pytest
import torch

from cocoweave.equivalence.check import check_schedules, world_applicable
from cocoweave.errors import ProgramError
from cocoweave.ir.loader import load_example
from cocoweave.schedule.enumerate import enumerate_schedules
from cocoweave.workloads import adam, adamw, boundary, lamb, layer, reduce_gradient, sgd

WORKLOADS = [
    ("sgd", lambda: sgd(13)),
    ("adam", lambda: adam(13)),
    ("adamw", lambda: adamw(13)),
    ("adamw-bf16-masters", lambda: adamw(13, param_dtype="bfloat16")),
    ("adamw-adasum", lambda: adamw(13, reduction="adasum")),
    ("adamw-reduced", lambda: adamw(13, grad="reduced")),
    ("lamb", lambda: lamb(13)),
    ("lamb-columns", lambda: lamb(7, 3)),
    ("reduce_gradient", lambda: reduce_gradient((13,), "sum")),
    ("model_parallel", lambda: layer(2, 3, 8, dtype="float32")),
    ("pipeline_parallel", lambda: boundary(2, 3, 8, dtype="float32")),
    ("model_parallel-constant-seed", lambda: layer(2, 3, 8, dtype="float32", seed=5)),
    ("pipeline_parallel-constant-seed", lambda: boundary(2, 3, 8, dtype="float32", seed=5)),
]


@pytest.mark.parametrize("build", [b for _, b in WORKLOADS], ids=[n for n, _ in WORKLOADS])
def test_every_schedule_matches_the_program_at_world_sizes_1_to_4(build):
    program = build()
    schedules = enumerate_schedules(program)
    for world_size in range(1, 5):
        if world_applicable(program, world_size) is not None:
            continue
        rows = check_schedules(program, schedules, world_size)
        bad = [r for r in rows if not r.ok]
        assert not bad, bad


def test_sliced_schedules_exist_where_the_optimizers_need_them():
    names = lambda p: {s.name for s in enumerate_schedules(p)}  # noqa: E731
    assert "RS-C-AG+slice(m,v)" in names(adamw(64))
    assert "C-RS-C-AG+slice(m,v,w)" in names(adamw(64, param_dtype="bfloat16"))  # masters sliced, bf16 gathered
    assert "RS-C-AG+slice(buf)" in names(sgd(64))
    assert "RS-C-AR-C-AG+slice(m,v)" in names(lamb(16, 4))  # the T partial norms are all-reduced
    assert names(adamw(64, reduction="adasum")) == {"AR-c", "AR-C"}  # adasum cannot be split


def test_dropout_seeds_are_runtime_scalars_unless_a_constant_is_given():
    for build in (layer, boundary):
        (drop,) = [v for v in build(2, 4, 8).values if v.op == "dropout"]
        assert drop.attrs["seed"] is None and drop.args[1].name == "seed"  # a new mask each step the caller asks
        (const,) = [v for v in build(2, 4, 8, seed=3).values if v.op == "dropout"]
        assert const.attrs["seed"] == 3 and "seed" not in build(2, 4, 8, seed=3).inputs


def test_pipeline_schedule_sends_only_slices():
    program = boundary(2, 4, 8)
    s = next(s for s in enumerate_schedules(program) if s.name == "RS-C-P2P-AG")
    sends = [v for v in s.program.values if v.op == "send"]
    assert sends and all(v.layout.is_sliced for v in sends)  # 1/tp of the bytes cross the stage boundary
    assert any(v.op == "all_gather" and v.group.name == "stage1" for v in s.program.values)


def _run(program, inputs):
    from cocoweave.backends import reference

    return reference.run(program, [inputs], {})[0]


def test_adamw_program_matches_torch_adamw():
    torch.manual_seed(0)
    w, g = torch.randn(10), torch.randn(10)
    param = torch.nn.Parameter(w.clone())
    opt = torch.optim.AdamW([param], lr=0.1, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.3)
    state = {"w": w.clone(), "m": torch.zeros(10), "v": torch.zeros(10)}
    for step in (1, 2, 3):
        param.grad = g * step
        opt.step()
        res = _run(adamw(10), {**state, "g": g * step, "lr": 0.1, "beta1": 0.8, "beta2": 0.95, "eps": 1e-6,
                                "weight_decay": 0.3, "step": step})
        state = {n: res.state[n] for n in "wmv"}
    torch.testing.assert_close(state["w"], param.detach())
    torch.testing.assert_close(state["v"], opt.state[param]["exp_avg_sq"])


def test_sgd_program_matches_torch_sgd_with_nesterov():
    torch.manual_seed(1)
    w, g = torch.randn(10), torch.randn(10)
    param = torch.nn.Parameter(w.clone())
    opt = torch.optim.SGD([param], lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)
    state = {"w": w.clone(), "buf": torch.zeros(10)}
    for step in (1, 2, 3):
        param.grad = g * step
        opt.step()
        res = _run(sgd(10), {**state, "g": g * step, "lr": 0.1, "momentum": 0.9, "dampening": 0.0,
                              "weight_decay": 0.01, "nesterov": 1.0, "momentum_on": 1.0})
        state = {n: res.state[n] for n in ("w", "buf")}
    torch.testing.assert_close(state["w"], param.detach())


def test_low_precision_parameters_are_cast_from_the_masters():
    res = _run(sgd(4, param_dtype="bfloat16"), {"g": torch.ones(4, dtype=torch.bfloat16), "w": torch.full((4,), 1 / 3),
                                                 "p": torch.zeros(4, dtype=torch.bfloat16), "buf": torch.zeros(4),
                                                 "lr": 0.0, "momentum": 0.0, "dampening": 0.0,
                                                 "weight_decay": 0.0, "nesterov": 0.0, "momentum_on": 0.0})
    assert res.state["w"].dtype == torch.float32
    assert torch.equal(res.state["p"], torch.full((4,), 1 / 3).bfloat16())


def test_examples_still_expose_the_workloads():
    assert load_example("adam.py:adam", N=8).name == "adam"
    assert load_example("lamb.py:lamb", N=8, T=2).inputs["w"].shape == (8, 2)
    assert load_example("model_parallel.py:layer", B=1, S=2, H=4).name == "model_parallel"
    assert load_example("pipeline_parallel.py:boundary", B=1, S=2, H=4).name == "pipeline_parallel"
    assert load_example("adamw.py:adamw", N=8).name == "adamw"
    assert load_example("sgd.py:sgd", N=8).name == "sgd"


def test_bad_options_name_the_program_and_the_choices():
    with pytest.raises(ProgramError, match="program `adamw`: grad must be one of local, reduced"):
        adamw(8, grad="sliced")
    with pytest.raises(ProgramError, match="reduction must be one of avg, sum, adasum"):
        sgd(8, reduction="max")
    with pytest.raises(ProgramError, match="param_dtype must be one of"):
        lamb(8, param_dtype="float64")
