"""One pipeline-parallel training step (zero_grad + the schedule's forwards and backwards + optimizer step) of the GPT
example with 8 blocks at pp 2 x tp 2 on a LocalWorld of 4 Gloo CPU ranks: torch.distributed.pipelining as a user
writes it (each stage tensor-parallel with torch's own TP, DTensor `parallelize_module`, the stage's whole
replicated activation sent to the next stage) against cocoweave.nn.Pipeline (cocoweave.nn.TransformerBlock stages,
each tp rank sending 1/tp of the activation and the next stage all-gathering it), in the same run.

    .venv/bin/python benchmarks/pipeline_step.py                          # GPipe and 1F1B, 3 rounds x 2 steps
    .venv/bin/python benchmarks/pipeline_step.py --schedules 1f1b --rounds 2 --steps 2 --dropout 0

Variants: "torch-tp:full" (DTensor TP, full sends, one fused torch AdamW per kind of parameter since torch's fused
kernel refuses a mix of DTensor and plain tensors), "cocoweave:full" (cocoweave's stages with the full send: the
boundary's A/B), "cocoweave:sliced" (the sliced boundary) and "cocoweave:sp" (sequence-parallel blocks: the stage's
last matmul reduce-scatters, its epilogue runs on the slice, the slice crosses, the next stage all-gathers before its
first matmul: RS-C-P2P-AG), the cocoweave.nn layers with schedule=--layers (default "auto": measured on the first
step, in the warm-up), each with DistributedAdamW over the (size-1) data-parallel group. Every variant and
schedule lives in the same rank processes; each round times every one
for --steps steps after a warm-up (the first round's warm-up also infers the engine's shapes), in a rotated
order. A step's time is the slowest rank's (each step starts after a barrier); the table gives the median, the
ratio to the torch variant of the same schedule, the bytes each rank sends across the boundary per
micro-batch (activations forward, gradients backward; counted on the engine's own sends) and the bubble: the
fraction of a rank's step outside its stage's forward and backward chunks (mean over ranks) beside the
schedule's theoretical (p - 1) / (m + p - 1). --memory instead runs each (variant, schedule) in fresh ranks and
reports each rank's peak RSS during a first step and --steps more above its RSS with the model built (activations
in flight, gradients, optimizer state, and for cocoweave the compiled programs and "auto"'s measurement).
JSON goes to benchmarks/results/pipeline_step-<device>-<date>.json (pipeline_memory-... with --memory) with the
machine, versions, date and load average.
"""

from __future__ import annotations

import argparse
import datetime
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

sys.path.insert(0, str(Path(__file__).parent))
from schedules import machine  # noqa: E402 - the benchmarks' one description of the machine

CONFIG = {"blocks": 8, "d_model": 512, "heads": 8, "seq": 128, "batch": 16, "microbatches": 8, "vocab": 64,
          "tp": 2, "pp": 2, "lr": 3e-4}
VARIANTS = ("torch-tp:full", "cocoweave:full", "cocoweave:sliced", "cocoweave:sp")


class Embed(nn.Module):
    """Token and position embeddings (the first stage's input module, replicated over the tp group)."""

    def __init__(self, vocab: int, d: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Head(nn.Module):
    """Final LayerNorm and the vocabulary head (the last stage's output module)."""

    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.ln, self.out = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


class TorchBlock(nn.Module):
    """The pre-LN block as a torch user writes it (nn.Linear, nn.Dropout); q/k/v ordered (head, qkv, dim) so that
    ColwiseParallel's slice holds whole heads, the head count read from the local width."""

    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.hd = d // heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T = x.shape[:2]
        q, k, v = self.qkv(self.ln1(x)).view(B, T, -1, 3, self.hd).permute(3, 0, 2, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x = x + self.drop(self.proj(a))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class TorchStage(nn.Module):
    """A stage of TorchBlocks with the first stage's Embed and the last stage's Head."""

    def __init__(self, blocks: list[nn.Module], first: nn.Module | None, last: nn.Module | None) -> None:
        super().__init__()
        self.first, self.blocks, self.last = first, nn.ModuleList(blocks), last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x) if self.first is not None else x
        for b in self.blocks:
            x = b(x)
        return self.last(x) if self.last is not None else x


def _loss(vocab: int) -> Any:
    def ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))
    return ce


