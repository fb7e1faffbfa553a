"""DTensor parameters (a tensor-parallel model's, cocoweave/sharding.py) under cocoweave.optim: trained over the
data-parallel group equal to the single-process model (clipping by the whole model's norm, replicated weights equal
across tensor-parallel ranks), refused over a group that spans a parameter's parts, and optimizer state dicts that
torch's DCP saves at tp 2 and loads at tp 4 and tp 1."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from cocoweave.errors import ParallelConfigError
from cocoweave.nn.functional import reduce_from_parallel
from cocoweave.optim import DistributedAdamW, DistributedLAMB
from cocoweave.sharding import local, replicate_parameter, shard_parameter

D, H, O, BATCH, STEPS, MAX_NORM = 6, 8, 5, 8, 4, 0.5


def _full(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"w1": (H, D), "b1": (H,), "w2": (O, H), "b2": (O,), "g": (O,)}
    return {k: torch.randn(s, generator=gen) * 0.5 + (1.0 if k == "g" else 0.0) for k, s in shapes.items()}


class Reference(torch.nn.Module):
    """The single-process model: column-parallel w1/b1, row-parallel w2, replicated b2 and g, all whole."""

    def __init__(self, full: dict[str, torch.Tensor]):
        super().__init__()
        for k, v in full.items():
            self.register_parameter(k, torch.nn.Parameter(v.clone()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(x @ self.w1.t() + self.b1) @ self.w2.t() + self.b2) * self.g


class Parallel(torch.nn.Module):
    """The same model at tensor parallelism `mesh.size()`: its parameters DTensors (Shard / Replicate) on `mesh`,
    the forward on their local tensors."""

    def __init__(self, full: dict[str, torch.Tensor], mesh):
        super().__init__()
        tp, r = mesh.size(), mesh.get_local_rank()
        self.group = mesh.get_group()
        self.w1 = shard_parameter(full["w1"].chunk(tp, 0)[r].clone(), mesh, 0)
        self.b1 = shard_parameter(full["b1"].chunk(tp, 0)[r].clone(), mesh, 0)
        self.w2 = shard_parameter(full["w2"].chunk(tp, 1)[r].clone(), mesh, 1)
        self.b2 = replicate_parameter(full["b2"].clone(), mesh)
        self.g = replicate_parameter(full["g"].clone(), mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = torch.tanh(x @ local(self.w1).t() + local(self.b1)) @ local(self.w2).t()
        return (reduce_from_parallel(partial, self.group) + local(self.b2)) * local(self.g)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, D, generator=gen), torch.randn(BATCH, O, generator=gen) * 3


def _mesh(dp: int, tp: int):
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def _slice(name: str, full: torch.Tensor, tp: int, r: int) -> torch.Tensor:
    dim = {"w1": 0, "b1": 0, "w2": 1}.get(name)
    return full if dim is None else full.chunk(tp, dim)[r]


def _train(rank: int, world_size: int, tp: int) -> dict[str, float]:
    """dp x tp ranks train the parallel model with DistributedAdamW over dp (clipped); one process trains the whole
    model with torch's AdamW and clip_grad_norm_. Returns the worst differences."""
    dp = world_size // tp
    mesh = _mesh(dp, tp)
    d, r = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    full = _full()
    model, ref = Parallel(full, mesh["tp"]), Reference(full)
    opt = DistributedAdamW(model.parameters(), lr=0.05, weight_decay=0.01, max_grad_norm=MAX_NORM,
                           process_group=mesh.get_group("dp"), module=model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.01)
    worst = {"loss": 0.0, "norm": 0.0, "weights": 0.0, "replicas": 0.0, "clipped": 0.0}
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.chunk(dp)[d]), y.chunk(dp)[d])
        loss.backward()
        assert all(type(p.grad) is type(p) and p.grad.placements == p.placements for p in model.parameters())
        opt.step()
        ref_opt.zero_grad()
        ref_loss = torch.nn.functional.mse_loss(ref(x), y)
        ref_loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
        ref_opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=mesh.get_group("dp"))
        worst["loss"] = max(worst["loss"], abs(float(mean_loss) / dp - float(ref_loss)))
        worst["norm"] = max(worst["norm"], abs(opt.last_grad_norm - norm))
        worst["clipped"] = max(worst["clipped"], float(norm > MAX_NORM))
    for name, p in model.named_parameters():
        want = _slice(name, dict(ref.named_parameters())[name].detach(), tp, r)
        worst["weights"] = max(worst["weights"], float((local(p).detach() - want).abs().max()))
    for name in ("b2", "g"):  # replicated: bit-identical on every tp rank
        mine = local(getattr(model, name)).detach().clone()
        every = [torch.empty_like(mine) for _ in range(tp)]
        dist.all_gather(every, mine, group=mesh.get_group("tp"))
        worst["replicas"] = max(worst["replicas"], max(float((e != mine).sum()) for e in every))
    return worst


