"""cocoweave.optim against DDP + torch.optim: on world sizes 1-4, a small MLP trained for several
steps with a distributed optimizer ends where the DDP-equivalent reference ends (per rank: average
the gradients with dist.all_reduce, then the torch optimizer), to float tolerance.

One world.run per world size runs every scenario; the rank function returns the worst difference
of each, so a failure names the scenario."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist

from cocoweave.errors import OptimizerError
from cocoweave.optim import DistributedAdamW, DistributedLAMB, DistributedSGD

STEPS = 4


def _mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).to(dtype)


def _shard(step: int, rank: int, world_size: int, dtype: torch.dtype = torch.float32) -> tuple:
    """This rank's part of step `step`'s global batch of 8."""
    gen = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen)
    return x.tensor_split(world_size)[rank].to(dtype), y.tensor_split(world_size)[rank].to(dtype)


def _backward(model: torch.nn.Module, step: int, rank: int, world_size: int) -> None:
    dtype = next(model.parameters()).dtype
    x, y = _shard(step, rank, world_size, dtype)
    torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()


def _backward_all(models, step: int, rank: int, world_size: int) -> None:
    for model in models:
        for p in model.parameters():
            p.grad = None
        _backward(model, step, rank, world_size)


def _ddp_average(params, average: bool = True) -> None:
    """What DDP does to the gradients: average them over the ranks (or only sum them)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        for p in params:
            dist.all_reduce(p.grad)
            if average:
                p.grad /= dist.get_world_size()


def _worst(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((x.detach().float() - y.detach().float()).abs().max().item()
               for x, y in zip(a.parameters(), b.parameters(), strict=True))


class ReferenceLAMB:
    """LAMB written out (You et al. 2020, Algorithm 2, phi = identity), one tensor at a time."""

    def __init__(self, params, lr, betas, eps, weight_decay):
        self.params, self.lr, self.betas, self.eps, self.wd = list(params), lr, betas, eps, weight_decay
        self.state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in self.params]
        self.t = 0

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        b1, b2 = self.betas
        for p, (m, v) in zip(self.params, self.state, strict=True):
            m.mul_(b1).add_((1 - b1) * p.grad)
            v.mul_(b2).add_((1 - b2) * p.grad * p.grad)
            u = (m / (1 - b1**self.t)) / ((v / (1 - b2**self.t)).sqrt() + self.eps) + self.wd * p
            wn, un = p.norm(), u.norm()
            trust = wn / un if wn > 0 and un > 0 else 1.0
            p.sub_(self.lr * trust * u)


def _train(rank, world_size, make_opt, make_ref, steps=STEPS, clip=None, scheduler=None, dtype=torch.float32,
           average=True):
    """Train a copy with each optimizer; returns (ours, reference, our optimizer)."""
    ours, ref = _mlp(dtype=dtype), _mlp(dtype=dtype)
    opt, ref_opt = make_opt(ours), make_ref(ref)
    sched = scheduler(opt) if scheduler else None
    ref_sched = scheduler(ref_opt) if scheduler else None
    for step in range(steps):
        _backward_all((ours, ref), step, rank, world_size)
        opt.step()
        _ddp_average(ref.parameters(), average)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()
        if sched:
            sched.step()
            ref_sched.step()
    return ours, ref, opt


def _groups(model: torch.nn.Module, lr: float) -> list[dict]:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights}, {"params": biases, "lr": lr * 3, "weight_decay": 0.0}]


def _bf16(rank, world_size):
    """bf16 parameters with fp32 masters vs the same written out: fp32 masters updated by torch's
    AdamW from the averaged fp32 gradients, cast back to bf16."""
    ours, ref = _mlp(dtype=torch.bfloat16), _mlp(dtype=torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_() for p in ref.parameters()]
    opt = DistributedAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, master_weights=True)
    ref_opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        _backward_all((ours, ref), step, rank, world_size)
        opt.step()
        for p, m in zip(ref.parameters(), masters, strict=True):
            m.grad = p.grad.float()
        _ddp_average(masters)
        ref_opt.step()
        with torch.no_grad():
            for p, m in zip(ref.parameters(), masters, strict=True):
                p.copy_(m)
    saved = opt.state_dict()["state"]
    master_diff = max((saved[i]["master_param"] - m).abs().max().item() for i, m in enumerate(masters))
    # the bf16 parameters are exactly the cast of the float32 masters
    cast = all(torch.equal(p, saved[i]["master_param"].bfloat16()) for i, p in enumerate(ours.parameters()))
    return master_diff if cast else float("inf")


