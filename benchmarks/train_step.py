"""One training step (zero_grad + forward + backward + step) of cocoweave's drop-in optimizers against the strongest
plain-torch peers, in the same run, interleaved and repeated, on a LocalWorld of Gloo CPU ranks.

    .venv/bin/python benchmarks/train_step.py                       # both models, worlds 2 and 4, AdamW and SGD
    .venv/bin/python benchmarks/train_step.py --models small --worlds 2 --rounds 3 --steps 8
    .venv/bin/python benchmarks/train_step.py --memory              # peak memory, 8 x Linear(2048, 2048)
    .venv/bin/python benchmarks/train_step.py --device cuda --worlds 1 --backend nccl   # on a GPU (gpu_check.sh)

--memory runs each variant in fresh ranks and reports, above the bare model, rank 0's peak RSS (VmHWM) and its
peak PSS (sampled after construction and after every backward and step). RSS counts a page shared by several
ranks fully in each of them, PSS divides it between them: cocoweave keeps on one host the parameters once for all
ranks and reads the others' gradient buckets in place, so its PSS is the fairer share of the machine's memory, and
its RSS counts those shared pages in every rank. `cocoweave-adamw` compiles its update with torch.compile (the
default route on CPU); `cocoweave-adamw:eager` runs the same schedule with the update as eager torch ops.

Models (one per run, same initial weights everywhere): "small", 5.3M parameters (Embedding 4096x256, 4 x
nn.TransformerEncoderLayer(256, 4 heads, ffn 1024), Linear head) and "large", 25.1M (Embedding 6144x512, 6 x
TransformerEncoderLayer(512, 8 heads, ffn 2048), Linear head); each rank trains on its own batch of 4 x 64 tokens.
Variants: DDP + AdamW(foreach), DDP + AdamW(fused=True), DDP + ZeroRedundancyOptimizer(AdamW fused), FSDP2
fully_shard + AdamW, and cocoweave.optim.DistributedAdamW (schedule "auto", and forced onto the library collectives
— Gloo, no shared memory — for comparison); likewise DDP + SGD(momentum, foreach / fused) against DistributedSGD.
Every variant lives in the same rank processes; each round times every variant for --steps steps after one
warm-up step, in a rotated order. The step time of a variant is the median over all its steps of the slowest
rank's time (each step starts after a barrier); the table gives it, its ratio to the fastest peer (the fastest
variant that is not cocoweave) and the optimizer-state bytes per rank. JSON goes to
benchmarks/results/train_step-<device>-<date>.json (options other than the defaults named before <device>) with the
machine, versions, date and load average; --memory to memory-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

MODELS = {"small": (4096, 256, 4, 1024, 4), "large": (6144, 512, 6, 2048, 8)}  # vocab, d, layers, ffn, heads
BATCH, SEQ = 4, 64
ADAMW = {"lr": 3e-4, "weight_decay": 0.1}
SGD = {"lr": 0.05, "momentum": 0.9}


class LM(torch.nn.Module):
    """Embedding, a stack of transformer encoder layers, a linear head (no dropout: every variant computes alike)."""

    def __init__(self, vocab: int, d: int, layers: int, ffn: int, heads: int):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(torch.nn.TransformerEncoderLayer(d, heads, ffn, dropout=0.0,
                                                                           batch_first=True) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def make_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return LM(*MODELS[name])


def state_bytes(opt: Any) -> int:
    """Bytes of optimizer state this rank holds (cocoweave: kept slices and whole state, not the parameters)."""
    from cocoweave.optim import DistributedOptimizer

    if isinstance(opt, DistributedOptimizer):
        total = 0
        for b in opt._buckets:
            total += sum(t.numel() * t.element_size() for n, t in b.state.items() if t is not b.data)
            total += sum(t.numel() * t.element_size() for t in b.exe.kept.values())
        return total
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer wraps the local optimizer
    total = 0
    for st in inner.state.values():
        for t in st.values():
            if isinstance(t, torch.Tensor):
                local = t.to_local() if hasattr(t, "to_local") else t
                total += local.numel() * local.element_size() if local.dim() else 0
    return total


def build(variant: str, model_name: str) -> tuple[Any, Any]:
    """(module to run forward, optimizer) of one variant, on a fresh copy of the model."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cocoweave.launch import rank_device
    from cocoweave.optim import DistributedAdamW, DistributedSGD

    model = make_model(model_name).to(rank_device())  # the LocalWorld's device (--device)
    kind, _, how = variant.partition(":")
    if kind == "cocoweave-adamw":
        return model, DistributedAdamW(model.parameters(), **ADAMW, schedule=how or "auto")
    if kind == "cocoweave-adamw-eager":  # the update as eager torch ops (no torch.compile)
        return model, DistributedAdamW(model.parameters(), **ADAMW, schedule=how or "auto", kernels="torch")
    if kind == "cocoweave-sgd":
        return model, DistributedSGD(model.parameters(), **SGD, schedule=how or "auto")
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), **ADAMW)
    ddp = DDP(model)
    if kind == "ddp-zero":
        return ddp, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW, fused=True)
    if kind == "ddp-adamw":
        return ddp, torch.optim.AdamW(model.parameters(), **ADAMW, **({"fused": True} if how == "fused" else
                                                                       {"foreach": True}))
    return ddp, torch.optim.SGD(model.parameters(), **SGD, **({"fused": True} if how == "fused" else
                                                                {"foreach": True}))


