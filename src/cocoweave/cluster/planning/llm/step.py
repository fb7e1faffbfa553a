"""Predicted time of one training step of a transformer under one layout on one machine type.

Per layer and micro-batch, on one GPU of a tp group: every matmul at its own shape's efficiency (`Efficiency`);
the elementwise work (LayerNorm, dropout, residual, activation, softmax) as passes over the bytes Korthikanti's
count stores (memory-bound); backward twice the forward; recomputation adds a forward (full) or the attention core
(selective). With float8 the linear layers' GEMMs run at the FP8 peak times the stack's `fp8_max`; attention stays
16-bit, except that the linear layers' inputs are all-gathered already cast (1 byte a value). Tensor-parallel
collectives on the tp group's link, exposed unless the stack overlaps them (then the fraction `tp_overlap` of them,
up to the GEMMs' time, is hidden). Context parallelism: each rank computes its
s / cp queries against all keys, the keys and values going around the cp ring in cp - 1 steps, each hidden behind
one block of attention (Megatron's ring attention); only what a step takes beyond its block is exposed. Experts:
grouped GEMMs over the rows each local expert receives, and with ep > 1 two all-to-alls (dispatch, combine) each
way on the ep group's link, exposed. A stage
runs its layers, sends and receives its boundary activations (1/tp of them with the scatter-gather optimisation),
and the first and last stages also the embedding and the logits; stages may hold unequal layers (`split_layers`
or a stated split). The 1F1B pipeline takes m x the slowest stage plus
the bubble (pp - 1) / vp x the mean stage (Narayanan et al. SC'21, sec. 2.2). Data-parallel gradient traffic on the
dp x cp group's link (experts': over the cp x dp / ep ranks that replicate them), in buckets that each pay the
collective's latency (2 (g - 1) alpha for a ring, 2 log2(g) alpha for a tree: at thousands of ranks this is what a
large data-parallel step adds), overlapped with the last micro-batch's backward where the framework does so (and
ZeRO's parameter all-gather with the next forward where the stack does that), each hidden second still costing
`overlap_drag` of a second of compute times the share of it spent moving bytes (not waiting out latency); then the
optimizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cocoweave.cluster.planning.llm.comm import Link, all_to_all_s, collective_s, group_link, priced
from cocoweave.cluster.planning.llm.memory import (
    MemoryBreakdown,
    layer_activation_bytes,
    memory_per_gpu,
    stage_param_split,
)
from cocoweave.cluster.planning.llm.parallelism import ParallelConfig
from cocoweave.cluster.planning.llm.spec import TransformerSpec
from cocoweave.cluster.planning.llm.system import System

BUCKET_BYTES = 25e6  # DDP's default gradient bucket: the last one cannot overlap the backward


@dataclass(frozen=True)
class StepBreakdown:
    """One step's predicted seconds, by term, on the busiest GPU; with memory and utilisation."""

    total_s: float
    pipeline_s: float  # all micro-batches through the pipeline, bubble included
    bubble_s: float
    compute_s: float  # matmuls + elementwise per step on the slowest stage (recomputation included)
    tp_comm_s: float  # exposed tensor-parallel collectives per step
    cp_comm_s: float  # exposed context-parallel key/value exchange per step
    ep_comm_s: float  # expert-parallel all-to-alls per step
    pp_comm_s: float  # point-to-point per step on the critical path
    dp_comm_s: float  # data-parallel traffic (all of it)
    dp_exposed_s: float  # the part not hidden behind backward
    optimizer_s: float
    mfu: float  # model FLOPs (no recomputation) / (time x GPUs x 16-bit peak)
    memory: MemoryBreakdown
    notes: tuple[str, ...] = field(default=())


