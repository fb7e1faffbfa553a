"""Memory per GPU of one layout: weights, gradients and optimizer state per ZeRO stage, and activations per
layer by Korthikanti et al. 2022 (Table 2, with sequence parallelism and recomputation) times the layers and
micro-batches a pipeline schedule keeps in flight on its first stage.

Korthikanti's per-layer count for b sequences of s tokens, hidden h, a heads, t-way tensor parallelism, in bytes
of 16-bit activations: sbh (10 + 24/t + 5 a s / (h t)) with tensor parallelism only; sbh (34/t + 5 a s / (h t))
with sequence parallelism; the 5 a s / (h t) term (attention scores, softmax, dropout) is dropped by selective
recomputation and by fused (flash) attention; full recomputation keeps only each layer's input, 2 sbh (/ t with
sequence parallelism). We generalise 24 to 4 h + 4 kv_heads x head_dim + 2 x FFN x (2 or 3 matrices) per token
(grouped-query attention, gated MLP; 24 h for GPT-3's shapes). With context parallelism every count is of the
s / cp tokens a rank holds (Megatron's CP shards all activations along the sequence).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from cocoweave.cluster.planning.llm.parallelism import ParallelConfig
from cocoweave.cluster.planning.llm.spec import TransformerSpec

OPTIMIZER_BYTES = 12  # Adam in mixed precision: fp32 master weights, first and second moments (ZeRO paper, sec. 3.1)
WORKSPACE_BYTES = 2e9  # CUDA context, NCCL buffers, allocator fragmentation: an assumption, shown separately


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU on the busiest pipeline stage."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    workspace: float = WORKSPACE_BYTES

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.workspace


def layer_activation_bytes(spec: TransformerSpec, cfg: ParallelConfig, recompute: str | None = None) -> float:
    """Bytes one layer keeps for backward, per micro-batch, on one GPU (Korthikanti 2022, Table 2, generalised)."""
    recompute = cfg.recompute if recompute is None else recompute
    s, b, h, t = spec.seq_len // cfg.cp, cfg.micro_batch, spec.hidden, cfg.tp
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if cfg.sp else 1)
    kvd = spec.kv * spec.dim_per_head
    sharded = s * b * (4 * h + 4 * kvd + 2 * spec.ffn_size * spec.mlp_matrices * spec.experts_per_token) / t
    replicated = 10 * sbh / (t if cfg.sp else 1)
    scores = 0.0 if spec.flash_attention or recompute == "selective" else 5 * spec.heads * s * spec.seq_len * b / t
    return replicated + sharded + scores


def in_flight_factor(cfg: ParallelConfig) -> float:
    """Layers' worth of micro-batches the first stage holds, in units of `layers / pp` layers x one micro-batch:
    pp for 1F1B (it has pp micro-batches in flight), pp (1 + (pp - 1) / (pp vp)) interleaved (Korthikanti,
    sec. 4.2.3)."""
    if cfg.pp == 1:
        return 1.0
    return cfg.pp * (1.0 + (cfg.pp - 1) / (cfg.pp * cfg.vp)) if cfg.vp > 1 else float(cfg.pp)


def held_layers(spec: TransformerSpec, cfg: ParallelConfig) -> float:
    """Layer x micro-batch activations the stage that holds the most keeps in flight. Evenly split, the first
    stage's: its layers x `in_flight_factor`. Unevenly (1F1B only), stage i holds pp - i micro-batches of its
    n_i layers, so a longer second stage can hold more than a shortened first one (Llama 3's 8 x 15 > 7 x 16);
    interleaved over stated uneven stages, the largest stage's layers x `in_flight_factor` (a bound)."""
    return _held_layers(cfg.stage_layers(spec), cfg.pp, cfg.vp)


@lru_cache(maxsize=4096)
def _held_layers(stages: tuple[int, ...], pp: int, vp: int) -> float:
    """`held_layers` of a pipeline of `stages` (what it depends on: computed once per split, not per layout)."""
    cfg = ParallelConfig(pp=pp, vp=vp)
    if len(set(stages)) == 1:
        return stages[0] * in_flight_factor(cfg)
    if cfg.vp > 1:  # interleaved over stated uneven stages: the largest stage, as the first holds them (bound)
        return max(stages) * in_flight_factor(cfg)
    return float(max(n * (cfg.pp - i) for i, n in enumerate(stages)))


def activation_bytes(spec: TransformerSpec, cfg: ParallelConfig) -> float:
    """Activation bytes of the pipeline stage that holds the most, plus the input embedding's output and, with one
    stage, the logits (fp32 for the loss)."""
    layers = layer_activation_bytes(spec, cfg) * held_layers(spec, cfg)
    s, b = spec.seq_len // cfg.cp, cfg.micro_batch
    embedding = 2 * s * b * spec.hidden / (cfg.tp if cfg.sp else 1) * min(cfg.pp, cfg.micro_batches(spec) or 1)
    logits = 4 * s * b * spec.vocab / cfg.tp if cfg.pp == 1 else 0.0
    return layers + embedding + logits


def stage_params(spec: TransformerSpec, cfg: ParallelConfig) -> float:
    """Parameters one GPU holds on the heaviest stage (the first holds the input embedding, the last the output
    projection, as large; the middle ones only layers), before ZeRO sharding; experts counted 1/ep."""
    dense, experts = stage_param_split(spec, cfg)
    return dense + experts


def stage_param_split(spec: TransformerSpec, cfg: ParallelConfig) -> tuple[float, float]:
    """(dense, expert) parameters one GPU of the heaviest stage holds: dense ones 1/tp (replicated over cp x dp),
    experts 1/(tp x ep) (replicated over cp x dp / ep), before ZeRO sharding."""
    per_layer = spec.layer_params() - spec.expert_params() * (1 - 1 / cfg.ep)
    if cfg.pp == 1:
        layers, embedding = spec.layers, spec.embedding_params()
    else:
        stages = cfg.stage_layers(spec)
        ends = max(stages[0], stages[-1])
        layers, embedding = (ends, spec.vocab * spec.hidden) if ends * per_layer + spec.vocab * spec.hidden >= \
            max(stages) * per_layer else (max(stages), 0)
    experts = layers * spec.expert_params() / cfg.ep
    return (layers * per_layer + embedding - experts) / cfg.tp, experts / cfg.tp


@lru_cache(maxsize=1 << 16)  # the search asks for a layout's memory, then its step does: once per layout
def memory_per_gpu(spec: TransformerSpec, cfg: ParallelConfig) -> MemoryBreakdown:
    """Weights (16-bit), gradients (cfg.grad_bytes), Adam state (12 bytes) per parameter, sharded from the ZeRO
    stage that shards each over the ranks that replicate it (cp x dp for dense weights, cp x dp / ep for experts,
    as Megatron's distributed optimizer does; weights whole where FSDP keeps them gathered from forward to backward,
    `reshard` False), and the first stage's activations."""
    dense, experts = stage_param_split(spec, cfg)
    replicas = cfg.cp * cfg.dp

    def sharded(stage: int) -> float:
        return dense / (replicas if cfg.zero >= stage else 1) + experts / (replicas // cfg.ep if cfg.zero >= stage
                                                                           else 1)

    weights = sharded(3) if cfg.reshard else dense + experts  # gathered weights kept whole without resharding
    return MemoryBreakdown(weights * spec.bytes_per_value, sharded(2) * cfg.grad_bytes, sharded(1) * OPTIMIZER_BYTES,
                           activation_bytes(spec, cfg))
