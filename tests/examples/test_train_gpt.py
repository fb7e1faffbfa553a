"""examples/train_gpt.py: a few steps of the tiny GPT, data parallel 2 x tensor parallel 2 on the session's
world of 4 ranks, give the loss curve of the same model trained in one process with plain torch."""

from __future__ import annotations

import importlib.util
import json
import sys
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