class Run:
    """One variant under one schedule on this rank: step() runs zero_grad, the schedule and the optimizer."""

    def __init__(self, variant: str, schedule: str, cfg: dict[str, Any], dropout: float, layers: str) -> None:
        from cocoweave.nn import Pipeline, TransformerBlock, parallel_mesh
        from cocoweave.nn.pipeline import SCHEDULES, CountingStage, stage_blocks
        from cocoweave.optim import DistributedAdamW

        mesh = parallel_mesh(tensor_parallel=cfg["tp"], pipeline_parallel=cfg["pp"])
        tp_group = mesh.get_group("tp")
        V, d, m = cfg["vocab"], cfg["d_model"], cfg["microbatches"]
        pp_rank = dist.get_rank(mesh.get_group("pp"))
        is_first, is_last = pp_rank == 0, pp_rank == cfg["pp"] - 1
        torch.manual_seed(0)  # every rank alike: the tp ranks of a stage draw the same nn.Dropout masks
        if variant.startswith("cocoweave"):
            sp = variant.endswith(":sp")
            self.pipe = Pipeline(mesh, n_blocks=cfg["blocks"],
                                 block=lambda i: TransformerBlock(d, cfg["heads"], dropout=dropout, group=tp_group,
                                                                  seed=100 * i, schedule=layers,
                                                                  sequence_parallel=sp),
                                 first=lambda: Embed(V, d, cfg["seq"]), last=lambda: Head(V, d), loss_fn=_loss(V),
                                 microbatches=m, pipeline_schedule=schedule, sliced=not variant.endswith(":full"),
                                 sequence_parallel=sp)
            self.stages, self.modules = self.pipe.stages, self.pipe.modules
            self.opt = DistributedAdamW(list(self.pipe.parameters()), lr=cfg["lr"], process_group=mesh.get_group("dp"))
            self.schedule = self.pipe.pipeline_schedule
        else:
            from torch.distributed.tensor import DTensor
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            blocks = []
            for _ in stage_blocks(cfg["blocks"], cfg["pp"], pp_rank):
                blk = TorchBlock(d, cfg["heads"], dropout)
                blocks.append(parallelize_module(blk, mesh["tp"], {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
                                                                   "fc1": ColwiseParallel(),
                                                                   "fc2": RowwiseParallel()}))
            mod = TorchStage(blocks, Embed(V, d, cfg["seq"]) if is_first else None, Head(V, d) if is_last else None)
            self.modules = [mod]
            self.stages = [CountingStage(mod, pp_rank, cfg["pp"], torch.device("cpu"), group=mesh.get_group("pp"))]
            self.schedule = SCHEDULES[schedule][0](self.stages[0], m, loss_fn=_loss(V))
            params = list(mod.parameters())
            kinds = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
            self.opts = [torch.optim.AdamW(ps, lr=cfg["lr"], fused=True) for ps in kinds if ps]
        self.variant, self.is_first, self.is_last, self.busy = variant, is_first, is_last, 0.0
        for stage in self.stages:  # time the stage's own forward and backward chunks: the rest is the bubble
            for name in ("forward_one_chunk", "backward_one_chunk"):
                setattr(stage, name, self._timed(getattr(stage, name)))

    def _timed(self, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - t0
        return run

    def step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> None:
        if self.variant.startswith("cocoweave"):
            self.opt.zero_grad()
            self.pipe.step(x, y, step=step, no_sync=self.opt.no_sync)
            self.opt.step()
            return
        for o in self.opts:
            o.zero_grad()
        self.schedule.step(*((x,) if self.is_first else ()), target=y if self.is_last else None)
        for o in self.opts:
            o.step()

    def sent(self) -> dict[str, int]:
        return {k: sum(s.sent[k] for s in self.stages) for k in ("forward", "backward")}


def _status(field: str) -> int:
    with open("/proc/self/status", encoding="utf-8") as f:
        return next((int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":")), 0)


