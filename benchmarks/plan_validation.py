"""Validate the LLM step model (`cocoweave.cluster.planning.llm`) on published training runs, and the planner on
GPT-3 175B.

    PYTHONPATH=src python benchmarks/plan_validation.py            # table, memory checks, planner check, timing
    PYTHONPATH=src python benchmarks/plan_validation.py --no-time  # without timing the one-command plan

For every run of `cluster/planning/llm/published.py` (SC'21 Table 1 and sec. 5.1, Korthikanti et al. 2022 Table 5,
torchtitan's Llama 3 table) it predicts the iteration time with the published model, layout and hardware (DGX A100
80 GB: NVLink 3, 8 x 200 Gb/s HDR InfiniBand) and prints the error with the source of each figure. The efficiency
constants were fitted on the rows marked "calibration" only (`calibrate.py`; refitted here from neutral starting
values to show it); "held-out" rows judge the model. Then: activation memory against Korthikanti's Table 2 formulas,
which published runs fit in 80 GB, the planner's best layout for GPT-3 175B on 1024 A100 80 GB with the reason, and
the wall time of `cocoweave plan --llm`.

Writes benchmarks/results/plan_validation-<date>.json (or $OUT/ when set) with versions, date, command and every figure.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from cocoweave.cluster.catalog import load_catalog
from cocoweave.cluster.planning.llm.calibrate import calibrate, errors
from cocoweave.cluster.planning.llm.memory import activation_bytes, layer_activation_bytes
from cocoweave.cluster.planning.llm.published import KORTHIKANTI_TABLE5, MACHINE, published_runs
from cocoweave.cluster.planning.llm.search import search
from cocoweave.cluster.planning.llm.spec import TransformerSpec
from cocoweave.cluster.planning.llm.step import predict_step
from cocoweave.cluster.planning.llm.system import STACKS, Efficiency, system_for

CALCULON = "Calculon (Isaev et al. SC'23) on Korthikanti's 8 Table 5 runs: 3.65% mean, 8.87% max"


def _summary(errs: np.ndarray) -> dict:
    a = np.abs(errs)
    return {"rows": int(len(a)), "mean_abs_pct": float(a.mean()), "max_abs_pct": float(a.max())}


def validation_table(catalog) -> tuple[list[dict], dict]:
    runs = published_runs()
    machines = {m.name: m for m in catalog.machines}
    rows = []
    print(f"{'run':36} {'role':11} {'layout':34} {'published s':>11} {'predicted s':>11} {'error':>7}")
    for run in runs:
        stack = STACKS[run.stack]
        step = predict_step(run.spec, run.cfg, system_for(machines[run.machine], catalog, stack.eff))
        err = 100 * (step.total_s / run.time_s - 1)
        rows.append({"run": run.name, "role": run.role, "stack": run.stack, "layout": run.cfg.describe(),
                     "gpus": run.cfg.gpus, "published_s": run.time_s, "predicted_s": step.total_s, "error_pct": err,
                     "source": run.source, "terms_s": {
                         "compute": step.compute_s, "tp_exposed": step.tp_comm_s, "pp_p2p": step.pp_comm_s,
                         "bubble": step.bubble_s, "dp_exposed": step.dp_exposed_s, "optimizer": step.optimizer_s},
                     "mfu": step.mfu, "memory_gb": step.memory.total / 1e9})
        print(f"{run.name:36} {run.role:11} {run.cfg.describe():34} {run.time_s:11.2f} {step.total_s:11.2f} "
              f"{err:+6.1f}%")
    errs = np.array([r["error_pct"] for r in rows])
    role = np.array([r["role"] for r in rows])
    korth = np.array([r["run"].startswith("Korthikanti") for r in rows])
    summary = {"all": _summary(errs), "calibration": _summary(errs[role == "calibration"]),
               "held_out": _summary(errs[role == "held-out"]), "korthikanti_table5": _summary(errs[korth]),
               "bar": CALCULON}
    print("\nSources:")
    for run in runs:
        print(f"  {run.name}: {run.source}")
    print()
    for key in ("all", "calibration", "held_out", "korthikanti_table5"):
        s = summary[key]
        print(f"{key:20} {s['rows']:2} rows: mean |error| {s['mean_abs_pct']:.2f}%, max {s['max_abs_pct']:.2f}%")
    print(f"bar: {CALCULON}")
    return rows, summary


def refit(catalog) -> dict:
    """Calibration re-run from neutral constants: what it fits and the errors it gives (held-out included)."""
    runs = published_runs()
    start = {name: Efficiency() for name in STACKS}
    t0 = time.perf_counter()
    fitted = calibrate(runs, catalog, start)
    seconds = time.perf_counter() - t0
    errs = errors(runs, catalog, fitted)
    role = np.array([r.role for r in runs])
    out = {"seconds": seconds, "fitted": {k: asdict(v) for k, v in fitted.items()},
           "shipped": {k: asdict(v.eff) for k, v in STACKS.items()},
           "calibration": _summary(errs[role == "calibration"]), "held_out": _summary(errs[role == "held-out"])}
    print(f"\nRefit from neutral constants ({seconds:.1f} s): " + "; ".join(
        f"{k}: gemm_max {v.gemm_max:.3f}, gemm_half {v.gemm_half:.0f}, passes {v.elementwise_passes:.2f}"
        for k, v in fitted.items()))
    print(f"  refit errors: calibration mean {out['calibration']['mean_abs_pct']:.2f}% / max "
          f"{out['calibration']['max_abs_pct']:.2f}%, held-out mean {out['held_out']['mean_abs_pct']:.2f}% / max "
          f"{out['held_out']['max_abs_pct']:.2f}%")
    return out


def korthikanti_formula(spec: TransformerSpec, t: int, mode: str) -> float:
    """Korthikanti et al. 2022 Table 2: activation bytes per layer (micro-batch b = 1... as spec says)."""
    s, b, h, a = spec.seq_len, 1, spec.hidden, spec.heads
    sbh = s * b * h
    return {"tp": sbh * (10 + 24 / t + 5 * a * s / (h * t)), "tp+sp": sbh * (34 / t + 5 * a * s / (h * t)),
            "tp+selective": sbh * (10 + 24 / t), "tp+sp+selective": sbh * 34 / t, "full": 2 * sbh}[mode]


def memory_checks(catalog) -> dict:
    """Our activation memory against Korthikanti's Table 2 formulas, and which layouts fit in 80 GB."""
    from cocoweave.cluster.planning.llm.parallelism import ParallelConfig

    print("\nActivation memory per layer, ours vs Korthikanti et al. 2022 Table 2 (MB, micro-batch 1, t = 8):")
    rows = []
    modes = {"tp": {"recompute": "none"}, "tp+sp": {"recompute": "none", "sp": True},
             "tp+selective": {"recompute": "selective"}, "tp+sp+selective": {"recompute": "selective", "sp": True},
             "full": {"recompute": "full"}}
    for name, heads, hidden, layers, _gpus, batch, _mb, pp, vp, _, _ in KORTHIKANTI_TABLE5:
        spec = TransformerSpec(name=name, layers=layers, hidden=hidden, heads=heads, vocab=51200, seq_len=2048,
                               global_batch=batch, dtype="float16", flash_attention=False)
        for mode, kw in modes.items():
            cfg = ParallelConfig(tp=8, pp=pp, dp=1, vp=vp, **kw)
            ours, paper = layer_activation_bytes(spec, cfg), korthikanti_formula(spec, 8, mode)
            rows.append({"model": name, "mode": mode, "ours_mb": ours / 1e6, "paper_mb": paper / 1e6,
                         "diff_pct": 100 * (ours / paper - 1)})
        line = ", ".join(f"{r['mode']} {r['ours_mb']:.0f}/{r['paper_mb']:.0f}" for r in rows[-len(modes):])
        print(f"  {name}: {line}")
    worst = max(abs(r["diff_pct"]) for r in rows)
    print(f"  largest difference: {worst:.2f}%")
    # the first stage's total: per layer x L (pp micro-batches of L/pp layers) x (1 + (p-1)/(pv)), sec. 4.2.3
    totals = []
    for run in published_runs():
        if not run.name.startswith("Korthikanti"):
            continue
        mem = predict_step(run.spec, run.cfg, system_for({m.name: m for m in catalog.machines}[MACHINE], catalog,
                                                         STACKS[run.stack].eff)).memory
        totals.append({"run": run.name, "activations_gb": mem.activations / 1e9, "total_gb": mem.total / 1e9,
                       "fits_80gb": mem.total <= 80e9})
    print("  published Korthikanti runs, predicted memory per GPU: " + "; ".join(
        f"{t['run'].removeprefix('Korthikanti ')} {t['total_gb']:.1f} GB (activations {t['activations_gb']:.1f})"
        for t in totals))
    gpt3 = next(r for r in published_runs() if r.name.startswith("SC'21 GPT-3"))
    no_recompute = replace(gpt3.cfg, recompute="none")
    rejected = activation_bytes(gpt3.spec, no_recompute) / 1e9
    print(f"  GPT-3 175B at TP 8 x PP 8 without recomputation: activations {rejected:.1f} GB on the first stage "
          "(Korthikanti sec. 1: does not fit in 80 GB with the model state)")
    return {"per_layer": rows, "largest_diff_pct": worst, "runs": totals, "gpt3_no_recompute_activations_gb": rejected}