class _Gemm:
    """Matmul time at its shape's efficiency; with float8, linear layers at the FP8 peak and `fp8_max`."""

    def __init__(self, system: System, dtype: str):
        self.peak = sixteen_bit_peak(system, dtype)
        self.fp8_peak = system.peak_flops("float8") * system.eff.fp8_max if dtype == "float8" else None
        self.eff = system.eff

    def __call__(self, m: float, n: float, k: float, batch: float = 1.0, linear: bool = False) -> float:
        d = min(m, n, k)
        shape = d / (d + self.eff.gemm_half)
        rate = self.fp8_peak if linear and self.fp8_peak else self.peak * self.eff.gemm_max
        return 2.0 * m * n * k * batch / (rate * shape)


SIXTEEN_BIT = "bfloat16"  # what float8 training runs outside its linear layers, and the peak MFU is quoted against


def sixteen_bit_peak(system: System, dtype: str) -> float:
    """The peak everything but float8's linear layers runs at (and MFU is quoted against): bf16 for float8."""
    return system.peak_flops(SIXTEEN_BIT if dtype == "float8" else dtype)


def local_tokens(spec: TransformerSpec, cfg: ParallelConfig) -> int:
    """Tokens of one micro-batch on one rank: b x s / cp."""
    return cfg.micro_batch * spec.seq_len // cfg.cp


def layer_forward_s(spec: TransformerSpec, cfg: ParallelConfig, system: System) -> tuple[float, float, float]:
    """Forward seconds of one layer and micro-batch on one GPU: (matmuls, elementwise, attention core), the last
    being the part selective recomputation redoes."""
    gemm = _Gemm(system, spec.dtype)
    b, s, h, t = cfg.micro_batch, spec.seq_len, spec.hidden, cfg.tp
    tokens, f, hd = local_tokens(spec, cfg), spec.ffn_size, spec.dim_per_head
    k = spec.experts_per_token
    mats = gemm(tokens, spec.qkv_out / t, h, linear=True) + gemm(tokens, h, spec.q_width / t, linear=True)
    up = (2 if spec.gated_mlp else 1) * f / t
    if spec.experts > 1:  # each local expert's rows: the tokens routed to it from the ep group
        rows, local = tokens * k * cfg.ep / spec.experts, spec.experts / cfg.ep
        mats += gemm(rows, up, h, local, linear=True) + gemm(rows, h, f / t, local, linear=True)
        mats += gemm(tokens, spec.experts, h)
    else:
        mats += gemm(tokens, up, h, linear=True) + gemm(tokens, h, f / t, linear=True)
    heads, sq = b * spec.heads / t, s // cfg.cp  # this rank's queries against every key
    hbm = system.hbm_bytes_s
    if spec.flash_attention:  # causal FlashAttention does half the s x s work, at a fraction of GEMM efficiency
        attn = 0.5 * (gemm(sq, s, hd, heads) + gemm(sq, hd, s, heads)) / system.eff.flash
        scores = 0.0
    else:
        attn = gemm(sq, s, hd, heads) + gemm(sq, hd, s, heads)
        scores = 5 * spec.heads * sq * s * b / t * system.eff.elementwise_passes / hbm
    stored = layer_activation_bytes(spec, cfg, recompute="selective")
    elementwise = stored * system.eff.elementwise_passes / hbm
    return mats, elementwise, attn + scores


def attention_backward(spec: TransformerSpec) -> float:
    """Backward seconds of the attention core per forward second: 2 for unfused matmuls (like every GEMM), 2.5
    for FlashAttention, whose backward runs five s x s matmuls to the forward's two (Dao 2023, FlashAttention-2,
    sec. 3.1.2; its recomputation of the scores included)."""
    return 2.5 if spec.flash_attention else 2.0


