"""`cocoweave show` and `cocoweave run`: print a program, run it on random inputs."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from rich.markup import escape
from rich.table import Table

from ..backends import reference
from ..backends.inputs import bound_sizes, gather_logical, make_inputs
from ..errors import BackendError, LoadError
from ..ir.graph import Program
from ..loader import load_program, parse_sizes, symbolic_sizes
from ..plan.plan import Plan
from ..schedule.schedule import Schedule
from .common import console, user_errors
from .options import SizeOpt, SpecArg, select


@user_errors
def show(spec: SpecArg, size: SizeOpt = None,
         schedule: Annotated[str | None, typer.Option(help="Show this schedule (see `cocoweave schedules`).")]
         = None,
         code: Annotated[bool, typer.Option("--code", help="Print the Python step function the torch backend "
                                                           "generates for one rank.")] = False,
         rank: Annotated[int, typer.Option(help="With --code: the rank whose code to print.")] = 0,
         world_size: Annotated[int, typer.Option("--world-size", "-n", min=1, help="With --code: ranks.")] = 2,
         triton: Annotated[bool, typer.Option("--triton", help="With --code: fused stages as generated Triton "
                                                               "kernels, whose sources are printed too.")] = False,
         ) -> None:
    """Print a program (one line per operation, with layouts and shapes), or one of its schedules
    with its steps, stages, rewritten program and plan, or (--code) the generated step function."""
    sizes = parse_sizes(size)
    program = load_program(spec, sizes)
    if schedule is None and not code:
        console.print(str(program), highlight=False, markup=False)
        console.print(f"fingerprint {program.fingerprint()}", style="dim")
        return
    from ..plan import lower
    s = select(program, schedule)[0] if schedule is not None else Schedule(program)
    if code:
        print(_step_code(lower(s), rank, world_size, bound_sizes(program, symbolic_sizes(program, sizes)), triton),
              end="")
        return
    console.print(str(s), highlight=False, markup=False)
    console.print(str(lower(s)), highlight=False, markup=False)


def _step_code(plan: Plan, rank: int, world_size: int, sizes: dict[str, int], triton: bool) -> str:
    """The generated step source of one rank, then the sources of its Triton kernels (with --triton)."""
    from ..backends.torch.codegen import generate

    for g in plan.program.groups:
        g.ranks(world_size)  # ProgramError naming the group that cannot be formed
    if not 0 <= rank < world_size:
        raise LoadError(f"--rank {rank} is not a rank of a world of {world_size}")
    fused: dict[int, Any] = {}
    if triton:
        try:
            from ..kernels.codegen import build_fused_kernels
        except ImportError:
            raise LoadError("--triton needs Triton and cocoweave.kernels.codegen, which are not installed") from None
        fused = build_fused_kernels(plan, rank, world_size, sizes, torch.device("cpu"))
    text = generate(plan, rank, world_size, sizes, fused)
    for i, kernel in sorted(fused.items()):
        text += f"\n\n# ---- Triton kernel of stage {i} ----\n" + str(getattr(kernel, "source", kernel))
    return text


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
    world_size: Annotated[int | None, typer.Option("--world-size", "-n", min=1,
                                                   help="Number of ranks (default 4; torchrun's under torchrun).")]
    = None,
    backend: Annotated[str, typer.Option(help="Backend: reference (simulated ranks) or torch (one process per "
                                              "rank over torch.distributed).")] = "reference",
    device: Annotated[str | None, typer.Option(help="torch backend: cpu or cuda (default cpu; under torchrun "
                                                    "the rank's GPU if it has one).")] = None,
    schedule: Annotated[str | None, typer.Option(help="Run this schedule (see `cocoweave schedules`).")] = None,
    iters: Annotated[int, typer.Option(min=0, help="torch backend: time this many steps after a warm-up and "
                                                   "print the median step time (max over ranks).")] = 0,
    timeout: Annotated[float, typer.Option(min=0.1, help="torch backend: seconds a rank may wait for the "
                                                         "others before the run fails.")] = 60.0,
    trace: Annotated[Path | None, typer.Option(help="torch backend: write a Chrome/Perfetto trace of one step "
                                                    "(a track per rank and stream) to this JSON file.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random inputs.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Run a program (or one of its schedules) on random inputs and print a summary of its outputs and
    updated state. With --backend torch, ranks are spawned here (Gloo on 127.0.0.1), or this command
    runs as one rank under torchrun."""
    if backend not in ("reference", "torch"):
        raise LoadError(f"backend {backend!r} is not available; use --backend reference or --backend torch")
    if backend == "reference" and (iters or trace is not None or device is not None):
        raise LoadError("--iters, --trace and --device need --backend torch")
    sizes = parse_sizes(size)
    program = load_program(spec, sizes)
    bound = symbolic_sizes(program, sizes)
    if schedule is not None:
        chosen = select(program, schedule)[0]
    else:
        chosen = Schedule(program)
    times: list[float] = []
    start = time.perf_counter()
    if backend == "reference":
        world_size = world_size or 4
        results = reference.run(chosen, make_inputs(program, world_size, bound, seed=seed), bound, whole_state=True)
        where = "reference"
    else:
        per_rank, world_size, where = _run_torch(chosen, world_size, bound, device, iters, timeout, trace, seed)
        if per_rank is None:  # a rank other than 0 under torchrun: rank 0 prints
            return
        results = [r["result"] for r in per_rank]
        if iters:
            times = [max(step) for step in zip(*(r["times_ms"] for r in per_rank))]
        if trace is not None:
            from ..trace import merge_and_write

            merge_and_write({i: r["events"] for i, r in enumerate(per_rank)}, trace)
    elapsed_ms = (time.perf_counter() - start) * 1e3
    rows = summarize(program, results, world_size)
    median = statistics.median(times) if times else None
    if as_json:
        print(json.dumps({"program": program.name, "fingerprint": program.fingerprint(), "schedule": chosen.name,
                          "backend": backend, "where": where, "world_size": world_size, "seed": seed,
                          "ms": elapsed_ms, "iters": iters, "median_step_ms": median, "step_ms": times,
                          "results": rows}, indent=2))
        return
    label = program.name + (f" [{chosen.name}]" if schedule is not None else "")
    table = Table(title=escape(f"{label} on {world_size} ranks ({where}, {elapsed_ms:.1f} ms)"))
    for col in ("kind", "name", "layout", "dtype", "shape", "mean", "std", "max |x|", "finite"):
        table.add_column(col, justify="right" if col in ("mean", "std", "max |x|") else "left")
    for r in rows:
        table.add_row(r["kind"], r["name"], r["layout"], r["dtype"], str(r["shape"]), f"{r['mean']:.4g}",
                      f"{r['std']:.4g}", f"{r['max_abs']:.4g}", "yes" if r["finite"] else "NO")
    console.print(table)
    if median is not None:
        console.print(f"median step {median:.3f} ms over {iters} steps (max over {world_size} ranks)",
                      highlight=False)
    if trace is not None:
        console.print(f"trace written to {trace} (open it in ui.perfetto.dev)", highlight=False)


