"""examples/train_gpt.py: a few steps of the tiny GPT, data parallel 2 x tensor parallel 2 on the session's
world of 4 ranks, give the loss curve of the same model trained in one process with plain torch."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"


@pytest.fixture(scope="module")
def train_gpt():
    spec = importlib.util.spec_from_file_location("cocoweave_example_train_gpt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_loss_curve_matches_single_process_training(train_gpt, world4, tmp_path):
    cfg = train_gpt.Config(steps=6, tensor_parallel=2, world_size=4)
    result = train_gpt.run_local(cfg, world=world4)
    assert len(result["parallel"]) == len(result["reference"]) == 6
    assert result["max_abs_diff"] < 1e-4, result
    assert result["parallel"][-1] < result["parallel"][0]  # it learns
    plot = train_gpt.write_outputs(result, tmp_path)
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "losses.json").read_text())["config"]["tensor_parallel"] == 2


def test_batches_are_deterministic_next_character_windows(train_gpt):
    cfg = train_gpt.Config(steps=1)
    data = train_gpt.CharData(cfg)
    x0, y0 = data.batch(0)
    assert x0.shape == (cfg.batch, cfg.block) and (x0[:, 1:] == y0[:, :-1]).all()
    assert (train_gpt.CharData(cfg).batch(0)[0] == x0).all()  # every rank draws the same global batch
    assert not (data.batch(1)[0] == x0).all()


def test_bad_layout_is_one_sentence_and_exit_code_2(train_gpt, capsys):
    assert train_gpt.main(["--tensor-parallel", "3"]) == 2  # checked before any rank starts
    assert capsys.readouterr().err.strip() == "error: --tensor-parallel 3 must divide the world size 4"


@pytest.mark.parametrize("args, message", [
    (["--lr-rule", "sqrt"], "learning-rate rule 'sqrt' applies to the scale policy only"),
    (["--tensor-parallel", "1", "--batch", "3"], "a global batch of 3 samples cannot be split over 4 ranks"),
    (["--batch-policy", "scale", "--lr-rule", "adascale"], "--lr-rule adascale needs --tensor-parallel 1"),
    (["--batch-policy", "scale", "--base-world", "3"], "does not split evenly over 3 base ranks"),
    (["--corpus-chars", "20"], "--corpus-chars 20 holds no sample of 33 characters"),
    (["--micro-batch", "0"], "the micro-batch cap must be an integer of at least 1, got 0"),
])
def test_a_batch_policy_it_cannot_use_is_one_sentence_and_exit_code_2(train_gpt, capsys, args, message):
    assert train_gpt.main(args) == 2  # checked before any rank starts
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_a_checkpoint_resumes_only_with_the_batch_policy_it_was_trained_with(train_gpt, local_world, tmp_path):
    from cocoweave.errors import BackendError

    fields = dict(steps=2, tensor_parallel=1, world_size=2, batch=4, corpus_chars=801)
    world = local_world(2)
    world.run(train_gpt.train_parallel, asdict(train_gpt.Config(batch_policy="scale", lr_rule="sqrt", **fields)),
              str(tmp_path), 2)
    with pytest.raises(BackendError, match="were trained with batch policy scale: 2 samples per rank .* not "
                                           "keep_global: 4 samples per step"):
        world.run(train_gpt.train_parallel, asdict(train_gpt.Config(**fields | {"steps": 3})), str(tmp_path), 2)
    with pytest.raises(BackendError, match="trained without AdaScale"):
        world.run(train_gpt.train_parallel,
                  asdict(train_gpt.Config(batch_policy="scale", lr_rule="adascale", **fields | {"steps": 3})),
                  str(tmp_path), 2)


def test_under_torchrun_the_model_goes_on_the_device_init_from_env_returns(train_gpt, monkeypatch):
    """On a GPU host init_from_env picks NCCL, which refuses CPU tensors: the rank's device must reach the model."""
    import torch

    from cocoweave import launch

    class Started(Exception):
        pass

    def train_parallel(*args):
        assert args[-1] == "meta"
        raise Started

    monkeypatch.setattr(launch, "in_torchrun", lambda: True)
    monkeypatch.setattr(launch, "init_from_env", lambda: (0, 4, torch.device("meta")))
    monkeypatch.setattr(train_gpt, "train_parallel", train_parallel)
    with pytest.raises(Started):
        train_gpt.main(["--steps", "1"])


def test_a_checkpoint_saved_at_tp2_resumes_at_tp1_and_tp4_on_the_same_curve(train_gpt, local_world, world4,
                                                                            tmp_path):
    """dp 2 x tp 2 for 2 steps, then from that checkpoint: tp 4 (dp 1) and tp 1 (dp 2) for 2 more; every curve is
    the one-process run's (weights, Adam's moments and the samples' order carried over; masks drawn by step)."""
    import shutil

    fields = dict(batch=8, corpus_chars=2000)
    saved = tmp_path / "tp2"
    first = world4.run(train_gpt.train_parallel, asdict(train_gpt.Config(steps=2, **fields)), str(saved), 2)[0]
    for tp, world in ((4, world4), (1, local_world(2))):
        ckpt = tmp_path / f"tp{tp}"
        shutil.copytree(saved, ckpt)
        cfg = train_gpt.Config(steps=4, tensor_parallel=tp, world_size=world.world_size, **fields)
        resumed = world.run(train_gpt.train_parallel, asdict(cfg), str(ckpt))[0]
        assert resumed["losses"][:2] == first["losses"]  # the first two steps come from the checkpoint
        result = train_gpt.compare(cfg, resumed)
        assert result["max_abs_diff"] < 1e-4, (tp, result)


def test_blocks_running_cocoweave_programs_train_the_same_curve(train_gpt, world4):
    """--schedule auto: every block layer runs its measured schedule of cocoweave programs; dp 2 x tp 2."""
    result = train_gpt.run_local(train_gpt.Config(steps=4, tensor_parallel=2, world_size=4, schedule="auto"),
                                 world=world4)
    assert result["max_abs_diff"] < 1e-4, result