def tp_comm_layer_s(spec: TransformerSpec, cfg: ParallelConfig, system: System) -> float:
    """Tensor-parallel collective seconds of one layer and micro-batch (forward, backward, recomputation): two
    all-reduces each way of b x s x h values, or with sequence parallelism two all-gathers and two
    reduce-scatters each way plus, unless full recomputation has just regathered them, the all-gathers backward
    redoes for the weight gradients (Megatron does not keep the gathered input). With float8 the gathered inputs
    of the column-parallel linears are already FP8 (Transformer Engine's FP8 all-gather under sequence
    parallelism, torchao's Float8ColwiseParallel): those all-gathers move 1 byte a value, the reduce-scatters and
    the gradients' all-gathers 2."""
    if cfg.tp == 1:
        return 0.0
    link = group_link(system, cfg.tp, 1)
    n = local_tokens(spec, cfg) * spec.hidden * spec.bytes_per_value
    if cfg.sp:
        ag, rs = collective_s("all_gather", n, cfg.tp, link), collective_s("reduce_scatter", n, cfg.tp, link)
        ag_in = collective_s("all_gather", n / 2, cfg.tp, link) if spec.dtype == "float8" else ag
        fwd, bwd = 2 * (ag_in + rs), 2 * (ag + rs) + (0 if cfg.recompute == "full" else 2 * ag_in)
    else:
        fwd = bwd = 2 * collective_s("all_reduce", n, cfg.tp, link)
    return fwd + bwd + (fwd if cfg.recompute == "full" else 0.0)


def cp_comm_layer_s(spec: TransformerSpec, cfg: ParallelConfig, system: System, attn_s: float) -> float:
    """Exposed context-parallel seconds of one layer and micro-batch (Ulysses: `ulysses_layer_s`): ring attention
    sends this rank's keys and
    values (2 x b x s/cp x kv_heads x head_dim, 1/tp of the heads) to the next rank cp - 1 times forward, and keys,
    values and their gradients backward (twice the bytes); each step overlaps one block of attention (1/cp of
    `attn_s`, the layer's forward attention), so a step exposes what it takes beyond its block."""
    if cfg.cp == 1:
        return 0.0
    if cfg.ulysses:
        return ulysses_layer_s(spec, cfg, system)
    kv = 2 * local_tokens(spec, cfg) * spec.kv * spec.dim_per_head * spec.bytes_per_value / min(cfg.tp, spec.kv)
    step = collective_s("p2p", kv, cfg.cp, group_link(system, cfg.cp, cfg.tp))
    block = attn_s / cfg.cp
    fwd, bwd = max(0.0, step - block), max(0.0, 2 * step - 2 * block)
    return (cfg.cp - 1) * (fwd + bwd + (fwd if cfg.recompute == "full" else 0.0))


def ulysses_layer_s(spec: TransformerSpec, cfg: ParallelConfig, system: System) -> float:
    """Ulysses context parallelism's seconds per layer and micro-batch (DeepSpeed-Ulysses, Jacobs et al. 2023): an
    all-to-all turns the rank's s/cp tokens of every (1/tp) query, key and value head into all s tokens of 1/cp of
    the heads before attention, another turns the output back; backward the same for the gradients, full
    recomputation once more; nothing overlaps them."""
    link_bytes = local_tokens(spec, cfg) * spec.bytes_per_value / cfg.tp
    qkv = all_to_all_s(link_bytes * spec.qkv_out, cfg.cp, cfg.tp, system)
    out = all_to_all_s(link_bytes * spec.q_width, cfg.cp, cfg.tp, system)
    return (qkv + out) * (2 + (1 if cfg.recompute == "full" else 0))


def ep_comm_layer_s(spec: TransformerSpec, cfg: ParallelConfig, system: System) -> float:
    """Expert-parallel all-to-all seconds of one MoE layer and micro-batch: dispatch and combine forward and
    backward (and forward again with full recomputation), each moving the rank's b x s/cp tokens x top-k x hidden
    (1/tp of them with sequence parallelism) over the ep group, ranks tp apart."""
    if cfg.ep == 1 or spec.experts == 1:
        return 0.0
    n = local_tokens(spec, cfg) * spec.experts_per_token * spec.hidden * spec.bytes_per_value / (
        cfg.tp if cfg.sp else 1)
    one = all_to_all_s(n, cfg.ep, cfg.tp, system)
    return one * (4 + (2 if cfg.recompute == "full" else 0))


