"""torch.optim's behaviours that training scripts rely on beyond loss.backward(): gradients set by hand, parameters
unfrozen after the optimizer was made, momentum switched on mid-training, checkpoint hooks and flags, copies and
parameter groups. Each case runs the same inputs through a cocoweave optimizer on every rank and through the
torch.optim optimizer it replaces (fed the ranks' average gradient, which is what DDP hands it) and returns the worst
difference, or the sentence of a refusal. One world.run per world size (2 and 3 ranks) runs every case."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cocoweave.errors import OptimizerError
from cocoweave.optim import DistributedAdamW, DistributedSGD

SHAPES = [(5,), (3, 4)]


def _grad(step: int, k: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank `rank`'s gradient of parameter k at step `step` (rounded to the parameters' dtype)."""
    gen = torch.Generator().manual_seed(1000 * step + 10 * k + rank)
    return torch.randn(SHAPES[k], generator=gen).to(dtype)


def _mean(step: int, k: int, world_size: int, dtype: torch.dtype) -> torch.Tensor:
    return sum(_grad(step, k, r, dtype).float() for r in range(world_size)) / world_size


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(7)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _pair(kind: str, dtype: torch.dtype, master: bool, frozen: int | None = None) -> tuple:
    """(ours, its params, torch's, its params); torch's in float32 when ours keeps fp32 master weights, and for
    AdamW in float16 (torch's own float16 AdamW divides by an eps of 1e-8 that float16 rounds to 0: inf)."""
    exact = dtype if not master and not (kind == "adamw" and dtype == torch.float16) else torch.float32
    ours, theirs = _params(dtype), _params(exact)
    if frozen is not None:
        ours[frozen].requires_grad_(False)
        theirs[frozen].requires_grad_(False)
    if kind == "adamw":
        opt = DistributedAdamW(ours, lr=0.1, weight_decay=0.1, master_weights=master)
        ref = torch.optim.AdamW(theirs, lr=0.1, weight_decay=0.1)
    else:
        opt = DistributedSGD(ours, lr=0.1, momentum=0.9, weight_decay=0.01, master_weights=master)
        ref = torch.optim.SGD(theirs, lr=0.1, momentum=0.9, weight_decay=0.01)
    return opt, ours, ref, theirs


