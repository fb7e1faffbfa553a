"""`cocoweave plan --llm` in one command, and typo'd planner inputs refused with one sentence and exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from cocoweave.cli.cluster_commands import plan_command
from cocoweave.cluster.catalog import DEFAULT_CATALOG

ROOT = Path(__file__).resolve().parents[4]
app = typer.Typer()
app.command("plan")(plan_command)
app.command("other")(lambda: None)
runner = CliRunner()
SPEC = "name: tiny\nlayers: 4\nhidden: 512\nheads: 8\nvocab: 32000\nseq_len: 1024\nglobal_batch: 64\n"


def _small_catalog(tmp_path: Path, **typo) -> Path:
    doc = yaml.safe_load(DEFAULT_CATALOG.read_text())
    doc["machines"] = [m for m in doc["machines"] if m["name"] in ("dgx-a100-80gb", "dgx-h100")]
    doc["machines"][0] |= typo
    path = tmp_path / "cat.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_plan_llm_recommends_a_layout(tmp_path):
    spec = tmp_path / "m.yaml"
    spec.write_text(SPEC)
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    result = runner.invoke(app, ["plan", "--llm", str(spec), "--tokens", "1e10", "--budget", "5000", "--catalog",
                                 str(_small_catalog(tmp_path)), "--max-gpus", "64", "--json", str(out),
                                 "--png", str(png)])
    assert result.exit_code == 0, result.output
    assert png.stat().st_size > 0
    doc = json.loads(out.read_text())
    best = doc["recommended"]
    assert best["parameter_servers"] == 0 and best["cost_usd"] <= 5000
    lay = best["layout"]
    assert lay["tp"] * lay["cp"] * lay["pp"] * lay["dp"] == best["workers"] and lay["ep"] == 1
    assert best["memory_per_gpu_bytes"] < 80e9 and 0 < best["mfu"] < 1


def test_hugging_face_config_plans_too(tmp_path):
    result = runner.invoke(app, ["plan", "--llm", str(ROOT / "examples/llm/llama3-8b-config.json"), "--tokens",
                                 "1e11", "--deadline", "1000", "--catalog", str(_small_catalog(tmp_path)),
                                 "--max-gpus", "64", "--json", "-"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["llm"]["kv_heads"] == 8


def test_typos_exit_2_with_the_key_and_the_allowed_keys(tmp_path):
    spec = tmp_path / "m.yaml"
    spec.write_text(SPEC + "tensor_parallel: 8\n")
    result = runner.invoke(app, ["plan", "--llm", str(spec), "--tokens", "1e10", "--budget", "100"])
    assert result.exit_code == 2
    assert "unknown key 'tensor_parallel'" in result.output and "allowed keys: name, layers" in result.output
    typo = _small_catalog(tmp_path, gpus_per_nod=8)
    result = runner.invoke(app, ["plan", "--model", "resnet-32", "--catalog", str(typo), "--budget", "100",
                                 "--steps", "1000"])
    assert result.exit_code == 2
    assert "machines[0]: unknown key 'gpus_per_nod'" in result.output and "gpus_per_node" in result.output
    profile = tmp_path / "p.yaml"
    profile.write_text("name: w\ncheckpoint_s: 5\nparameter_server: 1\nstep_time_s: {P100: {1: 0.2}}\n")
    result = runner.invoke(app, ["plan", "--profile", str(profile), "--steps", "10", "--budget", "100"])
    assert result.exit_code == 2
    assert "unknown key 'parameter_server'" in result.output and "parameter_servers" in result.output


def test_a_profile_without_parameter_servers_is_billed_none(tmp_path):
    profile = tmp_path / "p.yaml"
    profile.write_text("name: w\ncheckpoint_s: 5\nparameter_servers: 0\nstep_time_s: {H100: {8: 0.5, 16: 0.3}}\n")
    result = runner.invoke(app, ["plan", "--profile", str(profile), "--steps", "1000", "--deadline", "10",
                                 "--catalog", str(_small_catalog(tmp_path)), "--json", "-"])
    assert result.exit_code == 0, result.output
    best = json.loads(result.stdout)["recommended"]
    assert best["parameter_servers"] == 0
    assert best["cost_usd"] == pytest.approx(best["hours"] * best["nodes"] * (98.32 if best["pricing"] == "on-demand"
                                                                              else 34.41))


def test_a_billion_layers_are_refused_in_one_sentence_not_searched(tmp_path, returns_within):
    """#50 item 4: these inputs ran the search for minutes; now refused at once, naming the field and its limit.
    The modules `plan --llm` imports lazily are imported first, so the bound is on the call, not on cold imports."""
    import cocoweave.cluster.planning.checkpoint_model  # noqa: F401
    import cocoweave.cluster.planning.llm.plan  # noqa: F401

    spec = tmp_path / "m.yaml"
    spec.write_text(SPEC.replace("layers: 4", "layers: 1000000000"))
    result = returns_within(lambda: runner.invoke(app, ["plan", "--llm", str(spec), "--tokens", "1e10", "--budget",
                                                        "100", "--catalog", str(_small_catalog(tmp_path))]))
    assert result.exit_code == 2 and "'layers'" in result.output and "10000" in result.output


def test_a_gpu_bound_past_any_cluster_is_refused_before_any_work(tmp_path, returns_within, monkeypatch):
    """#50 item 4's other half: --max-gpus 10^12 is one sentence before the checkpoint model is fitted (which took
    over 60 s on a loaded host before the refusal came)."""
    import cocoweave.cluster.planning.checkpoint_model as checkpoint_model

    def fitted(*args, **kwargs):
        raise AssertionError("the checkpoint model was fitted before --max-gpus was checked")

    monkeypatch.setattr(checkpoint_model, "fit_checkpoint_model", fitted)
    spec = tmp_path / "m.yaml"
    spec.write_text(SPEC)
    result = returns_within(lambda: runner.invoke(app, ["plan", "--llm", str(spec), "--tokens", "1e10", "--budget",
                                                        "100", "--catalog", str(_small_catalog(tmp_path)),
                                                        "--max-gpus", str(10**12)]), 10.0)
    assert result.exit_code == 2 and "--max-gpus" in result.output and "1,048,576" in result.output


MOE = ("name: tiny-moe\nlayers: 4\nhidden: 512\nheads: 8\nvocab: 32000\nseq_len: 1024\nglobal_batch: 64\n"
       "experts: 8\nexperts_per_token: 2\ngated_mlp: true\n")


def test_an_moe_is_laid_out_with_its_expert_parallel_degree(tmp_path):
    """#47 item 6: the spec's expert_parallel is the ep of every layout planned, priced with its all-to-alls."""
    spec = tmp_path / "moe.yaml"
    spec.write_text(MOE + "expert_parallel: 4\n")
    result = runner.invoke(app, ["plan", "--llm", str(spec), "--tokens", "1e10", "--budget", "5000", "--catalog",
                                 str(_small_catalog(tmp_path)), "--max-gpus", "32", "--json", "-"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    best = doc["recommended"]
    assert best["layout"]["ep"] == 4 and best["terms_s"]["ep all-to-all"] > 0
    assert all(o["layout"]["ep"] == 4 for o in doc["pareto_front"])


@pytest.mark.parametrize("extra, words", [
    ("expert_parallel: 3\n", "expert_parallel 3 does not divide experts 8"),
    ("expert_parallel: 0\n", "'expert_parallel'"),
    ("expert_paralel: 2\n", "unknown key 'expert_paralel'"),
    ("context_parallel: 3\n", "context_parallel 3 needs seq_len 1024"),
    ("context_parallel: true\n", "'context_parallel'"),
    ("head_dim: 0\n", "'head_dim'"),
    ("head_dim: 64.5\n", "'head_dim'"),
])
def test_bad_expert_or_context_parallel_degrees_exit_2_in_one_sentence(tmp_path, extra, words):
    spec = tmp_path / "moe.yaml"
    spec.write_text(MOE + extra)
    result = runner.invoke(app, ["plan", "--llm", str(spec), "--tokens", "1e10", "--budget", "100"])
    assert result.exit_code == 2, result.output
    assert words in result.output and "Traceback" not in result.output
