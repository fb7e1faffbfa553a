"""The validation table: every published run predicted with its stack's shipped constants. The H100 rows held out
of calibration must stay within the bound stated here, and far better than one spec-sheet efficiency; the A100
figures must not get worse; the shipped constants must be what calibration fits."""

from __future__ import annotations

import numpy as np

from cocoweave.cluster.catalog import load_catalog
from cocoweave.cluster.planning.llm.calibrate import calibrate, errors
from cocoweave.cluster.planning.llm.published import (
    foundry_h100_rest_runs,
    h100_runs,
    nemo_long_seq_runs,
    validation_runs,
)
from cocoweave.cluster.planning.llm.system import stack_efficiencies
from cocoweave.cluster.planning.llm.validate import groups, main, table

CATALOG = load_catalog()
# measured 2026-12-05 (`python -m cocoweave.cluster.planning.llm.validate`): H100/H200 held-out 85 rows, mean
# 3.71 %, max 20.88 % (the max torchtitan's cp 8 row), with NeMo 24.03's long-sequence rows and Megatron-core's
# attention refitted on them; before them 81 rows, 3.88 % / 20.88 %; 47 of them 4.13 % / 20.88 % (4.31 % before
# FSDP gathered as its sources do and llm-foundry's SHARD_GRAD_OP rows were priced as such). Before
# Megatron-Bridge's own stack, llm-foundry's 128-512 GPU table and the bandwidth-share drag: 35 rows, 5.00 % /
# 19.91 % (bound 5.5 / 21);
# before FP8 all-gathers, FSDP1's drag and a GEMM rate per H100 kind: 7.46 % / 21.33 %; the same 47 rows before
# Hopper constants 15.22 % / 44.04 %. The bound leaves room for refits, not regressions.
H100_HELD_OUT_MEAN, H100_HELD_OUT_MAX = 3.8, 21.0


def test_h100_held_out_rows_within_the_bound_and_far_better_than_the_spec_sheet():
    runs, after, before = table(CATALOG)
    now = {g.name: g for g in groups(runs, after, CATALOG)}
    then = {g.name: g for g in groups(runs, before, CATALOG)}
    held = now["H100/H200 held-out"]
    assert held.rows >= 85 and {r.stack for r in h100_runs() if r.role == "held-out"} >= {
        "megatron-core-2024", "torchtitan-compile-2024", "llm-foundry-2023"}
    assert held.mean <= H100_HELD_OUT_MEAN and held.max <= H100_HELD_OUT_MAX
    assert held.mean < 0.6 * then["H100/H200 held-out"].mean and held.max < then["H100/H200 held-out"].max
    # Megatron-Bridge's Qwen3-30B-A3B on 16 H100s, seven releases: the four at ep 8 / pp 2 (Megatron's all-to-all
    # dispatcher in 25.11's recipe) run 1.3x-3x slower than predicted, a known gap, bounded, not hidden
    # (docs/planning_llm.md); the three at ep 16 / pp 1 (HybridEP's dispatcher) are within 5 %
    moe = [(r, e) for r, e in zip(runs, after, strict=True) if r.spec.experts > 1]
    assert now["H100/H200 MoE held-out"].rows == len(moe) == 7
    assert all(-67.0 <= e < -25.0 for r, e in moe if r.cfg.ep == 8)
    assert all(abs(e) <= 5.0 for r, e in moe if r.cfg.ep == 16)
    assert now["A100 held-out"].mean <= 3.5 and now["A100 held-out"].max <= 9.0
    assert now["A100 calibration"].mean <= 3.5 and now["A100 calibration"].max <= 9.0


def test_every_h100_row_names_its_source_and_machine():
    for run in h100_runs():
        assert "@" in run.source and run.machine in {m.name for m in CATALOG.machines}
        assert run.cfg.problems(run.spec, 8) == [], run.name
        assert run.role in ("calibration", "held-out")


def test_shipped_constants_are_what_calibration_fits():
    """One more round of coordinate descent from the shipped constants does not lower the calibration rows'
    mean |error| by more than 0.05 points (they are the fit, frozen), and held-out rows play no part in it."""
    runs = validation_runs()
    shipped = stack_efficiencies()
    fit = [r for r in runs if r.role == "calibration"]
    before = np.abs(errors(fit, CATALOG, shipped)).mean()
    refit = calibrate(runs, CATALOG, shipped, rounds=1, points=21)
    assert np.abs(errors(fit, CATALOG, refit)).mean() >= before - 0.05
    moved = calibrate([r for r in runs if r.role == "calibration"], CATALOG, shipped, rounds=1, points=21)
    assert moved == refit


def test_megatron_bridge_releases_alternate_calibration_and_held_out():
    """The rule fixed before the rows were predicted: Megatron-Bridge's dense H100 releases, in order, alternate
    calibration / held-out from 25.09 (so 25.11, held out from the start, stays held out); its MoE rows are all held
    out; its own stack prices them all."""
    from cocoweave.cluster.planning.llm.published import BRIDGE_RELEASES

    bridge = [r for r in h100_runs() if r.name.startswith("Megatron-Bridge")]
    assert len(bridge) == 20 and {r.stack for r in bridge} == {"megatron-bridge-2025"}
    for run in bridge:
        release = run.name.split()[1]
        dense_role = "held-out" if BRIDGE_RELEASES.index(release) % 2 else "calibration"
        assert run.role == ("held-out" if run.spec.experts > 1 else dense_role), run.name
    assert {r.name.split()[1] for r in bridge if r.role == "calibration"} == {"25.09", "26.02", "26.04", "26.06"}


