"""Drop-in fidelity of cocoweave.optim: torch's optimizer semantics and checkpoint APIs exactly, or a refusal with one
sentence, never a silent divergence or a hang. Each test reproduces a case a user moving a training script hits."""

from __future__ import annotations

import copy
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from cocoweave.errors import OptimizerError
from cocoweave.optim import DistributedAdam, DistributedAdamW, DistributedSGD


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _loss(model: torch.nn.Module, step: int, rank: int, world_size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen)
    return torch.nn.functional.mse_loss(model(x.tensor_split(world_size)[rank]), y.tensor_split(world_size)[rank])


def _worst(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


# -- clipping: opt.clip_grad_norm_ is the global norm of the reduced gradient; torch's own is refused --------------
def _clip(rank: int, world_size: int) -> dict:
    ours, theirs = _mlp(), _mlp()
    opt = DistributedAdamW(ours.parameters(), lr=1e-2)
    ddp, ref_opt = DDP(theirs), torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    norms = []
    for step in range(6):
        opt.zero_grad()
        ref_opt.zero_grad()
        _loss(ours, step, rank, world_size).backward()
        _loss(ddp, step, rank, world_size).backward()
        norms.append((float(opt.clip_grad_norm_(0.05)), float(torch.nn.utils.clip_grad_norm_(theirs.parameters(),
                                                                                                0.05))))
        opt.step()
        ref_opt.step()
    opt.zero_grad()
    _loss(ours, 7, rank, world_size).backward()
    torch.nn.utils.clip_grad_norm_(ours.parameters(), 0.05)  # sees only this rank's gradient
    try:
        opt.step()
        refused = ""
    except OptimizerError as e:
        refused = str(e)
    return {"norms": norms, "params": _worst(ours, theirs), "refused": refused}


def test_clip_grad_norm_is_the_global_norm_and_torchs_own_is_refused(local_world):
    for res in local_world(2).run(_clip):
        assert all(abs(a - b) <= 1e-5 * max(1.0, b) for a, b in res["norms"]), res["norms"]
        assert res["params"] <= 2e-5
        assert "the gradients changed between backward() and step()" in res["refused"]
        assert "opt.clip_grad_norm_(max_norm)" in res["refused"]


# -- torch.distributed.checkpoint: get/set_state_dict round trips like torch.optim.AdamW's ----------------------------
def _dcp(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for name, make in (("cocoweave", lambda m: DistributedAdamW(m.parameters(), lr=1e-2, weight_decay=0.1)),
                       ("torch", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1))):
        model = _mlp()
        opt = make(model)
        run = model if name == "cocoweave" else DDP(model)
        for step in range(3):
            opt.zero_grad()
            _loss(run, step, rank, world_size).backward()
            opt.step()
        before = copy.deepcopy(opt.state_dict())
        get_optimizer_state_dict(model, opt)  # must not step or change the state
        after = opt.state_dict()
        unchanged = all(torch.equal(before["state"][i][k], after["state"][i][k]) for i in before["state"]
                        for k in before["state"][i])
        msd, osd = get_state_dict(model, opt)
        path = os.path.join(root, name)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        model2 = _mlp(seed=1)  # other weights: the load must bring them back
        opt2 = make(model2)
        run2 = model2 if name == "cocoweave" else DDP(model2)
        msd2, osd2 = get_state_dict(model2, opt2)
        state = {"model": msd2, "optim": osd2}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for step in range(3, 6):
            for o, r in ((opt, run), (opt2, run2)):
                o.zero_grad()
                _loss(r, step, rank, world_size).backward()
                o.step()
        out[name] = {"unchanged": unchanged, "resumed_equals_uninterrupted": _worst(model, model2),
                     "model": [p.detach().clone() for p in model2.parameters()]}
    out["cocoweave_vs_torch"] = max(float((a - b).abs().max()) for a, b in
                                    zip(out["cocoweave"].pop("model"), out["torch"].pop("model"), strict=True))
    return out


def test_torch_checkpoint_helpers_round_trip_like_torch_adamw(local_world, tmp_path):
    for res in local_world(2).run(_dcp, str(tmp_path)):
        assert res["cocoweave"]["unchanged"] and res["torch"]["unchanged"]
        assert res["cocoweave"]["resumed_equals_uninterrupted"] <= 1e-6
        assert res["torch"]["resumed_equals_uninterrupted"] <= 1e-6
        assert res["cocoweave_vs_torch"] <= 2e-5


# -- state_dict on one rank: refused within the process group's timeout, never a hang; the next call meets ---------
def _rank0_state_dict(rank: int, world_size: int, slow: bool) -> dict:
    """Rank 0 asks for a state dict alone (refused within the group's 3 s timeout, naming it); then every rank asks
    (the refused call left no rank a call ahead: it works). With `slow`, rank 0 evaluates for 5.5 s before a
    checkpoint, inside a 15 s timeout: the others wait for it, as DDP's ranks would."""
    group = dist.new_group(timeout=timedelta(seconds=3))
    model = _mlp()
    opt = DistributedAdamW(model.parameters(), lr=1e-2, process_group=group)  # auto: the state is kept sliced
    opt.zero_grad()
    _loss(model, 0, rank, world_size).backward()
    opt.step()
    start, err = time.monotonic(), ""
    if rank == 0:
        try:
            opt.state_dict()
        except OptimizerError as e:
            err = str(e)
    seconds = time.monotonic() - start
    dist.barrier()
    after = opt.state_dict()["state"][0]["exp_avg"]
    out = {"seconds": seconds, "error": err, "schedules": opt.schedules, "after": float(after.abs().sum())}
    if slow:
        patient = dist.new_group(timeout=timedelta(seconds=15))
        opt = DistributedAdamW(_mlp().parameters(), lr=1e-2, process_group=patient)
        if rank == 0:
            time.sleep(5.5)
        out["slow"] = len(opt.state_dict()["state"])
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_state_dict_asked_on_one_rank_is_refused_within_the_timeout_and_the_next_meets(local_world, world_size):
    results = local_world(world_size).run(_rank0_state_dict, world_size == 2)
    rank0 = results[0]
    assert "+slice(" in rank0["schedules"][0]
    assert "every rank must call it" in rank0["error"] and "timeout (3 s)" in rank0["error"], rank0["error"]
    assert 2.5 < rank0["seconds"] < 8
    assert all(r["after"] > 0 for r in results)
    if world_size == 2:
        assert [r["slow"] for r in results] == [4, 4]


# -- BatchNorm buffers, as DDP's broadcast_buffers --------------------------------------------------------------
def _buffers(rank: int, world_size: int) -> list[float]:
    """Each rank trains on its own data, so its running statistics drift from the others'; with module=, every
    forward starts from rank 0's (seen by the BatchNorm layer itself, just before it runs)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
    opt = DistributedSGD(model.parameters(), lr=0.1, module=model)
    seen = []
    model[1].register_forward_pre_hook(lambda m, args: seen.append(m.running_mean.clone()))
    for step in range(3):
        opt.zero_grad()
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * rank + step))
        model(x).sum().backward()
        opt.step()
    diffs = []
    for mean in seen:
        every = [torch.empty_like(mean) for _ in range(world_size)]
        dist.all_gather(every, mean)
        diffs.append(max(float((m - every[0]).abs().max()) for m in every))
    return diffs


def test_buffers_start_every_forward_from_rank_0(local_world):
    for diffs in local_world(2).run(_buffers):
        assert diffs == [0.0, 0.0, 0.0]


def _buffers_without_module(rank: int, world_size: int) -> dict[str, float]:
    """A BatchNorm model trained without module=: after each step its running statistics are rank 0's on every
    rank (DDP keeps them equal with broadcast_buffers=True, its default); with broadcast_buffers=False they drift."""
    out = {}
    for flag in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
        opt = DistributedSGD(model.parameters(), lr=0.1, broadcast_buffers=flag)
        for step in range(3):
            opt.zero_grad()
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * rank + step))
            model(x).sum().backward()
            opt.step()
        worst = 0.0
        for buf in model[1].buffers():
            every = [torch.empty_like(buf) for _ in range(world_size)]
            dist.all_gather(every, buf)
            worst = max(worst, max(float((e - every[0]).abs().max()) for e in every))
        out[str(flag)] = worst
    return out


def test_buffers_stay_equal_across_ranks_without_module(local_world):
    for got in local_world(2).run(_buffers_without_module):
        assert got["True"] == 0.0 and got["False"] > 0.0, got


# -- arguments torch users pass ------------------------------------------------------------------------------------
def test_torch_keyword_arguments_are_accepted_or_refused_with_a_sentence():
    params = _mlp().parameters
    DistributedAdamW(params(), lr=torch.tensor(1e-3), fused=True, foreach=False, amsgrad=False, capturable=False)
    with pytest.raises(OptimizerError, match="amsgrad=True is not supported yet"):
        DistributedAdamW(params(), amsgrad=True)
    with pytest.raises(OptimizerError, match="maximize=True is not supported yet"):
        DistributedSGD(params(), maximize=True)
    with pytest.raises(OptimizerError, match="unknown argument 'betas2'"):
        DistributedAdamW(params(), betas2=(0.9, 0.99))


def test_the_chosen_schedule_is_visible():
    opt = DistributedAdamW(_mlp().parameters())
    assert opt.schedules and all(isinstance(s, str) for s in opt.schedules)
    assert f"bucket 0: 4 parameters, 75 elements, {opt.schedules[0]}" in repr(opt)


def test_adam_with_l2_weight_decay_equals_torch_adam():
    ours, theirs = _mlp(), _mlp()
    opt = DistributedAdam(ours.parameters(), lr=1e-2, weight_decay=0.1)
    ref = torch.optim.Adam(theirs.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(5):
        for o, m in ((opt, ours), (ref, theirs)):
            o.zero_grad()
            _loss(m, step, 0, 1).backward()
            o.step()
    assert _worst(ours, theirs) <= 1e-6


def test_several_ranks_without_a_process_group_are_refused(monkeypatch):
    assert not dist.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(OptimizerError, match="torch.distributed is not initialised"):
        DistributedAdamW(_mlp().parameters())
