"""The terms that lay out today's jobs, each computed by hand on a small case: FP8 linear layers, context
parallelism's ring exchange, expert parallelism's all-to-alls and experts per rank, the data-parallel collective's
latency per bucket at large dp, the share of tensor-parallel traffic a stack overlaps, FlashAttention's backward."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cocoweave.cluster.catalog import GPUSpec, MachineType, NetworkSpec
from cocoweave.cluster.planning.llm.comm import all_to_all_s, collective_s, group_link
from cocoweave.cluster.planning.llm.memory import memory_per_gpu, stage_param_split
from cocoweave.cluster.planning.llm.parallelism import ParallelConfig
from cocoweave.cluster.planning.llm.spec import TransformerSpec
from cocoweave.cluster.planning.llm.step import (
    BUCKET_BYTES,
    cp_comm_layer_s,
    ep_comm_layer_s,
    layer_forward_s,
    predict_step,
    tp_comm_layer_s,
)
from cocoweave.cluster.planning.llm.system import Efficiency, System

GPU = GPUSpec("G", "g", {"float32": 10.0, "bfloat16": 100.0, "float8": 200.0}, 1000.0, 80.0, "s")
NODE = MachineType("node", "G", 10.0, None, 0.0, 60.0, 8, "nvl", "ib")
EFF = Efficiency(gemm_max=1.0, gemm_half=0.0, fp8_max=0.5, elementwise_passes=1.0, memory=1.0, intra=1.0,
                 inter=1.0, flash=1.0)
SYSTEM = System(NODE, GPU, NetworkSpec("nvl", 100.0, 0.0, "s"), NetworkSpec("ib", 10.0, 0.0, "s"), EFF)
SPEC = TransformerSpec(layers=8, hidden=256, heads=8, vocab=1000, seq_len=128, global_batch=32, flash_attention=False)
MOE = SPEC.model_copy(update={"experts": 8, "experts_per_token": 2})


def test_fp8_runs_the_linear_layers_at_the_fp8_rate_and_attention_at_bf16():
    """float8: the linear GEMMs at 200 TFLOP/s x fp8_max 0.5 = the bf16 rate here, so the layer costs the same;
    with fp8_max 1 they take half; attention is unchanged; values stay 2 bytes."""
    cfg = ParallelConfig()
    bf16 = layer_forward_s(SPEC, cfg, SYSTEM)
    fp8 = SPEC.model_copy(update={"dtype": "float8"})
    assert layer_forward_s(fp8, cfg, SYSTEM) == pytest.approx(bf16)
    fast = replace(SYSTEM, eff=replace(EFF, fp8_max=1.0))
    mats, _, attn = layer_forward_s(fp8, cfg, fast)
    assert mats == pytest.approx(bf16[0] / 2) and attn == pytest.approx(bf16[2])
    assert fp8.bytes_per_value == 2
    step = predict_step(fp8, cfg, fast)
    assert step.mfu == pytest.approx(SPEC.model_flops_per_step() / (step.total_s * 100e12))  # vs the 16-bit peak


def test_context_parallel_ring_exposes_what_a_step_takes_beyond_its_block():
    """cp 4 of 128 tokens: each rank sends 2 x 32 x 256 bf16 keys and values (no GQA) three times forward (hidden
    behind a quarter of the attention each) and twice the bytes backward."""
    cfg = ParallelConfig(cp=4)
    kv = 2 * 32 * 256 * 2
    step = collective_s("p2p", kv, 4, group_link(SYSTEM, 4, 1))
    assert step == pytest.approx(kv / 100e9)
    assert cp_comm_layer_s(SPEC, cfg, SYSTEM, 0.0) == pytest.approx(3 * (step + 2 * step))  # nothing to hide behind
    assert cp_comm_layer_s(SPEC, cfg, SYSTEM, 4 * step) == 0.0  # each block as long as its step: all hidden
    assert cp_comm_layer_s(SPEC, cfg, SYSTEM, 2 * step) == pytest.approx(3 * (step / 2 + step))
    # each rank's attention: its 32 queries against all 128 keys, a quarter of the work; matmuls a quarter too
    one, four = layer_forward_s(SPEC, ParallelConfig(), SYSTEM), layer_forward_s(SPEC, cfg, SYSTEM)
    assert four[0] == pytest.approx(one[0] / 4)
    assert memory_per_gpu(SPEC, cfg).activations < memory_per_gpu(SPEC, ParallelConfig()).activations / 3


def test_context_parallel_problems_and_description():
    assert ParallelConfig(cp=3).problems(SPEC, 8) == ["seq_len 128 does not split into 2 x cp 3 chunks"]
    assert "cp4" in ParallelConfig(cp=4).describe() and ParallelConfig(tp=2, cp=4, dp=2).gpus == 16


def test_expert_parallel_all_to_alls_by_hand():
    """8 experts, top-2, ep 4 on one node: four all-to-alls per layer (dispatch and combine, each way) of the
    rank's 128 tokens x 2 x 256 bf16 values; none at ep 1; six with full recomputation."""
    cfg = ParallelConfig(dp=4, ep=4)
    n = 128 * 2 * 256 * 2
    one = all_to_all_s(n, 4, 1, SYSTEM)
    assert one == pytest.approx(3 / 4 * n / 100e9)
    assert ep_comm_layer_s(MOE, cfg, SYSTEM) == pytest.approx(4 * one)
    assert ep_comm_layer_s(MOE, replace(cfg, recompute="full"), SYSTEM) == pytest.approx(6 * one)
    assert ep_comm_layer_s(MOE, replace(cfg, ep=1), SYSTEM) == 0.0
    step = predict_step(MOE, cfg, SYSTEM)
    assert step.ep_comm_s == pytest.approx(8 * 8 * 4 * one)  # m = 8 micro-batches x 8 layers


