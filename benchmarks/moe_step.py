"""One training step of a small MoE decoder with expert parallelism through `cocoweave.nn.MoE`, against Megatron-core's
alltoall token dispatcher written by hand, torchtitan's own MoE (the package, its AllToAllTokenDispatcher) and the
communication-free floor, in the same rank processes, interleaved and repeated, on a LocalWorld of Gloo CPU ranks.

    .venv/bin/python benchmarks/moe_step.py                          # both models, ep 2
    .venv/bin/python benchmarks/moe_step.py --layouts ep2,ep4,dp2xep2
    .venv/bin/python benchmarks/moe_step.py --quick                  # smoke: tiny models, one round

The models (cocoweave.nn.MoEModel: nn.Llama's attention, 8 heads, 4 KV heads, vocab 2048, batch 4 x seq 128 per
rank, the same initial weights in every variant):
  mixtral    4 layers, dim 256, 8 experts of hidden 896, top-2, softmax scores, top-k weights normalised
  deepseek   4 layers, dim 256, 16 fine-grained experts of hidden 224, top-4, sigmoid scores normalised, one shared
             expert of hidden 224
Dropless, no auxiliary loss (torchtitan's MoE has none; its load balancing is a bias, off here). The step, the same
in every variant: zero_grad, forward, cross-entropy, backward, one flat all-reduce of the gradients (the non-expert
ones over every rank, the experts' over dp, all divided by the world: the data-parallel mean), torch.optim.AdamW
(fused) over plain tensors (a DTensor parameter's local tensor, as DistributedAdamW updates it). Variants:

  cocoweave   cocoweave.nn.MoE (experts over the mesh's "ep" dim); its all-to-alls and count exchange go through
              shared memory, the ranks being on one host (backends/torch/shm_all_to_all.py)
  cocoweave-gloo  the same layer with every all-to-all through Gloo's all_to_all_single (moe_dispatch's
              library_start_all_to_all / library_exchange_counts): what the layer costs off shared memory
  megatron    Megatron-core's MoEAlltoAllTokenDispatcher + SequentialMLP in plain torch, written here from its code:
              routing map (T, E), counts all-gathered over ep, permute by masked_select + index_select, all_to_all,
              sort_chunks_by_idxs, one fused gate/up Linear and a down Linear per local expert, the reverse, unpermute
              by scatter_add of the probability-weighted rows
  torchtitan  torchtitan 0.3.0's MoE (TokenChoiceTopKRouter, AllToAllTokenDispatcher over torch's functional
              all_to_all_single, GroupedExperts), its experts sharded by hand as its parallelize would (Shard(0) over
              ep) and its spmd backend set to "dtensor" (its default, spmd_types, needs its trainer's meshes). Its
              GroupedExperts casts to bfloat16 for torch._grouped_mm (hard-coded; torch 2.13's CPU _grouped_mm has no
              float32 backward), so it is not the same work: its losses are reported against the fp32 reference and
              it is a peer only with --titan-peer
  floor       cocoweave's layer with its two all-to-alls and the count exchange skipped (each rank's tokens go to its
              own experts of the same local index): the same sharded compute, a limit and not a peer
  cocoweave-program  (A/B, only when named) the layer with `experts_schedule="auto"`: dispatch, grouped SwiGLU and
              combine as the compiled dropless programs and their backward (nn/moe_program.py)

Before timing, each variant trains two steps from the same weights and tokens and its losses are compared with the
single-process model's on the whole batch (`same_work`). Each round then times every variant for --steps steps after
a warm-up, rotated; a step time is the median over steps of the slowest rank's time (a barrier before each);
`paired_cocoweave_over` is the median over steps of cocoweave's step over the variant's step of the same round;
`cpu_ms` the busier rank's median CPU time per step (time.process_time: every thread of the rank, Gloo's included),
which a loaded machine moves far less than the wall time.
`a2a_mb` is what one rank sends to the others per step (dispatch and combine, forward and backward; the same
routing in every variant), `ep_rows_max_over_mean` the slowest ep rank's expert rows over the mean (the floor's
ranks each compute their own tokens' rows: balanced), `saved_mb` the activations one rank's forward saves for
backward (saved-tensor hooks: the part of peak memory that differs between variants). JSON goes to
benchmarks/results/moe_step-<options>-cpu<cores>-<date>.json with the machine, versions, date and load average (at
the start of every layout and model too).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import machine, results_path  # noqa: E402  the house's machine record and results path

from cocoweave.sharding import local, local_data  # noqa: E402  a DTensor's local tensor; its storage

HEADS, KV_HEADS, VOCAB, BATCH, SEQ, LAYERS = 8, 4, 2048, 4, 128, 4
MODELS: dict[str, dict[str, Any]] = {
    "mixtral": dict(dim=256, n_experts=8, top_k=2, hidden_dim=896, score="softmax", normalize=True),
    "deepseek": dict(dim=256, n_experts=16, top_k=4, hidden_dim=224, score="sigmoid", normalize=True,
                     shared_hidden_dim=224),
}
ADAMW = {"lr": 3e-4, "weight_decay": 0.1}
VARIANTS = ("cocoweave", "cocoweave-gloo", "megatron", "torchtitan", "floor")
AB = ("cocoweave-sync", "cocoweave-program")  # A/B variants, only when named in --variants
PEERS = ("megatron", "torchtitan")


def build(model: str, group: Any, shape: dict[str, int]) -> nn.Module:
    from cocoweave.nn import LlamaConfig, MoEConfig, MoEModel

    spec = dict(MODELS[model])
    dim = spec.pop("dim")
    torch.manual_seed(0)
    return MoEModel(LlamaConfig(dim=dim, n_layers=shape["layers"], n_heads=HEADS, n_kv_heads=KV_HEADS,
                                vocab_size=VOCAB, max_seq_len=shape["seq"]), MoEConfig(**spec), group=group, seed=0)


# ---------------------------------------------------------------------------------------------------------
# Megatron-core's alltoall token dispatcher and SequentialMLP (megatron/core/transformer/moe/), in plain torch
# ---------------------------------------------------------------------------------------------------------

class MegatronExpert(nn.Module):
    """Megatron's MLP of a SequentialMLP expert with gated_linear_unit: linear_fc1 (gate and up fused), linear_fc2."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(w1.shape[0], 2 * w1.shape[1], bias=False)
        self.linear_fc2 = nn.Linear(w2.shape[0], w2.shape[1], bias=False)
        with torch.no_grad():
            self.linear_fc1.weight.copy_(torch.cat([w1.t(), w3.t()]))
            self.linear_fc2.weight.copy_(w2.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = torch.chunk(self.linear_fc1(x), 2, dim=-1)
        return self.linear_fc2(F.silu(gate) * up)


class MegatronMoE(nn.Module):
    """TopKRouter + MoEAlltoAllTokenDispatcher + SequentialMLP (+ shared expert) with the weights of a cocoweave
    MoE layer."""

    def __init__(self, moe: nn.Module, group: Any) -> None:
        super().__init__()
        self.group, self.ep, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.n_experts, self.top_k = moe.n_experts, moe.top_k
        self.score, self.normalize = moe.router.score, moe.router.normalize
        self.router = nn.Linear(moe.dim, moe.n_experts, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(moe.router.gate.weight)
        w1, w2, w3 = (local(w).detach() for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3))
        self.local_experts = nn.ModuleList(MegatronExpert(w1[e], w2[e], w3[e]) for e in range(w1.shape[0]))
        self.n_local = len(self.local_experts)
        self.shared_experts = None
        if moe.shared_experts is not None:
            s = moe.shared_experts
            self.shared_experts = MegatronExpert(s.w1.weight.detach().t(), s.w2.weight.detach().t(),
                                                 s.w3.weight.detach().t())
        self.sort_input_by_local_experts = torch.arange(self.n_experts).reshape(self.ep, self.n_local).T.ravel()
        self.restore_output_by_local_experts = torch.arange(self.n_experts).reshape(self.n_local, self.ep).T.ravel()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(probs (T, E) zero off the top-k, routing_map (T, E) bool): TopKRouter's topk_softmax_with_capacity."""
        logits = self.router(x).float()
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        top, idx = scores.topk(self.top_k, dim=-1)
        if self.normalize:
            top = top / (top.sum(-1, keepdim=True) + (1e-20 if self.score == "sigmoid" else 0.0))
        probs = torch.zeros_like(scores).scatter(1, idx, top)
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, idx, True)
        return probs, routing_map

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        probs, routing_map = self.route(x)
        # preprocess: counts all-gathered over ep (Megatron's gather_from_sequence_parallel_region)
        local_counts = routing_map.sum(dim=0).long()
        input_splits = local_counts.reshape(self.ep, self.n_local).sum(1).tolist()
        gathered = [torch.empty_like(local_counts) for _ in range(self.ep)]
        dist.all_gather(gathered, local_counts, group=self.group)
        first = self.rank * self.n_local
        per_local = torch.stack(gathered)[:, first:first + self.n_local]  # (ep, n_local)
        output_splits = per_local.sum(1).tolist()
        tokens_per_expert = per_local.sum(0).tolist()
        # permute (moe_utils.permute, unfused)
        rmap = routing_map.T.contiguous()
        sorted_indices = torch.arange(x.shape[0]).unsqueeze(0).expand(self.n_experts, -1).masked_select(rmap)
        permuted_probs = probs.T.contiguous().masked_select(rmap)
        permuted = x.index_select(0, sorted_indices)
        from cocoweave.nn.moe_dispatch import dispatch_all_to_all  # an autograd all_to_all_single, as Megatron's

        got = dispatch_all_to_all(permuted, input_splits, output_splits, self.group, library=True)
        got = _sort_chunks(got, per_local.ravel().tolist(), self.sort_input_by_local_experts)
        outs = [expert(t) for expert, t in zip(self.local_experts, torch.split(got, tokens_per_expert), strict=True)]
        out = torch.cat(outs)
        out = _sort_chunks(out, per_local.T.ravel().tolist(), self.restore_output_by_local_experts)
        back = dispatch_all_to_all(out, output_splits, input_splits, self.group, library=True)
        # unpermute
        back = back * permuted_probs.unsqueeze(-1).to(back.dtype)
        y = torch.zeros_like(x).scatter_add(0, sorted_indices.unsqueeze(1).expand(-1, x.shape[1]), back)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.view(shape)


