"""The dropless experts as one program (workloads.moe_dropless: dispatch all_to_all_v -> SwiGLU expert GEMMs as
grouped_matmul over the received (source rank, local expert) segments -> combine all_to_all_v) equal one process of
plain torch applying each token's expert to it (routings with experts that get no token and ranks that send nothing,
rows of padding), on the reference at 1-4 ranks and on the torch backend at 2 and 4 Gloo ranks; every enumerated
schedule equals the program as written on random agreeing counts, on both backends."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cocoweave import workloads
from cocoweave.backends import reference
from cocoweave.backends.torch.worker import run_schedules
from cocoweave.equivalence.check import check_schedules, torch_runner
from cocoweave.errors import ProgramError
from cocoweave.schedule.enumerate import enumerate_schedules
from cocoweave.schedule.schedule import Schedule

D, F = 6, 5


def _routed(experts: list[list[int]], n: int, e: int, seed: int
            ) -> tuple[list[dict], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each rank's tokens routed to the global experts `experts[rank]` (sorted: by destination rank, then by its
    local expert, experts e // R apart living on one rank), padded to n rows; the counts the program takes."""
    world = len(experts)
    per = e // world
    g = torch.Generator().manual_seed(seed)
    w1, w3, w2 = torch.randn(e, D, F, generator=g), torch.randn(e, D, F, generator=g), torch.randn(e, F, D, generator=g)
    sent = [[[sorted(experts[i]).count(j * per + k) for k in range(per)] for j in range(world)] for i in range(world)]
    ins = []
    for j in range(world):
        ins.append({"x": torch.randn(n, D, generator=g), "s": torch.tensor([sum(c) for c in sent[j]]),
                    "r": torch.tensor([sum(sent[i][j]) for i in range(world)]),
                    "c": torch.tensor([sent[i][j] for i in range(world)]),
                    "w1": w1[j * per:(j + 1) * per].clone(), "w3": w3[j * per:(j + 1) * per].clone(),
                    "w2": w2[j * per:(j + 1) * per].clone()})
    return ins, w1, w3, w2


def _plain(x: torch.Tensor, experts: list[int], w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One process: token t times its expert's SwiGLU, w2 (silu(x w1) * (x w3)); zero rows past the tokens."""
    out = torch.zeros_like(x)
    for t, k in enumerate(sorted(experts)):
        out[t] = (torch.nn.functional.silu(x[t] @ w1[k]) * (x[t] @ w3[k])) @ w2[k]
    return out


@st.composite
def routings(draw, world: int):
    """Per rank, its tokens' experts (a rank with no token, experts no token goes to) and rows of padding."""
    e = world * draw(st.integers(1, 3))
    experts = [draw(st.lists(st.integers(0, e - 1), max_size=6)) for _ in range(world)]
    if draw(st.booleans()):
        skipped = draw(st.integers(0, e - 1))
        experts = [[k for k in ks if k != skipped] for ks in experts]
    n = max(len(ks) for ks in experts) + draw(st.integers(0, 2))
    return e, experts, n, draw(st.integers(0, 99))


def _check(world: int, case: tuple, got: list[torch.Tensor] | None = None) -> list[dict]:
    e, experts, n, seed = case
    ins, w1, w3, w2 = _routed(experts, n, e, seed)
    p = workloads.moe_dropless(R=world, E=e, N=n, D=D, F=F)
    res = [r.outputs["y"] for r in reference.run(p, ins)] if got is None else got
    for j in range(world):
        torch.testing.assert_close(res[j], _plain(ins[j]["x"], experts[j], w1, w3, w2), rtol=1e-5, atol=1e-5)
    return ins


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), world=st.integers(1, 4))
def test_the_program_equals_one_process_of_plain_torch_on_the_reference(data, world):
    _check(world, data.draw(routings(world)))


@pytest.mark.parametrize("world", [2, 4])
def test_the_torch_backend_equals_one_process_of_plain_torch(local_world, world):
    ranks = local_world(world)

    @settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def check(data):
        e, experts, n, seed = case = data.draw(routings(world))
        ins, *_ = _routed(experts, n, e, seed)
        p = workloads.moe_dropless(R=world, E=e, N=n, D=D, F=F)
        got = ranks.run(run_schedules, [Schedule(p)], ins, {})
        _check(world, case, [got[j][0].outputs["y"] for j in range(world)])

    check()


def test_the_schedules_enumerated_are_the_program_fused_chunked_and_on_shared_memory():
    """Fusion, algorithms, and dispatch -> experts -> combine in 2 and 4 row-set chunks (Comet, MegaScale-MoE:
    schedule/rows.py), their exchanges on the library or on shared memory."""
    names = [s.name for s in enumerate_schedules(workloads.moe_dropless())]
    assert names == ["A2AV-MM-MM-c-MM-A2AV", "A2AV-MM-MM-C-MM-A2AV", "ol(A2AV,MM,MM,C,MM,A2AV,2)",
                     "ol(A2AV@shm,MM,MM,C,MM,A2AV@shm,2)", "ol(A2AV,MM,MM,C,MM,A2AV,4)",
                     "ol(A2AV@shm,MM,MM,C,MM,A2AV@shm,4)",
                     "A2AV@shm-MM-MM-C-MM-A2AV@shm"]


@pytest.mark.parametrize("world", [2, 4])
def test_every_schedule_equals_the_program_on_random_agreeing_counts(local_world, world):
    p = workloads.moe_dropless(R=world, E=2 * world, N=5, D=4, F=3)
    found = enumerate_schedules(p)
    for seed in range(3):
        rows = check_schedules(p, found, world, seed=seed)
        assert len(rows) == len(found) and all(r.ok for r in rows), rows
    rows = check_schedules(p, found, world, seed=7, batch=torch_runner(local_world(world)))
    assert len(rows) == len(found) and all(r.ok for r in rows), rows


