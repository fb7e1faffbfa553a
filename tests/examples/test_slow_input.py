"""examples/slow_input.py under `cocoweave profile` (reduced: 3 timed steps, one round): its decoding DataLoader is
named as the bottleneck with its share, its torch.save checkpoints are timed, and `plan --profile` prices
revocations with that measured checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from cocoweave.cli import app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def test_the_slow_loader_is_named_and_its_checkpoints_priced(tmp_path):
    out = tmp_path / "slow.json"
    r = runner.invoke(app, ["profile", str(ROOT / "examples/slow_input.py"), "-n", "1,2", "--rounds", "1",
                            "--steps", "3", "--warmup", "2", "--json", str(out), "--store", str(tmp_path / "store"),
                            "--", "--ckpt-every", "2", "--records", "32"])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert doc["bottleneck"].startswith("input-bound from 1 rank: ranks wait ")
    assert "raise num_workers from 0" in doc["bottleneck"]
    one = doc["io"]["worlds"][0]
    assert one["data_share_pct"] > 50 and one["batches"] == 1 and one["loaders"][0]["num_workers"] == 0
    assert doc["io"]["input_model"]["wait_ms"] > 0
    ckpt = doc["io"]["checkpoint"]
    assert ckpt["operation"] == "torch.save" and ckpt["bytes"] > 1e5 and ckpt["seconds"] > 0
    r = runner.invoke(app, ["plan", "--profile", str(out), "--budget", "100", "--png", str(tmp_path / "p.png")])
    assert r.exit_code == 0, r.output
    assert "MEASURED in the profiled run (torch.save" in r.output
    assert "adds the input pipeline's wait as measured on this host" in r.output  # the loader binds on GPUs too
