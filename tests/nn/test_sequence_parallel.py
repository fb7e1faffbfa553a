"""Sequence parallelism through `parallelize` (torchtitan's plan: norms on sequence slices, one all-gather before
attention and the feed-forward, reduce-scatters after them): at tp 2 and 4 the logits and every parameter's
gradient equal one process's, 20 clipped steps train the single-process curve, torch's parallelize_module takes the
same plan and computes the same logits, and what cannot be split is refused with a sentence."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cocoweave.errors import ParallelConfigError
from cocoweave.ir.loader import import_module_file
from cocoweave.nn import llama_plan, parallelize

_tp = import_module_file("_parallelize_cases", str(Path(__file__).with_name("test_parallelize.py")))
CONFIG, _model, _batch, _train, _reference = _tp.CONFIG, _tp._model, _tp._batch, _tp._train, _tp._reference


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for n, p in model.named_parameters()}


def one_step_case(rank: int, world_size: int, torch_tp: bool = False) -> dict:
    """One forward and backward at tp = the world with torchtitan's sequence-parallel plan: logits, loss, the whole
    gradient of every parameter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    model = _model()
    plan = llama_plan(model, sequence_parallel=True)
    if torch_tp:
        parallelize_module(model, init_device_mesh("cpu", (world_size,)), plan)
    else:
        parallelize(model, None, plan)
    x, y = _batch(0)
    logits = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    return {"logits": logits.detach(), "loss": float(loss.detach()), "grads": {} if torch_tp else _grads(model)}


def _single_process() -> dict:
    model = _model()
    x, y = _batch(0)
    logits = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    return {"logits": logits.detach(), "loss": float(loss.detach()), "grads": _grads(model)}


@pytest.mark.parametrize("world_size", [2, 4])
def test_logits_and_every_gradient_equal_one_process(local_world, world_size):
    ref = _single_process()
    for r in local_world(world_size).run(one_step_case):
        assert (r["logits"] - ref["logits"]).abs().max() < 1e-5
        assert set(r["grads"]) == set(ref["grads"])
        for name, g in ref["grads"].items():  # the norms' gradients are summed over the sequence slices
            assert (r["grads"][name] - g).abs().max() < 1e-5, name


def test_torch_parallelize_module_takes_the_same_plan_and_agrees(local_world):
    ref = _single_process()
    for r in local_world(2).run(one_step_case, True):
        assert (r["logits"] - ref["logits"]).abs().max() < 1e-5


def train_case(rank: int, world_size: int, steps: int) -> list[float]:
    model = _model()
    parallelize(model, None, llama_plan(model, sequence_parallel=True))
    losses, _ = _train(model, torch.optim.AdamW(model.parameters(), lr=_tp.LR), range(steps))
    return losses


def test_twenty_clipped_steps_train_the_single_process_curve(local_world):
    ref, _ = _reference(range(20))
    for losses in local_world(2).run(train_case, 20):
        assert max(abs(a - b) for a, b in zip(losses, ref)) < 1e-5, (losses, ref)


def uneven_case(rank: int, world_size: int) -> str:
    model = _model()
    parallelize(model, None, llama_plan(model, sequence_parallel=True))
    with pytest.raises(ParallelConfigError) as refused:
        model(_batch(0)[0][:, :7])
    return str(refused.value)


def test_a_sequence_that_does_not_split_is_refused_with_a_sentence(local_world):
    for msg in local_world(2).run(uneven_case):
        assert "a sequence of 7 tokens does not split over 2 tensor-parallel ranks" in msg


def test_hugging_face_names_are_refused_for_sequence_parallelism():
    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.o_proj = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = Attn()

    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer()])

    class HF(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()

    with pytest.raises(ParallelConfigError, match="sequence parallelism is planned for torchtitan's module names"):
        llama_plan(HF(), sequence_parallel=True)


def row_to_slices_case(rank: int, world_size: int) -> dict:
    """RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)) on a linear with a bias: this rank's
    sequence slice of the output, and the whole weight's and bias's gradients of the summed loss."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6))
    x = torch.randn(2, 4, 8)
    parallelize(model, None, {"0": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))})
    y = model(x)
    y.pow(2).sum().backward()
    return {"y": y.detach(), "grads": _grads(model)}


def test_a_row_projection_of_a_whole_input_reduce_scatters_into_sequence_slices(local_world):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 6))
    x = torch.randn(2, 4, 8)
    y = ref(x)
    y.pow(2).sum().backward()
    for rank, r in enumerate(local_world(2).run(row_to_slices_case)):
        assert (r["y"] - y.detach()[:, 2 * rank:2 * rank + 2]).abs().max() < 1e-6
        for name, g in _grads(ref).items():  # the bias's gradient summed over the sequence slices
            assert (r["grads"][name] - g).abs().max() < 1e-5, name