def _worst(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    return max(float((p.detach().float() - q.detach().to(p.dtype).float()).abs().max()) for p, q in zip(ours, theirs))


def _handset(rank: int, world_size: int, kind: str, dtype: torch.dtype, master: bool) -> dict:
    """A step after each way a script gives the optimizer its gradients: backward; set by hand after
    zero_grad(set_to_none=True); backward then replaced by hand; one parameter without a gradient (skipped); set by
    hand after zero_grad(set_to_none=False) (the other's zero gradient counts); model.zero_grad() then backward; set
    by hand again without zero_grad (torch replaces, never accumulates)."""
    opt, ours, ref, theirs = _pair(kind, dtype, master)
    steps, none_after_zero_grad = [], True

    def backward(step: int, ks: list[int]) -> None:
        sum((ours[k] * _grad(step, k, rank, dtype)).sum() for k in ks).float().backward()

    def by_hand(step: int, k: int, ref_only: bool = False) -> None:
        if not ref_only:
            ours[k].grad = _grad(step, k, rank, dtype)
        theirs[k].grad = _mean(step, k, world_size, dtype).to(theirs[k].dtype)

    for step in range(7):
        if step in (1, 2, 3):
            opt.zero_grad()
            ref.zero_grad()
            none_after_zero_grad &= all(p.grad is None for p in ours)
        elif step == 4:
            opt.zero_grad(set_to_none=False)
            ref.zero_grad(set_to_none=False)
        elif step == 5:
            for p in ours:
                p.grad = None
            ref.zero_grad()
        if step in (0, 2, 5):
            backward(step, [0, 1])
            for k in (0, 1):
                by_hand(step, k, ref_only=True)
        if step in (1, 6):
            by_hand(step, 0)
            by_hand(step, 1)
        if step == 2:
            by_hand(step + 100, 0)
        if step in (3, 4):
            by_hand(step, 1)
        opt.step()
        ref.step()
        steps.append(_worst(ours, theirs))
    return {"worst": max(steps), "steps": steps, "none_after_zero_grad": none_after_zero_grad}


def _sparse(rank: int, world_size: int) -> dict:
    """A sparse gradient set by hand: torch.optim.SGD takes it (so does DistributedSGD, densified); torch's AdamW
    refuses it, and so does DistributedAdamW, with a sentence."""
    ours, theirs = _params(torch.float32), _params(torch.float32)
    opt = DistributedSGD(ours, lr=0.1, momentum=0.9)  # torch's SGD refuses weight decay with sparse gradients
    ref = torch.optim.SGD(theirs, lr=0.1, momentum=0.9)
    for step in range(3):
        opt.zero_grad()
        ref.zero_grad()
        for k in (0, 1):
            ours[k].grad = _grad(step, k, rank, torch.float32).to_sparse()
            theirs[k].grad = _mean(step, k, world_size, torch.float32).to_sparse()
        opt.step()
        ref.step()
    adam, params, _, _ = _pair("adamw", torch.float32, False)
    params[0].grad = torch.ones(SHAPES[0]).to_sparse()
    try:
        adam.step()
        refused = ""
    except OptimizerError as exc:
        refused = str(exc)
    return {"worst": _worst(ours, theirs), "refused": refused}


def _unfreeze(rank: int, world_size: int, kind: str) -> float:
    """Progressive unfreezing: parameter 1 is frozen when the optimizers are made and unfrozen after two steps;
    torch trains it from then on (from a fresh state)."""
    opt, ours, ref, theirs = _pair(kind, torch.float32, False, frozen=1)
    for step in range(5):
        if step == 2:
            ours[1].requires_grad_(True)
            theirs[1].requires_grad_(True)
        opt.zero_grad()
        ref.zero_grad()
        trained = [k for k in (0, 1) if ours[k].requires_grad]
        sum((ours[k] * _grad(step, k, rank, torch.float32)).sum() for k in trained).backward()
        for k in trained:
            theirs[k].grad = _mean(step, k, world_size, torch.float32)
        opt.step()
        ref.step()
    return _worst(ours, theirs)


def _momentum_switched(rank: int, world_size: int) -> float:
    """SGD momentum switched on after two steps without it, then off and on again (per group: only group 0's):
    torch starts the buffer from the gradient when momentum first applies, and leaves it alone while momentum is 0."""
    ours, theirs = _params(torch.float32), _params(torch.float32)
    opt = DistributedSGD([{"params": [ours[0]]}, {"params": [ours[1]], "momentum": 0.5}], lr=0.1, dampening=0.1)
    ref = torch.optim.SGD([{"params": [theirs[0]]}, {"params": [theirs[1]], "momentum": 0.5}], lr=0.1, dampening=0.1)
    for step, momentum in enumerate([0.0, 0.0, 0.9, 0.9, 0.0, 0.0, 0.9]):
        for o in (opt, ref):
            o.param_groups[0]["momentum"] = momentum
            o.zero_grad()
        for k in (0, 1):
            ours[k].grad = _grad(step, k, rank, torch.float32)
            theirs[k].grad = _mean(step, k, world_size, torch.float32)
        opt.step()
        ref.step()
    return _worst(ours, theirs)


def _objects(rank: int, world_size: int) -> dict:
    """What code around an optimizer reads or makes of it: torch's param_group keys; Tensor betas; a parameter
    listed twice (torch's warning, stepped once); float64 refused with a sentence; opt.state[p]'s exp_avg and
    exp_avg_sq (gathered where the ranks keep them sliced); a post-step hook seeing step; copy.deepcopy(opt).step()
    as torch's copy steps."""
    import copy
    import warnings

    out: dict = {}
    ours, theirs = _params(torch.float32), _params(torch.float32)
    betas = (torch.tensor(0.8), torch.tensor(0.99))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        opt = DistributedAdamW([ours[0], ours[1], ours[0]], lr=0.1, betas=betas)
    ref = torch.optim.AdamW(theirs, lr=0.1, betas=betas)
    out["duplicate warned"] = any("duplicate parameters" in str(w.message) for w in said)
    out["keys"] = sorted(opt.param_groups[0]) == sorted(ref.param_groups[0])
    steps = {"ours": [], "torch": []}
    opt.register_step_post_hook(lambda o, a, k: steps["ours"].append(float(o.state[ours[0]]["step"])))
    ref.register_step_post_hook(lambda o, a, k: steps["torch"].append(float(o.state[theirs[0]]["step"])))
    for step in range(3):
        for k in (0, 1):
            ours[k].grad = _grad(step, k, rank, torch.float32)
            theirs[k].grad = _mean(step, k, world_size, torch.float32)
        opt.step()
        ref.step()
    out["steps seen"] = steps["ours"] == steps["torch"] == [1.0, 2.0, 3.0]
    out["state"] = max(float((opt.state[p][key] - ref.state[q][key]).abs().max()) for p, q in zip(ours, theirs)
                       for key in ("exp_avg", "exp_avg_sq"))
    mine, its = copy.deepcopy(opt), copy.deepcopy(ref)
    new_ours, new_theirs = mine.param_groups[0]["params"], its.param_groups[0]["params"]
    for step in range(3, 5):
        for k in (0, 1):
            new_ours[k].grad = _grad(step, k, rank, torch.float32)
            new_theirs[k].grad = _mean(step, k, world_size, torch.float32)
        mine.step()
        its.step()
    out["deepcopy"] = max(_worst(new_ours, new_theirs), _worst(ours, theirs))  # the originals did not move
    try:
        DistributedAdamW([torch.nn.Parameter(torch.ones(2, dtype=torch.float64))])
        out["float64"] = ""
    except OptimizerError as exc:
        out["float64"] = str(exc)
    return out


def _checkpoints(rank: int, world_size: int) -> dict:
    """torch's checkpoint hooks and all-or-nothing loading: a state-dict post-hook sees the whole state; a load
    pre-hook that edits the state (torch's way to adapt a checkpoint) takes effect and a post-hook sees it in place,
    loading torch's own AdamW state dict into both; a state dict with maximize=True, or an AdamW one given to
    DistributedSGD, is refused and changes nothing (the next steps still equal torch's)."""
    import copy

    ours, theirs = _params(torch.float32), _params(torch.float32)
    opt, ref = DistributedAdamW(ours, lr=0.1), torch.optim.AdamW(theirs, lr=0.1)

    def train(steps: range, pairs: list) -> None:
        for step in steps:
            for k in (0, 1):
                for _, ps, grad in pairs:
                    ps[k].grad = grad(step, k)
            for o, _, _ in pairs:
                o.step()

    mine = lambda step, k: _grad(step, k, rank, torch.float32)  # noqa: E731
    mean = lambda step, k: _mean(step, k, world_size, torch.float32)  # noqa: E731
    train(range(3), [(opt, ours, mine), (ref, theirs, mean)])
    out: dict = {}
    seen: dict = {}
    opt.register_state_dict_post_hook(lambda o, sd: seen.update(keys=sorted(sd["state"][0])))
    opt.state_dict()
    out["post-hook keys"] = seen.get("keys")
    saved = ref.state_dict()

    def pre(o: torch.optim.Optimizer, sd: dict) -> dict:
        sd["state"] = {k: {**v, "exp_avg": torch.zeros_like(v["exp_avg"])} for k, v in sd["state"].items()}
        return sd

    def post(o: torch.optim.Optimizer) -> None:
        p = o.param_groups[0]["params"][0]
        seen.setdefault("post", []).append((float(o.state[p]["step"]), float(o.state[p]["exp_avg"].abs().sum())))

    for o in (opt, ref):
        o.register_load_state_dict_pre_hook(pre)
        o.register_load_state_dict_post_hook(post)
        o.load_state_dict(copy.deepcopy(saved))
    out["post-hook saw"] = seen["post"]
    groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    refused = []
    for bad in ({**saved, "param_groups": [{**saved["param_groups"][0], "maximize": True, "lr": 9.0}]},
                {**saved, "param_groups": [{**saved["param_groups"][0], "amsgrad": True}]}):
        try:
            opt.load_state_dict(bad)
        except OptimizerError as exc:
            refused.append(str(exc))
    out["refused"] = refused
    out["groups unchanged"] = groups == [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    train(range(3, 5), [(opt, ours, mine), (ref, theirs, mean)])
    out["after"] = _worst(ours, theirs)
    sgd_ours, sgd_theirs = _params(torch.float32), _params(torch.float32)
    sgd, sgd_ref = DistributedSGD(sgd_ours, lr=0.1, momentum=0.9), torch.optim.SGD(sgd_theirs, lr=0.1, momentum=0.9)
    train(range(2), [(sgd, sgd_ours, mine), (sgd_ref, sgd_theirs, mean)])
    try:
        sgd.load_state_dict(opt.state_dict())
        out["sgd refused"] = ""
    except OptimizerError as exc:
        out["sgd refused"] = str(exc)
    train(range(2, 4), [(sgd, sgd_ours, mine), (sgd_ref, sgd_theirs, mean)])
    out["sgd after"] = _worst(sgd_ours, sgd_theirs)
    return out


def _other_model(rank: int, world_size: int) -> list[str]:
    """As DDP: ranks whose parameters differ (a shape, then a count) are refused at construction, before any
    collective, with a sentence naming the first difference on the rank that differs."""
    said = []
    for shapes in ([(5,), (3, 4)] if rank == 0 else [(5,), (4, 3)], [(5,), (3, 4)] + ([(2,)] if rank else [])):
        try:
            DistributedAdamW([torch.nn.Parameter(torch.zeros(s)) for s in shapes])
            said.append("")
        except OptimizerError as exc:
            said.append(str(exc))
    return said


def cases(rank: int, world_size: int) -> dict:
    out = {}
    for kind in ("adamw", "sgd"):
        for dtype, master in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True),
                              (torch.float16, False), (torch.float16, True)):
            out[f"handset {kind} {str(dtype)[6:]}{' master' if master else ''}"] = _handset(
                rank, world_size, kind, dtype, master)
        out[f"unfreeze {kind}"] = _unfreeze(rank, world_size, kind)
    out["sparse"] = _sparse(rank, world_size)
    out["momentum"] = _momentum_switched(rank, world_size)
    out["objects"] = _objects(rank, world_size)
    out["checkpoints"] = _checkpoints(rank, world_size)
    out["other model"] = _other_model(rank, world_size)
    dist.barrier()
    return out