def _sort_chunks(x: torch.Tensor, split_sizes: list[int], order: torch.Tensor) -> torch.Tensor:
    """Megatron's sort_chunks_by_idxs."""
    chunks = torch.split(x, split_sizes, dim=0)
    return torch.cat([chunks[i] for i in order.tolist()], dim=0)


# ---------------------------------------------------------------------------------------------------------
# torchtitan's MoE (the package) with the weights of a cocoweave MoE layer
# ---------------------------------------------------------------------------------------------------------

def titan_moe(moe: nn.Module, ep_mesh: Any) -> nn.Module:
    from torchtitan.distributed import utils as titan_dist
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    titan_dist.set_spmd_backend("dtensor")  # its default (spmd_types) reads its trainer's registered meshes
    d, E, k = moe.dim, moe.n_experts, moe.top_k
    w1, w2, w3 = (local(w).detach() for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3))
    hidden = w1.shape[2]
    shared = None
    if moe.shared_experts is not None:
        h = moe.shared_experts.w1.out_features
        shared = FeedForward.Config(w1=Linear.Config(in_features=d, out_features=h),
                                    w2=Linear.Config(in_features=h, out_features=d),
                                    w3=Linear.Config(in_features=d, out_features=h))
    config = MoE.Config(
        num_experts=E, load_balance_coeff=None, shared_experts=shared,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=d, hidden_dim=hidden, num_experts=E),
            token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=E, top_k=k)),
        router=TokenChoiceTopKRouter.Config(num_experts=E, gate=Linear.Config(in_features=d, out_features=E),
                                            top_k=k, score_func=moe.router.score, route_norm=moe.router.normalize))
    titan = config.build()
    experts = titan.routed_experts.inner_experts
    with torch.no_grad():  # its parallelize shards the experts Shard(0) over ep; the forward uses the local part
        experts.w1_EFD = nn.Parameter(w1.transpose(1, 2).contiguous())
        experts.w2_EDF = nn.Parameter(w2.transpose(1, 2).contiguous())
        experts.w3_EFD = nn.Parameter(w3.transpose(1, 2).contiguous())
        titan.router.gate.weight.copy_(moe.router.gate.weight)
        if shared is not None:
            for n in ("w1", "w2", "w3"):
                getattr(titan.shared_experts, n).weight.copy_(getattr(moe.shared_experts, n).weight)
    titan.routed_experts.token_dispatcher.wire_meshes(ep_mesh=ep_mesh)
    return titan


