"""Fit the efficiency constants of `system.STACKS` on the calibration rows of the published runs (coordinate
descent on the mean absolute percentage error of the step time), so the held-out rows judge the model honestly."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from cocoweave.cluster.catalog import Catalog
from cocoweave.cluster.planning.llm.published import PublishedRun
from cocoweave.cluster.planning.llm.step import predict_step
from cocoweave.cluster.planning.llm.system import Efficiency, system_for

# (stacks sharing the constant, field, low, high): what calibration may move
FREE = (
    (("megatron-2021",), "gemm_max", 0.6, 1.0),
    (("megatron-2022", "torchtitan-2024"), "gemm_max", 0.6, 1.0),
    (("megatron-2021", "megatron-2022", "torchtitan-2024"), "gemm_half", 0.0, 400.0),
    (("megatron-2021", "megatron-2022"), "elementwise_passes", 0.5, 8.0),
    (("torchtitan-2024",), "elementwise_passes", 0.5, 20.0),
)


def errors(runs: list[PublishedRun], catalog: Catalog, stacks: dict[str, Efficiency]) -> np.ndarray:
    """Signed percentage error (predicted / published - 1) of each run under the efficiency of its stack."""
    machines = {m.name: m for m in catalog.machines}
    out = []
    for run in runs:
        system = system_for(machines[run.machine], catalog, stacks[run.stack])
        out.append(100.0 * (predict_step(run.spec, run.cfg, system).total_s / run.time_s - 1.0))
    return np.array(out)


def calibrate(runs: list[PublishedRun], catalog: Catalog, stacks: dict[str, Efficiency],
              rounds: int = 10, points: int = 81) -> dict[str, Efficiency]:
    """`stacks` (name -> Efficiency) with the FREE constants refitted on the calibration rows of `runs`."""
    fit = [r for r in runs if r.role == "calibration"]
    best = dict(stacks)
    for _ in range(rounds):
        for names, field, low, high in FREE:
            candidates = []
            for value in np.linspace(low, high, points):
                trial = best | {n: replace(best[n], **{field: float(value)}) for n in names}
                candidates.append((float(np.mean(np.abs(errors(fit, catalog, trial)))), float(value)))
            value = min(candidates)[1]
            best = best | {n: replace(best[n], **{field: value}) for n in names}
    return best