def timings(rank: int, world_size: int, cfg: dict[str, Any], names: list[str], schedules: list[str], rounds: int,
            steps: int, dropout: float, layers: str) -> dict[str, Any]:
    """Every (variant, schedule)'s step times on this rank (ms), rounds interleaved; bytes sent per micro-batch,
    and busy fraction of its steps."""
    from cocoweave.backends.torch.worker import timed_steps

    torch.set_num_threads(1)
    keys = [f"{v}/{s}" for s in schedules for v in names]
    runs = {k: Run(*k.split("/"), cfg, dropout, layers) for k in keys}
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=gen)
    y = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=gen)
    out: dict[str, Any] = {k: {"times": [], "busy": [], "bytes": None} for k in keys}
    counter = [0]
    for r in range(rounds):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            run = runs[k]
            warm = 2 if r == 0 else 1
            busy: list[float] = []

            def step(run: Run = run, busy: list[float] = busy) -> None:
                counter[0] += 1
                run.busy = 0.0
                t0 = time.perf_counter()
                run.step(x, y, counter[0])
                busy.append(run.busy / (time.perf_counter() - t0))

            before = run.sent()
            times = timed_steps(step, world_size, torch.device("cpu"), steps, warm)
            after = run.sent()
            out[k]["times"] += times
            out[k]["busy"] += busy[warm:]
            per_mb = {d: (after[d] - before[d]) / ((steps + warm) * cfg["microbatches"]) for d in after}
            out[k]["bytes"] = per_mb
    return out


