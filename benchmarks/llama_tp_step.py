"""One tensor-parallel training step of a Llama-family model (RMSNorm, RoPE, GQA, SwiGLU; torchtitan's names)
through `cocoweave.nn.parallelize`, against torch's own tensor parallelism with the same plan
(`parallelize_module`, what torchtitan runs, with and without its sequence-parallel plan) and the
communication-free floor, in the same rank processes, interleaved and repeated, on a LocalWorld of Gloo CPU ranks.

    .venv/bin/python benchmarks/llama_tp_step.py                      # dim 256 and 512, tp 2
    .venv/bin/python benchmarks/llama_tp_step.py --sizes 1024 --layouts tp2,tp4,dp2xtp2
    .venv/bin/python benchmarks/llama_tp_step.py --quick              # smoke: tiny model, one round

The model: cocoweave.nn.Llama (4 layers, 8 heads, 4 KV heads, SwiGLU hidden 8/3 x dim rounded to 256, vocab 2048),
batch 4 x seq 128, the same initial weights (seed 0) in every variant. The step, the same in every variant:
zero_grad, forward, cross-entropy on next tokens, backward, (with dp > 1: one flat all-reduce of the gradients over
dp, the same helper everywhere), clipping by the whole model's norm (max 1.0: sharded parts' squares summed over
tp, replicated ones counted once; the same helper everywhere, since torch's clip_grad_norm_ refuses a model mixing
DTensor and plain parameters, which torch's TP leaves), torch.optim.AdamW (foreach). Variants:

  torch-tp       torch.distributed.tensor.parallel.parallelize_module(model, mesh["tp"], llama_plan(model))
  torch-tp-sp    torchtitan's Llama 3 plan with sequence parallelism: the embedding's output and the norms sharded on
                 the sequence, the attention and feed-forward inputs gathered (PrepareModuleInput), the row outputs
                 reduce-scattered, the output projection's input gathered
  cocoweave      cocoweave.nn.parallelize(model, mesh, llama_plan(model)), its defaults (schedule="auto")
  cocoweave-sp   cocoweave.nn.parallelize(model, mesh, llama_plan(model, sequence_parallel=True)): torchtitan's
                 sequence-parallel plan (the one torch-tp-sp runs) on cocoweave's layers (nn/sequence.py)
  floor          each planned nn.Linear replaced by this rank's part of it with no collective at all: the same
                 sharded compute, a limit and not a peer (it computes partial sums)

Before timing, each variant but the floor trains two steps from the same weights and input and its losses are
compared with the single-process model's (`same_work`). The first 5 steps of each variant in this process, building
included, are timed once (`first5_ms`; cocoweave first, so it pays its compile cost, warm or cold on-disk caches as
the machine has them). Each round then times every variant for --steps steps after a warm-up, rotated; a step time
is the median over steps of the slowest rank's time (a barrier before each). JSON goes to
benchmarks/results/llama_tp_step-<options>-cpu<cores>-<date>.json with the machine, versions, date and load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tp_step import layouts  # noqa: E402  'tp2,dp2xtp2' -> (label, world size, dp), as tp_step reads it
from train_step import machine, results_path  # noqa: E402  the house's machine record and results path

from cocoweave.sharding import local  # noqa: E402  a DTensor's local tensor, a plain tensor as it is

LAYERS, HEADS, KV_HEADS, VOCAB, BATCH, SEQ, MAX_NORM = 4, 8, 4, 2048, 4, 128, 1.0
ADAMW = {"lr": 3e-4, "weight_decay": 0.1}
VARIANTS = ("cocoweave", "cocoweave-sp", "torch-tp", "torch-tp-sp", "floor")
PEERS = ("torch-tp", "torch-tp-sp")


def build(dim: int) -> nn.Module:
    from cocoweave.nn import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(dim=dim, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS, vocab_size=VOCAB,
                             max_seq_len=SEQ))


def titan_sp_plan(model: nn.Module) -> dict[str, Any]:
    """torchtitan's Llama 3 tensor-parallel plan with sequence parallelism (torchtitan/models/llama3/parallelize.py,
    loss not parallel), spelled out in torch's styles for cocoweave.nn.Llama's names."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(len(model.layers)):
        p = f"layers.{i}."
        plan.update({
            p + "attention_norm": SequenceParallel(),
            p + "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
            p + "attention.wq": ColwiseParallel(), p + "attention.wk": ColwiseParallel(),
            p + "attention.wv": ColwiseParallel(),
            p + "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            p + "ffn_norm": SequenceParallel(),
            p + "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            p + "feed_forward.w1": ColwiseParallel(), p + "feed_forward.w3": ColwiseParallel(),
            p + "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    return plan


def floor_model(model: nn.Module, tp: int, rank: int) -> nn.Module:
    """Each planned linear replaced by this rank's part of it, nothing communicated (the model's views count heads
    from the widths, so attention runs on the local heads)."""
    from cocoweave.nn import llama_plan
    from cocoweave.nn.parallelize import _matches, _set

    plan = llama_plan(model)
    for name, module in list(model.named_modules()):
        style = next((s for pat, s in plan.items() if _matches(pat, name)), None)
        if style is None:
            continue
        dim = 0 if type(style).__name__ == "ColwiseParallel" else 1
        w = module.weight.detach().chunk(tp, dim)[rank]
        part = nn.Linear(w.shape[1], w.shape[0], bias=False)
        with torch.no_grad():
            part.weight.copy_(w)
        _set(model, name, part)
    return model


def is_sharded(t: torch.Tensor) -> bool:
    return hasattr(t, "placements") and any(p.is_shard() for p in t.placements)


def clip_whole_(params: list[torch.Tensor], max_norm: float, tp_group: Any) -> torch.Tensor:
    """Clip by the whole model's norm: sharded parts' squares summed over tp, replicated ones once (every variant)."""
    grads = [q.grad for q in params if q.grad is not None]
    sharded = torch.zeros((), dtype=torch.float64)
    plain = torch.zeros((), dtype=torch.float64)
    for g in grads:
        sq = local(g).detach().double().pow(2).sum()
        if is_sharded(g):
            sharded += sq
        else:
            plain += sq
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(sharded, group=tp_group)
    norm = (sharded + plain).sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0).float()
    for g in grads:
        local(g).detach().mul_(scale)
    return norm


def average_gradients(params: list[torch.Tensor], group: Any) -> None:
    """The data-parallel mean of every gradient, one flat all-reduce (the same helper in every variant)."""
    grads = [local(q.grad) for q in params if q.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


class Variant:
    """One variant's model on this rank, its optimizers and its step."""

    def __init__(self, name: str, dim: int, mesh: Any) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        from cocoweave.nn import llama_plan, parallelize

        self.name = name
        tp_mesh = mesh["tp"]
        self.tp = tp_mesh.get_group()
        self.dp = mesh["dp"].get_group() if mesh["dp"].size() > 1 else None
        model = build(dim)
        if name == "cocoweave":
            parallelize(model, tp_mesh, llama_plan(model))
        elif name == "cocoweave-sp":
            parallelize(model, tp_mesh, llama_plan(model, sequence_parallel=True))
        elif name == "torch-tp":
            parallelize_module(model, tp_mesh, llama_plan(model))
        elif name == "torch-tp-sp":
            parallelize_module(model, tp_mesh, titan_sp_plan(model))
        else:
            floor_model(model, tp_mesh.size(), tp_mesh.get_local_rank())
        self.model = model.train()
        self.params = [q for q in model.parameters() if q.requires_grad]
        kinds: dict[bool, list[torch.Tensor]] = {}
        for q in self.params:  # torch's AdamW takes one kind per call of its foreach kernels
            kinds.setdefault(hasattr(q, "to_local"), []).append(q)
        self.optimizers = [torch.optim.AdamW(qs, **ADAMW) for qs in kinds.values()]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        x, y = tokens[:, :-1], tokens[:, 1:]
        logits = local(self.model(x))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        if self.dp is not None:
            average_gradients(self.params, self.dp)
        clip_whole_(self.params, MAX_NORM, self.tp)
        for opt in self.optimizers:
            opt.step()
        return loss.detach()


def timings(rank: int, world_size: int, dim: int, dp: int, names: list[str], rounds: int, steps: int,
            warmup: int) -> dict[str, Any]:
    import torch.distributed.tensor.parallel  # noqa: F401  every variant needs DTensor: its import (0.4-0.6 s)
    from torch.distributed.device_mesh import init_device_mesh  # is paid here, not by the first variant timed

    from cocoweave.backends.torch.worker import timed_steps

    tp = world_size // dp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_coordinate()[0]
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + dp_rank))

    # the single-process model on this rank's batch (with dp > 1 the ranks' batches differ: compare at dp 1 only)
    reference = build(dim)
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    ref_losses = []
    for _ in range(2):
        ref_opt.zero_grad()
        logits = reference(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        ref_opt.step()
        ref_losses.append(float(loss.detach()))

    first5, built, same = {}, {}, {}
    for v in names:
        dist.barrier()
        t0 = time.perf_counter()
        built[v] = Variant(v, dim, mesh)
        losses = [float(built[v].step(tokens)) for _ in range(5)]
        first5[v] = 1e3 * (time.perf_counter() - t0)
        if v != "floor" and dp == 1:
            same[v] = max(abs(a - b) for a, b in zip(losses[:2], ref_losses))
        built[v] = Variant(v, dim, mesh)  # timed from the same initial weights as the others
    times: dict[str, list[float]] = {v: [] for v in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for v in order:
            times[v] += timed_steps(lambda v=v: built[v].step(tokens), world_size, torch.device("cpu"), steps,
                                    warmup if r == 0 else 1)
    return {"times": times, "first5_ms": first5, "same_work": same}


def summarise(label: str, ws: int, dp: int, dim: int, names: list[str], per_rank: list[dict]) -> list[dict]:
    from cocoweave.backends.torch.worker import step_time_ms, step_times

    rows = []
    for v in names:
        t = [r["times"][v] for r in per_rank]
        same = [r["same_work"][v] for r in per_rank if v in r["same_work"]]
        rows.append({"layout": label, "world": ws, "dp": dp, "tp": ws // dp, "dim": dim, "variant": v,
                     "kind": "floor" if v == "floor" else "peer" if v in PEERS else "cocoweave",
                     "median_ms": step_time_ms(t), "step_ms": step_times(t),
                     "first5_ms": max(r["first5_ms"][v] for r in per_rank),
                     "same_work_abs_diff": max(same) if same else None})
    fastest = min(r["median_ms"] for r in rows if r["kind"] == "peer")
    floor = next((r["median_ms"] for r in rows if r["kind"] == "floor"), None)
    for r in rows:
        r["ratio_to_fastest_peer"] = r["median_ms"] / fastest
        r["ratio_to_floor"] = None if floor is None else r["median_ms"] / floor
    return rows


def print_table(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for h in ("variant", "median ms", "vs fastest peer", "vs floor", "first 5 steps ms", "same work (loss)"):
        table.add_column(h, justify="left" if h == "variant" else "right")
    for r in rows:
        table.add_row(r["variant"] + (" (limit)" if r["kind"] == "floor" else ""), f"{r['median_ms']:.1f}",
                      f"{r['ratio_to_fastest_peer']:.2f}",
                      "-" if r["ratio_to_floor"] is None else f"{r['ratio_to_floor']:.2f}", f"{r['first5_ms']:.0f}",
                      "-" if r["same_work_abs_diff"] is None else f"{r['same_work_abs_diff']:.0e}")
    Console(width=150).print(table)


def main(argv: list[str] | None = None) -> int:
    global BATCH, SEQ, LAYERS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256,512", help="model dims (the issue's set: 256,512,1024)")
    ap.add_argument("--layouts", default="tp2", help="tpN and dpMxtpN, comma-separated (e.g. tp2,tp4,dp2xtp2)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="smoke test: dim 64, 2 layers, seq 16, 1 round x 1 step")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.rounds, args.steps, args.warmup = "64", 1, 1, 1
        BATCH, SEQ, LAYERS = 2, 16, 2
    from cocoweave.launch import LocalWorld

    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not any(v in PEERS for v in names):
        raise SystemExit(f"--variants: {', '.join(unknown) or 'no peer'}; choose from {', '.join(VARIANTS)} "
                         "with at least one of " + ", ".join(PEERS))
    doc: dict[str, Any] = {
        "command": "benchmarks/llama_tp_step.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(), "model": {"layers": LAYERS, "heads": HEADS, "kv_heads": KV_HEADS, "vocab": VOCAB,
                                        "batch": BATCH, "seq": SEQ, "max_grad_norm": MAX_NORM},
        "variants": names, "rows": []}
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    for label, ws, dp in layouts(args.layouts):
        over = f", oversubscribed: {ws} ranks on {os.cpu_count()} cores" if ws > (os.cpu_count() or 1) else ""
        with LocalWorld(ws, timeout_s=1800) as world:
            for dim in (int(s) for s in args.sizes.split(",")):
                per_rank = world.run(timings, dim, dp, names, args.rounds, args.steps, args.warmup)
                rows = summarise(label, ws, dp, dim, names, per_rank)
                for r in rows:
                    r["oversubscribed"] = bool(over)
                doc["rows"] += rows
                print_table(rows, f"{label}{over}: Llama dim {dim}, {LAYERS} layers, batch {BATCH} x seq {SEQ}, "
                                  f"{args.rounds} rounds x {args.steps} steps, median of the slowest rank")
    doc["machine"]["load_average_end"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    options = {"sizes": args.sizes, "layouts": args.layouts, "quick": args.quick}
    path = results_path(args.out, "llama_tp_step", ap, options)
    path.write_text(json.dumps(doc, indent=1))
    print(f"\nJSON: {path}")
    bad = [f"{r['variant']} (dim {r['dim']}, {r['layout']}): {r['same_work_abs_diff']:.1e}" for r in doc["rows"]
           if r["same_work_abs_diff"] is not None and r["same_work_abs_diff"] > 1e-4]
    if bad:
        print("variants whose losses differ from the single-process model's: " + "; ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