def planner_check(catalog) -> dict:
    """The planner's best layout for GPT-3 175B on 1024 A100 80 GB, against the published one, per stack."""
    gpt3 = next(r for r in published_runs() if r.name.startswith("SC'21 GPT-3"))
    machine = {m.name: m for m in catalog.machines}[MACHINE]
    out = {}
    print("\nPlanner: GPT-3 175B, batch 1536, on 1024 A100 80 GB (dgx-a100-80gb)")
    for name, stack in STACKS.items():
        system = system_for(machine, catalog, stack.eff)
        t0 = time.perf_counter()
        result = search(gpt3.spec, system, 1024, stack)
        seconds = time.perf_counter() - t0
        best = result.best
        published = predict_step(gpt3.spec, replace(gpt3.cfg, dp_overlap=stack.dp_overlap), system)
        terms = {k: (getattr(published, k), getattr(best.step, k)) for k in
                 ("compute_s", "tp_comm_s", "pp_comm_s", "bubble_s", "dp_exposed_s")}
        reason = ", ".join(f"{k.removesuffix('_s')} {a:.2f} -> {b:.2f} s" for k, (a, b) in terms.items()
                           if abs(a - b) > 0.05)
        same = best.cfg.describe() == replace(gpt3.cfg, dp_overlap=stack.dp_overlap).describe()
        out[name] = {"best": best.cfg.describe(), "best_s": best.step.total_s,
                     "best_memory_gb": best.memory.total / 1e9,
                     "published_layout": gpt3.cfg.describe(), "published_layout_predicted_s": published.total_s,
                     "published_s": gpt3.time_s, "same": same, "reason": reason, "search_s": seconds,
                     "layouts_rejected_for_memory": result.rejected}
        verdict = "the published layout" if same else f"faster than the published layout by " \
            f"{100 * (1 - best.step.total_s / published.total_s):.0f}% ({reason})"
        print(f"  {name}: best {best.cfg.describe()} {best.step.total_s:.2f} s, {best.memory.total / 1e9:.1f} GB; "
              f"published layout {gpt3.cfg.describe()} predicted {published.total_s:.2f} s -> {verdict} "
              f"[{seconds * 1e3:.0f} ms, {result.rejected} layouts rejected for memory]")
    return out


def time_command() -> dict:
    cmd = [sys.executable, "-m", "cocoweave", "plan", "--llm", "examples/llm/gpt3-175b.yaml", "--tokens", "3e11",
           "--deadline", "720", "--json", os.devnull]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"PYTHONPATH": "src"})
    seconds = time.perf_counter() - t0
    print(f"\n`{' '.join(cmd[2:])}`: {seconds:.1f} s wall (load average {load:.2f} at start), exit {proc.returncode}")
    return {"command": " ".join(["cocoweave", *cmd[3:]]), "wall_s": seconds, "load_avg_1min": load,
            "exit_code": proc.returncode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-time", action="store_true", help="skip timing the one-command plan")
    args = parser.parse_args()
    catalog = load_catalog()
    rows, summary = validation_table(catalog)
    result = {"machine": platform.node(), "python": platform.python_version(),
              "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
              "load_avg_1min_start": os.getloadavg()[0], "rows": rows, "summary": summary,
              "refit": refit(catalog), "memory": memory_checks(catalog), "planner": planner_check(catalog),
              "timing": None if args.no_time else time_command()}
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).parent / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"plan_validation-{dt.date.today().isoformat()}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