# ---------------------------------------------------------------------------------------------------------
# The variants and their step
# ---------------------------------------------------------------------------------------------------------

class Variant:
    """One variant's model on this rank, its optimizers and its step."""

    def __init__(self, name: str, model: str, mesh: Any, shape: dict[str, int]) -> None:
        from cocoweave.nn.compiled import Programs
        from cocoweave.nn.moe_dispatch import (
            library_exchange_counts,
            library_start_all_to_all,
            no_exchange,
            no_start,
            no_wait,
        )

        self.name = name
        ep_mesh = mesh["ep"]
        self.world = dist.get_world_size()
        self.dp = mesh["dp"].get_group() if mesh["dp"].size() > 1 else None
        net = build(model, ep_mesh, shape)
        for layer in net.layers.values():
            if name == "floor":
                layer.moe.start, layer.moe.wait, layer.moe.exchange = no_start, no_wait, no_exchange
            elif name == "cocoweave-gloo":
                layer.moe.start, layer.moe.exchange = library_start_all_to_all, library_exchange_counts
            elif name == "cocoweave-sync":  # A/B: no overlap of the shared expert with the all-to-alls
                layer.moe.overlap = False
            elif name == "cocoweave-program":  # A/B: the experts through the dropless programs, schedule "auto"
                moe = layer.moe
                moe.programs = Programs("auto", moe.group, moe.ep, moe.ep_rank)
            elif name == "megatron":
                layer.moe = MegatronMoE(layer.moe, ep_mesh.get_group())
            elif name == "torchtitan":
                layer.moe = titan_moe(layer.moe, ep_mesh)
        self.model = net.train()
        self.experts = [p for n, p in net.named_parameters() if _is_expert(n)]
        self.others = [p for n, p in net.named_parameters() if not _is_expert(n)]
        # every variant's AdamW updates plain tensors: a DTensor parameter through its local tensor (its gradient's
        # local tensor set before each step), as DistributedAdamW does, so no variant pays DTensor's dispatch per op
        self.locals = [(q, local_data(q)) for q in self.experts + self.others if hasattr(q, "to_local")]
        plain = [q for q in self.experts + self.others if not hasattr(q, "to_local")]
        self.optimizers = [torch.optim.AdamW(plain + [t for _, t in self.locals], **ADAMW, fused=True)]

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        for q, _ in self.locals:
            q.grad = None
        loss = self.loss(tokens)
        loss.backward()
        average_gradients(self.others, dist.group.WORLD if self.world > 1 else None, self.world)
        average_gradients(self.experts, self.dp, self.world)  # already summed over ep by the combine's backward
        for q, t in self.locals:
            t.grad = None if q.grad is None else local(q.grad)
        for opt in self.optimizers:
            opt.step()
        return loss.detach()


