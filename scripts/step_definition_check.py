"""How the stored `cocoweave profile` JSONs of a script fitted within the cores (slow_input: 1 and 2 ranks on 2 cores,
the 3-rank world measured to check) would be predicted under two changes of the core-sharing rule, offline (it reads
the JSONs and runs nothing):

- `now`: this tree's model (eta = the synthetic factor measured at 3 ranks, `core_sharing.sharing_factor`);
- `K-ratio`: eta = eta_bal x the synthetic factor, eta_bal the 2-rank world's step over its measured CPU time per rank;
- `K-ratio, slowest rank's median step`: the same with every world's step taken as the slowest rank's median step
  (max over ranks of `per_rank_step_ms`) instead of the house definition (per step the slowest rank's time, then the
  median over steps), which a rank's staggered step boundaries inflate when ranks outnumber cores.

    PYTHONPATH=src python scripts/step_definition_check.py [FILE ...]   # default: the stored slow_input-*
    PYTHONPATH=src python scripts/step_definition_check.py --refit FILE ...

Errors are against the measured 3-rank step under the same definition. The model's CPU time at 3 ranks is used
(`HostScaling.busy_ms`), the synthetic factor as stored (measured under the house definition).
`--refit`: any stored profile refitted on its fitted sizes with every world's step taken on each definition (the
median of the per-step maxima `steps_ms`, or the largest of `per_rank_step_ms`), with this tree's rules, and the
error at each checked size printed for both.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path

from cocoweave.cluster.profiling.host_scaling import fit_host_scaling, measured_cpu_ms
from cocoweave.cluster.profiling.run_profile import RunProfile

DEFAULT = sorted((Path(__file__).resolve().parents[1] / "benchmarks/results/profile").glob("slow_input-*.json"))


def main(paths: list[Path]) -> int:
    for path in paths:
        prof = RunProfile.from_json(json.loads(path.read_text()), str(path))
        runs = {r.world_size: r for r in prof.runs}
        synthetic = prof.core_sharing.get(3)
        if synthetic is None or 2 not in runs or 3 not in runs or not runs[3].per_rank_step_ms:
            continue
        r2, r3, model = runs[2], runs[3], prof.model
        cpu2, shared = measured_cpu_ms(r2), 3 / int(prof.host["cores"]) * model.busy_ms(3)  # ideal sharing at 3
        house, slowest = r3.step_ms, max(r3.per_rank_step_ms)
        now = model.predict(3).total_ms / house - 1
        k_house = r2.step_ms / cpu2 * synthetic * shared / house - 1
        k_slowest = max(r2.per_rank_step_ms) / cpu2 * synthetic * shared / slowest - 1
        print(f"{path.stem:44s} {prof.host.get('cpu', '')[:10]:10s} now {100 * now:+6.1f}%  "
              f"K-ratio {100 * k_house:+6.1f}%  K-ratio, slowest rank's median step {100 * k_slowest:+6.1f}%  "
              f"(busy warning: {bool(prof.busy_warning())})")
    return 0


def refit(paths: list[Path]) -> int:
    for path in paths:
        prof = RunProfile.from_json(json.loads(path.read_text()), str(path))
        said = []
        for name, step in (("house", lambda r: statistics.median(r.steps_ms)),
                           ("slowest rank's median", lambda r: max(r.per_rank_step_ms))):
            runs = [dataclasses.replace(r, step_ms=step(r)) for r in prof.runs]
            model = fit_host_scaling([r for r in runs if r.world_size in prof.fit_world_sizes],
                                     int(prof.host["cores"]), prof.core_sharing or None)
            said += [f"{name} at {r.world_size}: {100 * (model.predict(r.world_size).total_ms / r.step_ms - 1):+.1f}%"
                     for r in runs if r.world_size not in prof.fit_world_sizes]
        print(f"{path.stem:44s} " + "  ".join(said))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--refit"]:
        sys.exit(refit([Path(p) for p in sys.argv[2:]]))
    sys.exit(main([Path(p) for p in sys.argv[1:]] or DEFAULT))