def scenarios(rank: int, world_size: int) -> dict[str, float]:
    """Every scenario on this rank: the worst parameter difference from the reference of each."""
    ref_adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)  # noqa: E731
    out: dict[str, float] = {}
    ours, ref, opt = _train(rank, world_size, lambda m: DistributedAdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
                            ref_adamw)
    out["adamw auto (sliced)"] = _worst(ours, ref)
    b = opt._buckets[0]  # the sliced schedule keeps 1/world of exp_avg, exp_avg_sq on each rank
    sliced = "m" in b.exe.kept and b.exe.kept["m"].numel() <= math.ceil(b.shape[0] / world_size)
    out["state is sliced"] = 0.0 if world_size == 1 or sliced else 1.0
    step_lr = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.3)  # noqa: E731
    ours, ref, opt = _train(rank, world_size, lambda m: DistributedAdamW(_groups(m, 1e-2), lr=1e-2, schedule="AR-C"),
                            lambda m: torch.optim.AdamW(_groups(m, 1e-2), lr=1e-2), scheduler=step_lr)
    out["adamw AR-C, groups, StepLR"] = _worst(ours, ref)
    out["StepLR changed lr"] = abs(opt.param_groups[0]["lr"] - 1e-2 * 0.3 ** (STEPS // 2))
    ours, ref, opt = _train(rank, world_size,
                            lambda m: DistributedAdamW(m.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=0.05),
                            ref_adamw, clip=0.05)
    out["clip by global norm"] = _worst(ours, ref)
    out["clipping happened"] = 0.0 if opt.last_grad_norm > 0.05 else 1.0
    ours, ref, _ = _train(rank, world_size,
                          lambda m: DistributedSGD(m.parameters(), lr=0.05, momentum=0.9, dampening=0.1,
                                                   weight_decay=0.01),
                          lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, dampening=0.1,
                                                    weight_decay=0.01))
    out["sgd momentum"] = _worst(ours, ref)
    ours, ref, _ = _train(rank, world_size, lambda m: DistributedSGD(m.parameters(), lr=0.05, reduction="sum"),
                          lambda m: torch.optim.SGD(m.parameters(), lr=0.05), average=False)
    out["sgd reduction=sum"] = _worst(ours, ref)
    ours, ref, _ = _train(rank, world_size,
                          lambda m: DistributedLAMB(m.parameters(), lr=1e-2, weight_decay=0.01),
                          lambda m: ReferenceLAMB(m.parameters(), 1e-2, (0.9, 0.999), 1e-6, 0.01))
    out["lamb"] = _worst(ours, ref)
    out["bf16 + fp32 masters"] = _bf16(rank, world_size)
    out["sgd adasum"] = _adasum(rank, world_size)
    return out


def _adasum(rank: int, world_size: int) -> float:
    """reduction="adasum" combines each parameter's gradient with Adasum on its own (as Horovod does: a bucket per
    tensor); the reference gathers every rank's gradient of each parameter and combines them with the oracle's tree."""
    from cocoweave.backends.adasum import adasum_tree

    ours, ref = _mlp(), _mlp()
    opt = DistributedSGD(ours.parameters(), lr=0.05, momentum=0.9, reduction="adasum")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        _backward_all((ours, ref), step, rank, world_size)
        opt.step()
        for p in ref.parameters():
            parts = [p.grad]
            if world_size > 1:
                parts = [torch.empty_like(p.grad) for _ in range(world_size)]
                dist.all_gather(parts, p.grad.contiguous())
            p.grad = adasum_tree(parts)
        ref_opt.step()
    assert len(opt._buckets) == len(list(ours.parameters()))  # one tensor per bucket
    assert all(b.schedule.name in ("AR-C", "C") for b in opt._buckets)
    return _worst(ours, ref)


def warm_up(rank: int, world_size: int) -> None:
    """Import once per rank what the first optimizer step needs (torch.optim loads torch._dynamo: seconds),
    so that the run of the scenarios spends its time limit on training."""
    import torch._dynamo  # noqa: F401

    import cocoweave.optim  # noqa: F401
    import cocoweave.tune  # noqa: F401


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_distributed_optimizers_match_ddp_and_torch(local_world, world_size):
    world = local_world(world_size)
    world.run(warm_up)
    results = world.run(scenarios)
    for rank, res in enumerate(results):
        bad = {k: v for k, v in res.items() if not v <= 2e-5}
        assert not bad, f"rank {rank} of {world_size}: {bad}"


def test_single_process_without_torch_distributed():
    assert not dist.is_initialized()
    ours, ref, opt = _train(0, 1, lambda m: DistributedAdamW(m.parameters(), lr=1e-2),
                            lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
    assert _worst(ours, ref) <= 1e-6
    ours_sgd, ref_sgd, _ = _train(0, 1, lambda m: DistributedSGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True),
                                  lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True))
    assert _worst(ours_sgd, ref_sgd) <= 1e-6
    # the state dict is torch's: it loads into torch.optim.AdamW and continues identically
    again = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    again.load_state_dict(opt.state_dict())
    torch.testing.assert_close(again.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def _reshard(rank: int, world_size: int, saved: dict | None, steps: int) -> dict:
    """Train from step `start` to `start + steps` (loading `saved` model and optimizer state if given);
    returns the model state and, at the half-way point of an uninterrupted run, the checkpoint."""
    model = _mlp()
    opt = DistributedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    start = 0
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
        start = saved["step"]
    out = {}
    for step in range(start, start + steps):
        for p in model.parameters():
            p.grad = None
        _backward(model, step, rank, world_size)
        opt.step()
        if saved is None and step + 1 == steps // 2:
            out["checkpoint"] = {"model": copy.deepcopy(model.state_dict()), "optim": opt.state_dict(),
                                 "step": step + 1}
    out["final"] = model.state_dict()
    return out


def test_state_dict_saved_at_world_4_continues_at_world_2(local_world):
    for n in (4, 2):
        local_world(n).run(warm_up)
    whole = local_world(4).run(_reshard, None, 6)[0]
    resumed = local_world(2).run(_reshard, whole["checkpoint"], 3)
    for rank_result in resumed:
        for name, value in whole["final"].items():
            torch.testing.assert_close(rank_result["final"][name], value, atol=2e-6, rtol=1e-5)


def test_bad_arguments_say_what_is_wrong():
    params = _mlp().parameters
    with pytest.raises(OptimizerError, match="reduction must be one of avg, sum, adasum"):
        DistributedAdamW(params(), reduction="max")
    with pytest.raises(OptimizerError, match="betas must be two numbers"):
        DistributedLAMB(params(), betas=(0.9, 1.5))
    with pytest.raises(OptimizerError, match="Nesterov momentum needs momentum > 0"):
        DistributedSGD(params(), nesterov=True)
    with pytest.raises(OptimizerError, match="parameters must be float32, bfloat16 or float16"):
        DistributedSGD(_mlp(dtype=torch.float64).parameters())
    with pytest.raises(OptimizerError, match="schedule 'no-such-schedule' is not available .* choose one of: auto"):
        DistributedAdamW(params(), schedule="no-such-schedule")


# -- a world of one rank: no collective ------------------------------------------------------------------------------
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "reduce", "barrier", "all_to_all_single", "send", "recv", "isend", "irecv")