def _is_expert(name: str) -> bool:
    return any(part in name for part in (".experts.w", ".local_experts.", ".inner_experts."))


def average_gradients(params: list[torch.Tensor], group: Any, world: int) -> None:
    """Sum every gradient over `group` (None: no reduction) in one flat all-reduce and divide by the world: the
    data-parallel mean (the same helper in every variant)."""
    grads = [local(q.grad) for q in params if q.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if group is not None:
        dist.all_reduce(flat, group=group)
    flat /= world
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def saved_bytes(variant: Variant, tokens: torch.Tensor) -> int:
    """Bytes of the tensors one forward saves for backward (distinct storages)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = variant.loss(tokens)
    loss.backward()
    for opt in variant.optimizers:
        opt.zero_grad(set_to_none=True)
    return sum(seen.values())


def a2a_bytes(net: nn.Module, rank: int, ep: int, dim: int) -> int:
    """Bytes this rank sends to the other ep ranks in one step: the rows of every layer's last routing bound for
    another rank's experts, 4 times (dispatch and combine, forward and backward), fp32."""
    rows = 0
    for layer in net.layers.values():
        counts = layer.moe.tokens_per_expert.view(ep, -1).sum(1)
        rows += int(counts.sum() - counts[rank])
    return 4 * rows * dim * 4


def imbalance(net: nn.Module, ep_group: Any, ep: int) -> float:
    """The slowest ep rank's expert rows over the mean, averaged over the layers (their last routing): what the
    floor, each rank computing its own tokens' rows, does not pay."""
    counts = torch.stack([layer.moe.tokens_per_expert for layer in net.layers.values()])
    dist.all_reduce(counts, group=ep_group)
    rows = counts.view(counts.shape[0], ep, -1).sum(-1).double()
    return float((rows.max(1).values / rows.mean(1)).mean())


def timings(rank: int, world_size: int, model: str, dp: int, names: list[str], rounds: int, steps: int,
            warmup: int, shape: dict[str, int]) -> dict[str, Any]:
    import torch.distributed.tensor  # noqa: F401  DTensor's import paid here, not by the first variant built
    from torch.distributed.device_mesh import init_device_mesh

    from cocoweave.backends.torch.worker import timed_steps

    ep = world_size // dp
    mesh = init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp", "ep"))
    batches = [torch.randint(0, VOCAB, (shape["batch"], shape["seq"] + 1),
                             generator=torch.Generator().manual_seed(100 + r))
               for r in range(world_size)]
    tokens = batches[rank]

    # the single-process model on the whole batch: each rank's tokens in turn, losses / world, one AdamW step
    singles = [dist.new_group([r]) for r in range(world_size)]  # every rank makes every group, in order
    reference = build(model, singles[rank], shape)
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    ref_losses = []
    for _ in range(2):
        ref_opt.zero_grad()
        total = 0.0
        for b in batches:
            logits = reference(b[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), b[:, 1:].reshape(-1)) / world_size
            loss.backward()
            total += float(loss.detach())
        ref_opt.step()
        ref_losses.append(total)

    built, same, saved, sent, skew = {}, {}, {}, None, None
    for v in names:
        dist.barrier()
        built[v] = Variant(v, model, mesh, shape)
        losses = []
        for _ in range(2):
            whole = built[v].step(tokens).clone()
            dist.all_reduce(whole)
            losses.append(float(whole) / world_size)
        if v != "floor":
            same[v] = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
        if v == "cocoweave":
            sent = a2a_bytes(built[v].model, mesh["ep"].get_local_rank(), ep, MODELS[model]["dim"])
            skew = imbalance(built[v].model, mesh["ep"].get_group(), ep)
        built[v] = Variant(v, model, mesh, shape)  # timed from the same initial weights as the others
        saved[v] = saved_bytes(built[v], tokens)
    times: dict[str, list[float]] = {v: [] for v in names}
    cpu: dict[str, list[float]] = {v: [] for v in names}

    def step(v: str) -> torch.Tensor:
        start = time.process_time()  # this rank's CPU time, every thread (Gloo's too): little moved by other load
        loss = built[v].step(tokens)
        cpu[v].append((time.process_time() - start) * 1e3)
        return loss

    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for v in order:
            times[v] += timed_steps(lambda v=v: step(v), world_size, torch.device("cpu"), steps,
                                    warmup if r == 0 else 1)
    return {"times": times, "cpu": {v: statistics.median(c) for v, c in cpu.items()}, "same_work": same,
            "saved": saved, "a2a": sent, "imbalance": skew}


def summarise(label: str, ws: int, dp: int, model: str, names: list[str], per_rank: list[dict],
              titan_peer: bool) -> list[dict]:
    from cocoweave.backends.torch.worker import step_time_ms, step_times

    peers = [p for p in PEERS if titan_peer or p != "torchtitan"]
    rows = []
    for v in names:
        t = [r["times"][v] for r in per_rank]
        same = [r["same_work"][v] for r in per_rank if v in r["same_work"]]
        ms = step_time_ms(t)
        rows.append({"layout": label, "world": ws, "dp": dp, "ep": ws // dp, "model": model, "variant": v,
                     "kind": "floor" if v == "floor" else "peer" if v in peers else
                     "cocoweave" if v == "cocoweave" else "other",
                     "median_ms": ms, "step_ms": step_times(t), "tokens_per_s": ws * BATCH * SEQ / (ms / 1e3),
                     "cpu_ms": max(r["cpu"][v] for r in per_rank),
                     "a2a_mb": 0.0 if v == "floor" else max(r["a2a"] for r in per_rank) / 2**20,
                     "saved_mb": max(r["saved"][v] for r in per_rank) / 2**20,
                     "ep_rows_max_over_mean": None if v == "floor" else per_rank[0]["imbalance"],
                     "same_work_abs_diff": max(same) if same else None})
    peer_ms = [r["median_ms"] for r in rows if r["kind"] == "peer"]
    fastest = min(peer_ms) if peer_ms else None
    floor = next((r["median_ms"] for r in rows if r["kind"] == "floor"), None)
    ours = next(r["step_ms"] for r in rows if r["variant"] == "cocoweave")
    for r in rows:
        r["ratio_to_fastest_peer"] = None if fastest is None else r["median_ms"] / fastest
        r["ratio_to_floor"] = None if floor is None else r["median_ms"] / floor
        # the median over timed steps of cocoweave's step over this variant's step of the same round (the variants
        # take turns round by round): steadier than the ratio of medians when the machine's load moves
        r["paired_cocoweave_over"] = statistics.median(a / b for a, b in zip(ours, r["step_ms"], strict=True))
    return rows


def print_table(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for h in ("variant", "median ms", "CPU ms", "tokens/s", "vs fastest peer", "vs floor", "cocoweave / it, paired",
              "a2a MB/step", "saved MB", "same work (loss)"):
        table.add_column(h, justify="left" if h == "variant" else "right")
    for r in rows:
        table.add_row(r["variant"] + {"floor": " (limit)", "other": " (not a peer)"}.get(r["kind"], ""),
                      f"{r['median_ms']:.1f}", f"{r['cpu_ms']:.1f}", f"{r['tokens_per_s']:.0f}",
                      "-" if r["ratio_to_fastest_peer"] is None else f"{r['ratio_to_fastest_peer']:.2f}",
                      "-" if r["ratio_to_floor"] is None else f"{r['ratio_to_floor']:.2f}",
                      f"{r['paired_cocoweave_over']:.3f}", f"{r['a2a_mb']:.1f}",
                      f"{r['saved_mb']:.1f}",
                      "-" if r["same_work_abs_diff"] is None else f"{r['same_work_abs_diff']:.0e}")
    Console(width=160).print(table)


def layouts(spec: str) -> list[tuple[str, int, int]]:
    """'ep2,ep4,dp2xep2' -> [(label, world size, dp)]."""
    out = []
    for item in spec.split(","):
        dp_s, _, ep_s = item.rpartition("x")
        if not ep_s.startswith("ep") or (dp_s and not dp_s.startswith("dp")):
            raise SystemExit(f"--layouts: {item!r} is not epN or dpMxepN")
        dp = int(dp_s[2:]) if dp_s else 1
        out.append((item, dp * int(ep_s[2:]), dp))
    return out


def main(argv: list[str] | None = None) -> int:
    global BATCH, SEQ, LAYERS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mixtral,deepseek")
    ap.add_argument("--layouts", default="ep2", help="epN and dpMxepN, comma-separated (e.g. ep2,ep4,dp2xep2)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--titan-peer", action="store_true", help="count torchtitan (bf16 experts) as a peer")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="smoke test: 2 layers, batch 2 x seq 16, 1 round x 1 step")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 1, 1
        BATCH, SEQ, LAYERS = 2, 16, 2
    from cocoweave.launch import LocalWorld

    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS + AB]
    if unknown or "cocoweave" not in names:
        raise SystemExit(f"--variants: {', '.join(unknown) or 'no cocoweave'}; choose from {', '.join(VARIANTS + AB)}")
    if "torchtitan" in names and importlib.util.find_spec("torchtitan") is None:
        print("torchtitan is not installed (pip install --no-deps torchtitan==0.3.0 spmd_types tyro docstring_parser): "
              "timing the other variants")
        names.remove("torchtitan")
    doc: dict[str, Any] = {
        "command": "benchmarks/moe_step.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(), "models": {m: MODELS[m] for m in args.models.split(",")},
        "shape": {"layers": LAYERS, "heads": HEADS, "kv_heads": KV_HEADS, "vocab": VOCAB, "batch_per_rank": BATCH,
                  "seq": SEQ}, "variants": names, "rows": []}
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    for label, ws, dp in layouts(args.layouts):
        over = f", oversubscribed: {ws} ranks on {os.cpu_count()} cores" if ws > (os.cpu_count() or 1) else ""
        with LocalWorld(ws, timeout_s=1800) as world:
            for model in args.models.split(","):
                load = os.getloadavg()
                t0 = time.perf_counter()
                per_rank = world.run(timings, model, dp, names, args.rounds, args.steps, args.warmup,
                                     {"batch": BATCH, "seq": SEQ, "layers": LAYERS})
                rows = summarise(label, ws, dp, model, names, per_rank, args.titan_peer)
                for r in rows:
                    r["oversubscribed"], r["load_average_at_start"] = bool(over), load
                doc["rows"] += rows
                print_table(rows, f"{label}{over}: {model}, {LAYERS} layers, batch {BATCH} x seq {SEQ} per rank, "
                                  f"{args.rounds} rounds x {args.steps} steps, median of the slowest rank "
                                  f"(load {load[0]:.2f} at start, {time.perf_counter() - t0:.0f} s)")
    doc["machine"]["load_average_end"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    options = {"models": args.models, "layouts": args.layouts, "quick": args.quick}
    path = results_path(args.out, "moe_step", ap, options)
    path.write_text(json.dumps(doc, indent=1))
    print(f"\nJSON: {path}")
    bad = [f"{r['variant']} ({r['model']}, {r['layout']}): {r['same_work_abs_diff']:.1e}" for r in doc["rows"]
           if r["variant"] != "torchtitan" and r["same_work_abs_diff"] is not None and r["same_work_abs_diff"] > 1e-4]
    if bad:
        print("variants whose losses differ from the single-process model's: " + "; ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
