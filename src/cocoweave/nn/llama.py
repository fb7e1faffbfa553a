"""A Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU, no biases) in plain torch, and the
tensor-parallel plans `parallelize` takes for it, for torchtitan's Llama 3 and for Hugging Face's LlamaForCausalLM.

    model = Llama(LlamaConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2048))
    parallelize(model, mesh, llama_plan(model))          # Megatron's split of every block, one call

`Llama` uses torchtitan's module names (tok_embeddings, layers.N.attention.wq/wk/wv/wo, feed_forward.w1/w2/w3,
attention_norm, ffn_norm, norm, output), so the same plan serves both; its attention infers the head count from
its projections' widths (`-1` in the views), as torchtitan's and Hugging Face's do, so a tensor-parallel rank
attends over its own heads without any change to the model's code.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ParallelConfigError


@dataclass
class LlamaConfig:
    """The shape of a Llama-family model (torchtitan's ModelArgs names)."""

    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None
    vocab_size: int = 2048
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 2048

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """SwiGLU's hidden width: 2/3 of 4 x dim, times the multiplier, rounded up to `multiple_of` (Llama's rule)."""
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * -(-hidden // self.multiple_of)

    def check(self) -> None:
        kv = self.n_kv_heads or self.n_heads
        if self.dim % self.n_heads or self.n_heads % kv:
            raise ParallelConfigError(f"LlamaConfig: dim {self.dim}, {self.n_heads} heads and {kv} KV heads do not "
                                      "fit (dim must divide by heads, heads by KV heads)")


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of RoPE's angles, (seq_len, head_dim // 2) each."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, T, heads, head_dim) by position, pairs of adjacent features as complex numbers (Llama's)."""
    T = x.shape[1]
    xr = x.float().reshape(*x.shape[:-1], -1, 2)
    c, s = cos[:T].view(1, T, 1, -1), sin[:T].view(1, T, 1, -1)
    re, im = xr[..., 0], xr[..., 1]
    return torch.stack((re * c - im * s, re * s + im * c), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    """Grouped-query causal self-attention with RoPE; heads counted from the projections' widths."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = config.n_heads, config.n_kv_heads or config.n_heads
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = q.shape[2] // k.shape[2]  # query heads per KV head: the same on every tensor-parallel rank
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then h + feed_forward(norm(h))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config.dim, config.hidden_dim)
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab): embedding, blocks, final RMSNorm, output projection."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        config.check()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): LlamaBlock(config) for i in range(config.n_layers)})
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.config.max_seq_len:
            raise ParallelConfigError(f"Llama: {tokens.shape[1]} tokens exceed max_seq_len "
                                      f"{self.config.max_seq_len}")
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h))


# ---------------------------------------------------------------------------------------------------------
# Tensor-parallel plans (torch's ParallelStyles; `parallelize` or torch's parallelize_module take them)
# ---------------------------------------------------------------------------------------------------------

# (column-parallel patterns, row-parallel patterns) of a block, per naming scheme
_BLOCKS = {
    "torchtitan": (("layers.*.attention.wq", "layers.*.attention.wk", "layers.*.attention.wv",
                    "layers.*.attention.qkv_linear.wqkv", "layers.*.attention.qkv_linear.wq",
                    "layers.*.attention.qkv_linear.wk", "layers.*.attention.qkv_linear.wv",
                    "layers.*.feed_forward.w1", "layers.*.feed_forward.w3"),
                   ("layers.*.attention.wo", "layers.*.feed_forward.w2")),
    "huggingface": (("model.layers.*.self_attn.q_proj", "model.layers.*.self_attn.k_proj",
                     "model.layers.*.self_attn.v_proj", "model.layers.*.mlp.gate_proj", "model.layers.*.mlp.up_proj"),
                    ("model.layers.*.self_attn.o_proj", "model.layers.*.mlp.down_proj")),
}
_HEADS = {"torchtitan": ("tok_embeddings", ("output", "lm_head")), "huggingface": ("model.embed_tokens", ("lm_head",))}


