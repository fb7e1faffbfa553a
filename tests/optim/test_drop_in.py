"""cocoweave.optim as a drop-in for DDP + torch.optim over a real training loop: 20 steps with clipping by the global
norm, gradient accumulation over 2 micro-batches (no_sync on the first), two parameter groups, a parameter that has
no gradient on some steps, in float32 and in bfloat16. The losses and the parameters equal those of DDP
(find_unused_parameters) + torch.optim.AdamW + torch.nn.utils.clip_grad_norm_ to float tolerance at 2, 3 and 4 ranks.
One world.run per world size runs every case; each rank returns the worst difference of each."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from cocoweave.errors import OptimizerError
from cocoweave.optim import DistributedAdamW, DistributedSGD

STEPS = 20  # every feature above acts on 10 or more steps (odd and even ones); clipping is asserted active


class Net(torch.nn.Module):
    """An MLP with a branch that only odd steps take: its parameters have no gradient on even steps."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(6, 16)
        self.b = torch.nn.Linear(16, 4)
        self.branch = torch.nn.Linear(16, 16)
        self.to(dtype)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.b(h)


def _groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3}]


def _batch(step: int, micro: int, rank: int, world_size: int, dtype: torch.dtype) -> tuple:
    gen = torch.Generator().manual_seed(1000 * step + micro)
    x, y = torch.randn(12, 6, generator=gen), torch.randn(12, 4, generator=gen)
    return x.tensor_split(world_size)[rank].to(dtype), y.tensor_split(world_size)[rank].to(dtype)


def _loss(model: torch.nn.Module, step: int, micro: int, rank: int, world_size: int, dtype: torch.dtype):
    x, y = _batch(step, micro, rank, world_size, dtype)
    return torch.nn.functional.mse_loss(model(x, use_branch=step % 2 == 1).float(), y.float()) / 2


def _train(rank: int, world_size: int, dtype: torch.dtype, kind: str, kernels: str | None = None) -> dict[str, float]:
    ours, theirs = Net(dtype), Net(dtype)
    if kind == "adamw":
        opt = DistributedAdamW(_groups(ours), lr=1e-2, max_grad_norm=0.5, kernels=kernels)
        ref_opt = torch.optim.AdamW(_groups(theirs), lr=1e-2)
    else:
        opt = DistributedSGD(_groups(ours), lr=5e-2, momentum=0.9, max_grad_norm=0.5, kernels=kernels)
        ref_opt = torch.optim.SGD(_groups(theirs), lr=5e-2, momentum=0.9)
    ddp = DDP(theirs, find_unused_parameters=True)
    worst_loss = worst_param = clipped = 0.0
    for step in range(STEPS):
        opt.zero_grad()
        ref_opt.zero_grad()
        with opt.no_sync(), ddp.no_sync():
            _loss(ours, step, 0, rank, world_size, dtype).backward()
            _loss(ddp, step, 0, rank, world_size, dtype).backward()
        mine = _loss(ours, step, 1, rank, world_size, dtype)
        mine.backward()
        ref = _loss(ddp, step, 1, rank, world_size, dtype)
        ref.backward()
        opt.step()
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5)
        ref_opt.step()
        worst_loss = max(worst_loss, abs(float(mine) - float(ref)))
        clipped = max(clipped, float(opt.last_grad_norm > 0.5))
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        worst_param = max(worst_param, float((p.float() - q.float()).abs().max()))
    return {"loss": worst_loss, "params": worst_param, "clipped": clipped}