@pytest.mark.parametrize("world_size,tp", [(2, 2), (4, 2)])
def test_a_tensor_parallel_model_trains_as_one_process_with_clipping(local_world, world_size, tp):
    for rank, got in enumerate(local_world(world_size).run(_train, tp)):
        assert got["clipped"] == 1.0, got  # the clip was active
        assert got["norm"] <= 1e-6 and got["loss"] <= 1e-5 and got["weights"] <= 1e-5, f"rank {rank}: {got}"
        assert got["replicas"] == 0.0, f"rank {rank}: replicated weights differ across tp ranks: {got}"


def _over_the_world(rank: int, world_size: int) -> list[str]:
    """tp 2 on 2 ranks; optimizers over the default (world) group, and LAMB over the dp group."""
    mesh = _mesh(1, 2)
    said = []
    for kwargs in ({}, {"module": None}):
        model = Parallel(_full(), mesh["tp"])
        before = local(model.w1).detach().clone()
        try:
            DistributedAdamW(model.parameters(), **({"module": model} if kwargs else {}))
        except ParallelConfigError as exc:
            said.append(str(exc))
        said.append(str(torch.equal(local(model.w1).detach(), before)))  # nothing broadcast over rank 1's slice
    try:
        DistributedLAMB(Parallel(_full(), mesh["tp"]).parameters(), process_group=mesh.get_group("dp"))
    except ParallelConfigError as exc:
        said.append(str(exc))
    return said


def test_an_optimizer_over_ranks_holding_different_parts_is_refused(local_world):
    for said in local_world(2).run(_over_the_world):
        assert said[0] == ("DistributedAdamW: parameter 0 is sharded over mesh dim 'tp' (ranks [0, 1]), which the "
                           "optimizer's process group (ranks [0, 1]) spans; pass the data-parallel group as "
                           "process_group=")
        assert said[1] == "True" and said[3] == "True"
        assert said[2].startswith("DistributedAdamW: parameter 'w1' is sharded over mesh dim 'tp'"), said[2]
        assert said[4].startswith("DistributedLAMB: parameter 0 is sharded over mesh dim 'tp' (ranks [0, 1]); "
                                  "LAMB's per-tensor trust ratio"), said[4]


def _state(opt: DistributedAdamW) -> dict[int, dict[str, torch.Tensor]]:
    """Each parameter's whole exp_avg / exp_avg_sq (DTensors gathered over tp)."""
    return {i: {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in entry.items()}
            for i, entry in opt.state_dict()["state"].items()}


def _reshard(rank: int, world_size: int, path: str) -> dict[str, float]:
    """Save the optimizer with torch's DCP at dp 2 x tp 2; load it at tp 4 and at tp 1 (dp 4)."""
    import torch.distributed.checkpoint as dcp

    full = _full()
    mesh = _mesh(2, 2)
    model = Parallel(full, mesh["tp"])
    opt = DistributedAdamW(model.parameters(), lr=0.05, process_group=mesh.get_group("dp"))
    for step in range(2):
        x, y = _batch(step)
        d = mesh.get_local_rank("dp")
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x.chunk(2)[d]), y.chunk(2)[d]).backward()
        opt.step()
    sd = opt.state_dict()
    kinds = {type(v).__name__ for e in sd["state"].values() for k, v in e.items() if k != "step"}
    want = _state(opt)
    dcp.save({"optim": sd}, checkpoint_id=path)
    worst = {"kinds": float(kinds == {"DTensor"})}
    for dp, tp in ((1, 4), (4, 1)):
        mesh = _mesh(dp, tp)
        model = Parallel(full, mesh["tp"])
        new = DistributedAdamW(model.parameters(), lr=0.05, process_group=mesh.get_group("dp"))
        target = {"optim": new.state_dict()}
        dcp.load(target, checkpoint_id=path)
        new.load_state_dict(target["optim"])
        got, r = _state(new), mesh.get_local_rank("tp")
        names = [n for n, _ in model.named_parameters()]
        diff, mine = 0.0, new.state_dict()["state"]
        for i, entry in want.items():
            for k, v in entry.items():
                part = v if v.dim() == 0 else _slice(names[i], v, tp, r)  # the step count is one number
                diff = max(diff, float((local(mine[i][k]) - part).abs().max()),
                           float((got[i][k] - v).abs().max()))
        worst[f"tp{tp}"] = diff
    return worst


def test_optimizer_state_saved_by_dcp_at_tp2_loads_at_tp4_and_tp1(local_world, tmp_path):
    for rank, got in enumerate(local_world(4).run(_reshard, str(tmp_path / "ckpt"))):
        assert got["kinds"] == 1.0, f"rank {rank}: state tensors are not DTensors"
        assert got["tp4"] == 0.0 and got["tp1"] == 0.0, f"rank {rank}: {got}"