def p2p_micro_s(spec: TransformerSpec, cfg: ParallelConfig, system: System) -> float:
    """Point-to-point seconds per micro-batch on a stage's critical path: one activation forward and one gradient
    backward per model chunk, 1/tp of b x s/cp x h each over the pipeline's link, re-gathered over NVLink."""
    if cfg.pp == 1:
        return 0.0
    n = local_tokens(spec, cfg) * spec.hidden * spec.bytes_per_value
    link = group_link(system, cfg.pp, cfg.gpus // cfg.pp)
    one = collective_s("p2p", n / cfg.tp, cfg.pp, link)
    if cfg.tp > 1:
        one += collective_s("all_gather", n, cfg.tp, group_link(system, cfg.tp, 1))
    return 2 * cfg.vp * one


def bucketed_s(kind: str, nbytes: float, size: int, link: Link | None,
               bucket: float = BUCKET_BYTES) -> tuple[float, float, str]:
    """A data-parallel collective of `nbytes` issued in buckets of at most `bucket` bytes, each paying the
    collective's latency: (seconds of all of them, of the last bucket alone, the algorithm priced)."""
    if size <= 1 or nbytes <= 0:
        return 0.0, 0.0, "none"
    buckets = max(1, math.ceil(nbytes / bucket * (1 - 1e-9)))
    one, algo = priced(kind, nbytes / buckets, size, link)
    return buckets * one, one, algo


def dp_exposed_s(spec: TransformerSpec, cfg: ParallelConfig, system: System, window_bwd: float, window_fwd: float,
                 pipeline: float, split: tuple[float, float] | None = None) -> tuple[float, float, str]:
    """Data-parallel seconds per step (all of it, the part not hidden, the algorithm): dense gradients over the
    cp x dp ranks that replicate them (tp apart), experts' over the cp x dp / ep ranks (tp x ep apart); the hidden
    part still costs `overlap_drag` of its bandwidth share (the collectives' kernels moving bytes through SMs and
    HBM beside the compute; the latency they wait out takes neither); `split`, when given, is
    `stage_param_split(spec, cfg)`."""
    dense, experts = split if split is not None else stage_param_split(spec, cfg)
    total = exposed = 0.0
    algo = "none"
    replicas = cfg.cp * cfg.dp
    for params, size, stride in ((dense, replicas, cfg.tp), (experts, replicas // cfg.ep, cfg.tp * cfg.ep)):
        if size <= 1 or params <= 0:
            continue
        link = group_link(system, size, stride)
        t, part, algo = _group_traffic(spec, cfg, params, size, link, window_bwd, window_fwd, pipeline)
        total += t
        if not cfg.dp_overlap:
            exposed += t
        elif system.eff.overlap_drag and t > part:
            bandwidth_only = _group_traffic(spec, cfg, params, size, Link(link.name, link.bandwidth, 0.0),
                                            window_bwd, window_fwd, pipeline)[0]
            exposed += part + system.eff.overlap_drag * (t - part) * min(1.0, bandwidth_only / t)
        else:
            exposed += part
    return total, exposed, algo


def _group_traffic(spec: TransformerSpec, cfg: ParallelConfig, params: float, size: int, link: Link,
                   window_bwd: float, window_fwd: float, pipeline: float) -> tuple[float, float, str]:
    """One replica group's data-parallel seconds per step, the part of them not hidden, and the algorithm."""
    grads, weights = params * cfg.grad_bytes, params * spec.bytes_per_value
    if cfg.zero == 0:
        t, last, algo = bucketed_s("all_reduce", grads, size, link)
        return t, max(t - window_bwd, last), algo
    if cfg.zero in (1, 2):
        rs, last_rs, _ = bucketed_s("reduce_scatter", grads, size, link)
        ag, last_ag, algo = bucketed_s("all_gather", weights, size, link)
        t = rs + ag
        part = max(rs - window_bwd, last_rs) + max(ag - window_fwd, last_ag) if cfg.gather_overlap else \
            max(t - window_bwd, last_rs)
        return t, part, algo
    # FSDP: parameters gathered for forward, again for backward, gradients scattered, one collective per layer
    # (FSDP's unit is the transformer block), every micro-batch. Full recomputation gathers nothing more: the
    # checkpointed block sits inside its FSDP unit (torchtitan 9dec370 parallelize_llama: apply_ac before
    # fully_shard; Composer's prepare_fsdp_module: apply_activation_checkpointing on the wrapped model, FSDP
    # units excluded), so the recomputed forward runs on the parameters the backward has just gathered
    # (with `reshard` False, FSDP1's SHARD_GRAD_OP, the forward's gather serves the backward too)
    m = cfg.micro_batches(spec)
    gathers = 2 if cfg.reshard else 1
    units = spec.layers / cfg.pp
    ag, last, algo = bucketed_s("all_gather", weights, size, link, weights / units)
    rs, _, _ = bucketed_s("reduce_scatter", grads, size, link, grads / units)
    t = m * (gathers * ag + rs)
    return t, max(t - pipeline, last), algo


def layer_compute_s(spec: TransformerSpec, cfg: ParallelConfig, forward: tuple[float, float, float]) -> float:
    """Compute seconds of one layer and micro-batch, forward, backward and recomputation, from `layer_forward_s`'s
    (matmuls, elementwise, attention core)."""
    mats, elementwise, attn = forward
    fwd = mats + elementwise + attn
    redo = {"none": 0.0, "selective": attn, "full": fwd}[cfg.recompute]
    return 3 * fwd + (attention_backward(spec) - 2) * attn + redo


def forward_key(cfg: ParallelConfig) -> tuple[int, int, int, int, bool]:
    """What of a layout `layer_forward_s` depends on (with the spec and the GPU, its peaks and the stack's
    constants): layouts that agree on it have the same per-layer forward, whatever their pp, dp, vp, ZeRO stage
    or recomputation (the search computes it once per key)."""
    return cfg.tp, cfg.cp, cfg.micro_batch, cfg.ep, cfg.sp


def layer_key(cfg: ParallelConfig) -> tuple:
    """What of a layout `layer_terms` depends on (with the spec and the machine): `forward_key`, Ulysses,
    recomputation and the tp overlap."""
    return cfg.tp, cfg.cp, cfg.micro_batch, cfg.ep, cfg.sp, cfg.ulysses, cfg.recompute, cfg.tp_overlap


def layer_terms(spec: TransformerSpec, cfg: ParallelConfig, system: System,
                forward: tuple[float, float, float] | None = None) -> tuple[float, float, float, float]:
    """Seconds of one layer and micro-batch: (compute, exposed tp, exposed cp, ep all-to-alls); `forward`, when
    given, is `layer_forward_s(spec, cfg, system)` computed beforehand."""
    mats, elementwise, attn = forward if forward is not None else layer_forward_s(spec, cfg, system)
    layer_compute = layer_compute_s(spec, cfg, (mats, elementwise, attn))
    layer_tp = tp_comm_layer_s(spec, cfg, system)
    if cfg.tp_overlap:
        layer_tp -= min(layer_tp, 3 * mats) * system.eff.tp_overlap
    layer_cp = cp_comm_layer_s(spec, cfg, system, attn)
    layer_ep = ep_comm_layer_s(spec, cfg, system)
    return layer_compute, layer_tp, layer_cp, layer_ep


def pipeline_s(spec: TransformerSpec, cfg: ParallelConfig, system: System,
               layer: tuple[float, float, float, float]) -> tuple[float, float, list[float], float]:
    """(all micro-batches through the pipeline, its bubble, each stage's seconds per micro-batch, the
    point-to-point seconds per micro-batch) from one layer's `layer_terms`."""
    gemm = _Gemm(system, spec.dtype)
    h, t = spec.hidden, cfg.tp
    tokens = local_tokens(spec, cfg)
    layer_compute, layer_tp, layer_cp, layer_ep = layer
    per_layer = layer_compute + layer_tp + layer_cp + layer_ep
    p2p = p2p_micro_s(spec, cfg, system)
    # Megatron's block recomputation: those layers' forward again (their tp collectives not counted again)
    per_block = sum(layer_forward_s(spec, cfg, system)) if cfg.recompute_layers else 0.0
    hbm = system.hbm_bytes_s
    logits = 3 * gemm(tokens, spec.vocab / t, h) + 3 * 4 * tokens * spec.vocab / t * 2 / hbm
    embedding = 3 * tokens * h * spec.bytes_per_value / hbm
    if cfg.pp == 1:
        stages = [spec.layers * per_layer + logits + embedding]
    else:
        stages = [n * per_layer + p2p for n in cfg.stage_layers(spec)]
        stages[0] += embedding
        stages[-1] += logits
    stages = [t + cfg.recompute_layers * per_block for t in stages]
    slowest, mean = max(stages), sum(stages) / len(stages)
    bubble = (cfg.pp - 1) / cfg.vp * mean
    return cfg.micro_batches(spec) * slowest + bubble, bubble, stages, p2p


def optimizer_s(spec: TransformerSpec, cfg: ParallelConfig, system: System,
                split: tuple[float, float] | None = None) -> float:
    """Adam's seconds per step: its bytes per parameter this GPU updates (1/(cp x dp) of them from ZeRO-1 on) at
    HBM bandwidth; `split`, when given, is `stage_param_split(spec, cfg)`."""
    dense, experts = split if split is not None else stage_param_split(spec, cfg)
    replicas = cfg.cp * cfg.dp
    opt_params = dense / (replicas if cfg.zero >= 1 else 1) + experts / (replicas // cfg.ep if cfg.zero >= 1 else 1)
    return opt_params * (26 + cfg.grad_bytes) / system.hbm_bytes_s


def predict_step(spec: TransformerSpec, cfg: ParallelConfig, system: System,
                 forward: tuple[float, float, float] | None = None,
                 layer: tuple[float, float, float, float] | None = None) -> StepBreakdown:
    """The predicted step of `spec` under `cfg` on `system` (the layout is assumed valid: see `problems`);
    `forward` and `layer`, when given, are `layer_forward_s` and `layer_terms` of the same arguments computed
    beforehand (the search memoises them)."""
    m = cfg.micro_batches(spec)
    mats, elementwise, attn = forward if forward is not None else layer_forward_s(spec, cfg, system)
    fwd = mats + elementwise + attn
    layer = layer if layer is not None else layer_terms(spec, cfg, system, (mats, elementwise, attn))
    layer_compute, layer_tp, layer_cp, layer_ep = layer
    layers = cfg.stage_layers(spec)
    pipeline, bubble, stages, p2p = pipeline_s(spec, cfg, system, layer)
    slowest_at = max(range(len(stages)), key=stages.__getitem__)
    busiest_layers = layers[slowest_at]  # the layers of the stage that sets the pace

    split = stage_param_split(spec, cfg)
    dp_time, exposed, algo = dp_exposed_s(spec, cfg, system, busiest_layers * 2 * fwd, busiest_layers * fwd,
                                          pipeline, split)
    optimizer = optimizer_s(spec, cfg, system, split)
    total = pipeline + exposed + optimizer
    mfu = spec.model_flops_per_step() / (total * cfg.gpus * sixteen_bit_peak(system, spec.dtype))
    dp_link = group_link(system, cfg.cp * cfg.dp, cfg.tp)
    notes = (f"dp traffic on {dp_link.name if dp_link else 'no link'} ({algo})",)
    return StepBreakdown(
        total_s=total, pipeline_s=pipeline, bubble_s=bubble,
        compute_s=m * (busiest_layers * layer_compute + cfg.recompute_layers * fwd),
        tp_comm_s=m * busiest_layers * layer_tp,
        cp_comm_s=m * busiest_layers * layer_cp, ep_comm_s=m * busiest_layers * layer_ep,
        pp_comm_s=m * p2p, dp_comm_s=dp_time, dp_exposed_s=exposed,
        optimizer_s=optimizer, mfu=mfu, memory=memory_per_gpu(spec, cfg), notes=notes)
