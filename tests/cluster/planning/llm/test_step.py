"""The step model term by term on small cases computed by hand, and its error on the published runs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from cocoweave.cluster.catalog import GPUSpec, MachineType, NetworkSpec, load_catalog
from cocoweave.cluster.planning.llm.calibrate import errors
from cocoweave.cluster.planning.llm.memory import stage_param_split
from cocoweave.cluster.planning.llm.parallelism import ParallelConfig
from cocoweave.cluster.planning.llm.published import published_runs
from cocoweave.cluster.planning.llm.spec import TransformerSpec
from cocoweave.cluster.planning.llm.step import (
    dp_exposed_s,
    layer_forward_s,
    p2p_micro_s,
    predict_step,
    tp_comm_layer_s,
)
from cocoweave.cluster.planning.llm.system import STACKS, Efficiency, System, system_for

GPU = GPUSpec("G", "g", {"float32": 10.0, "bfloat16": 100.0}, 1000.0, 80.0, "s")
NODE = MachineType("node", "G", 10.0, None, 0.0, 60.0, 8, "nvl", "ib")
# ideal hardware: every GEMM at peak (gemm_half 0), HBM and links at their figures, no latency
EFF = Efficiency(gemm_max=1.0, gemm_half=0.0, elementwise_passes=1.0, memory=1.0, intra=1.0, inter=1.0, flash=1.0)
SYSTEM = System(NODE, GPU, NetworkSpec("nvl", 100.0, 0.0, "s"), NetworkSpec("ib", 10.0, 0.0, "s"), EFF)
SPEC = TransformerSpec(layers=8, hidden=256, heads=8, vocab=1000, seq_len=128, global_batch=32,
                       flash_attention=False)


def test_layer_forward_is_flops_over_peak_plus_bytes_over_bandwidth():
    cfg = ParallelConfig(tp=2, micro_batch=2)
    mats, elementwise, attn = layer_forward_s(SPEC, cfg, SYSTEM)
    b, s, h = 2, 128, 256
    scores = 5 * 8 * s * s * b / 2 / 1000e9  # softmax, dropout: Korthikanti's 5 a s^2 b bytes, one pass
    assert mats + attn == pytest.approx((24 * b * s * h * h + 4 * b * s * s * h) / 2 / 100e12 + scores)
    assert elementwise == pytest.approx(s * b * h * (10 + 24 / 2) / 1000e9)
    assert attn - (4 * b * s * s * h / 2 / 100e12) == pytest.approx(scores)


def test_tp_collectives_by_hand():
    n = 2 * 128 * 256 * 2  # b s h bf16 bytes
    ar = 2 * 7 / 8 * n / 100e9
    assert tp_comm_layer_s(SPEC, ParallelConfig(tp=8, micro_batch=2), SYSTEM) == pytest.approx(4 * ar)
    assert tp_comm_layer_s(SPEC, ParallelConfig(tp=8, micro_batch=2, recompute="full"), SYSTEM) == \
        pytest.approx(6 * ar)
    half = 7 / 8 * n / 100e9  # SP: 2 AG + 2 RS each way, and 2 AG redone backward
    assert tp_comm_layer_s(SPEC, ParallelConfig(tp=8, micro_batch=2, sp=True), SYSTEM) == pytest.approx(10 * half)


def test_pipeline_p2p_sends_a_tp_slice_and_regathers():
    cfg = ParallelConfig(tp=8, pp=4, dp=1, vp=2)
    n = 128 * 256 * 2
    one = n / 8 / 10e9 + 7 / 8 * n / 100e9  # 1/tp over InfiniBand (stages in different nodes), all-gather on NVLink
    assert p2p_micro_s(SPEC, cfg, SYSTEM) == pytest.approx(2 * 2 * one)


def test_bubble_is_pp_minus_one_over_m_v_of_a_stage():
    cfg = ParallelConfig(pp=4, dp=1, vp=2, micro_batch=1)  # m = 32 micro-batches
    step = predict_step(SPEC.model_copy(update={"vocab": 8}), cfg, SYSTEM)  # tiny logits: stages nearly equal
    per_micro = (step.pipeline_s - step.bubble_s) / 32
    # the bubble is (pp - 1) / vp mean stages; the mean stage is within the slowest one (logits on the last)
    assert step.bubble_s == pytest.approx(3 / 2 * per_micro, rel=0.01)
    assert step.bubble_s / (step.pipeline_s - step.bubble_s) == pytest.approx(3 / (32 * 2), rel=0.01)


def test_data_parallel_overlap_and_tp_overlap():
    cfg = ParallelConfig(dp=8, micro_batch=4)
    wide = SPEC.model_copy(update={"hidden": 1024})  # 200 MB of gradients: more than one 25 MB bucket
    hidden = predict_step(wide, cfg, SYSTEM)
    exposed = predict_step(wide, replace(cfg, dp_overlap=False), SYSTEM)
    assert exposed.dp_exposed_s == pytest.approx(exposed.dp_comm_s)
    assert hidden.dp_exposed_s < exposed.dp_exposed_s
    assert exposed.total_s - hidden.total_s == pytest.approx(exposed.dp_exposed_s - hidden.dp_exposed_s)
    tp = ParallelConfig(tp=8)
    assert predict_step(SPEC, replace(tp, tp_overlap=True), SYSTEM).tp_comm_s < predict_step(SPEC, tp, SYSTEM).tp_comm_s


def test_overlap_drag_prices_the_bytes_moved_not_the_latency_waited():
    """DDP's all-reduce in 25 MB buckets on 8 GPUs of one node (100 GB/s, 5 us a message step): a ring bucket takes
    14 alpha + 2 x 7/8 x bytes / B; every bucket but the last hides behind the backward and costs `overlap_drag` of
    its bandwidth seconds only (1.75 x bytes / B each), the last one is exposed whole."""
    system = replace(SYSTEM, intra=NetworkSpec("nvl", 100.0, 5.0, "s"), eff=replace(EFF, overlap_drag=0.5))
    wide = SPEC.model_copy(update={"hidden": 1024})
    cfg = ParallelConfig(dp=8)
    nbytes = stage_param_split(wide, cfg)[0] * 2
    buckets = -(-nbytes // 25e6)
    bandwidth = 1.75 * nbytes / buckets / 100e9
    total, exposed, algo = dp_exposed_s(wide, cfg, system, window_bwd=1e3, window_fwd=0.0, pipeline=0.0)
    assert algo == "ring" and buckets == 9
    assert total == pytest.approx(buckets * (14 * 5e-6 + bandwidth))
    assert exposed == pytest.approx(14 * 5e-6 + bandwidth + 0.5 * (buckets - 1) * bandwidth)


def test_fsdp_gathers_twice_per_micro_batch_full_recomputation_included():
    """FSDP by hand on 8 GPUs of one node (100 GB/s, no latency): per micro-batch every layer's weights are
    all-gathered for the forward and again for the backward (7/8 x bytes / B each on a ring) and its gradients
    reduce-scattered; full recomputation adds no third gather, since both stacks that run it (torchtitan's FSDP2,
    Composer's FSDP1) wrap the checkpointed block inside the FSDP unit, so the recomputed forward runs on the
    parameters the backward has just gathered."""
    cfg = ParallelConfig(dp=8, zero=3, grad_bytes=4)
    params = stage_param_split(SPEC, cfg)[0]
    m = SPEC.global_batch // 8
    by_hand = m * (2 * 7 / 8 * 2 * params + 7 / 8 * 4 * params) / 100e9
    for recompute in ("none", "full"):
        step = predict_step(SPEC, replace(cfg, recompute=recompute), SYSTEM)
        assert step.dp_comm_s == pytest.approx(by_hand), recompute
    # FSDP1's SHARD_GRAD_OP (reshard False): the forward's gather serves the backward, the weights stay whole
    kept = predict_step(SPEC, replace(cfg, reshard=False), SYSTEM)
    assert kept.dp_comm_s == pytest.approx(m * (7 / 8 * 2 * params + 7 / 8 * 4 * params) / 100e9)
    assert kept.memory.weights == pytest.approx(2 * params) and step.memory.weights == pytest.approx(2 * params / 8)
    assert ParallelConfig(dp=8, zero=1, reshard=False).problems(SPEC, 8)


def test_recomputation_costs_a_forward_or_the_attention_core():
    base = predict_step(SPEC, ParallelConfig(), SYSTEM)
    full = predict_step(SPEC, ParallelConfig(recompute="full"), SYSTEM)
    sel = predict_step(SPEC, ParallelConfig(recompute="selective"), SYSTEM)
    assert full.compute_s == pytest.approx(base.compute_s * 4 / 3)
    assert base.compute_s < sel.compute_s < full.compute_s


def test_block_recomputation_adds_those_layers_forward_per_micro_batch():
    """Megatron's recompute_method=block (Megatron-Bridge's H100 Llama 3 8B recipe recomputes 5 layers): k layers of
    each stage run their forward again; by hand, one layer's forward at b 1, s 128, h 256 on the ideal GPU is its
    GEMMs (24 b s h^2 + 4 b s^2 h FLOPs at 100 TFLOP/s), softmax and dropout (5 a s^2 b bytes) and the stored
    activations (s b h x 34 bytes) at 1000 GB/s; 32 micro-batches."""
    b, s, h = 1, 128, 256
    fwd = (24 * b * s * h * h + 4 * b * s * s * h) / 100e12 + (5 * 8 * s * s * b + s * b * h * 34) / 1000e9
    base = predict_step(SPEC, ParallelConfig(), SYSTEM)
    three = predict_step(SPEC, ParallelConfig(recompute_layers=3), SYSTEM)
    assert three.total_s - base.total_s == pytest.approx(32 * 3 * fwd)
    assert three.compute_s - base.compute_s == pytest.approx(32 * 3 * fwd)
    # every layer recomputed this way is full recomputation
    every = predict_step(SPEC, ParallelConfig(recompute_layers=8), SYSTEM)
    assert every.total_s == pytest.approx(predict_step(SPEC, ParallelConfig(recompute="full"), SYSTEM).total_s)
    assert ParallelConfig(recompute="full", recompute_layers=3).problems(SPEC, 8)
    assert ParallelConfig(pp=2, recompute_layers=5).problems(SPEC, 8)  # 4 layers a stage


def test_published_runs_within_the_bar():
    runs = published_runs()
    errs = np.abs(errors(runs, load_catalog(), {k: v.eff for k, v in STACKS.items()}))
    held = np.array([r.role == "held-out" for r in runs])
    assert errs.mean() <= 3.5 and errs.max() <= 9.0
    assert errs[held].mean() <= 3.5 and errs[held].max() <= 9.0
    assert held.sum() >= 10


def test_uneven_stages_the_pipeline_waits_for_the_longest():
    """Same layers, same mean stage: moving one more layer into the longest middle stage, (1, 3, 3, 1) -> (1, 4, 2, 1),
    adds m x one layer's forward + backward to the pipeline; the bubble (its mean stage) is unchanged. The even split
    (2, 2, 2, 2) is faster than both."""
    spec = SPEC.model_copy(update={"vocab": 8})
    even = predict_step(spec, ParallelConfig(pp=4, dp=1), SYSTEM)
    three = predict_step(spec, ParallelConfig(pp=4, dp=1, stages=(1, 3, 3, 1)), SYSTEM)
    four = predict_step(spec, ParallelConfig(pp=4, dp=1, stages=(1, 4, 2, 1)), SYSTEM)
    layer = 3 * sum(layer_forward_s(spec, ParallelConfig(pp=4, dp=1), SYSTEM))  # forward + backward (2x)
    assert four.bubble_s == pytest.approx(three.bubble_s) and three.bubble_s == pytest.approx(even.bubble_s)
    assert four.pipeline_s - three.pipeline_s == pytest.approx(32 * layer)  # m = 32 micro-batches
    assert even.pipeline_s < three.pipeline_s


def test_llama3_405b_on_16384_h100_tp8_pp16_uneven_dp128_is_described_and_predicted():
    """#48: Llama 3 405B's 126 layers on 16 stages (7, 8 x 14, 7) with tp 8 x dp 128, 16M-token batches of 8K
    sequences, on H100 nodes with 400 Gb/s RoCE: a layout the planner describes, prices and sizes."""
    catalog = load_catalog()
    machine = next(m for m in catalog.machines if m.name == "h100-roce-8x")
    system = system_for(machine, catalog, STACKS["megatron-2022"].eff)
    spec = TransformerSpec(name="Llama 3 405B", layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248,
                           gated_mlp=True, vocab=128256, seq_len=8192, global_batch=2048)
    cfg = ParallelConfig(tp=8, pp=16, dp=128, zero=1, sp=True, recompute="full")
    assert cfg.gpus == 16384 and cfg.problems(spec, 8) == []
    assert cfg.stage_layers(spec) == (7,) + (8,) * 14 + (7,)
    step = predict_step(spec, cfg, system)
    assert step.memory.total < 80e9
    tokens_s = spec.tokens_per_step() / step.total_s
    assert 0.2 < step.mfu < 0.8 and tokens_s > 1e6  # a plausible step, not a number fitted to anything
