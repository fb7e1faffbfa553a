"""cocoweave.nn's state dicts: a single-process model's (full) state dict loads at any tensor-parallel size and the
whole comes back (full_state_dict); a checkpoint saved at tp 2 resumes at tp 1 and tp 4 (sharded_state_dict and
cocoweave.checkpoint), optimizer state included, with the same dropout masks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from cocoweave import checkpoint
from cocoweave.errors import ParallelConfigError
from cocoweave.nn import (
    ReferenceBlock,
    RowParallelLinear,
    TransformerBlock,
    full_state_dict,
    sharded_optimizer_state_dict,
    sharded_state_dict,
    unshard,
)

D, HEADS = 24, 4
# eps well above rounding noise: the key bias's gradient is 0 up to rounding (softmax ignores a shift of every key),
# and Adam would turn a different rounding at another tensor-parallel size into a step of lr
ADAMW = {"lr": 1e-2, "eps": 1e-4}


def _tensors_equal(a: dict, b: dict, tol: float = 0.0) -> list[str]:
    """Keys whose tensors differ by more than `tol` (or are missing from `b`)."""
    return [k for k, v in a.items() if isinstance(v, torch.Tensor)
            and (k not in b or v.shape != b[k].shape or (v - b[k]).abs().max().item() > tol)]


def full_load_case(rank: int, world_size: int) -> list[str]:
    """A single-process block's state dict into a tensor-parallel block: this rank's parts, the same forward
    (dropout masks included: the counter comes with it), and the whole back from full_state_dict."""
    ref = ReferenceBlock(D, HEADS, dropout=0.2, seed=2)
    ref.dropout_step = 5
    blk = TransformerBlock(D, HEADS, dropout=0.2, seed=7)
    blk.load_state_dict(ref.state_dict())
    bad = _tensors_equal(ref.state_dict(), full_state_dict(blk))
    x = torch.randn(2, 6, D, generator=torch.Generator().manual_seed(0))
    if (blk(x) - ref(x)).abs().max() > 1e-5 or blk.dropout_step != 6:
        bad.append("forward after loading")
    plain = ReferenceBlock(D, HEADS, seed=0)
    result = plain.load_state_dict(full_state_dict(blk), strict=False)  # and back into one process
    if result.missing_keys or set(result.unexpected_keys) != {"proj._extra_state", "fc2._extra_state"}:
        bad.append(f"back: {result}")  # only the row layers' own dropout counters have no place there
    bad += [f"back: {k}" for k in _tensors_equal(ref.state_dict(), plain.state_dict())]
    return bad


def test_a_single_process_state_dict_loads_at_every_tensor_parallel_size(local_world):
    assert full_load_case(0, 1) == []
    for n in (2, 4):
        assert local_world(n).run(full_load_case) == [[]] * n


def test_a_tensor_of_another_shape_is_one_sentence():
    blk = TransformerBlock(D, HEADS)
    sd = blk.state_dict()
    sd["fc1.weight"] = torch.zeros(3, D)
    with pytest.raises(ParallelConfigError, match=r"fc1.weight has shape \[3, 24\]: this rank holds"):
        blk.load_state_dict(sd)


def test_the_dropout_counter_is_in_the_state_dict_and_a_linear_state_dict_keeps_it():
    row = RowParallelLinear(8, 8, dropout=0.5, seed=2)
    x = torch.randn(4, 8)
    row(x), row(x)
    saved = row.state_dict()
    assert saved["_extra_state"] == {"seed": 2, "dropout_step": 2}
    expected = row(x)
    fresh = RowParallelLinear(8, 8, dropout=0.5, seed=9)
    fresh.load_state_dict(saved)
    assert torch.equal(fresh(x), expected)  # the same weights and the same (third) mask
    linear = nn.Linear(8, 8)
    fresh.load_state_dict(linear.state_dict())  # nn.Linear's keys: the counter stays where it was
    assert fresh.dropout_step == 3 and torch.equal(fresh.weight, linear.weight)


def _model(group: object, seed: int) -> nn.ModuleList:
    return nn.ModuleList(TransformerBlock(D, HEADS, dropout=0.2, seed=seed + 10 * i, group=group) for i in range(2))


def _step(model: nn.ModuleList, opt: torch.optim.Optimizer) -> float:
    opt.zero_grad()
    x = torch.randn(2, 6, D, generator=torch.Generator().manual_seed(1))
    for blk in model:
        x = blk(x)
    loss = x.square().mean()
    loss.backward()
    opt.step()
    return loss.item()


def _state(model: nn.ModuleList, opt: torch.optim.Optimizer) -> dict:
    return {"model": sharded_state_dict(model), "optim": sharded_optimizer_state_dict(model, opt)}


def _whole(model: nn.ModuleList) -> dict[str, torch.Tensor]:
    """The whole parameters, copied (full_state_dict, like state_dict, gives replicated ones as they are)."""
    return {k: v.clone() for k, v in full_state_dict(model).items() if isinstance(v, torch.Tensor)}


def _full_moments(model: nn.ModuleList, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Adam's first moment of every parameter, whole (gathered like the parameters)."""
    saved = {n: p.data.clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(opt.state[p]["exp_avg"])
        moments = _whole(model)
        for n, p in model.named_parameters():
            p.copy_(saved[n])
    return moments


def save_case(rank: int, world_size: int, path: str) -> dict:
    """Train 2 steps at tp = world size, save, then one more step: what a resumed run must reproduce."""
    model = _model(None, seed=1)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    _step(model, opt), _step(model, opt)
    checkpoint.save(path, _state(model, opt))
    saved = {"params": _whole(model), "moments": _full_moments(model, opt)}
    return saved | {"next_loss": _step(model, opt), "after": _whole(model)}


def load_case(rank: int, world_size: int, path: str) -> dict:
    """Another model (other seeds) and optimizer at tp = world size, resumed from the checkpoint, one step."""
    model = _model(None, seed=50)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW | {"lr": 0.0})
    _step(model, opt)  # torch's AdamW creates its state in its first step (lr 0: nothing moves)
    loaded = checkpoint.load(path, _state(model, opt))
    model.load_state_dict(unshard(loaded["model"]))
    opt.load_state_dict(unshard(loaded["optim"]))
    resumed = {"params": _whole(model), "moments": _full_moments(model, opt)}
    return resumed | {"next_loss": _step(model, opt), "after": _whole(model)}


def test_a_checkpoint_saved_at_tp2_resumes_at_tp1_and_tp4_with_the_same_masks(local_world, tmp_path: Path):
    path = str(tmp_path / "step-2")
    saved = local_world(2).run(save_case, path)[0]
    for resumed in (load_case(0, 1, path), local_world(4).run(load_case, path)[0]):
        assert _tensors_equal(saved["params"], resumed["params"]) == []
        assert _tensors_equal(saved["moments"], resumed["moments"]) == []
        assert resumed["next_loss"] == pytest.approx(saved["next_loss"], rel=1e-5)  # same weights, same masks
        assert _tensors_equal(saved["after"], resumed["after"], tol=1e-5) == []