def _run_torch(schedule: Schedule, world_size: int | None, sizes: dict[str, int], device: str | None, iters: int,
               timeout: float, trace: Path | None, seed: int) -> tuple[list[dict] | None, int, str]:
    """Per-rank results of `run_and_time` (None on ranks other than 0 under torchrun), the world size,
    and where it ran."""
    from ..backends.torch.worker import run_and_time
    from ..launch import LocalWorld, in_torchrun, init_from_env

    if device not in (None, "cpu", "cuda"):
        raise LoadError(f"--device must be cpu or cuda, got {device!r}")
    if not in_torchrun():
        world_size = world_size or 4
        with LocalWorld(world_size, backend="auto", device=device or "cpu", timeout_s=timeout) as world:
            inputs = make_inputs(schedule.original, world_size, sizes, seed=seed)
            per_rank = world.call(run_and_time, (schedule, inputs, sizes, device or "cpu", iters, trace is not None))
            return per_rank, world_size, f"torch, {world.backend} on {world.device}, spawned ranks"
    import torch.distributed as dist

    rank, size, dev = init_from_env(timeout, backend="gloo" if device == "cpu" else None)
    if world_size is not None and world_size != size:
        raise LoadError(f"--world-size {world_size} differs from torchrun's WORLD_SIZE {size}")
    dev = torch.device("cpu") if device == "cpu" else dev
    gathered: list[Any] = [None] * size
    try:
        mine = run_and_time(rank, size, schedule, make_inputs(schedule.original, size, sizes, seed=seed), sizes,
                            str(dev), iters, trace is not None)
        dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    except (RuntimeError, getattr(dist, "DistError", RuntimeError)) as exc:  # a peer died, hung or diverged
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        raise BackendError(f"rank {rank}: the process group failed within --timeout {timeout:g} s: "
                           f"{lines[0][:300]}") from None
    return (gathered if rank == 0 else None), size, f"torch, {dist.get_backend()} on {dev.type}, torchrun"
