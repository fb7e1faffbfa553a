"""cocoweave.nn.MoE: the single-process layer equals a dense reference written here (every expert on every token,
weighted by the routing, capacity drops chosen by sorting), and the expert-parallel layer at ep 1, 2 and 4 equals
the single-process layer called on each rank's tokens: same routing, outputs, aux loss, gradients of the input and
of every parameter (experts: summed over the ranks' calls; the router and shared expert: per rank), fp32 tight,
with uneven loads and experts that receive no token. Bad configurations are refused with one sentence."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cocoweave.errors import ParallelConfigError
from cocoweave.nn import MoE, full_experts, full_state_dict, moe_dispatch
from cocoweave.nn.moe_dispatch import library_exchange_counts, library_start_all_to_all
from cocoweave.sharding import is_dtensor

DIM, HIDDEN, TOKENS = 16, 24, 12
TOL = 1e-6  # fp32: the same GEMMs over other row counts and orders


def _kwargs(case: dict) -> dict:
    return dict(dim=DIM, hidden_dim=HIDDEN, n_experts=case.get("experts", 8), top_k=case.get("top_k", 2),
                score=case.get("score", "softmax"), normalize=case.get("normalize"),
                shared_hidden_dim=case.get("shared"), capacity_factor=case.get("capacity"),
                aux_loss_coeff=case.get("aux", 0.01), seed=case.get("seed", 0))


def _inputs(case: dict, ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ranks, TOKENS, DIM) inputs pulled towards one direction by `skew` (the router's scores then favour a few
    experts: with a large skew most experts get no token), and upstream gradients."""
    g = torch.Generator().manual_seed(100 + case.get("seed", 0))
    direction = F.normalize(torch.randn(DIM, generator=g), dim=0)
    x = torch.randn(ranks, TOKENS, DIM, generator=g) + case.get("skew", 0.0) * direction
    return x, torch.randn(ranks, TOKENS, DIM, generator=g)


def _grads(layer: MoE) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, an expert's whole (E, ...) one gathered over ep."""
    return {n: (p.grad.full_tensor() if is_dtensor(p.grad) else p.grad).detach().clone()
            for n, p in layer.named_parameters()}


def _run(layer: MoE, x: torch.Tensor, g: torch.Tensor) -> dict:
    x = x.clone().requires_grad_()
    y = layer(x)
    ((y * g).sum() + layer.aux_loss).backward()
    return {"y": y.detach(), "x_grad": x.grad, "aux": float(layer.aux_loss.detach()), "tokens": layer.tokens_per_expert}


def _reference(case: dict, x: torch.Tensor, g: torch.Tensor, state: dict | None = None
               ) -> tuple[list[dict], dict[str, torch.Tensor], MoE]:
    """The single-process layer (`state` loaded, if given) called on each rank's tokens in turn, gradients
    accumulated."""
    ref = MoE(**_kwargs(case))
    if state is not None:
        ref.load_state_dict(state)
    calls = [_run(ref, x[r], g[r]) for r in range(x.shape[0])]
    return calls, _grads(ref), ref


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> bool:
    """|a - b| <= tol, relative to the larger magnitude when it exceeds 1."""
    scale = max(1.0, float(b.abs().max()) if b.numel() else 1.0)
    return a.shape == b.shape and (not a.numel() or float((a - b).abs().max()) <= tol * scale)


def _grad_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """_close, but a gradient that is zero but for rounding (top-1 normalised: the router's weight is 1 whatever its
    scores) need only be that on both sides."""
    if b.numel() and float(b.abs().max()) < 1e-5:
        return a.shape == b.shape and float(a.abs().max()) < 1e-5
    return _close(a, b)


# ---------------------------------------------------------------------------------------------------------
# The single-process layer against a dense reference
# ---------------------------------------------------------------------------------------------------------