def test_a_world_of_one_rank_issues_no_collective(monkeypatch):
    """torch.distributed initialised with one rank: construction, steps (clipped) and zero_grad call no collective
    of torch.distributed (counted by wrapping each entry point, and the ones the torch backend keeps)."""
    from cocoweave.backends.torch import runtime

    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    calls: list[str] = []

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapped

    try:
        for name in COLLECTIVES:
            monkeypatch.setattr(dist, name, counting(name, getattr(dist, name)))
        for name in ("_ALL_GATHER", "_REDUCE_SCATTER"):
            monkeypatch.setattr(runtime, name, counting(name, getattr(runtime, name)))
        model, ref = _mlp(), _mlp()
        opt = DistributedAdamW(model.parameters(), lr=1e-2, max_grad_norm=0.1)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for step in range(3):
            _backward_all((model, ref), step, 0, 1)
            opt.step()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
            ref_opt.step()
            opt.zero_grad()
        assert calls == []
        assert _worst(model, ref) <= 1e-5  # and it trained as torch does
    finally:
        dist.destroy_process_group()


def plain_nccl_case(rank: int, world_size: int) -> dict:
    """The world as plain `init_process_group("nccl")` makes it (its config says cuda:nccl, no CPU backend; faked on
    Gloo ranks) and ranks on two hosts (no shared memory): the used-parameter flags of every step are all-reduced on
    a Gloo group beside it, as CPU tensors, so reading them back syncs no GPU; the step trains as DDP + AdamW."""
    from cocoweave.backends.torch import placement, shm

    real_config, real_group_for, real_all_reduce = dist.get_backend_config, shm.group_for, dist.all_reduce
    flag_groups = []

    def spy(t, *args, group=None, **kwargs):
        if t.dtype == torch.int32:
            flag_groups.append((group, t.device.type))
        return real_all_reduce(t, *args, group=group, **kwargs)

    dist.get_backend_config, shm.group_for, dist.all_reduce = (lambda group=None: "cuda:nccl"), (lambda g: None), spy
    try:
        model, ref = _mlp(), _mlp()
        opt = DistributedAdamW(model.parameters(), lr=1e-2)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for step in range(3):
            _backward_all((model, ref), step, rank, world_size)
            _ddp_average(ref.parameters())
            opt.step()
            ref_opt.step()
        side = placement.cpu_group(None)
        return {"flags on the side group, as CPU tensors": [g is side and dev == "cpu" for g, dev in flag_groups],
                "side is the world": side is dist.group.WORLD, "side backend": str(real_config(side)),
                "worst": _worst(model, ref)}
    finally:
        dist.get_backend_config, shm.group_for, dist.all_reduce = real_config, real_group_for, real_all_reduce