def test_expert_parallel_holds_experts_over_ep_and_their_rows_grow():
    """At ep 4 a rank holds 2 of the 8 experts' weights; their gradients are reduced over dp / ep ranks; its
    expert GEMMs take the same FLOPs (4x the rows for 1/4 of the experts), so at peak the layer costs the same."""
    dense, experts = stage_param_split(MOE, ParallelConfig(dp=4, ep=4))
    dense1, experts1 = stage_param_split(MOE, ParallelConfig(dp=4))
    assert experts == pytest.approx(experts1 / 4) and dense == pytest.approx(dense1)
    assert experts1 == pytest.approx(8 * MOE.expert_params())
    assert layer_forward_s(MOE, ParallelConfig(dp=4, ep=4), SYSTEM)[0] == \
        pytest.approx(layer_forward_s(MOE, ParallelConfig(dp=4), SYSTEM)[0])
    assert ParallelConfig(dp=2, ep=4).problems(MOE, 8) == ["ep 4 must divide the 8 experts and cp x dp 2"]
    assert ParallelConfig(dp=4, ep=4).problems(MOE, 8) == [] and "ep4" in ParallelConfig(dp=4, ep=4).describe()


def test_data_parallel_latency_grows_with_the_ring_and_the_buckets():
    """The gradient all-reduce runs in 25 MB buckets, each paying the ring's 2 (g - 1) alpha (or the tree's
    2 log2 g alpha, whichever NCCL would pick): at large dp the step stops shrinking as fast as the compute."""
    latency = replace(SYSTEM, inter=NetworkSpec("ib", 10.0, 5.0, "s"))
    wide = SPEC.model_copy(update={"hidden": 2048, "heads": 16, "global_batch": 4096})  # ~1 GB of gradients
    cfg = ParallelConfig(dp=512, dp_overlap=False)
    grads = wide.layers * wide.layer_params() + wide.embedding_params()
    buckets = -(-grads * 2 // BUCKET_BYTES)
    step = predict_step(wide, cfg, latency)
    ring = 2 * 511 * 5e-6 + 2 * 511 / 512 * grads * 2 / buckets / 80e9
    tree = 2 * 9 * 5e-6 + 2 * grads * 2 / buckets / 80e9  # 8 rails x 10 GB/s (the NVLink cap is 100)
    assert step.dp_comm_s == pytest.approx(buckets * min(ring, tree))
    assert step.dp_comm_s > 2 * grads * 2 / 80e9 + buckets * 2 * 9 * 5e-6 * 0.99


def test_the_stack_hides_its_share_of_tensor_parallel_traffic():
    cfg = ParallelConfig(tp=8, sp=True)
    tp = tp_comm_layer_s(SPEC, cfg, SYSTEM)
    mats = layer_forward_s(SPEC, cfg, SYSTEM)[0]
    half = replace(SYSTEM, eff=replace(EFF, tp_overlap=0.5))
    exposed = predict_step(SPEC, replace(cfg, tp_overlap=True), half).tp_comm_s / (8 * 32)  # per layer, micro-batch
    assert exposed == pytest.approx(tp - 0.5 * min(tp, 3 * mats))
    # full recomputation regathers the input: backward does not all-gather it again
    ag = collective_s("all_gather", 128 * 256 * 2, 8, group_link(SYSTEM, 8, 1))
    rs = collective_s("reduce_scatter", 128 * 256 * 2, 8, group_link(SYSTEM, 8, 1))
    assert tp == pytest.approx(4 * (ag + rs) + 2 * ag)
    assert tp_comm_layer_s(SPEC, replace(cfg, recompute="full"), SYSTEM) == pytest.approx(6 * (ag + rs))


def test_flash_attention_backward_is_two_and_a_half_forwards():
    flash = SPEC.model_copy(update={"flash_attention": True})
    cfg = ParallelConfig()
    mats, elementwise, attn = layer_forward_s(flash, cfg, SYSTEM)
    step = predict_step(flash, cfg, SYSTEM)
    assert step.compute_s == pytest.approx(32 * 8 * (3 * (mats + elementwise) + 3.5 * attn))


def test_ulysses_context_parallel_all_to_alls_by_hand():
    """Ulysses at cp 4: per layer an all-to-all of the rank's 32 tokens' queries, keys and values (qkv_out = 768
    values each, bf16) and one of its output (256), forward and again backward; none hidden. It needs the heads
    to split over tp x cp."""
    cfg = ParallelConfig(cp=4, ulysses=True)
    qkv = all_to_all_s(32 * 768 * 2, 4, 1, SYSTEM)
    out = all_to_all_s(32 * 256 * 2, 4, 1, SYSTEM)
    assert qkv == pytest.approx(3 / 4 * 32 * 768 * 2 / 100e9)
    assert cp_comm_layer_s(SPEC, cfg, SYSTEM, 1.0) == pytest.approx(2 * (qkv + out))  # attention hides nothing
    assert cp_comm_layer_s(SPEC, replace(cfg, recompute="full"), SYSTEM, 1.0) == pytest.approx(3 * (qkv + out))
    assert "cp4u" in cfg.describe() and cfg.problems(SPEC, 8) == []
    (why,) = ParallelConfig(tp=4, cp=4, ulysses=True).problems(SPEC, 8)
    assert "split over tp x cp 16" in why


def test_float8_gathers_the_linear_inputs_at_one_byte_a_value():
    """With float8 and sequence parallelism the column-parallel linears' inputs are cast before they are
    all-gathered (TE's FP8 all-gather, torchao's Float8ColwiseParallel): those all-gathers move half the bytes;
    the reduce-scatters and the gradients' all-gathers backward stay 16-bit."""
    n = 128 * 256 * 2  # b s h, 16-bit
    link = group_link(SYSTEM, 8, 1)
    ag, rs = collective_s("all_gather", n, 8, link), collective_s("reduce_scatter", n, 8, link)
    ag8 = 7 / 8 * (n / 2) / 100e9  # 1 byte a value
    fp8 = SPEC.model_copy(update={"dtype": "float8"})
    cfg = ParallelConfig(tp=8, sp=True)
    # forward: 2 AG (fp8) + 2 RS; backward: 2 AG of gradients + 2 RS + the 2 fp8 inputs regathered for wgrad
    assert tp_comm_layer_s(fp8, cfg, SYSTEM) == pytest.approx(2 * (ag8 + rs) + 2 * (ag + rs) + 2 * ag8)
    # full recomputation: forward twice, no regather backward
    assert tp_comm_layer_s(fp8, replace(cfg, recompute="full"), SYSTEM) == pytest.approx(
        2 * 2 * (ag8 + rs) + 2 * (ag + rs))
    # without sequence parallelism the all-reduces carry the 16-bit outputs: float8 changes nothing
    assert tp_comm_layer_s(fp8, ParallelConfig(tp=8), SYSTEM) == tp_comm_layer_s(SPEC, ParallelConfig(tp=8), SYSTEM)


def test_hidden_data_parallel_traffic_drags_the_compute_by_its_fraction():
    """`overlap_drag` d: each second of data-parallel traffic hidden behind the backward still costs d seconds;
    exposed traffic costs what it did."""
    wide = SPEC.model_copy(update={"hidden": 1024})  # 200 MB of gradients: more than one 25 MB bucket
    cfg = ParallelConfig(dp=8, micro_batch=4)
    free = predict_step(wide, cfg, SYSTEM)
    hidden = free.dp_comm_s - free.dp_exposed_s
    assert hidden > 0
    drag = predict_step(wide, cfg, replace(SYSTEM, eff=replace(EFF, overlap_drag=0.25)))
    assert drag.dp_exposed_s == pytest.approx(free.dp_exposed_s + 0.25 * hidden)
    assert drag.total_s - free.total_s == pytest.approx(0.25 * hidden)
    off = replace(cfg, dp_overlap=False)  # nothing hidden: nothing to drag
    assert predict_step(wide, off, replace(SYSTEM, eff=replace(EFF, overlap_drag=0.25))).total_s == \
        pytest.approx(predict_step(wide, off, SYSTEM).total_s)
