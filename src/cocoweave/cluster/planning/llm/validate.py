"""The validation table of the LLM step model: every published run of `published.py` predicted with its stack's
calibrated constants, grouped A100 / Hopper (H100, H200) and calibration / held-out, beside the Hopper rows
predicted as the planner did before it had Hopper constants (one spec-sheet efficiency for every GEMM: the
catalog's measured 0.78 of the bf16 and of the FP8 peak, the stack's A100-fitted constants for the rest).

    python -m cocoweave.cluster.planning.llm.validate            # the table, the groups' mean and max |error|
    python -m cocoweave.cluster.planning.llm.validate --markdown # the same as docs/planning_llm.md shows it
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

import numpy as np

from cocoweave.cluster.catalog import Catalog, load_catalog
from cocoweave.cluster.planning.llm.calibrate import errors
from cocoweave.cluster.planning.llm.published import (
    PublishedRun,
    foundry_h100_rest_runs,
    nemo_long_seq_runs,
    validation_runs,
)
from cocoweave.cluster.planning.llm.system import STACKS, Efficiency, stack_efficiencies


@dataclass(frozen=True)
class Group:
    """Mean and max |error| (%) of one group of rows."""

    name: str
    rows: int
    mean: float
    max: float


def spec_sheet_efficiencies(catalog: Catalog) -> dict[str, Efficiency]:
    """The constants as they were before Hopper calibration: each stack's A100 ones, every GEMM (FP8 too) at the
    H100's measured fraction of its peak (the catalog's `gemm_efficiency`)."""
    h100 = catalog.gpus["H100"].gemm_efficiency or 1.0
    out = stack_efficiencies()
    for key in [k for k in out if "/" in k]:
        out[key] = replace(STACKS[key.split("/")[0]].eff, gemm_max=h100, fp8_max=h100)
    return out


def is_hopper(run: PublishedRun, catalog: Catalog) -> bool:
    machine = next(m for m in catalog.machines if m.name == run.machine)
    return catalog.gpus[machine.gpu].family == "hopper"


def groups(runs: list[PublishedRun], errs: np.ndarray, catalog: Catalog) -> list[Group]:
    """A100 / Hopper (H100, H200) dense / Hopper MoE x calibration / held-out."""
    out = []
    hopper = np.array([is_hopper(r, catalog) for r in runs])
    moe = np.array([r.spec.experts > 1 for r in runs])
    for gpu, sel in (("A100", ~hopper & ~moe), ("H100/H200", hopper & ~moe), ("H100/H200 MoE", hopper & moe)):
        for role in ("calibration", "held-out"):
            mask = sel & np.array([r.role == role for r in runs])
            if mask.any():
                a = np.abs(errs[mask])
                out.append(Group(f"{gpu} {role}", int(mask.sum()), float(a.mean()), float(a.max())))
    return out


def table(catalog: Catalog | None = None) -> tuple[list[PublishedRun], np.ndarray, np.ndarray]:
    """(runs, signed % error with the shipped constants, signed % error with the spec-sheet ones)."""
    catalog = catalog or load_catalog()
    runs = validation_runs()
    return (runs, errors(runs, catalog, stack_efficiencies()),
            errors(runs, catalog, spec_sheet_efficiencies(catalog)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    args = parser.parse_args(argv)
    catalog = load_catalog()
    runs, after, before = table(catalog)
    if args.markdown:
        print("| run | role | stack | dtype | layout | published s | predicted s | error | before (spec sheet) |")
        print("| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: |")
    for run, a, b in zip(runs, after, before, strict=True):
        predicted = run.time_s * (1 + a / 100)
        prior = f"{b:+.1f}%" if is_hopper(run, catalog) else ""
        if args.markdown:
            print(f"| {run.name} | {run.role} | {run.stack} | {run.spec.dtype} | {run.cfg.describe()} | "
                  f"{run.time_s:.3f} | {predicted:.3f} | {a:+.1f}% | {prior} |")
        else:
            print(f"{run.name:48} {run.role:11} {run.cfg.describe():42} {run.time_s:9.3f} {predicted:9.3f} "
                  f"{a:+6.1f}% {prior:>7}")
    print()
    for g, p in zip(groups(runs, after, catalog), groups(runs, before, catalog), strict=True):
        line = f"{g.name:25} {g.rows:2} rows: mean |error| {g.mean:5.2f}%, max {g.max:5.2f}%"
        if g.name.startswith("H100/H200") and "MoE" not in g.name:
            line += f"   (before, one spec-sheet efficiency: mean {p.mean:5.2f}%, max {p.max:5.2f}%)"
        print(("- " if args.markdown else "") + line)
    rest = {r.name for r in foundry_h100_rest_runs()}
    added = [r.name in rest for r in runs]
    long_seq = {r.name for r in nemo_long_seq_runs() if r.role == "held-out"}
    hopper_held = [is_hopper(r, catalog) and r.role == "held-out" for r in runs]
    for name, mask, note in (
            ("llm-foundry added rows", added, "held out from the start: FOUNDRY_H100_REST"),
            ("NeMo long-seq held-out", [r.name in long_seq for r in runs], "LLAMA2-7B 8K-512K, cp 1-16: NEMO_LONG_SEQ"),
            ("H100/H200 held-out + MoE", hopper_held, "the dense and the MoE held-out rows together")):
        a = np.abs(after[np.array(mask)])
        print(("- " if args.markdown else "") + f"{name:25} {len(a):2} rows: mean |error| {a.mean():5.2f}%, max "
              f"{a.max():5.2f}%   ({note})")


if __name__ == "__main__":
    main()
