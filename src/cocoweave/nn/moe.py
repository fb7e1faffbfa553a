"""A dropless mixture-of-experts layer with expert parallelism (`MoE`), Megatron-core's alltoall token dispatcher in
plain torch: route, permute the tokens by expert, dispatch them to the ranks owning their experts (one all-to-all,
after one all-to-all of the counts), run the local experts (SwiGLU, one GEMM per expert over its contiguous rows),
send the results back (the combine), weight and sum them per token, and add the optional shared expert.

    moe = MoE(dim=256, hidden_dim=512, n_experts=8, top_k=2, group=mesh)   # experts over mesh["ep"]
    y = moe(x)                       # (..., dim) -> (..., dim); moe.aux_loss: this call's load-balancing loss

Expert parallelism: the ep ranks hold different tokens; rank r of ep owns experts [r E/ep, (r+1) E/ep). Experts
are stacked parameters `experts.w1` (E, dim, hidden), `experts.w3` (E, dim, hidden), `experts.w2` (E, hidden, dim),
torchtitan's names and layout, held as DTensors Shard(0) on the ep mesh: their whole shape and indices are the
global experts', so `full_state_dict`, `sharded_state_dict` + cocoweave.checkpoint (or DCP) load at another ep
degree. Each rank draws only its experts, each from its own generator (seed, matrix, expert): the values do not
depend on ep. The router and the shared expert are plain parameters, the same on every rank.

What it computes, checked in tests/nn/test_moe*.py: rank r's output is the single-process layer's on rank r's
tokens; an expert's gradient is the sum over the ep ranks' tokens (what the single-process layer accumulates over
the ranks' calls), divided by `expert_grad_divisor`; a plain parameter's gradient is this rank's own (an optimizer
over the ranks sums or averages it). Routing decisions (capacity, the auxiliary loss) are per call, on this rank's
tokens, as Megatron's are. With dp x ep, average the plain parameters over every rank (dp x ep) and the experts over
dp with `expert_grad_divisor=ep` (torchtitan's gradient divide factor): see `expert_parameters`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import ParallelConfigError
from ..sharding import is_dtensor, local_data, tp_mesh
from .compiled import Programs, check_schedule
from .functional import group_rank, group_size, mix_seed
from .moe_dispatch import exchange_counts, start_all_to_all, wait_all_to_all
from .moe_experts import GroupedExperts, SharedExpert, uniform
from .moe_program import DroplessExperts, agreed_sizes
from .moe_router import SCORES, Router

try:
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # pragma: no cover - torch without torch.distributed
    DeviceMesh = None  # type: ignore[assignment,misc]

_GATE, _SHARED = 10, 20  # init streams (the experts' are moe_experts.py's)


def ep_group(group: Any) -> tuple[Any, Any]:
    """(process group, 1-D DeviceMesh) of the experts: a DeviceMesh's "ep" dim (or its only dim), a ProcessGroup,
    None (the world); (None, None) when torch.distributed is not initialised (one process)."""
    if DeviceMesh is not None and isinstance(group, DeviceMesh) and group.ndim > 1 and \
            "ep" not in (group.mesh_dim_names or ()):
        raise ParallelConfigError(f"MoE: a DeviceMesh with dims {list(group.mesh_dim_names or ())} has no 'ep' dim "
                                  "for the experts; name the expert-parallel dim 'ep'")
    mesh = tp_mesh(group, "ep")  # one mesh per group, shared by the layers (sharding.py)
    return (None, None) if mesh is None else (mesh.get_group(), mesh)


class MoE(nn.Module):
    """Mixture of `n_experts` SwiGLU experts of width `hidden_dim`, `top_k` per token, experts split over the ep
    group. `group`: a DeviceMesh (its "ep" dim), a ProcessGroup, None (the world; one process without
    torch.distributed). `score`: "softmax" or "sigmoid"; `normalize`: divide the top-k weights by their sum (default:
    for sigmoid only); `shared_hidden_dim`: the shared expert's width (None: none); `capacity_factor`: each expert
    takes at most ceil(T k / E * factor) of a call's T tokens, the highest-scored (None: dropless);
    `aux_loss_coeff`: the load-balancing loss's coefficient (kept in `aux_loss` after each call); `seed`: the
    experts', router's and shared expert's initial values; `expert_grad_divisor`: see the module;
    `experts_schedule`: None (or "as written") runs dispatch, experts and combine by hand (the default: the fastest
    measured, docs/moe.md), a schedule's name or "auto" runs them as the checked dropless programs
    (nn/moe_program.py; the shared expert then runs after them, not during the exchanges)."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int, top_k: int = 2, *, group: Any = None,
                 score: str = "softmax", normalize: bool | None = None, shared_hidden_dim: int | None = None,
                 capacity_factor: float | None = None, aux_loss_coeff: float = 0.0, seed: int = 0,
                 expert_grad_divisor: float = 1.0, experts_schedule: str | None = None) -> None:
        super().__init__()
        schedule = check_schedule(experts_schedule, "MoE")
        self.group, mesh = ep_group(group)
        self.ep, self.ep_rank = group_size(self.group), group_rank(self.group)
        _check(dim, hidden_dim, n_experts, top_k, self.ep, score, capacity_factor, aux_loss_coeff,
               expert_grad_divisor, shared_hidden_dim)
        self.dim, self.n_experts, self.top_k = dim, n_experts, top_k
        self.router = Router(dim, n_experts, top_k, score=score,
                             normalize=score == "sigmoid" if normalize is None else normalize,
                             capacity_factor=capacity_factor, aux_loss_coeff=aux_loss_coeff)
        with torch.no_grad():
            self.router.gate.weight.copy_(uniform((n_experts, dim), dim ** -0.5, mix_seed(seed, _GATE)))
        self.experts = GroupedExperts(dim, hidden_dim, n_experts, mesh=mesh, rank=self.ep_rank, ranks=self.ep,
                                      seed=seed, grad_divisor=expert_grad_divisor)
        self.shared_experts = None if not shared_hidden_dim else \
            SharedExpert(dim, shared_hidden_dim, mix_seed(seed, _SHARED))
        self.aux_loss = torch.zeros(())
        self.tokens_per_expert = torch.zeros(n_experts, dtype=torch.long)  # the last call's, before any drop
        self.start, self.wait, self.exchange = start_all_to_all, wait_all_to_all, exchange_counts  # floor: no-ops
        self.overlap = True  # the shared expert's two parts while the dispatch and the combine are in flight
        self.programs = Programs(schedule, self.group, self.ep, self.ep_rank) if schedule else None
        self._size_slots = None  # agreed_sizes' shared-memory slots
        if self.group is not None and self.ep > 1:
            from .groups import agree_on_build

            agree_on_build(self.group, "an MoE layer", "MoE", dim=dim, hidden_dim=hidden_dim, n_experts=n_experts,
                           top_k=top_k, score=score, normalize=self.router.normalize,
                           shared_hidden_dim=shared_hidden_dim, capacity_factor=capacity_factor,
                           dtype=str(self.router.gate.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.dim:
            raise ParallelConfigError(f"MoE: input features {x.shape[-1]} differ from dim {self.dim}")
        flat = x.reshape(-1, self.dim)
        routing = self.router(flat)
        self.aux_loss = routing.aux_loss
        experts = routing.experts.flatten()
        self.tokens_per_expert = torch.bincount(experts, minlength=self.n_experts)
        # permute: one row per kept (token, expert) pair, grouped by expert (stable: tokens in order); without a
        # capacity every pair is kept (no test of `kept`: a device sync per step)
        kept = routing.kept.flatten()
        pairs = None if self.router.capacity_factor is None or bool(kept.all()) else kept.nonzero().squeeze(1)
        if pairs is not None:
            experts = experts[pairs]
        order = experts.argsort(stable=True)
        pair_of_row = order if pairs is None else pairs[order]
        token_of_row = pair_of_row // self.top_k
        counts = self.tokens_per_expert if pairs is None else torch.bincount(experts, minlength=self.n_experts)
        rows = flat.index_select(0, token_of_row)  # (its backward is an index_add: faster than indexing's)
        out_rows, shared = self._experts(rows, counts, flat)
        weights = routing.weights.flatten().index_select(0, pair_of_row).to(x.dtype)
        y = flat.new_zeros(flat.shape).index_add(0, token_of_row, out_rows * weights[:, None])
        if shared is not None:
            y = y + shared
        return y.view(x.shape)

    def _experts(self, rows: torch.Tensor, counts: torch.Tensor, flat: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the local experts' outputs for `rows` (grouped by global expert, counts[e] for expert e), through the
        ranks owning them and back; the shared expert's output on `flat`, None without one). With ep > 1 and
        `overlap`, the shared expert's first part runs while the dispatch is in flight and its second while the
        combine is; backward: autograd runs the nodes recorded between a start and its wait (later first) while the
        gradients' all-to-all is in flight, so the shared expert's backward overlaps both backward all-to-alls."""
        n_local, shared = self.experts.n_local, self.shared_experts
        if self.programs is not None:  # dispatch -> grouped SwiGLU -> combine as the compiled programs
            sent = counts.view(self.ep, n_local)
            received = sent if self.ep == 1 else self.exchange(sent, self.group)
            *sizes, self._size_slots = agreed_sizes(rows.shape[0], flat.shape[0] * self.top_k, received,
                                                    self.group if self.ep > 1 else None, self._size_slots)
            out = DroplessExperts.apply(rows, *self.experts.weights(), sent, received, tuple(sizes), self.programs)
            return out, None if shared is None else shared(flat)
        if self.group is None or self.ep == 1:
            return self.experts(rows, counts.tolist()), None if shared is None else shared(flat)
        sent = counts.view(self.ep, n_local)
        received = self.exchange(sent, self.group)  # (source rank, local expert)
        in_splits, out_splits = sent.sum(1).tolist(), received.sum(1).tolist()
        overlap = shared is not None and self.overlap
        buf, pending = self.start(rows, in_splits, out_splits, self.group)
        hidden = shared.hidden(flat) if overlap else None
        got = self.wait(buf, pending)
        # regroup the received rows from (source, expert) order to (expert, source) order
        segment = torch.repeat_interleave(torch.arange(self.ep * n_local, device=received.device), received.flatten())
        regroup = ((segment % n_local) * self.ep + segment // n_local).argsort(stable=True)
        out = self.experts(got.index_select(0, regroup), received.sum(0).tolist())
        back = torch.empty_like(regroup)
        back[regroup] = torch.arange(regroup.numel(), device=regroup.device)
        buf, pending = self.start(out.index_select(0, back), out_splits, in_splits, self.group)
        shared_out = shared.w2(hidden) if hidden is not None else None
        out_rows = self.wait(buf, pending)
        if shared is not None and shared_out is None:
            shared_out = shared(flat)
        return out_rows, shared_out


def _check(dim: int, hidden_dim: int, n_experts: int, top_k: int, ep: int, score: str,
           capacity_factor: float | None, aux_loss_coeff: float, divisor: float, shared: int | None) -> None:
    """Refuse a configuration the layer cannot run, one sentence each."""
    for name, v in (("dim", dim), ("hidden_dim", hidden_dim), ("n_experts", n_experts), ("top_k", top_k)):
        if not isinstance(v, int) or v < 1:
            raise ParallelConfigError(f"MoE: {name} must be a positive integer, got {v!r}")
    if top_k > n_experts:
        raise ParallelConfigError(f"MoE: top_k {top_k} exceeds the {n_experts} experts")
    if n_experts % ep:
        raise ParallelConfigError(f"MoE: {n_experts} experts do not divide over {ep} expert-parallel ranks; use a "
                                  "multiple of the ep size")
    if score not in SCORES:
        raise ParallelConfigError(f"MoE: score must be one of {', '.join(SCORES)}, got {score!r}")
    if capacity_factor is not None and not (isinstance(capacity_factor, int | float) and capacity_factor > 0):
        raise ParallelConfigError(f"MoE: capacity_factor must be a positive number or None, got {capacity_factor!r}")
    if not (isinstance(aux_loss_coeff, int | float) and aux_loss_coeff >= 0):
        raise ParallelConfigError(f"MoE: aux_loss_coeff must be a number >= 0, got {aux_loss_coeff!r}")
    if not (isinstance(divisor, int | float) and divisor > 0):
        raise ParallelConfigError(f"MoE: expert_grad_divisor must be a positive number, got {divisor!r}")
    if shared is not None and (not isinstance(shared, int) or shared < 0):
        raise ParallelConfigError(f"MoE: shared_hidden_dim must be a positive integer or None, got {shared!r}")


def expert_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(the experts' parameters, every other parameter) of `model`: with dp x ep, give the first to an optimizer
    over the dp group (with `expert_grad_divisor=ep` on the layers) and the second to one over all dp x ep ranks."""
    ids = {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    params = list(model.parameters())
    return [p for p in params if id(p) in ids], [p for p in params if id(p) not in ids]


def full_experts(moe: MoE) -> dict[str, torch.Tensor]:
    """The whole (E, ...) expert tensors of `moe` (gathered over ep when split): what a single-process layer holds."""
    return {n: (p.full_tensor() if is_dtensor(p) else local_data(p)).detach().clone()
            for n, p in moe.experts.named_parameters()}


__all__ = ["GroupedExperts", "MoE", "SharedExpert", "ep_group", "expert_parameters", "full_experts"]