def test_llm_foundry_large_scale_rows_alternate_from_calibration():
    """llm-foundry's 128-512 GPU table, added by the rule of its other table: in its order every second row
    calibrates, the first one first."""
    large = [r for r in h100_runs() if "(large scale)" in r.source]
    assert len(large) == 18 and {r.cfg.gpus for r in large} == {128, 256, 512}
    assert [r.role for r in large] == ["calibration", "held-out"] * 9


def test_llm_foundry_rest_rows_are_held_out_and_within_their_bound():
    """The BF16 table's other 34 rows, added held out by a rule fixed before their errors were seen (measured
    2026-12-05 at their first prediction: mean 3.46 %, max 7.43 %)."""
    rest = foundry_h100_rest_runs()
    assert len(rest) == 34 and {r.role for r in rest} == {"held-out"}
    assert {r.name for r in rest}.isdisjoint(r.name for r in validation_runs() if r.role == "calibration")
    err = np.abs(errors(rest, CATALOG, stack_efficiencies()))
    assert err.mean() <= 4.0 and err.max() <= 8.0


def test_nemo_long_sequence_rows_follow_their_rule_and_their_source():
    """NeMo 24.03.01's LLAMA2-7B rows, 4K to 1M tokens: 4M tokens a step on as many GPUs as K tokens, the layout's
    degrees filling them, and the rule fixed before they were predicted: by sequence length every second row
    calibrates, 4K first (cp 2, 8, 32 calibrate; cp 2, 4, 16 held out)."""
    rows = nemo_long_seq_runs()
    assert [r.spec.seq_len // 1024 for r in rows] == [4 << i for i in range(9)]
    assert all(r.spec.seq_len * r.spec.global_batch == 4 << 20 and r.cfg.gpus == r.spec.seq_len // 1024
               for r in rows)
    assert [r.role for r in rows] == ["calibration", "held-out"] * 4 + ["calibration"]
    assert [r.cfg.cp for r in rows if r.role == "held-out"] == [1, 2, 4, 16]
    assert {r.stack for r in rows} == {"megatron-core-2024"} and all(r in validation_runs() for r in rows)


def test_nemo_flops_per_token_is_the_formula_of_nemo_s_own_columns():
    """NeMo 24.07's summary publishes tokens/s and model TFLOP/s of the same runs (@070a0bb1: LLAMA2-7B at 4K, 16847
    and 776; LLAMA3-8B at 8K, 12036 and 697): their ratio is the FLOPs a token NeMo counts, full s x s attention
    included, which converts the long-sequence table's TFLOP/s into step seconds."""
    from cocoweave.cluster.planning.llm.published import _nemo_spec, nemo_flops_per_token

    for model, seq, tokens_s, tflops in (("LLAMA2-7B", 4096, 16847, 776), ("LLAMA3-8B", 8192, 12036, 697)):
        ours = nemo_flops_per_token(_nemo_spec(model, seq, 128))
        assert abs(ours / (tflops * 1e12 / tokens_s) - 1) < 0.002, model


def test_megatron_ring_rows_held_out_within_their_bound():
    """Megatron-core's ring at cp 2, 4 and 16 (NeMo 24.03's held-out long-sequence rows, 32K-512K tokens) with no
    context-parallel term beyond the exposed ring transfer (measured 2026-12-05: -1.3 %, -0.4 %, +2.0 %; with the
    4K-cp 1 row, mean 1.72 %, max 3.22 %)."""
    held = [r for r in nemo_long_seq_runs() if r.role == "held-out"]
    err = np.abs(errors(held, CATALOG, stack_efficiencies()))
    assert err.mean() <= 2.0 and err.max() <= 3.5, err


def test_the_command_prints_the_groups(capsys):
    main([])
    out = capsys.readouterr().out
    assert "H100/H200 held-out" in out and "before, one spec-sheet efficiency" in out and "NeMo 24.07" in out
    assert "llm-foundry added rows    34 rows" in out and "H100/H200 held-out + MoE  92 rows" in out


def test_a_data_parallel_scaling_series_grows_as_measured():
    """DGX Cloud's GPT-3 175B on 128 to 2048 H100s (dp 4 to 64, the same work per pipeline): the measured step grows
    2.2 % (BF16) and 5.9 % (FP8); the predicted one must grow too, by within 3 points of that, never shrink."""
    from cocoweave.cluster.planning.llm.published import DGXC_175B

    runs, after, _ = table(CATALOG)
    for dtype, series in DGXC_175B:
        rows = [(r, e) for r, e in zip(runs, after, strict=True) if r.name.startswith("DGX Cloud")
                and r.spec.dtype == dtype]
        assert [r.cfg.gpus for r, _ in rows] == [g for g, _ in series]
        predicted = [r.time_s * (1 + e / 100) for r, e in rows]
        measured_growth = series[-1][1] / series[0][1] - 1
        predicted_growth = predicted[-1] / predicted[0] - 1
        assert all(b >= a for a, b in zip(predicted, predicted[1:], strict=False))
        assert abs(predicted_growth - measured_growth) <= 0.03, (dtype, predicted_growth, measured_growth)
