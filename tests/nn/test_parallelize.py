"""cocoweave.nn.parallelize on a Llama-family model: one call with torch's plan vocabulary trains the single-process
loss curve (clipping on), its parameters are DTensors that torch.distributed.checkpoint saves and reshards, and
torch's clip_grad_norm_ returns the whole model's norm."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cocoweave.errors import ParallelConfigError
from cocoweave.nn import Llama, LlamaConfig, llama_plan, parallelize

CONFIG = dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=96, multiple_of=32, max_seq_len=32)
BATCH, SEQ, LR, CLIP = 2, 12, 3e-3, 0.05  # a clip this small acts at every step


def _model() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(**CONFIG))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> tuple[list[float], list[float]]:
    """Losses and the norms clip_grad_norm_ returned, one per step."""
    losses, norms = [], []
    for step in steps:
        x, y = _batch(step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
        losses.append(float(loss.detach()))
    return losses, norms


def _reference(steps: range) -> tuple[list[float], list[float]]:
    model = _model()
    return _train(model, torch.optim.AdamW(model.parameters(), lr=LR), range(steps.stop))


def train_case(rank: int, world_size: int, steps: int) -> dict:
    """tp = the world: the losses and norms of `steps` clipped steps, and whether the replicated parameters stayed
    bit-identical across ranks."""
    import torch.distributed as dist

    model = _model()
    parallelize(model, None, llama_plan(model))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = _train(model, opt, range(steps))
    drift = 0.0
    for p in model.parameters():
        if p.placements[0].is_replicate():
            mine = p.to_local().detach().clone()
            ref = mine.clone()
            dist.broadcast(ref, 0)
            drift = max(drift, float((mine - ref).abs().max()))
    return {"losses": losses, "norms": norms, "drift": drift,
            "all dtensors": all(hasattr(p, "placements") for p in model.parameters()),
            "local wq rows": model.layers["0"].attention.wq.weight.to_local().shape[0]}


@pytest.mark.parametrize("world_size", [2])
def test_one_parallelize_call_trains_the_single_process_curve_with_clipping(local_world, world_size):
    steps = 20  # the bar: 20 clipped steps within 1e-5
    ref_losses, ref_norms = _reference(range(steps))
    for r in local_world(world_size).run(train_case, steps):
        assert r["all dtensors"]
        assert r["local wq rows"] == CONFIG["n_heads"] * (CONFIG["dim"] // CONFIG["n_heads"]) // world_size
        assert max(abs(a - b) for a, b in zip(r["losses"], ref_losses)) < 1e-5, (r["losses"], ref_losses)
        assert max(abs(a - b) for a, b in zip(r["norms"], ref_norms)) < 1e-5, (r["norms"], ref_norms)
        assert r["drift"] == 0.0


def dp_tp_case(rank: int, world_size: int, steps: int) -> list[float]:
    """dp 2 x tp 2: parallelize over the mesh's "tp" dim, DistributedAdamW over its "dp" dim (clipping by the whole
    model's norm), each dp replica on its half of the batch; the losses of the whole batch."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from cocoweave.optim import DistributedAdamW

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    d, dp = mesh.get_local_rank("dp"), mesh.get_group("dp")
    model = _model()
    parallelize(model, mesh, llama_plan(model))
    opt = DistributedAdamW(model.parameters(), lr=LR, weight_decay=0.01, max_grad_norm=CLIP, process_group=dp)
    losses = []
    for step in range(steps):
        x, y = (t.chunk(2)[d] for t in _batch(step))
        opt.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        whole = loss.detach().clone()
        dist.all_reduce(whole, group=dp)
        losses.append(float(whole) / 2)
    return losses


def test_dp2_x_tp2_with_distributed_adamw_over_dp_trains_the_single_process_curve(local_world):
    steps = 6
    ref, _ = _reference(range(steps))
    for losses in local_world(4).run(dp_tp_case, steps):
        assert max(abs(a - b) for a, b in zip(losses, ref)) < 1e-5, (losses, ref)


def dcp_save_case(rank: int, world_size: int, path: str, steps: int) -> list[float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _model()
    parallelize(model, None, llama_plan(model))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, _ = _train(model, opt, range(steps))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return losses


def dcp_resume_case(rank: int, world_size: int, path: str, start: int, stop: int) -> list[float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _model()
    for p in model.parameters():  # nothing of the fresh model may survive the load
        torch.nn.init.zeros_(p) if p.dim() == 1 else torch.nn.init.normal_(p)
    parallelize(model, None, llama_plan(model))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    _train(model, opt, range(0, 1))  # creates the optimizer state the load fills
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses, _ = _train(model, opt, range(start, stop))
    return losses


def test_a_dcp_checkpoint_of_model_state_dict_saved_at_tp2_resumes_at_tp1_and_tp4(local_world, tmp_path: Path):
    ref, _ = _reference(range(6))
    path = str(tmp_path / "ckpt")
    saved = local_world(2).run(dcp_save_case, path, 3)
    assert all(max(abs(a - b) for a, b in zip(s, ref[:3])) < 1e-5 for s in saved)
    for n in (1, 4):
        for resumed in local_world(n).run(dcp_resume_case, path, 3, 6):
            assert max(abs(a - b) for a, b in zip(resumed, ref[3:])) < 1e-5, (n, resumed, ref[3:])


def heads_case(rank: int, world_size: int) -> str:
    model = Llama(LlamaConfig(**{**CONFIG, "n_kv_heads": 1}))
    try:
        parallelize(model, None, llama_plan(model))
    except ParallelConfigError as e:
        return str(e)
    return "accepted"


def test_fewer_kv_heads_than_ranks_is_refused_up_front(local_world):
    for msg in local_world(2).run(heads_case):
        assert "1 KV heads, which 2 tensor-parallel ranks do not divide" in msg


def test_a_plan_naming_no_module_is_one_sentence():
    with pytest.raises(ParallelConfigError, match="matches no module"):
        parallelize(_model(), None, {"layers.*.attn.wq": llama_plan(_model())["layers.*.attention.wq"]})


def test_an_input_layout_change_other_than_the_sequence_gather_is_one_sentence_naming_the_module():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput

    style = PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),))
    said = r"^parallelize: layers\.0\.attention \(\w+\) with PrepareModuleInput: converting input 0 from S\(0\) to R"
    with pytest.raises(ParallelConfigError, match=said + " is not supported"):
        parallelize(_model(), None, {"layers.0.attention": style})


def test_llama_plan_uses_torch_styles_for_both_namings():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = llama_plan(_model())
    assert isinstance(plan["layers.*.attention.wq"], ColwiseParallel)
    assert isinstance(plan["layers.*.feed_forward.w2"], RowwiseParallel)
    assert "output" not in plan and "tok_embeddings" not in plan
    assert isinstance(llama_plan(_model(), loss_parallel=True)["output"], ColwiseParallel)
    hf = torch.nn.Module()
    hf.model = torch.nn.Module()
    hf.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    hf.model.layers[0].self_attn = torch.nn.Module()
    hf.model.layers[0].self_attn.q_proj = torch.nn.Linear(4, 4)
    assert list(llama_plan(hf)) == ["model.layers.*.self_attn.q_proj"]


def test_one_process_parallelize_is_the_model_itself():
    ref, model = _model(), _model()
    parallelize(model, None, llama_plan(model))  # no process group: plain tensors, the same numbers
    x, _ = _batch(0)
    assert torch.equal(model(x), ref(x))
    assert copy.deepcopy(model) is not None
