"""`cocoweave show` and `cocoweave run`: print a program, run it on random inputs."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Annotated, Any

import torch
import typer

from ..backends import reference
from ..backends.inputs import bound_sizes, gather_logical, make_inputs
from ..backends.results import RankResult
from ..backends.torch.worker import step_times
from ..errors import LoadError
from ..ir.graph import Program
from ..plan.plan import Plan
from ..schedule.schedule import Schedule
from .common import console, table, user_errors
from .options import (
    DEFAULT_TIMEOUT_S,
    DEFAULT_WORLD,
    Device,
    JsonOpt,
    SizeOpt,
    SpecArg,
    TimeoutOpt,
    WallTimeoutOpt,
    WorldOpt,
    check_fits,
    check_local_worlds,
    check_output,
    load,
    parse_timeouts,
    parse_world_sizes,
    select,
    write_json,
)


@user_errors
def show(spec: SpecArg, size: SizeOpt = None,
         schedule: Annotated[str | None, typer.Option(help="Show this schedule (see `cocoweave schedules`).")]
         = None,
         code: Annotated[bool, typer.Option("--code", help="Print the Python step function the torch backend "
                                                           "generates for one rank.")] = False,
         rank: Annotated[int, typer.Option(help="With --code: the rank whose code to print.")] = 0,
         world_size: WorldOpt = DEFAULT_WORLD,
         triton: Annotated[bool, typer.Option("--triton", help="With --code: fused stages as generated Triton "
                                                               "kernels, whose sources are printed too.")] = False,
         as_json: JsonOpt = None,
         ) -> None:
    """Print a program (one line per operation, with layouts and shapes), or one of its schedules
    with its steps, stages, rewritten program and plan, or (--code) the generated step function of one rank
    for each world size of -n."""
    check_output(as_json, "--json")
    program, _, bound = load(spec, size)
    doc: dict[str, Any] = {"program": program.name, "fingerprint": program.fingerprint()}
    if schedule is None and not code:
        doc["text"] = str(program)
        if as_json != "-":
            console.print(doc["text"], highlight=False, markup=False)
            console.print(f"fingerprint {doc['fingerprint']}", style="dim", highlight=False)
        write_json(doc, as_json)
        return
    from ..plan import lower

    s = select(program, schedule)[0] if schedule is not None else Schedule(program)
    plan = lower(s)
    doc |= {"schedule": s.name, "schedule_fingerprint": s.fingerprint(), "steps": json.loads(s.to_json())["steps"]}
    if code:
        worlds = parse_world_sizes(world_size)
        doc["code"] = [{"world_size": w, "rank": rank,
                        "source": _step_code(plan, rank, w, bound_sizes(program, bound), triton)} for w in worlds]
        if as_json != "-":
            for entry in doc["code"]:
                if len(worlds) > 1:
                    print(f"# ==== world size {entry['world_size']}, rank {rank} ====")
                print(entry["source"], end="")
    else:
        doc |= {"text": str(s), "plan": str(plan)}
        if as_json != "-":
            console.print(doc["text"], highlight=False, markup=False)
            console.print(doc["plan"], highlight=False, markup=False)
    write_json(doc, as_json)


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


def summarize(program: Program, results: list[RankResult], world_size: int) -> list[dict]:
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
    world_size: Annotated[str | None, typer.Option(
        "--world-size", "-n", help="Ranks: 4, a range 1-8 or a list 1,2,4, each size in turn (default 4; under "
                                   "torchrun, torchrun's world size).")] = None,
    backend: Annotated[str, typer.Option(help="Backend: reference (simulated ranks) or torch (one process per "
                                              "rank over torch.distributed).")] = "reference",
    device: Annotated[Device | None, typer.Option(help="torch backend: cpu or cuda (default cpu; under torchrun "
                                                    "the rank's GPU if it has one).")] = None,
    schedule: Annotated[str | None, typer.Option(help="Run this schedule (see `cocoweave schedules`).")] = None,
    iters: Annotated[int, typer.Option(min=0, help="torch backend: time this many steps after a warm-up and "
                                                   "print the median step time (max over ranks).")] = 0,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT_S,
    wall_timeout: WallTimeoutOpt = None,
    trace: Annotated[Path | None, typer.Option(help="torch backend: write a Chrome/Perfetto trace of one step "
                                                    "(a track per rank and stream) to this JSON file.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random inputs.")] = 0,
    as_json: JsonOpt = None,
) -> None:
    """Run a program (or one of its schedules) on random inputs and print a summary of its outputs and
    updated state. With --backend torch, ranks are spawned here (Gloo on 127.0.0.1), or this command
    runs as one rank under torchrun."""
    if backend not in ("reference", "torch"):
        raise LoadError(f"backend {backend!r} is not available; use --backend reference or --backend torch")
    if backend == "reference" and (iters or trace is not None or device is not None):
        raise LoadError("--iters, --trace and --device need --backend torch")
    timeouts = parse_timeouts(timeout, wall_timeout)
    worlds = parse_world_sizes(world_size or DEFAULT_WORLD)
    if trace is not None and len(worlds) > 1:
        raise LoadError("--trace writes one world's trace; give one world size with -n")
    check_output(trace, "--trace")
    check_output(as_json, "--json")
    program, given, bound = load(spec, size)
    chosen = select(program, schedule, device)[0] if schedule is not None else Schedule(program)
    from ..launch import in_torchrun

    if backend == "torch" and in_torchrun():
        _run_under_torchrun(chosen, schedule is not None, world_size, bound, given, device, iters, timeouts, trace,
                            seed, as_json)
        return
    if backend == "torch":
        check_local_worlds(worlds)
    check_fits(program, bound, worlds, given)
    docs = [_run_one(chosen, w, bound, backend, device, iters, timeouts, trace, seed) for w in worlds]
    _report(docs, chosen, schedule is not None, trace, as_json)


def _run_one(schedule: Schedule, world_size: int, sizes: dict[str, int], backend: str, device: str | None,
             iters: int, timeouts: tuple[float, float | None], trace: Path | None, seed: int) -> dict[str, Any]:
    """One run at `world_size` (spawned ranks for the torch backend) as the JSON document `run` prints."""
    program = schedule.original
    start = time.perf_counter()
    if backend == "reference":
        results = reference.run(schedule, make_inputs(program, world_size, sizes, seed=seed), sizes, whole_state=True)
        return _doc(schedule, results, world_size, "reference", seed, start, iters, [])
    from ..backends.torch.worker import run_and_time
    from ..launch import LocalWorld

    timeout, wall = timeouts
    with LocalWorld(world_size, backend="auto", device=device or "cpu", timeout_s=timeout,
                    wall_timeout_s=wall) as world:
        inputs = make_inputs(program, world_size, sizes, seed=seed)
        per_rank = world.call(run_and_time, (schedule, inputs, sizes, device or "cpu", iters, trace is not None))
        where = f"torch, {world.backend} on {world.device}, spawned ranks"
    return _finish(schedule, per_rank, world_size, where, seed, start, iters, trace)


def _finish(schedule: Schedule, per_rank: list[dict], world_size: int, where: str, seed: int, start: float,
            iters: int, trace: Path | None) -> dict[str, Any]:
    """The JSON document of a torch run from each rank's `run_and_time` result; writes the trace."""
    times = step_times([r["times_ms"] for r in per_rank]) if iters else []
    if trace is not None:
        from ..perf.trace import merge_and_write

        try:
            merge_and_write({i: r["events"] for i, r in enumerate(per_rank)}, trace)
        except OSError as exc:
            raise LoadError(f"--trace {trace} could not be written: {exc.strerror or exc}") from None
    return _doc(schedule, [r["result"] for r in per_rank], world_size, where, seed, start, iters, times)