def test_under_plain_nccl_the_flags_go_through_a_cpu_group_beside_it(local_world):
    for r in local_world(2).run(plain_nccl_case):
        assert r["flags on the side group, as CPU tensors"] == [True] * 3  # one all-reduce of flags per step
        assert not r["side is the world"] and "gloo" in r["side backend"]
        assert r["worst"] <= 1e-5


def master_view_case(rank: int, world_size: int) -> list:
    """Half parameters with fp32 master weights at 3 ranks (uneven slices): opt.state[p] shows the same keys and
    master weights as state_dict() (the fp32 weights the half parameter is the rounding of)."""
    from cocoweave.optim import DistributedLAMB

    model = _mlp(dtype=torch.float16)
    opt = DistributedLAMB(model.parameters(), lr=1e-2, master_weights=True)
    for step in range(2):
        _backward(model, step, rank, world_size)
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    out = []
    for i, p in enumerate(model.parameters()):
        view, saved = opt.state[p], sd["state"][i]
        out.append((sorted(view) == sorted(saved), view["master_param"].dtype == torch.float32,
                    torch.equal(view["master_param"], saved["master_param"]),
                    torch.equal(view["master_param"].half(), p.detach())))
    return out


def test_half_parameters_show_their_fp32_masters_in_opt_state_as_in_the_state_dict(local_world):
    for rows in local_world(3).run(master_view_case):
        assert rows and all(all(r) for r in rows), rows