def llama_plan(model: nn.Module, *, vocab_parallel: bool = False, loss_parallel: bool = False,
               sequence_parallel: bool = False) -> dict[str, Any]:
    """Megatron's split of a Llama-family model in torch's vocabulary: q/k/v and gate/up column-parallel, the
    attention output and down projections row-parallel. `vocab_parallel`: the embedding's vocabulary split too.
    `loss_parallel`: the output projection column-parallel with its logits left split on the vocabulary (for
    `vocab_parallel_cross_entropy`); without it the output projection is replicated and the logits whole.
    `sequence_parallel`: torchtitan's plan with sequence parallelism (norms and residuals on sequence slices; it
    splits the embedding's vocabulary, and the output projection's features); torchtitan's module names only."""
    from torch.distributed.tensor import Replicate  # imported here: DTensor costs 0.4 s to import
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from .parallelize import _matches

    names = [n for n, _ in model.named_modules() if n]
    for scheme, (cols, rows) in _BLOCKS.items():
        present = [p for p in cols + rows if any(_matches(p, n) for n in names)]
        if not present:
            continue
        plan: dict[str, Any] = {p: ColwiseParallel() if p in cols else RowwiseParallel() for p in present}
        embedding, outputs = _HEADS[scheme]
        head = next((o for o in outputs if o in names), None)
        if loss_parallel and head is None:
            raise ParallelConfigError(f"llama_plan: {type(model).__name__} has no output projection named "
                                      f"{' or '.join(outputs)} to split for loss_parallel")
        if sequence_parallel:
            return _sequence_plan(model, scheme, plan, names, head, loss_parallel)
        if vocab_parallel and embedding in names:
            plan[embedding] = RowwiseParallel(input_layouts=Replicate())
        if loss_parallel:
            plan[head] = ColwiseParallel()
        return plan
    raise ParallelConfigError(f"llama_plan: {type(model).__name__} has neither torchtitan's (layers.N.attention.wq) "
                              "nor Hugging Face's (model.layers.N.self_attn.q_proj) module names; write the plan "
                              "by hand")


def _positional_inputs(module: nn.Module) -> int:
    """How many positional inputs `module.forward` takes (torch's PrepareModuleInput wants one layout for each)."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds for p in inspect.signature(module.forward).parameters.values())


def _sequence_plan(model: nn.Module, scheme: str, plan: dict[str, Any], names: list[str], head: str | None,
                   loss_parallel: bool) -> dict[str, Any]:
    """torchtitan's tensor + sequence parallel plan (torchtitan/models/llama3/parallelize.py, apply_tp)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    from .parallelize import _matches

    if scheme != "torchtitan":
        raise ParallelConfigError(f"llama_plan: sequence parallelism is planned for torchtitan's module names only; "
                                  f"{type(model).__name__} computes positions and masks from the embedding's output "
                                  "length, which sequence parallelism splits")
    needed = ("tok_embeddings", "norm")
    missing = [n for n in needed if n not in names] + ([] if head else ["output"])
    if missing:
        raise ParallelConfigError(f"llama_plan: sequence parallelism needs {type(model).__name__}'s "
                                  f"{', '.join(missing)}, which it does not have")
    plan = {p: (RowwiseParallel(output_layouts=Shard(1)) if isinstance(s, RowwiseParallel) else s)
            for p, s in plan.items()}
    attention = next(m for n, m in model.named_modules() if _matches("layers.*.attention", n))
    rest = (None,) * (_positional_inputs(attention) - 1)  # (x, freqs_cis), or (x, cos, sin) in cocoweave's Llama
    plan.update({
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        head: ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate()),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": PrepareModuleInput(input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(),
                                                                                                          *rest)),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    })
    return plan


__all__ = ["Attention", "FeedForward", "Llama", "LlamaBlock", "LlamaConfig", "apply_rope", "llama_plan",
           "rope_tables"]
