"""Training an MoE model with expert parallelism: at dp 2 x ep 2 (4 ranks; DistributedAdamW over every rank for the
non-expert parameters, over dp for the experts) and at tp 2 x ep 2 (the attention tensor-parallel) the 20-step loss
curve equals one process's; a checkpoint saved at ep 2 (cocoweave.checkpoint of sharded_state_dict) resumes at ep 1
and ep 4 on the same losses."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from cocoweave import checkpoint
from cocoweave.nn import (
    LlamaConfig,
    MoEConfig,
    MoEModel,
    expert_parameters,
    sharded_optimizer_state_dict,
    sharded_state_dict,
    unshard,
)

CONFIG = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16)
MOE = dict(n_experts=4, top_k=2, hidden_dim=24, shared_hidden_dim=16, aux_loss_coeff=0.01, capacity_factor=1.5)
BATCH, SEQ, LR = 4, 8, 3e-3
EPS = 1e-4  # near the gradients' size: Adam then sees their scale (a wrong expert gradient divisor fails)


def _model(group=None, divisor: float = 1.0, seed: int = 0, **moe) -> MoEModel:
    torch.manual_seed(seed)
    return MoEModel(LlamaConfig(**CONFIG), MoEConfig(**(MOE | moe)), group=group, seed=seed,
                    expert_grad_divisor=divisor)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step % 2)  # two batches in turn: the model learns them
    tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model: MoEModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten()) + model.aux_loss()


def reference_curve(steps: int, parts: int, **moe) -> list[float]:
    """One process: each step the batch's `parts` rank shares one after another, each loss / parts, gradients
    accumulated (what data parallelism over `parts` ranks computes), one AdamW step."""
    model = _model(**moe)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for x, y in zip(*(t.chunk(parts) for t in _batch(step)), strict=True):
            loss = _loss(model, x, y) / parts
            loss.backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total)
    return losses


def dp_ep_case(rank: int, world_size: int, steps: int) -> list[float]:
    """dp 2 x ep 2: each rank its quarter of the batch; the experts' optimizer over dp (their gradients divided by
    ep), the others' over all four ranks; the mean loss of the four."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from cocoweave.optim import DistributedAdamW

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    model = _model(mesh, divisor=mesh["ep"].size())
    experts, others = expert_parameters(model)
    opts = [DistributedAdamW(experts, lr=LR, eps=EPS, process_group=mesh.get_group("dp")),
            DistributedAdamW(others, lr=LR, eps=EPS)]
    losses = []
    for step in range(steps):
        x, y = (t.chunk(world_size)[rank] for t in _batch(step))
        for opt in opts:
            opt.zero_grad()
        loss = _loss(model, x, y)
        loss.backward()
        for opt in opts:
            opt.step()
        whole = loss.detach().clone()
        dist.all_reduce(whole)
        losses.append(float(whole) / world_size)
    return losses


def test_dp2_x_ep2_trains_the_single_process_curve(local_world):
    steps = 20  # the bar: 20 steps within 1e-5
    ref = reference_curve(steps, 4)
    assert ref[-1] < ref[0] - 0.1  # it learns
    for losses in local_world(4).run(dp_ep_case, steps):
        assert max(abs(a - b) for a, b in zip(losses, ref, strict=True)) < 1e-5, (losses, ref)


# ---------------------------------------------------------------------------------------------------------
# A checkpoint at another ep degree (dropless, no aux loss: a rank's share of the batch does not change the math)
# ---------------------------------------------------------------------------------------------------------

DROPLESS = {"capacity_factor": None, "aux_loss_coeff": 0.0}


def _train(model: MoEModel, opt: torch.optim.Optimizer, steps: range, rank: int, world_size: int) -> list[float]:
    """Steps at dp 1 x ep = world: the non-expert gradients averaged over the ranks (one all-reduce), the experts'
    already summed over them (divided by ep in the layer)."""
    import torch.distributed as dist

    from cocoweave.sharding import is_dtensor

    losses = []
    for step in steps:
        x, y = (t.chunk(world_size)[rank] for t in _batch(step))
        opt.zero_grad()
        loss = _loss(model, x, y)
        loss.backward()
        if world_size > 1:
            for p in model.parameters():
                if not is_dtensor(p):
                    dist.all_reduce(p.grad)
                    p.grad /= world_size
            dist.all_reduce(whole := loss.detach().clone())
            loss = whole / world_size
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _state(model: MoEModel, opt: torch.optim.Optimizer) -> dict:
    return {"model": sharded_state_dict(model), "optim": sharded_optimizer_state_dict(model, opt)}


