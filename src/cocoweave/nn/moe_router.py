"""The MoE router: scores (softmax or sigmoid) of a linear gate, top-k experts per token, optional normalisation of
the top-k weights, an optional capacity (Megatron's drop policy "probs": an expert keeps its highest-scored tokens,
ranked by their scores before normalisation) and the auxiliary load-balancing loss.

The auxiliary loss is Switch's and DeepSeek's expert-level balance loss, as Megatron-core computes it
(`switch_load_balancing_loss_func`): coeff * E / (k T^2) * sum_i count_i * sum_t p_{t,i}, where count_i is the
number of the T tokens that chose expert i (before any drop) and p_t the token's scores normalised to sum 1 (the
softmax itself; sigmoid scores divided by their sum). Everything here is computed on the tokens of one call (one
rank's tokens under expert parallelism), as Megatron does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

SCORES = ("softmax", "sigmoid")


@dataclass
class Routing:
    """The router's decision for T tokens: `experts` (T, k) int64 and `weights` (T, k) in the scores' dtype (0
    where capacity dropped the pair), `kept` (T, k) bool, `aux_loss` a scalar (0 without a coefficient)."""

    experts: torch.Tensor
    weights: torch.Tensor
    kept: torch.Tensor
    aux_loss: torch.Tensor


def capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """Tokens an expert takes in one call: ceil(T k / E * capacity_factor) (Megatron's get_capacity), at most T."""
    return min(tokens, math.ceil(tokens * top_k / n_experts * capacity_factor))


class Router(nn.Module):
    """`gate` (a bias-free nn.Linear dim -> n_experts) and the routing rule; forward((T, dim)) -> Routing."""

    def __init__(self, dim: int, n_experts: int, top_k: int, *, score: str = "softmax", normalize: bool = False,
                 capacity_factor: float | None = None, aux_loss_coeff: float = 0.0) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.n_experts, self.top_k, self.score, self.normalize = n_experts, top_k, score, normalize
        self.capacity_factor, self.aux_loss_coeff = capacity_factor, aux_loss_coeff

    def forward(self, x: torch.Tensor) -> Routing:
        logits = self.gate(x).float()  # scores in fp32 (Megatron's and torchtitan's)
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        raw, experts = scores.topk(self.top_k, dim=-1)
        top = raw / (raw.sum(-1, keepdim=True) + (1e-20 if self.score == "sigmoid" else 0.0)) if self.normalize \
            else raw
        kept = torch.ones_like(experts, dtype=torch.bool)
        if self.capacity_factor is not None:  # ranked by the scores before normalisation (no ties at top-1)
            kept = self._within_capacity(raw.detach(), experts)
            top = top * kept
        aux = logits.new_zeros(())
        if self.aux_loss_coeff:
            aux = self._aux_loss(scores, experts)
        return Routing(experts, top, kept, aux)

    def _within_capacity(self, top: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """(T, k) bool: the pairs kept when each expert takes its `capacity` highest-scored tokens."""
        T = experts.shape[0]
        cap = capacity(T, self.n_experts, self.top_k, self.capacity_factor or 0.0)
        dense = torch.zeros(T, self.n_experts, dtype=top.dtype, device=top.device).scatter(1, experts, top)
        routed = torch.zeros_like(dense, dtype=torch.bool).scatter(1, experts, True)
        best = dense.topk(cap, dim=0, sorted=False).indices  # (cap, E): each expert's highest-scored tokens
        within = torch.zeros_like(routed).scatter(0, best, True) & routed
        return within.gather(1, experts)

    def _aux_loss(self, scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        T = scores.shape[0]
        probs = scores if self.score == "softmax" else scores / (scores.sum(-1, keepdim=True) + 1e-20)
        counts = torch.bincount(experts.flatten(), minlength=self.n_experts).to(probs.dtype)
        scale = self.aux_loss_coeff * self.n_experts / (self.top_k * T * T)
        return scale * (probs.sum(0) * counts).sum()


__all__ = ["SCORES", "Router", "Routing", "capacity"]