def memory(rank: int, world_size: int, cfg: dict[str, Any], key: str, steps: int, dropout: float,
           layers: str) -> dict[str, int]:
    """Peak RSS of one (variant, schedule) in fresh ranks during a first step and `steps` more, above this rank's
    memory with the model built: activations in flight, gradients, optimizer state, compiled programs."""
    import gc

    torch.set_num_threads(1)
    run = Run(*key.split("/"), cfg, dropout, layers)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=gen)
    y = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=gen)
    gc.collect()
    dist.barrier()
    base = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM from here on
        f.write("5")
    for i in range(steps + 1):  # the first also infers shapes, measures "auto" and allocates optimizer state
        run.step(x, y, i)
    return {"peak_rss_bytes": _status("VmHWM") - base, "base_rss_bytes": base}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules", default="gpipe,1f1b")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--layers", default="auto",
                    help="cocoweave.nn layers' schedule= (auto, 'as written', a name; sequence parallel: auto)")
    ap.add_argument("--memory", action="store_true",
                    help="peak RSS per variant and schedule, each in a fresh world, instead of step times")
    ap.add_argument("--d-model", type=int, default=CONFIG["d_model"])
    ap.add_argument("--seq", type=int, default=CONFIG["seq"])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    from cocoweave.backends.torch.worker import step_time_ms, step_times
    from cocoweave.launch import LocalWorld

    cfg = CONFIG | {"d_model": args.d_model, "seq": args.seq}
    world = cfg["tp"] * cfg["pp"]
    names, schedules = args.variants.split(","), args.schedules.split(",")
    doc: dict[str, Any] = {"command": "benchmarks/pipeline_step.py " + " ".join(sys.argv[1:]),
                           "machine": machine("cpu", world),
                           "config": cfg | {"dropout": args.dropout, "layers": args.layers},
                           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "rows": []}
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    if args.memory:
        print(f"peak RSS above the built model over 1 + {args.steps} steps, fresh ranks per variant")
        for s in schedules:
            for v in names:
                with LocalWorld(world, timeout_s=1800) as lw:
                    got = lw.run(memory, cfg, f"{v}/{s}", args.steps, args.dropout, args.layers)
                row = {"variant": v, "schedule": s, "peak_rss_bytes": [g["peak_rss_bytes"] for g in got],
                       "base_rss_bytes": [g["base_rss_bytes"] for g in got]}
                doc["rows"].append(row)
                print(f"  {v + ' ' + s:<28} per rank MiB: "
                      + " ".join(f"{b / 2**20:6.1f}" for b in row["peak_rss_bytes"]))
        _write(doc, args, ap, "pipeline_memory")
        return
    with LocalWorld(world, timeout_s=1800) as lw:
        per_rank = lw.run(timings, cfg, names, schedules, args.rounds, args.steps, args.dropout, args.layers)
    p, m = cfg["pp"], cfg["microbatches"]
    activation = cfg["batch"] // m * cfg["seq"] * cfg["d_model"] * 4
    print(f"\nGPT {cfg['blocks']} blocks d{cfg['d_model']}, seq {cfg['seq']}, batch {cfg['batch']} in {m} "
          "micro-batches, "
          f"pp {p} x tp {cfg['tp']} on {world} Gloo CPU ranks, {os.cpu_count()} cores, dropout {args.dropout}, "
          f"{args.rounds} rounds x {args.steps} steps; activation {activation / 1024:.0f} KiB per micro-batch")
    print(f"{'variant':<28} {'median ms':>10} {'vs torch':>9} {'KiB/mb fwd':>11} {'KiB/mb bwd':>11} "
          f"{'bubble':>7} {'theory':>7}")
    for s in schedules:
        rows = []
        for v in names:
            k = f"{v}/{s}"
            t = [r[k]["times"] for r in per_rank]
            senders = [r[k]["bytes"] for r in per_rank]
            row = {"variant": v, "schedule": s, "median_ms": step_time_ms(t), "step_ms": step_times(t),
                   "bytes_per_microbatch": {"forward": max(b["forward"] for b in senders),
                                            "backward": max(b["backward"] for b in senders)},
                   "bytes_per_rank": senders, "activation_bytes": activation,
                   "boundary_bytes_per_microbatch": sum(b["forward"] for b in senders) / (p - 1),
                   "bubble": 1 - statistics.mean(statistics.median(r[k]["busy"]) for r in per_rank),
                   "bubble_theory": (p - 1) / (m + p - 1)}
            rows.append(row)
        base = next((r["median_ms"] for r in rows if r["variant"] == "torch-tp:full"), None)
        for r in rows:
            r["ratio_to_torch"] = r["median_ms"] / base if base else None
            print(f"{r['variant'] + ' ' + s:<28} {r['median_ms']:>10.1f} "
                  f"{r['ratio_to_torch'] if base else float('nan'):>9.2f} "
                  f"{r['bytes_per_microbatch']['forward'] / 1024:>11.0f} "
                  f"{r['bytes_per_microbatch']['backward'] / 1024:>11.0f} "
                  f"{r['bubble']:>7.1%} {r['bubble_theory']:>7.1%}")
        doc["rows"] += rows
    _write(doc, args, ap, "pipeline_step")


def _write(doc: dict[str, Any], args: argparse.Namespace, ap: argparse.ArgumentParser, kind: str) -> None:
    doc["machine"]["load_average_end"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    options = ("schedules", "variants", "dropout", "d_model", "seq", "layers")
    tag = "".join(f"-{k}-{getattr(args, k)}".replace(",", "+").replace(" ", "_") for k in options
                  if getattr(args, k) != ap.get_default(k))
    path = args.out / f"{kind}{tag}-cpu{os.cpu_count()}-{datetime.date.today().isoformat()}.json"
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