def _doc(schedule: Schedule, results: list, world_size: int, where: str, seed: int, start: float, iters: int,
         times: list[float]) -> dict[str, Any]:
    program = schedule.original
    return {"program": program.name, "fingerprint": program.fingerprint(), "schedule": schedule.name,
            "backend": "reference" if where == "reference" else "torch", "where": where, "world_size": world_size,
            "seed": seed, "ms": (time.perf_counter() - start) * 1e3, "iters": iters,
            "median_step_ms": statistics.median(times) if times else None, "step_ms": times,
            "results": summarize(program, results, world_size)}


def _report(docs: list[dict[str, Any]], schedule: Schedule, named: bool, trace: Path | None,
            as_json: str | None) -> None:
    """Print each run's table (unless --json -) and write the JSON: one document, or a list of them."""
    if as_json != "-":
        for doc in docs:
            label = doc["program"] + (f" [{schedule.name}]" if named else "")
            t = table(f"{label} on {doc['world_size']} ranks ({doc['where']}, {doc['ms']:.1f} ms)",
                      {"kind": "left", "name": "left", "layout": "left", "dtype": "left", "shape": "left",
                       "mean": "right", "std": "right", "max |x|": "right", "finite": "left"})
            for r in doc["results"]:
                t.add_row(r["kind"], r["name"], r["layout"], r["dtype"], str(r["shape"]), f"{r['mean']:.4g}",
                          f"{r['std']:.4g}", f"{r['max_abs']:.4g}", "yes" if r["finite"] else "NO")
            console.print(t)
            if doc["median_step_ms"] is not None:
                console.print(f"median step {doc['median_step_ms']:.3f} ms over {doc['iters']} steps (max over "
                              f"{doc['world_size']} ranks)", highlight=False)
        if trace is not None:
            console.print(f"trace written to {trace} (open it in ui.perfetto.dev)", highlight=False, markup=False)
    write_json(docs[0] if len(docs) == 1 else docs, as_json)


def _run_under_torchrun(schedule: Schedule, named: bool, world_size: str | None, sizes: dict[str, int],
                        given: dict[str, int], device: str | None, iters: int,
                        timeouts: tuple[float, float | None], trace: Path | None, seed: int,
                        as_json: str | None) -> None:
    """This process is one rank of a torchrun world: run, gather the results on rank 0, which reports them;
    every rank then leaves the process group cleanly. A failure names this rank and its stage (exit 4)."""
    from ..backends.torch.worker import run_and_time
    from .torchrun_rank import gather_on_rank0, torchrun_rank

    with torchrun_rank(timeouts, device, world_size) as me:
        check_fits(schedule.original, sizes, [me.size], given)
        start = time.perf_counter()
        inputs = make_inputs(schedule.original, me.size, sizes, seed=seed)
        gathered = gather_on_rank0(me, lambda: run_and_time(me.rank, me.size, schedule, inputs, sizes,
                                                              str(me.device), iters, trace is not None))
    if gathered is not None:
        _report([_finish(schedule, gathered, me.size, me.where, seed, start, iters, trace)], schedule, named, trace,
                as_json)