def cases(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    return {f"{kind} {str(dtype)[6:]}": _train(rank, world_size, dtype, kind)
            for kind in ("adamw", "sgd") for dtype in (torch.float32, torch.bfloat16)}


TOLERANCE = {"float32": 2e-5, "bfloat16": 6e-2}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_a_training_loop_matches_ddp_and_torch_optim(local_world, world_size):
    for rank, res in enumerate(local_world(world_size).run(cases)):
        for name, got in res.items():
            tol = TOLERANCE[name.split()[1]]
            assert got["loss"] <= tol and got["params"] <= tol, f"rank {rank} of {world_size}, {name}: {got}"
            assert got["clipped"] == 1.0, name  # the clip was active on some steps


def compiled(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    return {f"adamw {str(dtype)[6:]}": _train(rank, world_size, dtype, "adamw", "compiled")
            for dtype in (torch.float32, torch.bfloat16)}


def test_the_same_loop_with_the_update_compiled_into_one_loop(local_world):
    """Every bucket's fused update compiled by torch.compile (the CPU default for users)."""
    for rank, res in enumerate(local_world(2).run(compiled)):
        for name, got in res.items():
            tol = TOLERANCE[name.split()[1]]
            assert got["loss"] <= tol and got["params"] <= tol, f"rank {rank}, {name}: {got}"


def _frozen(rank: int, world_size: int) -> float:
    """A requires_grad=False parameter passed in model.parameters() never moves (torch skips it)."""
    model = Net(torch.float32)
    model.branch.weight.requires_grad_(False)
    before = model.branch.weight.detach().clone()
    opt = DistributedAdamW(model.parameters(), lr=1e-2, weight_decay=0.5)
    for step in range(5):
        opt.zero_grad()
        _loss(model, 2 * step + 1, 0, rank, world_size, torch.float32).backward()
        opt.step()
    return float((model.branch.weight - before).abs().max())


def test_a_frozen_parameter_never_moves(local_world):
    assert local_world(2).run(_frozen) == [0.0, 0.0]


def _agree(rank: int, world_size: int) -> float:
    """Ranks disagree on which parameters have gradients: as DDP with find_unused_parameters, the ones any rank
    used are updated everywhere (their missing gradients count as zeros), and the weights stay equal."""
    model = Net(torch.float32)
    opt = DistributedAdamW(model.parameters(), lr=1e-2)
    for step in range(4):
        opt.zero_grad()
        _loss(model, step, 0, rank, world_size, torch.float32).backward() if rank == 0 or step % 2 else \
            (model(torch.randn(2, 6), use_branch=False).sum() * 0).backward()
        opt.step()
    w = model.branch.weight.detach().clone()
    others = [torch.empty_like(w) for _ in range(world_size)]
    dist.all_gather(others, w)
    return max(float((o - w).abs().max()) for o in others)


def test_ranks_that_disagree_on_unused_parameters_stay_equal(local_world):
    assert max(local_world(2).run(_agree)) == 0.0


def _accumulate_on_the_library(rank: int, world_size: int) -> float:
    """DDP's idiom on the library collectives (the reduction launched from backward hooks): all micro-batches but the
    last under no_sync. The launch must wait for the last backward's gradients."""
    ours, theirs = Net(torch.float32), Net(torch.float32)
    opt = DistributedAdamW(ours.parameters(), lr=1e-2, schedule="RS-C-AG+slice(m,v)")
    ref_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    ddp = DDP(theirs)
    for step in range(4):
        opt.zero_grad()
        ref_opt.zero_grad()
        for micro in range(3):
            sync = micro == 2
            with (contextlib.nullcontext() if sync else opt.no_sync()):
                _loss(ours, 2 * step + 1, micro, rank, world_size, torch.float32).backward()
            with (contextlib.nullcontext() if sync else ddp.no_sync()):
                _loss(ddp, 2 * step + 1, micro, rank, world_size, torch.float32).backward()
        opt.step()
        ref_opt.step()
    return max(float((p - q).abs().max()) for p, q in zip(ours.parameters(), theirs.parameters(), strict=True))


def test_accumulation_with_no_sync_on_the_library_collectives(local_world):
    assert max(local_world(2).run(_accumulate_on_the_library)) <= 2e-5


def _slots_after_rebuilds(rank: int, world_size: int) -> list[bool]:
    """A bucket recompiled mid-training (clipping turned on, then its masked program when a parameter goes without a
    gradient) keeps its gradients and weights where the new program's shared-memory collectives read and write
    them, so the reduction copies nothing in and the all-gather writes the weights in place."""
    model = Net(torch.float32)
    opt = DistributedAdamW(model.parameters(), lr=1e-2)
    for step in range(4):
        opt.zero_grad()
        _loss(model, step, 0, rank, world_size, torch.float32).backward()
        if step == 1:
            opt.clip_grad_norm_(0.5)
        opt.step()
    placed = []
    for b in opt._buckets:
        g, w = b.exe.shared_input("g"), b.exe.shared_input("w")
        placed += [b.masked, g is not None and g.data_ptr() == b.grad.data_ptr(),
                   w is not None and w.data_ptr() == b.data.data_ptr()]
    return placed


def test_a_recompiled_bucket_keeps_its_tensors_in_the_new_programs_slots(local_world):
    for placed in local_world(2).run(_slots_after_rebuilds):
        assert placed and all(placed)


def _stored_once(rank: int, world_size: int) -> list[float]:
    """On one host the ranks keep the parameters in one tensor they all map (the all-gather is then a barrier):
    what rank 0 writes into a weight between steps, every rank reads, and training still equals DDP + AdamW."""
    ours, theirs = Net(torch.float32), Net(torch.float32)
    opt = DistributedAdamW(ours.parameters(), lr=1e-2)
    ref_opt, ddp = torch.optim.AdamW(theirs.parameters(), lr=1e-2), DDP(theirs)
    for step in range(3):
        for model, o in ((ours, opt), (ddp, ref_opt)):
            o.zero_grad()
            _loss(model, 2 * step + 1, 0, rank, world_size, torch.float32).backward()
            o.step()
    diff = max(float((p - q).abs().max()) for p, q in zip(ours.parameters(), theirs.parameters(), strict=True))
    dist.barrier()
    if rank == 0:
        with torch.no_grad():
            ours.a.weight[0, 0] = 123.0
    dist.barrier()
    return [diff, float(ours.a.weight[0, 0])]


def test_the_ranks_of_one_host_store_the_parameters_once(local_world):
    for diff, seen in local_world(2).run(_stored_once):
        assert diff <= 2e-5
        assert seen == 123.0


def _steps_without_zero_grad(rank: int, world_size: int) -> list[str]:
    """The reduction works inside the gradient buffers, so gradients cannot pile up across steps: a second step without
    zero_grad() is refused with a sentence; model.zero_grad() (gradients set to None) is as good as opt.zero_grad()."""
    model = Net(torch.float32)
    opt = DistributedAdamW(model.parameters(), lr=1e-2)
    said = []
    for step, clear in enumerate(["opt", "model", None]):
        if clear == "opt":
            opt.zero_grad()
        elif clear == "model":
            model.zero_grad()
        _loss(model, 2 * step + 1, 0, rank, world_size, torch.float32).backward()
        try:
            opt.step()
            said.append("ok")
        except OptimizerError as exc:
            said.append(str(exc))
    try:  # turning clipping on recompiles the buckets: the gradients they carry over are still the stale ones
        opt.clip_grad_norm_(1.0)
        said.append("ok")
    except OptimizerError as exc:
        said.append(str(exc))
    return said


def test_a_step_without_zero_grad_since_the_last_is_refused(local_world):
    for said in local_world(2).run(_steps_without_zero_grad):
        assert said[:2] == ["ok", "ok"]
        assert all("without zero_grad()" in s and "no_sync()" in s for s in said[2:]) and len(said) == 4


def _load_right_after_construction(rank: int, world_size: int) -> float:
    """The ranks share the parameters' memory, so a rank must not go on from the constructor while another still
    copies the initial parameters in: rank 1 copies late here, rank 0 loads new values at once and reads them later."""
    import time

    from cocoweave.optim import buckets

    attach = buckets.Bucket.attach

    def late(self, *args, **kwargs):  # noqa: ANN001, ANN202
        if rank == 1:
            time.sleep(0.5)
        return attach(self, *args, **kwargs)

    buckets.Bucket.attach = late
    try:
        model = Net(torch.float32)
        DistributedAdamW(model.parameters(), lr=1e-2)
    finally:
        buckets.Bucket.attach = attach
    time.sleep(0.0 if rank == 0 else 1.5)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)  # a checkpoint loaded into the model (by rank 1 too, later)
    time.sleep(1.0 if rank == 0 else 0.0)
    seen = min(float(p.min()) for p in model.parameters())
    dist.barrier()
    return seen


def test_parameters_loaded_right_after_construction_are_not_overwritten(local_world):
    assert local_world(2).run(_load_right_after_construction) == [7.0, 7.0]