def dense_moe(layer: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, aux loss) of `layer`'s parameters computed densely: every expert on every token, each token's
    output the sum of its kept experts' outputs times their weights; capacity by sorting each expert's tokens."""
    router, (w1, w2, w3) = layer.router, (layer.experts.w1, layer.experts.w2, layer.experts.w3)
    E, k, T = layer.n_experts, layer.top_k, x.shape[0]
    logits = x @ router.gate.weight.t()
    scores = logits.softmax(-1) if router.score == "softmax" else logits.sigmoid()
    raw, idx = scores.topk(k, dim=-1)
    top = raw / raw.sum(-1, keepdim=True) if router.normalize else raw
    keep = torch.ones(T, k)
    if router.capacity_factor is not None:
        cap = min(T, math.ceil(T * k / E * router.capacity_factor))
        for e in range(E):
            chosen = [(float(raw[t, j].detach()), t, j) for t in range(T) for j in range(k) if int(idx[t, j]) == e]
            for _, t, j in sorted(chosen, reverse=True)[cap:]:
                keep[t, j] = 0.0
    y = torch.zeros_like(x)
    for e in range(E):
        coef = ((idx == e) * top * keep).sum(-1, keepdim=True)
        y = y + coef * ((F.silu(x @ w1[e]) * (x @ w3[e])) @ w2[e])
    if layer.shared_experts is not None:
        s = layer.shared_experts
        y = y + (F.silu(x @ s.w1.weight.t()) * (x @ s.w3.weight.t())) @ s.w2.weight.t()
    probs = scores if router.score == "softmax" else scores / scores.sum(-1, keepdim=True)
    counts = torch.stack([(idx == e).sum() for e in range(E)]).float()
    aux = router.aux_loss_coeff * E / (k * T * T) * (probs.sum(0) * counts).sum()
    return y, aux


CASE = st.fixed_dictionaries({
    "experts": st.sampled_from([4, 8]), "top_k": st.sampled_from([1, 2, 3]),
    "score": st.sampled_from(["softmax", "sigmoid"]), "normalize": st.sampled_from([None, True, False]),
    "shared": st.sampled_from([None, 8]), "capacity": st.sampled_from([None, 0.5, 1.0, 1.5]),
    "aux": st.sampled_from([0.0, 0.01]), "skew": st.sampled_from([0.0, 2.0, 6.0]), "seed": st.integers(0, 10**6)})


@settings(max_examples=60, deadline=None)
@given(case=CASE)
def test_the_single_process_layer_equals_the_dense_reference(case):
    layer = MoE(**_kwargs(case))
    x, g = _inputs(case, 1)
    got = _run(layer, x[0], g[0])
    grads = _grads(layer)
    layer.zero_grad()
    xr = x[0].clone().requires_grad_()
    y, aux = dense_moe(layer, xr)
    ((y * g[0]).sum() + aux).backward()
    assert _close(got["y"], y.detach()) and abs(got["aux"] - float(aux.detach())) <= TOL
    assert _close(got["x_grad"], xr.grad)
    for n, p in layer.named_parameters():
        assert _grad_close(grads[n], p.grad), n
    assert int(got["tokens"].sum()) == TOKENS * layer.top_k


def test_skewed_inputs_leave_experts_without_tokens_and_capacity_drops_pairs():
    """The cases the equivalence tests rely on exist: a skew starves experts, a capacity factor drops pairs."""
    case = {"skew": 6.0, "capacity": 1.0}
    layer = MoE(**_kwargs(case))
    x, _ = _inputs(case, 1)
    routing = layer.router(x[0])
    assert (torch.bincount(routing.experts.flatten(), minlength=8) == 0).sum() >= 3
    assert not bool(routing.kept.all()) and bool((routing.weights[~routing.kept] == 0).all())


# ---------------------------------------------------------------------------------------------------------
# Expert parallelism against the single-process layer
# ---------------------------------------------------------------------------------------------------------

def ep_case(rank: int, world_size: int, case: dict, state: dict | None, x: torch.Tensor, g: torch.Tensor) -> dict:
    """The layer at ep = the world: its initial experts (whole), then, with the reference's state loaded (if
    given), this rank's call on x[rank] and every parameter's gradient."""
    layer = MoE(**_kwargs(case), experts_schedule=case.get("program"))  # "program": through the DSL programs
    layer.overlap = case.get("overlap", True)  # False: the plain path (every all-to-all waited at once)
    if case.get("gloo"):  # every all-to-all through the library's all_to_all_single, not shared memory
        layer.start, layer.exchange = library_start_all_to_all, library_exchange_counts
    out = {"initial": full_experts(layer), "local experts": tuple(layer.experts.w1.to_local().shape),
           "shm route": world_size > 1 and moe_dispatch._route(layer.group, torch.device("cpu")) is not None}
    if state is not None:
        layer.load_state_dict(state)
        out["whole"] = full_state_dict(layer)  # back to the whole tensors a single-process layer loads
    out |= _run(layer, x[rank], g[rank]) | {"grads": _grads(layer)}
    return out | {"ran": dict(layer.programs.chosen) if layer.programs is not None else None}


def _check_against_reference(case: dict, results: list[dict], state: dict | None = None) -> None:
    ep = len(results)
    x, g = _inputs(case, ep)
    calls, ref_grads, ref = _reference(case, x, g, state)
    for r, (got, want) in enumerate(zip(results, calls, strict=True)):
        assert torch.equal(got["tokens"], want["tokens"]), (r, got["tokens"], want["tokens"])  # same routing
        assert _close(got["y"], want["y"]), (r, float((got["y"] - want["y"]).abs().max()))
        assert _close(got["x_grad"], want["x_grad"]), r
        assert abs(got["aux"] - want["aux"]) <= TOL
        assert got["local experts"][0] == ref.n_experts // ep
    for n, want in ref_grads.items():
        if n.startswith("experts."):  # the ranks' calls' sum, already in each rank's experts
            got = results[0]["grads"][n]
        else:  # this rank's call's gradient: an optimizer over the ranks sums them
            got = torch.stack([r["grads"][n] for r in results]).sum(0)
        assert _grad_close(got, want), (n, float((got - want).abs().max()))
    fresh = MoE(**_kwargs(case)).experts  # the same initial experts, whatever the ep degree
    for n in ("w1", "w2", "w3"):
        assert all(torch.equal(r["initial"][n], getattr(fresh, n).detach()) for r in results), n


CASES = [
    {"top_k": 1}, {"top_k": 2}, {"top_k": 2, "shared": 8}, {"top_k": 2, "capacity": 1.0},
    {"top_k": 1, "capacity": 0.5, "shared": 8}, {"top_k": 2, "skew": 6.0}, {"top_k": 1, "skew": 6.0, "shared": 8},
    {"top_k": 2, "skew": 3.0, "capacity": 1.25, "score": "sigmoid"}, {"top_k": 3, "score": "sigmoid", "aux": 0.0},
]


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_the_expert_parallel_layer_equals_the_single_process_layer(local_world, ep):
    for case in CASES:
        x, g = _inputs(case, ep)
        state = MoE(**_kwargs(case | {"seed": 7})).state_dict()  # not the layer's own values: the load matters
        results = local_world(ep).run(ep_case, case, state, x, g)
        for r in results:
            assert r["whole"].keys() == state.keys() and all(torch.equal(r["whole"][k], v) for k, v in state.items())
        _check_against_reference(case, results, state)


def test_experts_receiving_no_token_on_some_ranks_and_none_at_all(local_world):
    """A strong skew: most experts get no token from any rank (zero splits in both all-to-alls)."""
    case = {"top_k": 1, "skew": 12.0, "experts": 8}
    x, g = _inputs(case, 4)
    results = local_world(4).run(ep_case, case, None, x, g)
    total = sum(r["tokens"] for r in results)
    assert (total == 0).sum() >= 4, total
    _check_against_reference(case, results)


@pytest.mark.parametrize("ep", [2, 4])
def test_the_overlapped_path_equals_the_plain_one(local_world, ep):
    """The default path (the shared expert's first part computed while the dispatch is in flight, its second while
    the combine is; backward: the gradients' all-to-alls in flight during its backward) against `overlap=False`
    (each all-to-all waited at once): both equal the single-process layer and each other, with skewed loads
    (experts without rows) and without a shared expert (nothing to overlap: the same path)."""
    for case in [{"top_k": 2, "shared": 8}, {"top_k": 1, "skew": 12.0, "shared": 8}, {"top_k": 3, "skew": 3.0},
                 {"top_k": 2, "capacity": 0.5, "shared": 8, "score": "sigmoid"}]:
        x, g = _inputs(case, ep)
        plain = local_world(ep).run(ep_case, case | {"overlap": False}, None, x, g)
        overlapped = local_world(ep).run(ep_case, case, None, x, g)
        _check_against_reference(case, plain)
        _check_against_reference(case, overlapped)
        for a, b in zip(plain, overlapped, strict=True):
            assert _close(a["y"], b["y"]) and _close(a["x_grad"], b["x_grad"])
            assert all(_grad_close(a["grads"][n], b["grads"][n]) for n in a["grads"]), case


@pytest.mark.parametrize("ep", [2, 4])
def test_the_layer_through_shared_memory_equals_it_through_gloo(local_world, ep):
    """The ranks of a LocalWorld share this host, so the layer's all-to-alls and count exchange go through shared
    memory (backends/torch/shm_all_to_all.py); the same layer with them through Gloo's all_to_all_single computes
    the same bits (the transport only moves rows): outputs, input gradients, every parameter's gradient, and both
    equal the single-process layer. Overlapped and plain, skewed (experts without rows), capacity drops."""
    for case in [{"top_k": 2, "shared": 8}, {"top_k": 1, "skew": 12.0, "shared": 8, "overlap": False},
                 {"top_k": 3, "skew": 3.0}, {"top_k": 2, "capacity": 0.5, "shared": 8, "score": "sigmoid"}]:
        x, g = _inputs(case, ep)
        shm = local_world(ep).run(ep_case, case, None, x, g)
        gloo = local_world(ep).run(ep_case, case | {"gloo": True}, None, x, g)
        assert all(r["shm route"] for r in shm)
        _check_against_reference(case, shm)
        _check_against_reference(case, gloo)
        for a, b in zip(shm, gloo, strict=True):
            assert torch.equal(a["y"], b["y"]) and torch.equal(a["x_grad"], b["x_grad"]), case
            assert all(torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"]), case


PROGRAM_CASES = [{"top_k": 2, "shared": 8}, {"top_k": 1, "skew": 12.0, "shared": 8}, {"top_k": 3, "skew": 3.0},
                 {"top_k": 2, "capacity": 0.5, "shared": 8, "score": "sigmoid"}]


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_the_program_path_equals_the_hand_written_one(local_world, ep):
    """`experts_schedule`: dispatch, grouped SwiGLU and combine as the compiled dropless programs (forward and
    backward, nn/moe_program.py) equal the hand-written path (outputs, input and every parameter's gradient, 1e-6)
    and the single-process layer, with uneven loads, experts without rows, capacity drops; "auto" and named
    schedules (the program as written, and on shared memory)."""
    named = ["A2AV-MM-MM-c-MM-A2AV"] + (["A2AV@shm-MM-MM-C-MM-A2AV@shm"] if ep > 1 else [])
    for i, case in enumerate(PROGRAM_CASES):
        x, g = _inputs(case, ep)
        hand = local_world(ep).run(ep_case, case, None, x, g)
        for schedule in ["auto", named[i % len(named)]]:
            prog = local_world(ep).run(ep_case, case | {"program": schedule}, None, x, g)
            assert all(r["ran"].keys() == {"experts forward", "experts backward"} for r in prog), prog[0]["ran"]
            assert schedule == "auto" or all(r["ran"]["experts forward"] == schedule for r in prog)
            _check_against_reference(case, prog)
            for a, b in zip(hand, prog, strict=True):
                assert _close(a["y"], b["y"]) and _close(a["x_grad"], b["x_grad"]), (case, schedule)
                assert all(_grad_close(a["grads"][n], b["grads"][n]) for n in a["grads"]), (case, schedule)


def test_a_tensor_parallel_schedule_name_is_refused_by_the_experts():
    from cocoweave.nn.compiled import ASYNC_SHM

    layer = MoE(16, 24, 4, top_k=2, experts_schedule=ASYNC_SHM)
    with pytest.raises(ParallelConfigError, match="is not available for the MoE layer's experts; choose one of"):
        layer(torch.randn(2, 5, 16))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=CASE)
def test_hypothesis_routings_at_ep2(local_world, case):
    if case["experts"] % 2:
        return
    x, g = _inputs(case, 2)
    _check_against_reference(case, local_world(2).run(ep_case, case, None, x, g))


# ---------------------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "words"), [
    ({"top_k": 9}, "top_k 9 exceeds the 8 experts"),
    ({"top_k": 0}, "top_k must be a positive integer"),
    ({"score": "relu"}, "score must be one of softmax, sigmoid"),
    ({"capacity_factor": 0}, "capacity_factor must be a positive number"),
    ({"aux_loss_coeff": -1}, "aux_loss_coeff must be a number >= 0"),
    ({"expert_grad_divisor": 0}, "expert_grad_divisor must be a positive number"),
])
def test_bad_configurations_are_refused_with_one_sentence(kwargs, words):
    with pytest.raises(ParallelConfigError, match=words) as info:
        MoE(**{"dim": DIM, "hidden_dim": HIDDEN, "n_experts": 8, **kwargs})
    assert str(info.value).count(". ") == 0


def refusal_case(rank: int, world_size: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    said = []
    for make in (lambda: MoE(DIM, HIDDEN, 6, 2),
                 lambda: MoE(DIM, HIDDEN, 8, 2, group=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))):
        try:
            make()
        except ParallelConfigError as exc:
            said.append(str(exc))
    layer = MoE(DIM, HIDDEN, 8, 2)
    try:
        layer.load_state_dict({**layer.state_dict(), "experts.w1": torch.zeros(3, DIM, HIDDEN)})
    except ParallelConfigError as exc:
        said.append(str(exc))
    return said


def test_experts_that_do_not_divide_over_ep_and_a_mesh_without_ep_are_refused(local_world):
    said = local_world(4).run(refusal_case)[0]
    assert said[0] == "MoE: 6 experts do not divide over 4 expert-parallel ranks; use a multiple of the ep size"
    assert "has no 'ep' dim" in said[1]
    assert "experts.w1 has shape [3, 16, 24]" in said[2]


def mismatch_case(rank: int, world_size: int) -> str:
    try:
        MoE(DIM, HIDDEN, 8, 2 if rank == 0 else 1)
    except ParallelConfigError as exc:
        return str(exc)
    return "built"


def test_ranks_that_build_the_layer_differently_are_refused_on_every_rank(local_world):
    said = local_world(2).run(mismatch_case)
    assert all("top_k" in s and "MoE" in s for s in said), said
