"""examples/train_gpt_pipeline.py: the tiny GPT at pp 2 x tp 2 on the session's world of 4 ranks, stopped after a
checkpoint and resumed, gives the loss curve of the same model trained in one process with plain torch."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest

from cocoweave.ir.loader import import_module_file

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_gpt_pipeline.py"


@pytest.fixture(scope="module")
def example():
    return import_module_file("cocoweave_example_train_gpt_pipeline", str(SCRIPT))


def test_a_resumed_pipeline_run_trains_the_one_process_curve(example, world4, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    cfg = example.Config(steps=2, tensor_parallel=2, world_size=4, layers=2)
    first = world4.run(example.train_pipeline, asdict(cfg), 2, 4, "1f1b", ckpt, 2)[0]
    assert first["resumed_at"] == 0 and len(first["losses"]) == 2
    cfg.steps = 4
    parallel = world4.run(example.train_pipeline, asdict(cfg), 2, 4, "gpipe", ckpt, 2)[0]
    assert parallel["resumed_at"] == 2  # each stage loaded its part
    result = example.compare(cfg, parallel, {})
    assert len(result["parallel"]) == len(result["reference"]) == 4
    assert result["max_abs_diff"] < 1e-4, result
    assert result["parallel"][-1] < result["parallel"][0]  # it learns
    steps, mbs, samples = 2, 4, cfg.batch // 4  # this run's steps, micro-batches of `samples` sequences
    assert parallel["boundary_bytes"]["forward"] == steps * mbs * samples * cfg.block * cfg.d_model * 4 // 2  # 1/tp


@pytest.mark.parametrize("args,said", [
    (["--pipeline-parallel", "3"], "does not divide the world size 4"),
    (["--microbatches", "3"], "cannot be split into 1 data-parallel replicas of --microbatches 3"),
    (["--microbatches", "0"], "--microbatches must be at least 1, got 0"),
    (["--layers", "1"], "--layers 1 cannot be cut into --pipeline-parallel 2 stages"),
])
def test_a_layout_it_cannot_run_is_one_sentence_and_exit_code_2(example, capsys, args, said):
    assert example.main(args) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1