def test_experts_that_do_not_divide_over_the_ranks_are_one_sentence():
    with pytest.raises(ProgramError, match="5 experts do not divide over 2 ranks"):
        workloads.moe_dropless(R=2, E=5)


# The backward: moe_dropless_backward from moe_dropless(save=True)'s saved rows equals torch autograd of the plain layer


def _autograd(experts: list[list[int]], ins: list[dict], w: tuple, gs: list[torch.Tensor]) -> tuple[list, list]:
    """torch autograd of sum over ranks of (plain layer's y * g): each rank's dx and the whole w1, w3, w2 gradients."""
    xs = [i["x"].clone().requires_grad_() for i in ins]
    ws = [t.clone().requires_grad_() for t in w]
    zero = sum(t.sum() for t in xs + ws) * 0  # every leaf in the graph: zero gradients where no token flows
    sum(((_plain(x, ks, *ws) * g).sum() for x, ks, g in zip(xs, experts, gs)), zero).backward()
    return [x.grad for x in xs], [t.grad for t in ws]


def _backward_inputs(ins: list[dict], saved: list[dict], seed: int) -> list[dict]:
    """Each rank's output gradient g, the forward's counts and saved rows, its experts' weights transposed."""
    g = torch.Generator().manual_seed(seed + 1)
    return [{"g": torch.randn(i["x"].shape, generator=g), "s": i["s"], "r": i["r"], "c": i["c"],
             **{k: o[k] for k in ("got", "gate", "up", "hidden")},
             **{f"{k}t": i[k].transpose(1, 2) for k in ("w1", "w3", "w2")}} for i, o in zip(ins, saved)]


def _check_backward(world: int, case: tuple, run_forward, run_backward) -> None:  # noqa: ANN001
    """Forward (save=True) then backward through the given runners; every rank's dx and its experts' gw1, gw3,
    gw2 equal autograd's (fp32, 1e-5)."""
    e, experts, n, seed = case
    ins, w1, w3, w2 = _routed(experts, n, e, seed)
    fwd = workloads.moe_dropless(R=world, E=e, N=n, D=D, F=F, save=True)
    bwd = workloads.moe_dropless_backward(R=world, E=e, N=n, D=D, F=F)
    bins = _backward_inputs(ins, run_forward(fwd, ins), seed)
    dx, (g1, g3, g2) = _autograd(experts, ins, (w1, w3, w2), [b["g"] for b in bins])
    per = e // world
    for got in run_backward(bwd, bins):  # one list of per-rank outputs per schedule
        for j in range(world):
            mine = slice(j * per, (j + 1) * per)
            for name, want in (("dx", dx[j]), ("gw1", g1[mine]), ("gw3", g3[mine]), ("gw2", g2[mine])):
                torch.testing.assert_close(got[j][name], want, rtol=1e-5, atol=1e-5, msg=lambda m, k=name: f"{k}: {m}")


def _reference(p, ins):  # noqa: ANN001, ANN202
    return [r.outputs for r in reference.run(p, ins)]


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), world=st.integers(1, 4))
def test_the_backward_equals_torch_autograd_of_plain_torch_on_the_reference_every_schedule(data, world):
    def every_schedule(p, ins):  # noqa: ANN001, ANN202
        return [[r.outputs for r in reference.run(s, ins)] for s in enumerate_schedules(p)]

    _check_backward(world, data.draw(routings(world)), _reference, every_schedule)


@pytest.mark.parametrize("world", [2, 4])
def test_the_backward_on_the_torch_backend_equals_torch_autograd_every_schedule(local_world, world):
    ranks = local_world(world)

    def on_torch(schedules):  # noqa: ANN001, ANN202
        def run(p, ins):  # noqa: ANN001, ANN202
            got = ranks.run(run_schedules, schedules(p), ins, {})
            return [[got[j][k].outputs for j in range(world)] for k in range(len(got[0]))]
        return run

    @settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def check(data):
        forward = on_torch(lambda p: [Schedule(p)])
        _check_backward(world, data.draw(routings(world)), lambda p, ins: forward(p, ins)[0],
                        on_torch(enumerate_schedules))

    check()


def test_the_backward_schedules_are_its_program_fused_chunked_and_on_shared_memory():
    """The backward's chain in row-set chunks too: its grouped_matmul_wgrads add up their chunks' partial sums."""
    names = [s.name for s in enumerate_schedules(workloads.moe_dropless_backward())]
    chain, shm = "A2AV,MM,MM,C,MM,MM,MM,MM,C,A2AV", "A2AV@shm,MM,MM,C,MM,MM,MM,MM,C,A2AV@shm"
    assert names == ["A2AV-MM-MM-c-MM-MM-MM-MM-c-A2AV", "A2AV-MM-MM-C-MM-MM-MM-MM-C-A2AV",
                     f"ol({chain},2)", f"ol({shm},2)", f"ol({chain},4)", f"ol({shm},4)",
                     "A2AV@shm-MM-MM-C-MM-MM-MM-MM-C-A2AV@shm"]


@pytest.mark.parametrize("world", [2, 4])
def test_every_backward_schedule_equals_the_program_on_random_agreeing_counts(local_world, world):
    p = workloads.moe_dropless_backward(R=world, E=2 * world, N=5, D=4, F=3)
    found = enumerate_schedules(p)
    rows = check_schedules(p, found, world, seed=1) + check_schedules(p, found, world, seed=5,
                                                                      batch=torch_runner(local_world(world)))
    assert len(rows) == 2 * len(found) and all(r.ok for r in rows), rows
