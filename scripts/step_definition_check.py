"""How stored `cocoweave profile` JSONs would be predicted on each definition of a world's step, offline (it reads the
JSONs and runs nothing): every world's step taken as the median over steps of the slowest rank's time (`house`, the
definition until late 2026-11-27, `steps_ms`), or as the slowest rank's median step (`per_rank_step_ms`, the
definition since), the model refitted on the fitted sizes with this tree's rules (where no oversubscribed world is
fitted, eta = eta_bal x the stored synthetic factor, which was measured on the house definition), and the error at
each checked size printed for both.

    PYTHONPATH=src python scripts/step_definition_check.py [FILE ...]   # default: the stored slow_input-*
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path

from cocoweave.cluster.profiling.run_profile import RunProfile

DEFAULT = sorted((Path(__file__).resolve().parents[1] / "benchmarks/results/profile").glob("slow_input-*.json"))
DEFINITIONS = {"house": lambda r: statistics.median(r.steps_ms),
               "slowest rank's median": lambda r: max(r.per_rank_step_ms)}


def main(paths: list[Path]) -> int:
    for path in paths:
        prof = RunProfile.from_json(json.loads(path.read_text()), str(path))
        checked = [r.world_size for r in prof.runs if r.world_size not in prof.fit_world_sizes]
        said = []
        for name, step in DEFINITIONS.items():
            again = dataclasses.replace(prof, runs=[dataclasses.replace(r, step_ms=step(r)) for r in prof.runs],
                                        _model=None)  # refitted on these steps
            said += [f"{name} at {p.world_size}: {p.error_pct:+.1f}%" for p in again.predict(checked)]
        print(f"{path.stem:44s} {prof.host.get('cpu', '')[:10]:10s} " + "  ".join(said))
    return 0


if __name__ == "__main__":
    sys.exit(main([Path(p) for p in sys.argv[1:]] or DEFAULT))