def variants(optimizer: str, eager: bool = False) -> list[str]:
    if optimizer == "adamw":
        return ["ddp-adamw:foreach", "ddp-adamw:fused", "ddp-zero", "fsdp2", "cocoweave-adamw",
                "cocoweave-adamw:RS-C-AG+slice(m,v)"] + (["cocoweave-adamw-eager"] if eager else [])
    return ["ddp-sgd:foreach", "ddp-sgd:fused", "cocoweave-sgd", "cocoweave-sgd:RS-C-AG+slice(buf)"]


def timings(rank: int, world_size: int, model_name: str, names: list[str], rounds: int, steps: int) -> dict:
    """Every variant's step times on this rank (ms), rounds interleaved; and its optimizer-state bytes."""
    from cocoweave.backends.torch.worker import timed_steps

    built = {v: build(v, model_name) for v in names}
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, MODELS[model_name][0], (BATCH, SEQ), generator=gen)
    y = torch.randint(0, MODELS[model_name][0], (BATCH, SEQ), generator=gen)
    vocab = MODELS[model_name][0]
    device = next(built[names[0]][0].parameters()).device
    x, y = x.to(device), y.to(device)
    times: dict[str, list[float]] = {v: [] for v in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for v in order:
            run, opt = built[v]

            def step(run=run, opt=opt) -> None:
                opt.zero_grad()
                torch.nn.functional.cross_entropy(run(x).reshape(-1, vocab), y.reshape(-1)).backward()
                opt.step()

            times[v] += timed_steps(step, world_size, device, steps, 3 if r == 0 else 1)
    return {"times": times, "state_bytes": {v: state_bytes(built[v][1]) for v in names},
            "schedules": {v: [b.schedule.name for b in built[v][1]._buckets] for v in names
                          if v.startswith("cocoweave")}}


def _status(field: str) -> int:
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _pss() -> int:
    try:
        with open("/proc/self/smaps_rollup", encoding="utf-8") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
    except (OSError, StopIteration):
        return 0


def memory(rank: int, world_size: int, variant: str, steps: int) -> dict[str, int]:
    """Peak memory of one variant on this rank above the bare model: 8 x Linear(2048, 2048) fp32, 5 steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)])
    gc.collect()
    base = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # peak RSS from here on
        f.write("5")
    run, opt = build_for(variant, model)
    pss = [_pss()]
    x = torch.randn(32, 2048, generator=torch.Generator().manual_seed(rank))
    for _ in range(steps):
        opt.zero_grad()
        run(x).square().mean().backward()
        pss.append(_pss())
        opt.step()
        pss.append(_pss())
        dist.barrier()
    return {"peak_rss": _status("VmHWM") - base, "pss": pss[-1] - base, "peak_pss": max(pss) - base,
            "state_bytes": state_bytes(opt)}


def build_for(variant: str, model: torch.nn.Module) -> tuple[Any, Any]:
    """A variant around a given model (the memory test's MLP)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cocoweave.optim import DistributedAdamW

    if variant.startswith("cocoweave-adamw"):  # ":eager": the update as eager torch ops, no torch.compile at all
        kernels = "torch" if variant.endswith(":eager") else None
        return model, DistributedAdamW(model.parameters(), **ADAMW, kernels=kernels)
    if variant == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), **ADAMW)
    ddp = DDP(model)
    if variant == "ddp-zero":
        return ddp, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW, fused=True)
    return ddp, torch.optim.AdamW(model.parameters(), **ADAMW, fused=True)


