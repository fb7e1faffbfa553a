"""1-D vs 2-D vs 3-D tensor parallelism of a transformer MLP block (cocoweave.workloads.mlp_1d/2d/3d): the cost
model's communication volume and step time per rank over world sizes and hidden sizes, the crossover where 2-D
and 3-D beat 1-D, and beside it what can be measured here (the torch backend on this machine's ranks). Every
figure is labelled: "modelled" (the analytic cost model, perf/costmodel.py, no run) or "measured".

    PYTHONPATH=src python benchmarks/meshes.py                  # model, then measure 1-D/2-D at 4 ranks, 1-D/3-D at 8
    PYTHONPATH=src python benchmarks/meshes.py --no-measure     # the model only (seconds)
    PYTHONPATH=src python benchmarks/meshes.py --calibration .cocoweave/calibration-torch-cpu-w4.json

The model prices each block under a calibration: by default a *modelled reference cluster* (constants below,
not measured: an H100 per rank with DESIGN.md's GEMM rate and memory bandwidth, and a flat network of 50 GB/s and
20 us per collective per rank), or a `perf calibrate` file. For each (world size, hidden size, parallelism) it
prices every schedule cocoweave enumerates and keeps the fastest, as the tuner would. The cost model's alpha is
one latency per collective (it does not grow with the ranks of a ring), so at large world sizes it favours
collectives over many ranks; read the crossover as the bandwidth argument of Bian et al. (2021), not a promise.

Writes benchmarks/results/meshes-<device>-<date>.json (or $OUT/ when set) with the machine, versions, date,
command, the calibration and every figure.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from cocoweave import workloads
from cocoweave.perf.costmodel import AlphaBeta, Calibration, predict_plan
from cocoweave.plan import lower
from cocoweave.schedule.enumerate import enumerate_schedules

sys.path.insert(0, str(Path(__file__).parent))
from schedules import machine  # noqa: E402 - the benchmarks' one description of the machine

WORLDS = (4, 8, 16, 64, 256, 512, 1024, 4096)
HIDDEN = (1024, 2048, 4096, 8192, 16384)
TOKENS = {"B": 64, "S": 256}  # 16384 tokens per block: B is split over up to 64 ranks of one axis
KINDS = ("1-D", "2-D", "3-D")


def reference_cluster() -> Calibration:
    """Modelled constants (no measurement): per rank 775 TFLOP/s bf16 GEMMs and 2.99 TB/s of memory (DESIGN.md's
    H100 figures), 5 us per kernel, and a flat network of 50 GB/s with 20 us per collective."""
    net = AlphaBeta(0.02, 1e6 / 50e9 * 1e3)  # ms + ms per MB moved per rank
    return Calibration(backend="model", device="h100-50GBps", world_size=0,
                       collectives={"all_reduce/library": net, "reduce_scatter/library": net,
                                    "all_gather/library": net, "p2p/library": net},
                       kernels={"bfloat16": AlphaBeta(0.005, 1e6 / 2.99e12 * 1e3)},
                       matmuls={"bfloat16": AlphaBeta(0.01, 1e6 / 775e12 * 1e3)}, fused_kernels=True,
                       meta={"source": "modelled reference cluster, benchmarks/meshes.py"})


def program(kind: str, world: int, H: int, dtype: str, tokens: dict[str, int]) -> Any:
    """The block for `kind` at `world` ranks, or None when the world is not a square (2-D) or cube (3-D)."""
    B, S = tokens["B"], tokens["S"]
    if kind == "1-D":
        return workloads.mlp_1d(B, S, H, dtype)
    root = round(world ** (1 / (2 if kind == "2-D" else 3)))
    if root ** (2 if kind == "2-D" else 3) != world:
        return None
    build = workloads.mlp_2d if kind == "2-D" else workloads.mlp_3d
    return build(B, S, H, root, dtype)


def best_prediction(p: Any, world: int, cal: Calibration) -> dict[str, Any]:
    """The fastest predicted schedule of `p` at `world` ranks: its time, communication volume and split."""
    best = None
    for s in enumerate_schedules(p):
        pred = predict_plan(lower(s), {}, world, cal)
        if best is None or pred.total_ms < best[1].total_ms:
            best = (s, pred)
    s, pred = best
    f = pred.features
    return {"schedule": s.name, "modelled_ms": pred.total_ms, "modelled_comm_ms": f["comm_ms"],
            "modelled_compute_ms": f["matmul_ms"] + f["kernel_ms"], "modelled_comm_mb_per_rank": f["comm_mb"]}


def model(cal: Calibration, dtype: str, tokens: dict[str, int], console: Console) -> tuple[list[dict], list[dict]]:
    rows = []
    for H in HIDDEN:
        for world in WORLDS:
            for kind in KINDS:
                p = program(kind, world, H, dtype, tokens)
                if p is None:
                    continue
                rows.append({"hidden": H, "world_size": world, "parallelism": kind, **best_prediction(p, world, cal)})
    crossovers = []
    for H in HIDDEN:
        at = {(r["world_size"], r["parallelism"]): r for r in rows if r["hidden"] == H}
        entry: dict[str, Any] = {"hidden": H}
        for kind in ("2-D", "3-D"):
            wins = [w for w in WORLDS
                    if (w, kind) in at and at[(w, kind)]["modelled_ms"] < at[(w, "1-D")]["modelled_ms"]]
            entry[f"{kind} beats 1-D from world"] = min(wins) if wins else None
        crossovers.append(entry)
    return rows, crossovers


def measure(worlds: dict[int, tuple[str, ...]], tokens: dict[str, int], H: int, iters: int, timeout: float,
            console: Console) -> list[dict[str, Any]]:
    """The program as written and its fastest measured schedule, per parallelism, on this machine's ranks."""
    from cocoweave.launch import LocalWorld
    from cocoweave.perf.measure import measure_schedules

    rows = []
    for world, kinds in worlds.items():
        with LocalWorld(world, timeout_s=timeout) as w:
            for kind in kinds:
                p = program(kind, world, H, "float32", tokens)
                schedules = enumerate_schedules(p)
                found = measure_schedules(w, schedules, {}, iters=iters, warmup=3, timeout_s=timeout)
                written, best = found[0], min(found, key=lambda m: m.total_ms)
                rows.append({"world_size": world, "parallelism": kind, "hidden": H, **tokens,
                             "as_written_measured_ms": written.total_ms, "best_schedule": best.name,
                             "best_measured_ms": best.total_ms,
                             "every_schedule_measured_ms": {m.name: m.total_ms for m in found}})
                console.print(f"  measured {kind} at {world} ranks: as written {written.total_ms:.2f} ms, "
                              f"best {best.name} {best.total_ms:.2f} ms", highlight=False)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", type=Path, help="a `perf calibrate` JSON file (default: the modelled cluster)")
    ap.add_argument("--no-measure", action="store_true", help="only the model")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size of the measured blocks")
    ap.add_argument("--iters", type=int, default=20, help="timed steps per measured schedule")
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args(argv)
    console = Console(width=max(120, Console().width))
    cal = reference_cluster()
    if args.calibration is not None:
        cal = Calibration.from_json(json.loads(args.calibration.read_text()), str(args.calibration))
    started = dt.datetime.now(dt.UTC)
    t0 = time.perf_counter()
    dtype = "bfloat16" if "bfloat16" in cal.kernels else "float32"
    rows, crossovers = model(cal, dtype, TOKENS, console)
    t = Table(title=f"modelled: best schedule per block, {TOKENS['B']}x{TOKENS['S']} tokens, {dtype}, calibration "
                    f"{cal.meta.get('source', cal.device)} (ms per step per rank; MB moved per rank)",
              title_justify="left")
    t.add_column("hidden", justify="right")
    t.add_column("world", justify="right")
    for kind in KINDS:
        t.add_column(f"{kind} ms", justify="right")
        t.add_column(f"{kind} MB", justify="right")
    for H in HIDDEN:
        for world in WORLDS:
            cells = []
            for kind in KINDS:
                r = next((r for r in rows if (r["hidden"], r["world_size"], r["parallelism"]) == (H, world, kind)),
                         None)
                cells += [f"{r['modelled_ms']:.3f}", f"{r['modelled_comm_mb_per_rank']:.1f}"] if r else ["", ""]
            t.add_row(str(H), str(world), *cells)
    console.print(t)
    ct = Table(title="modelled crossover: the smallest world size where the parallelism's block is faster than "
                     "1-D's at the same world size", title_justify="left")
    for col in ("hidden", "2-D beats 1-D from world", "3-D beats 1-D from world"):
        ct.add_column(col, justify="right")
    for c in crossovers:
        ct.add_row(str(c["hidden"]), *(str(c[k] or f"not up to {WORLDS[-1]}") for k in list(c)[1:]))
    console.print(ct)
    measured: list[dict[str, Any]] = []
    info = machine("cpu", 8)
    if not args.no_measure:
        small = {"B": 8, "S": 32}
        measured = measure({4: ("1-D", "2-D"), 8: ("1-D", "3-D")}, small, args.hidden, args.iters, args.timeout,
                           console)
        mt = Table(title=f"measured here: torch backend on {info['cpu']} ({info['cores']} cores), hidden "
                         f"{args.hidden}, {small['B']}x{small['S']} tokens, float32, median of {args.iters} steps",
                   title_justify="left")
        for col in ("world", "parallelism", "as written ms", "best schedule", "best ms"):
            mt.add_column(col, justify="right" if "ms" in col or col == "world" else "left")
        for r in measured:
            mt.add_row(str(r["world_size"]), r["parallelism"], f"{r['as_written_measured_ms']:.2f}",
                       r["best_schedule"], f"{r['best_measured_ms']:.2f}")
        console.print(mt)
        if info["cores"] and 8 > info["cores"]:
            console.print(f"[yellow]note:[/] 8 ranks on {info['cores']} cores share them: the measured figures "
                          "say how the schedules run here, not how 2-D/3-D scale", highlight=False)
    if hasattr(os, "getloadavg"):
        info["load_average_at_end"] = os.getloadavg()
    doc = {"benchmark": "meshes", "date": started.isoformat(timespec="seconds"),
           "elapsed_s": time.perf_counter() - t0, "command": " ".join([Path(sys.executable).name, *sys.argv]),
           "machine": info, "calibration": cal.to_json(), "tokens": TOKENS,
           "labels": {"modelled_*": "the analytic cost model under the calibration, no run",
                      "*_measured_ms": "median over steps of the slowest rank, torch backend, this machine"},
           "modelled": rows, "modelled_crossover": crossovers, "measured": measured}
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).parent / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"meshes-{'model' if args.no_measure else 'cpu'}-{started:%Y%m%d-%H%M}.json"
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    console.print(f"results written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
