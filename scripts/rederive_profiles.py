"""Re-derive stored `cocoweave profile` JSONs with this tree's scaling model and compare rules for core sharing
beyond the cores (eta) on the worlds each profile measured but did not fit (its check worlds). Offline: it reads
the JSONs and runs nothing.

    PYTHONPATH=src python scripts/rederive_profiles.py [FILE_OR_FOLDER ...]   # default: benchmarks/results/profile

Per profile, the measured ratio of every world: step / CPU time of a rank (p <= K) and step / (p x CPU / K) beyond
the cores (K cores; CPU: main thread, other threads and input pipeline, as the fit counts it). Per check world, the
prediction error of:

- `model`: this tree's model (`RunProfile.model`): eta_bal x (1 + mu x imbalance(p)) times p x the model's CPU
  (with shared_cpu) / K; the synthetic factor for eta when no fitted world oversubscribed the cores (else eta_bal);
- `previous`: one eta for every size beyond the cores, the geometric mean over the oversubscribed fitted worlds of
  their step over p x the model's CPU / K (no shared_cpu); the synthetic factor, else 1, when none was fitted;
- `K-ratio`: eta_bal x (1 + mu x imbalance(p)) on the model's CPU without shared_cpu, eta_bal the K-rank world's
  step over the model's CPU there and mu from the unevenly spread fitted worlds on the model's CPU; eta_bal x the
  synthetic factor when no fitted world oversubscribed the cores;
- `cpu`: the model's CPU time of a rank at the check world (shared_cpu included) over the measured one;
- `eta: previous` and `eta: spread`: the measured CPU of the check world in place of the model's (what an eta rule
  alone is worth): the oversubscribed fitted worlds' step over their measured CPU (the previous rule), or the
  synthetic factor; and the model's eta_bal x (1 + mu x imbalance(p)), or eta_bal x the synthetic factor.

Then mean |error|, the largest and how many exceed 10%, over every profile and over the quiet ones (no busy warning).
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from cocoweave.cluster.profiling.host_scaling import (
    HostScaling,
    geomean,
    imbalance,
    measured_cpu_ms,
    spread_factors,
)
from cocoweave.cluster.profiling.run_profile import RunProfile
from cocoweave.errors import PlanningError

DEFAULT = Path(__file__).resolve().parents[1] / "benchmarks/results/profile"
COLUMNS = ("model", "previous", "K-ratio", "cpu", "eta: previous", "eta: spread")


@dataclass
class Check:
    name: str
    world_size: int
    measured_ms: float
    quiet: bool
    errors: dict[str, float]  # column -> % error


def ratio(run, cores: int, cpu: float) -> float:
    """Step over ideal sharing of `cpu` per rank (over `cpu` within the cores)."""
    return run.step_ms / (max(run.world_size / cores, 1.0) * cpu)


def checks(prof: RunProfile, name: str) -> list[Check]:
    model = prof.model
    cores = model.cores
    base = replace(model, shared_cpu=1.0)  # the model's CPU without what the oversubscribed worlds measured
    shared = [r for r in prof.runs if r.world_size in prof.fit_world_sizes and r.world_size > cores]
    at_cores = prof.run(cores)
    if at_cores is None:
        print(f"skipped {name}: no world of {cores} ranks measured", file=sys.stderr)
        return []
    if shared:
        prev = max(geomean([ratio(r, cores, base.busy_ms(r.world_size)) for r in shared]), 1.0)
        k_bal, k_mu = spread_factors(ratio(at_cores, cores, base.busy_ms(cores)),
                                     [(imbalance(r.world_size, cores), ratio(r, cores, base.busy_ms(r.world_size)))
                                      for r in shared])
        prev_measured = geomean([ratio(r, cores, measured_cpu_ms(r)) for r in shared])
    out = []
    for run in sorted(prof.runs, key=lambda r: r.world_size):
        p = run.world_size
        if p in prof.fit_world_sizes or p <= cores:
            continue
        if shared:
            etas = {"previous": prev, "K-ratio": k_bal * (1 + k_mu * imbalance(p, cores)),
                    "eta: previous": prev_measured, "eta: spread": model.sharing_at(p)}
        else:  # the model's eta is the synthetic factor (else eta_bal); the candidate multiplies the two
            synthetic = model.sharing_at(p) if model.sharing else 1.0
            etas = {"previous": synthetic, "K-ratio": model.eta_bal * synthetic, "eta: previous": synthetic,
                    "eta: spread": model.eta_bal * synthetic}
        cpu = measured_cpu_ms(run)
        predicted = {"model": model.predict(p).total_ms, "cpu": model.busy_ms(p) / cpu * run.step_ms}
        predicted |= {k: eta * p * (base.busy_ms(p) if k in ("previous", "K-ratio") else cpu) / cores
                      for k, eta in etas.items()}
        out.append(Check(name, p, run.step_ms, prof.busy_warning() is None,
                         {k: 100 * (predicted[k] / run.step_ms - 1) for k in COLUMNS}))
    return out


def load(paths: list[Path]) -> list[tuple[str, RunProfile]]:
    files = sorted(f for p in paths for f in (p.glob("*.json") if p.is_dir() else [p]))
    out = []
    for f in files:
        try:
            out.append((f.stem, RunProfile.from_json(json.loads(f.read_text()), str(f))))
        except PlanningError as exc:
            print(f"skipped {f.name}: {exc}", file=sys.stderr)
    return out


def describe(model: HostScaling) -> str:
    sharing = ", ".join(f"synthetic x{f:.3f} at {p}" for p, f in model.sharing.items())
    return (f"eta_bal {model.eta_bal:.3f} mu {model.mu:.2f} shared_cpu {model.shared_cpu:.3f} "
            f"kappa {model.kappa:.2f}" + (f" ({sharing})" if sharing else ""))


def main(argv: list[str]) -> None:
    profiles = load([Path(a) for a in argv] or [DEFAULT])
    rows: list[Check] = []
    over_k: dict[int, list[float]] = {}
    print("## measured ratios (p <= K: step / CPU; beyond: step / (p x CPU / K)) and the fitted core sharing\n")
    for name, prof in profiles:
        cores = prof.model.cores
        worlds = " ".join(f"{r.world_size}{'*' if r.world_size in prof.fit_world_sizes else ''}:"
                          f"{ratio(r, cores, measured_cpu_ms(r)):.2f}"
                          for r in sorted(prof.runs, key=lambda r: r.world_size))
        print(f"{name:48} {prof.host.get('cpu', '?')[:24]:24} {worlds:32} {describe(prof.model)}")
        rows += checks(prof, name)
        at_cores = prof.run(cores)
        if at_cores is not None and prof.busy_warning() is None:
            for r in prof.runs:
                if r.world_size > cores:
                    over_k.setdefault(r.world_size, []).append(ratio(r, cores, measured_cpu_ms(r))
                                                               / ratio(at_cores, cores, measured_cpu_ms(at_cores)))
    print("\nquiet profiles, each world's ratio over the K-rank world's: "
          + "; ".join(f"{p} ranks {statistics.fmean(v):.3f} +- {statistics.pstdev(v):.3f} "
                      f"({min(v):.2f}-{max(v):.2f}, {len(v)} profiles)" for p, v in sorted(over_k.items())))
    print("\n## prediction error at the check worlds, % (cpu: the model's CPU over the measured)\n")
    print(f"| profile | p | measured ms | {' | '.join(COLUMNS)} |")
    print("|" + " --- |" * (3 + len(COLUMNS)))
    for c in rows:
        flag = "" if c.quiet else " (busy)"
        print(f"| {c.name}{flag} | {c.world_size} | {c.measured_ms:.1f} | "
              + " | ".join(f"{c.errors[k]:+.1f}" for k in COLUMNS) + " |")
    for label, subset in (("all", rows), ("quiet", [c for c in rows if c.quiet])):
        for group in ("train", "slow_input"):
            picked = [c for c in subset if c.name.startswith(group)]
            if not picked:
                continue
            summary = []
            for k in COLUMNS:
                errors = [abs(c.errors[k]) for c in picked]
                summary.append(f"{k} {statistics.fmean(errors):.1f}/{max(errors):.1f}/{sum(e > 10 for e in errors)}")
            print(f"\n{label} {group}* ({len(picked)}): mean |error| / max / over 10%: " + "; ".join(summary))


if __name__ == "__main__":
    main(sys.argv[1:])