def machine() -> dict[str, Any]:
    import cocoweave

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "cocoweave": cocoweave.__version__, "load_average": os.getloadavg(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


def results_path(out: Path, name: str, ap: argparse.ArgumentParser, options: dict[str, Any]) -> Path:
    """Where a benchmark's JSON goes: out/<name>-<each option not at its default>-cpu<cores>-<date>.json."""
    tag = "".join(f"-{k}-{v}".replace(",", "+") for k, v in options.items() if v != ap.get_default(k))
    return out / f"{name}{tag}-cpu{os.cpu_count()}-{datetime.date.today().isoformat()}.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="small,large")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--optimizers", default="adamw,sgd")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--memory", action="store_true", help="peak memory per variant instead of step times")
    ap.add_argument("--repeats", type=int, default=3, help="--memory: fresh runs of each variant (median reported)")
    ap.add_argument("--eager", action="store_true", help="also time DistributedAdamW with its update as eager ops")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the ranks' models live")
    ap.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                    help="the ranks' process group (auto: NCCL with a GPU per rank, else Gloo)")
    args = ap.parse_args()
    from cocoweave.backends.torch.worker import step_time_ms, step_times
    from cocoweave.launch import LocalWorld

    worlds = [int(w) for w in args.worlds.split(",")]
    doc: dict[str, Any] = {"command": "benchmarks/train_step.py " + " ".join(os.sys.argv[1:]), "machine": machine(),
                           "rows": []}
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    if args.memory:  # every variant in fresh ranks, the variants taking turns, --repeats times
        names = ["ddp-adamw:fused", "ddp-zero", "fsdp2", "cocoweave-adamw", "cocoweave-adamw:eager"]
        for ws in worlds:
            runs: dict[str, list[dict]] = {v: [] for v in names}
            for _ in range(args.repeats):
                for v in names:
                    with LocalWorld(ws, timeout_s=900) as world:
                        runs[v].append(world.run(memory, v, 5)[0])
            print(f"\nworld {ws}: MiB above the bare model, median (min-max) of {args.repeats} fresh runs")
            for v in names:
                row = {"world": ws, "variant": v, "runs": runs[v], "state_bytes": runs[v][0]["state_bytes"]}
                for k in ("peak_rss", "peak_pss"):
                    xs = sorted(r[k] for r in runs[v])
                    row[k] = xs[len(xs) // 2]
                    row[k + "_range"] = [xs[0], xs[-1]]
                doc["rows"].append(row)
                print(f"  {v:<22} peak RSS {row['peak_rss'] / 2**20:6.1f} ({row['peak_rss_range'][0] / 2**20:.0f}-"
                      f"{row['peak_rss_range'][1] / 2**20:.0f})  peak PSS {row['peak_pss'] / 2**20:6.1f} "
                      f"({row['peak_pss_range'][0] / 2**20:.0f}-{row['peak_pss_range'][1] / 2**20:.0f})  "
                      f"optimizer state {row['state_bytes'] / 2**20:6.1f}")
    else:
        for ws in worlds:
            with LocalWorld(ws, backend=args.backend, device=args.device, timeout_s=1800) as world:
                for model_name in args.models.split(","):
                    for optimizer in args.optimizers.split(","):
                        names = variants(optimizer, args.eager)
                        per_rank = world.run(timings, model_name, names, args.rounds, args.steps)
                        rows = []
                        for v in names:
                            t = [r["times"][v] for r in per_rank]
                            rows.append({"world": ws, "model": model_name, "optimizer": optimizer, "variant": v,
                                         "median_ms": step_time_ms(t), "step_ms": step_times(t),
                                         "state_bytes": per_rank[0]["state_bytes"][v],
                                         "schedules": per_rank[0]["schedules"].get(v)})
                        fastest = min(r["median_ms"] for r in rows if not r["variant"].startswith("cocoweave"))
                        params = sum(p.numel() for p in make_model(model_name).parameters())
                        print(f"\n{optimizer}, {model_name} model ({params / 1e6:.1f}M parameters), {ws} "
                              f"{world.backend} {args.device} ranks, {os.cpu_count()} cores, {args.rounds} rounds x "
                              f"{args.steps} steps")
                        print(f"{'variant':<40} {'median ms':>10} {'vs fastest peer':>16} {'state MiB/rank':>15}")
                        for r in rows:
                            r["ratio_to_fastest_peer"] = r["median_ms"] / fastest
                            print(f"{r['variant']:<40} {r['median_ms']:>10.1f} {r['ratio_to_fastest_peer']:>16.2f} "
                                  f"{r['state_bytes'] / 2**20:>15.1f}")
                        doc["rows"] += rows
    doc["machine"]["load_average_end"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    kind = "memory" if args.memory else "train_step"
    options = {"models": args.models, "worlds": args.worlds, "optimizers": args.optimizers, "eager": args.eager,
               "backend": args.backend}
    tag = "".join(f"-{k}-{v}".replace(",", "+") for k, v in options.items() if v != ap.get_default(k))
    where = f"cpu{os.cpu_count()}" if args.device == "cpu" else args.device
    path = args.out / f"{kind}{'' if args.memory else tag}-{where}-{datetime.date.today().isoformat()}.json"
    path.write_text(json.dumps(doc, indent=1))
    print(f"\nJSON: {path}")


if __name__ == "__main__":
    main()
