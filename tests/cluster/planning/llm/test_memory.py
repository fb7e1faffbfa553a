"""Memory per GPU: Korthikanti et al.'s activation formulas, ZeRO sharding and the pipeline's in-flight factor,
computed by hand on a small model."""

from __future__ import annotations

import pytest

from cocoweave.cluster.planning.llm.memory import (
    OPTIMIZER_BYTES,
    activation_bytes,
    in_flight_factor,
    layer_activation_bytes,
    memory_per_gpu,
    stage_params,
)
from cocoweave.cluster.planning.llm.parallelism import ParallelConfig
from cocoweave.cluster.planning.llm.spec import TransformerSpec

SPEC = TransformerSpec(layers=8, hidden=256, heads=8, vocab=1000, seq_len=128, global_batch=32, dtype="float16",
                       flash_attention=False)
S, H, A = 128, 256, 8


def test_korthikanti_table2_per_layer():
    sbh = S * 2 * H  # micro-batch 2
    scores = 5 * A * S / H
    cases = {ParallelConfig(tp=4, micro_batch=2): sbh * (10 + 24 / 4 + scores / 4),
             ParallelConfig(tp=4, micro_batch=2, sp=True): sbh * (34 / 4 + scores / 4),
             ParallelConfig(tp=4, micro_batch=2, recompute="selective"): sbh * (10 + 24 / 4),
             ParallelConfig(tp=4, micro_batch=2, sp=True, recompute="selective"): sbh * 34 / 4,
             ParallelConfig(tp=4, micro_batch=2, recompute="full"): 2 * sbh,
             ParallelConfig(micro_batch=2): sbh * (34 + scores)}
    for cfg, expected in cases.items():
        assert layer_activation_bytes(SPEC, cfg) == pytest.approx(expected), cfg.describe()


def test_flash_attention_keeps_no_scores():
    flash = SPEC.model_copy(update={"flash_attention": True})
    cfg = ParallelConfig(tp=2)
    assert layer_activation_bytes(flash, cfg) == pytest.approx(S * H * (10 + 24 / 2))


def test_pipeline_in_flight_and_stage_total():
    assert in_flight_factor(ParallelConfig(pp=4)) == 4  # 1F1B: pp micro-batches on the first stage
    assert in_flight_factor(ParallelConfig(pp=4, vp=2)) == pytest.approx(4 * (1 + 3 / 8))
    cfg = ParallelConfig(tp=2, pp=4, dp=1, sp=True, recompute="selective")
    per_layer = S * H * 34 / 2
    embedding = 2 * S * H / 2 * 4
    assert activation_bytes(SPEC, cfg) == pytest.approx(per_layer * 8 / 4 * 4 + embedding)


def test_zero_stages_shard_their_parts():
    params = stage_params(SPEC, ParallelConfig(tp=2, pp=2, dp=4))
    assert params == pytest.approx((SPEC.layer_params() * 4 + 1000 * 256) / 2)
    for zero, (w, g, o) in {0: (1, 1, 1), 1: (1, 1, 4), 2: (1, 4, 4), 3: (4, 4, 4)}.items():
        m = memory_per_gpu(SPEC, ParallelConfig(tp=2, pp=2, dp=4, zero=zero))
        assert (m.weights, m.gradients, m.optimizer) == pytest.approx(
            (params * 2 / w, params * 2 / g, params * OPTIMIZER_BYTES / o)), zero


def test_uneven_stages_hold_the_most_on_the_stage_with_most_layers_times_micro_batches():
    """Stage i of a 1F1B pipeline holds pp - i micro-batches of its layers: with (1, 4, 2, 1) the second stage's
    4 x 3 = 12 layer-micro-batches beat the first's 1 x 4; its weights (4 layers) beat the first's 1 + embedding."""
    spec = SPEC.model_copy(update={"vocab": 8})
    cfg = ParallelConfig(pp=4, dp=1, stages=(1, 4, 2, 1))
    per_layer = layer_activation_bytes(spec, cfg)
    embedding = 2 * S * H * 4  # the embedding's output, for pp micro-batches in flight
    assert activation_bytes(spec, cfg) == pytest.approx(12 * per_layer + embedding)
    assert stage_params(spec, cfg) == 4 * spec.layer_params()
    even = ParallelConfig(pp=4, dp=1)
    assert activation_bytes(spec, even) == pytest.approx(2 * 4 * per_layer + embedding)
    assert stage_params(spec, even) == 2 * spec.layer_params() + 8 * H
