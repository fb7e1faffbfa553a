"""Predicted time of one training step of a transformer under one layout on one machine type.

Per layer and micro-batch, on one GPU of a tp group: every matmul at its own shape's efficiency (`Efficiency`);
the elementwise work (LayerNorm, dropout, residual, activation, softmax) as passes over the bytes Korthikanti's
count stores (memory-bound); backward twice the forward; recomputation adds a forward (full) or the attention core
(selective). Tensor-parallel collectives on the tp group's link, exposed unless a schedule overlaps them. A stage
runs its layers, sends and receives its boundary activations (1/tp of them with the scatter-gather optimisation),
and the first and last stages also the embedding and the logits; stages may hold unequal layers (`split_layers`
or a stated split). The 1F1B pipeline takes m x the slowest stage plus
the bubble (pp - 1) / vp x the mean stage (Narayanan et al. SC'21, sec. 2.2). Data-parallel gradient traffic on the
dp group's link, overlapped with the last micro-batch's backward where the framework does so; then the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cocoweave.cluster.planning.llm.comm import collective_s, group_link, priced
from cocoweave.cluster.planning.llm.memory import MemoryBreakdown, layer_activation_bytes, memory_per_gpu, stage_params
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
    pp_comm_s: float  # point-to-point per step on the critical path
    dp_comm_s: float  # data-parallel traffic (all of it)
    dp_exposed_s: float  # the part not hidden behind backward
    optimizer_s: float
    mfu: float  # model FLOPs (no recomputation) / (time x GPUs x peak)
    memory: MemoryBreakdown
    notes: tuple[str, ...] = field(default=())


class _Gemm:
    """Matmul time at its shape's efficiency."""

    def __init__(self, system: System, dtype: str):
        self.peak = system.peak_flops(dtype)
        self.eff = system.eff

    def __call__(self, m: float, n: float, k: float, batch: float = 1.0) -> float:
        d = min(m, n, k)
        eta = self.eff.gemm_max * d / (d + self.eff.gemm_half)
        return 2.0 * m * n * k * batch / (self.peak * eta)


def layer_forward_s(spec: TransformerSpec, cfg: ParallelConfig, system: System) -> tuple[float, float, float]:
    """Forward seconds of one layer and micro-batch on one GPU: (matmuls, elementwise, attention core), the last
    being the part selective recomputation redoes."""
    gemm = _Gemm(system, spec.dtype)
    b, s, h, t = cfg.micro_batch, spec.seq_len, spec.hidden, cfg.tp
    tokens, f, hd = b * s, spec.ffn_size, spec.head_dim
    k = spec.experts_per_token
    mats = gemm(tokens, spec.qkv_out / t, h) + gemm(tokens, h, h / t)
    up = (2 if spec.gated_mlp else 1) * f / t
    mats += k * (gemm(tokens, up, h) + gemm(tokens, h, f / t))
    if spec.experts > 1:
        mats += gemm(tokens, spec.experts, h)
    heads = b * spec.heads / t
    hbm = system.hbm_bytes_s
    if spec.flash_attention:  # causal FlashAttention does half the s x s work, at a fraction of GEMM efficiency
        attn = 0.5 * (gemm(s, s, hd, heads) + gemm(s, hd, s, heads)) / system.eff.flash
        scores = 0.0
    else:
        attn = gemm(s, s, hd, heads) + gemm(s, hd, s, heads)
        scores = 5 * spec.heads * s * s * b / t * system.eff.elementwise_passes / hbm
    stored = layer_activation_bytes(spec, cfg, recompute="selective")
    elementwise = stored * system.eff.elementwise_passes / hbm
    return mats, elementwise, attn + scores


def tp_comm_layer_s(spec: TransformerSpec, cfg: ParallelConfig, system: System) -> float:
    """Tensor-parallel collective seconds of one layer and micro-batch (forward, backward, recomputation): two
    all-reduces each way of b x s x h values, or with sequence parallelism two all-gathers and two
    reduce-scatters each way plus the all-gathers backward redoes for the weight gradients."""
    if cfg.tp == 1:
        return 0.0
    link = group_link(system, cfg.tp, 1)
    n = cfg.micro_batch * spec.seq_len * spec.hidden * spec.bytes_per_value
    if cfg.sp:
        ag, rs = collective_s("all_gather", n, cfg.tp, link), collective_s("reduce_scatter", n, cfg.tp, link)
        fwd, bwd = 2 * (ag + rs), 2 * (ag + rs) + 2 * ag
    else:
        fwd = bwd = 2 * collective_s("all_reduce", n, cfg.tp, link)
    return fwd + bwd + (fwd if cfg.recompute == "full" else 0.0)


