"""`cocoweave demo`: the main job. For now: run the paper's three workloads on the reference
backend at world size 4 and print what they compute."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.table import Table

from ..backends import reference
from ..backends.inputs import make_inputs
from ..loader import examples_dir, load_program
from .common import console, user_errors
from .program_commands import summarize

WORKLOADS = [
    ("adam.py:adam", {"N": 1 << 16}),
    ("model_parallel.py:layer", {"B": 4, "S": 64, "H": 256}),
    ("pipeline_parallel.py:boundary", {"B": 4, "S": 64, "H": 256}),
    ("lamb.py:lamb", {"N": 1 << 16}),
]


@user_errors
def demo(world_size: Annotated[int, typer.Option("--world-size", "-n", min=1)] = 4) -> None:
    """Run the paper's workloads on simulated ranks and print a summary of each."""
    for spec, sizes in WORKLOADS:
        program = load_program(str(examples_dir() / spec), sizes)
        start = time.perf_counter()
        results = reference.run(program, make_inputs(program, world_size, seed=0))
        ms = (time.perf_counter() - start) * 1e3
        table = Table(title=f"{program.name} {sizes} on {world_size} simulated ranks: {ms:.1f} ms")
        for col in ("kind", "name", "layout", "shape", "mean", "std", "finite"):
            table.add_column(col)
        for r in summarize(program, results, world_size):
            table.add_row(r["kind"], r["name"], r["layout"], str(r["shape"]), f"{r['mean']:.4g}",
                          f"{r['std']:.4g}", "yes" if r["finite"] else "NO")
        console.print(table)