def save_case(rank: int, world_size: int, path: str) -> list[float]:
    """ep 2: 3 steps, save, 3 more; the 6 losses."""
    model = _model(None, divisor=world_size, **DROPLESS)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, foreach=False)
    losses = _train(model, opt, range(3), rank, world_size)
    checkpoint.save(path, _state(model, opt))
    return losses + _train(model, opt, range(3, 6), rank, world_size)


def resume_case(rank: int, world_size: int, path: str) -> list[float]:
    """ep = world: a model of other weights resumed from the checkpoint; the losses of steps 3-5."""
    model = _model(None, divisor=world_size, seed=9, **DROPLESS)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, eps=EPS, foreach=False)
    _train(model, opt, range(0, 1), rank, world_size)  # torch's AdamW makes its state in its first step
    loaded = checkpoint.load(path, _state(model, opt))
    model.load_state_dict(unshard(loaded["model"]))
    opt.load_state_dict(unshard(loaded["optim"]))
    return _train(model, opt, range(3, 6), rank, world_size)


def test_a_checkpoint_saved_at_ep2_resumes_at_ep1_and_ep4_on_the_same_losses(local_world, tmp_path: Path):
    path = str(tmp_path / "step-3")
    saved = local_world(2).run(save_case, path)[0]
    ref = reference_curve(6, 1, **DROPLESS)  # also: the experts divided by ep (EPS makes Adam see it)
    assert max(abs(a - b) for a, b in zip(saved, ref, strict=True)) < 1e-5, (saved, ref)
    for resumed in (resume_case(0, 1, path), local_world(4).run(resume_case, path)[0]):
        assert max(abs(a - b) for a, b in zip(resumed, saved[3:], strict=True)) < 1e-5, (resumed, saved[3:])


def dcp_save_case(rank: int, world_size: int, path: str) -> dict:
    """torch.distributed.checkpoint of model.state_dict() at ep = world; the whole state (full_state_dict)."""
    import torch.distributed.checkpoint as dcp

    from cocoweave.nn import full_state_dict

    model = _model(None, seed=3, **DROPLESS)
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    return full_state_dict(model)


def dcp_load_case(rank: int, world_size: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from cocoweave.nn import full_state_dict

    model = _model(None, seed=4, **DROPLESS)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    return full_state_dict(model)


def test_a_dcp_checkpoint_of_model_state_dict_saved_at_ep2_loads_at_ep4(local_world, tmp_path: Path):
    saved = local_world(2).run(dcp_save_case, str(tmp_path / "dcp"))[0]
    for loaded in local_world(4).run(dcp_load_case, str(tmp_path / "dcp")):
        assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], v) for k, v in saved.items())
    assert any(k.endswith("experts.w1") for k in saved)


# ---------------------------------------------------------------------------------------------------------
# Composed with tensor-parallel attention: tp 2 x ep 2 (attention split over tp by one parallelize call, the
# experts over ep, each ep rank its share of the batch, both tp ranks of a share the same tokens)
# ---------------------------------------------------------------------------------------------------------


def tp_ep_case(rank: int, world_size: int, steps: int) -> list[float]:
    """tp 2 x ep 2: the attention's projections split over tp; the experts (DTensors over ep, whose gradients the
    combine sums over ep) stepped over tp, where they are replicated; everything else over ep, the data-parallel
    dimension of the other parameters."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from cocoweave.nn import expert_parameters, llama_plan, parallelize
    from cocoweave.optim import DistributedAdamW
    from cocoweave.sharding import is_dtensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
    model = _model(mesh, divisor=mesh["ep"].size())
    plan = llama_plan(model)
    assert plan and all(".attention." in name for name in plan)  # the attention only: the MoE layers stay as they are
    parallelize(model, mesh["tp"], plan)
    assert is_dtensor(model.layers["0"].attention.wq.weight)
    experts, others = expert_parameters(model)
    opts = [DistributedAdamW(experts, lr=LR, eps=EPS, process_group=mesh.get_group("tp")),
            DistributedAdamW(others, lr=LR, eps=EPS, process_group=mesh.get_group("ep"))]
    share = mesh.get_coordinate()[0]
    losses = []
    for step in range(steps):
        x, y = (t.chunk(2)[share] for t in _batch(step))
        for opt in opts:
            opt.zero_grad()
        loss = _loss(model, x, y)
        loss.backward()
        for opt in opts:
            opt.step()
        whole = loss.detach().clone()
        dist.all_reduce(whole)
        losses.append(float(whole) / world_size)  # each share's loss counted by its two tp ranks
    return losses


def test_tp2_x_ep2_trains_the_single_process_curve(local_world):
    steps = 20
    ref = reference_curve(steps, 2)
    assert ref[-1] < ref[0] - 0.1  # it learns
    for losses in local_world(4).run(tp_ep_case, steps):
        assert max(abs(a - b) for a, b in zip(losses, ref, strict=True)) < 1e-5, (losses, ref)