def p2p_micro_s(spec: TransformerSpec, cfg: ParallelConfig, system: System) -> float:
    """Point-to-point seconds per micro-batch on a stage's critical path: one activation forward and one gradient
    backward per model chunk, 1/tp of b x s x h each over the pipeline's link, re-gathered over NVLink."""
    if cfg.pp == 1:
        return 0.0
    n = cfg.micro_batch * spec.seq_len * spec.hidden * spec.bytes_per_value
    link = group_link(system, cfg.pp, cfg.gpus // cfg.pp)
    one = collective_s("p2p", n / cfg.tp, cfg.pp, link)
    if cfg.tp > 1:
        one += collective_s("all_gather", n, cfg.tp, group_link(system, cfg.tp, 1))
    return 2 * cfg.vp * one


def predict_step(spec: TransformerSpec, cfg: ParallelConfig, system: System) -> StepBreakdown:
    """The predicted step of `spec` under `cfg` on `system` (the layout is assumed valid: see `problems`)."""
    gemm = _Gemm(system, spec.dtype)
    b, s, h, t = cfg.micro_batch, spec.seq_len, spec.hidden, cfg.tp
    m = cfg.micro_batches(spec)
    mats, elementwise, attn = layer_forward_s(spec, cfg, system)
    fwd = mats + elementwise + attn
    redo = {"none": 0.0, "selective": attn, "full": fwd}[cfg.recompute]
    layer_compute = 3 * fwd + redo
    layer_tp = tp_comm_layer_s(spec, cfg, system)
    if cfg.tp_overlap:
        layer_tp = max(0.0, layer_tp - 3 * mats)
    layers = cfg.stage_layers(spec)
    per_layer = layer_compute + layer_tp
    p2p = p2p_micro_s(spec, cfg, system)
    hbm = system.hbm_bytes_s
    logits = 3 * gemm(b * s, spec.vocab / t, h) + 3 * 4 * b * s * spec.vocab / t * 2 / hbm
    embedding = 3 * b * s * h * spec.bytes_per_value / hbm
    if cfg.pp == 1:
        stages = [spec.layers * per_layer + logits + embedding]
    else:
        stages = [n * per_layer + p2p for n in layers]
        stages[0] += embedding
        stages[-1] += logits
    slowest_at = max(range(len(stages)), key=stages.__getitem__)
    slowest, mean = stages[slowest_at], sum(stages) / len(stages)
    busiest_layers = layers[slowest_at]  # the layers of the stage that sets the pace
    bubble = (cfg.pp - 1) / cfg.vp * mean
    pipeline = m * slowest + bubble

    params = stage_params(spec, cfg)
    dp_link = group_link(system, cfg.dp, cfg.tp)
    grads = params * cfg.grad_bytes
    if cfg.zero == 0:
        dp_time, algo = priced("all_reduce", grads, cfg.dp, dp_link)
        last = collective_s("all_reduce", min(grads, BUCKET_BYTES), cfg.dp, dp_link)
        window = busiest_layers * 2 * fwd
    elif cfg.zero in (1, 2):
        weights = params * spec.bytes_per_value
        dp_time = collective_s("reduce_scatter", grads, cfg.dp, dp_link) + \
            collective_s("all_gather", weights, cfg.dp, dp_link)
        algo = "ring"
        last = collective_s("reduce_scatter", min(grads, BUCKET_BYTES), cfg.dp, dp_link)
        window = busiest_layers * 2 * fwd
    else:  # FSDP: parameters gathered for forward, again for backward (and recomputation), gradients scattered
        weights = params * spec.bytes_per_value
        gathers = 2 + (1 if cfg.recompute == "full" else 0)
        dp_time = m * (gathers * collective_s("all_gather", weights, cfg.dp, dp_link)
                       + collective_s("reduce_scatter", grads, cfg.dp, dp_link))
        algo = "ring"
        last = collective_s("all_gather", min(weights, BUCKET_BYTES), cfg.dp, dp_link)
        window = pipeline
    exposed = max(dp_time - window, last) if cfg.dp_overlap else dp_time
    if cfg.dp == 1:
        exposed = 0.0
    opt_params = params / (cfg.dp if cfg.zero >= 1 else 1)
    optimizer = opt_params * (26 + cfg.grad_bytes) / hbm
    total = pipeline + exposed + optimizer
    n_gpus = cfg.gpus
    mfu = spec.model_flops_per_step() / (total * n_gpus * system.peak_flops(spec.dtype))
    notes = (f"dp traffic on {dp_link.name if dp_link else 'no link'} ({algo})",)
    return StepBreakdown(
        total_s=total, pipeline_s=pipeline, bubble_s=bubble,
        compute_s=m * busiest_layers * layer_compute, tp_comm_s=m * busiest_layers * layer_tp,
        pp_comm_s=m * p2p, dp_comm_s=dp_time if cfg.dp > 1 else 0.0, dp_exposed_s=exposed,
        optimizer_s=optimizer, mfu=mfu, memory=memory_per_gpu(spec, cfg), notes=notes)
