"""A decoder block with nn/llama's attention and an MoE feed-forward (`MoEBlock`), and a small decoder of them
(`MoEModel`: embedding, blocks, final RMSNorm, output projection), torchtitan's names (`layers.N.moe.experts.w1`).

    config = LlamaConfig(dim=256, n_layers=4, n_heads=8, vocab_size=2048)
    model = MoEModel(config, MoEConfig(n_experts=8, top_k=2, hidden_dim=512), group=mesh)   # experts over "ep"
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) + model.aux_loss()
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn

from .functional import mix_seed
from .llama import Attention, Llama, LlamaConfig
from .moe import MoE


@dataclass
class MoEConfig:
    """An MoE feed-forward's shape and routing (MoE's keyword arguments)."""

    n_experts: int = 8
    top_k: int = 2
    hidden_dim: int = 512
    score: str = "softmax"
    normalize: bool | None = None
    shared_hidden_dim: int | None = None
    capacity_factor: float | None = None
    aux_loss_coeff: float = 0.0


class MoEBlock(nn.Module):
    """Pre-norm block: h = x + attention(norm(x)), then h + moe(norm(h))."""

    def __init__(self, config: LlamaConfig, moe: MoEConfig, *, group: Any = None, seed: int = 0,
                 expert_grad_divisor: float = 1.0) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        options = asdict(moe)
        self.moe = MoE(config.dim, options.pop("hidden_dim"), options.pop("n_experts"), options.pop("top_k"),
                       group=group, seed=seed, expert_grad_divisor=expert_grad_divisor, **options)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.moe(self.ffn_norm(h))


class MoEModel(Llama):
    """Token ids (B, T) -> logits (B, T, vocab): nn.Llama with `config.n_layers` MoE blocks. The non-expert
    parameters are drawn from torch's generator (seed it the same on every rank); each layer's experts from `seed`
    and the layer's index."""

    def __init__(self, config: LlamaConfig, moe: MoEConfig, *, group: Any = None, seed: int = 0,
                 expert_grad_divisor: float = 1.0) -> None:
        super().__init__(replace(config, n_layers=0))  # embedding, final norm, output, RoPE tables
        self.config = config
        self.layers = nn.ModuleDict({str(i): MoEBlock(config, moe, group=group, seed=mix_seed(seed, i),
                                                      expert_grad_divisor=expert_grad_divisor)
                                     for i in range(config.n_layers)})

    def aux_loss(self) -> torch.Tensor:
        """The sum of the layers' load-balancing losses of the last forward."""
        return sum((layer.moe.aux_loss for layer in self.layers.values()), torch.zeros(()))


__all__ = ["MoEBlock", "MoEConfig", "MoEModel"]
