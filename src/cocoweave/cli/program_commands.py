"""`cocoweave show` and `cocoweave run`: print a program, run it on random inputs."""

from __future__ import annotations

import json
import time
from typing import Annotated

import torch
import typer
from rich.table import Table

from ..backends import reference
from ..backends.inputs import gather_logical, make_inputs
from ..errors import LoadError
from ..ir.graph import Program
from ..loader import load_program, parse_sizes, symbolic_sizes
from .common import console, user_errors

SizeOpt = Annotated[list[str] | None, typer.Option("--size", "-s", help="A size as NAME=INT (repeatable).")]
SpecArg = Annotated[str, typer.Argument(help="A program: FILE.py:FUNCTION.")]


@user_errors
def show(spec: SpecArg, size: SizeOpt = None,
         schedule: Annotated[str | None, typer.Option(help="Show this schedule (see `cocoweave schedules`).")]
         = None) -> None:
    """Print a program (one line per operation, with layouts and shapes), or one of its schedules
    with its steps, stages, rewritten program and plan."""
    program = load_program(spec, parse_sizes(size))
    if schedule is None:
        console.print(str(program), highlight=False, markup=False)
        console.print(f"fingerprint {program.fingerprint()}", style="dim")
        return
    from ..plan import lower
    from .schedule_commands import select

    s = select(program, schedule)[0]
    console.print(str(s), highlight=False, markup=False)
    console.print(str(lower(s)), highlight=False, markup=False)


def summarize(program: Program, results: list[reference.RankResult], world_size: int) -> list[dict]:
    """One row per output and updated state: logical shape and simple statistics."""
    rows = []
    named = [("output", n, v) for n, v in program.outputs] + \
            [("state", n, v) for n, v in program.updates.items()]
    for kind, name, v in named:
        key = "outputs" if kind == "output" else "state"
        parts = [getattr(r, key)[name] for r in results if name in getattr(r, key)]
        t = gather_logical(v, parts).double()
        rows.append({
            "kind": kind, "name": name, "layout": repr(v.layout), "dtype": v.dtype,
            "shape": list(t.shape), "mean": t.mean().item() if t.numel() else 0.0,
            "std": t.std().item() if t.numel() > 1 else 0.0,
            "max_abs": t.abs().max().item() if t.numel() else 0.0,
            "finite": bool(torch.isfinite(t).all()),
        })
    return rows


@user_errors
def run(
    spec: SpecArg,
    size: SizeOpt = None,
    world_size: Annotated[int, typer.Option("--world-size", "-n", min=1, help="Number of ranks.")] = 4,
    backend: Annotated[str, typer.Option(help="Backend: reference.")] = "reference",
    seed: Annotated[int, typer.Option(help="Seed of the random inputs.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Run a program on random inputs and print a summary of its outputs and updated state."""
    if backend != "reference":
        raise LoadError(f"backend {backend!r} is not available; use --backend reference")
    sizes = parse_sizes(size)
    program = load_program(spec, sizes)
    inputs = make_inputs(program, world_size, symbolic_sizes(program, sizes), seed=seed)
    start = time.perf_counter()
    results = reference.run(program, inputs, symbolic_sizes(program, sizes))
    elapsed_ms = (time.perf_counter() - start) * 1e3
    rows = summarize(program, results, world_size)
    if as_json:
        print(json.dumps({"program": program.name, "fingerprint": program.fingerprint(), "backend": backend,
                          "world_size": world_size, "seed": seed, "ms": elapsed_ms, "results": rows}, indent=2))
        return
    table = Table(title=f"{program.name} on {world_size} ranks ({backend}, {elapsed_ms:.1f} ms)")
    for col in ("kind", "name", "layout", "dtype", "shape", "mean", "std", "max |x|", "finite"):
        table.add_column(col, justify="right" if col in ("mean", "std", "max |x|") else "left")
    for r in rows:
        table.add_row(r["kind"], r["name"], r["layout"], r["dtype"], str(r["shape"]), f"{r['mean']:.4g}",
                      f"{r['std']:.4g}", f"{r['max_abs']:.4g}", "yes" if r["finite"] else "NO")
    console.print(table)