TOLERANCE = {"float32": 5e-6, "bfloat16": 4e-2, "float16": 5e-3}


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_optim_behaviours(local_world, world_size):
    for rank, res in enumerate(local_world(world_size).run(cases)):
        where = f"rank {rank} of {world_size}"
        for name, got in res.items():
            if name.startswith("handset"):
                tol = TOLERANCE[name.split()[2]]
                assert got["worst"] <= tol, f"{where}, {name}: a hand-set gradient is off by {got['worst']}"
                assert got["none_after_zero_grad"], f"{where}, {name}: p.grad is not None after zero_grad()"
            elif name.startswith("unfreeze"):
                assert got <= 2e-6, f"{where}, {name}: the unfrozen parameter is off by {got}"
        assert res["sparse"]["worst"] <= 2e-6, where
        assert "does not support sparse gradients" in res["sparse"]["refused"], where
        assert res["momentum"] <= 2e-6, f"{where}: SGD with momentum switched on and off is off by {res['momentum']}"
        obj = res["objects"]
        assert obj["duplicate warned"] and obj["keys"] and obj["steps seen"], f"{where}: {obj}"
        assert obj["state"] <= 2e-6 and obj["deepcopy"] <= 5e-6, f"{where}: {obj}"
        assert "float64 and complex are not supported" in obj["float64"], f"{where}: {obj}"
        ck = res["checkpoints"]
        assert ck["post-hook keys"] == ["exp_avg", "exp_avg_sq", "step"], f"{where}: {ck}"
        assert ck["post-hook saw"][0] == ck["post-hook saw"][1] == (3.0, 0.0), f"{where}: {ck}"  # ours, torch's
        assert "maximize=True is not supported" in ck["refused"][0], f"{where}: {ck}"
        assert "amsgrad=True is not supported" in ck["refused"][1], f"{where}: {ck}"
        assert ck["groups unchanged"] and ck["after"] <= 5e-6, f"{where}: {ck}"
        assert "saved by another optimizer" in ck["sgd refused"] and ck["sgd after"] <= 2e-6, f"{where}: {ck}"
        shape, count = res["other model"]
        assert "every rank must pass the same parameters" in shape and "every rank must pass" in count, where
        if rank:
            assert "parameter 1 of group 0 differs in shape: [4, 3]" in shape, shape
            assert "group 0 has 3 parameters on rank" in count, count
