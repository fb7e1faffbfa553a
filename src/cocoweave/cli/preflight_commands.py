"""`cocoweave preflight FILE.py:FUNCTION`: check a pipeline job before it runs (cocoweave.preflight)."""

from __future__ import annotations

import re
import time
from typing import Annotated, Any

import typer

from ..errors import LoadError, PreflightError
from .common import EXIT_MISMATCH, console, fail, table, user_errors
from .options import DEFAULT_LOAD_TIMEOUT_S, JsonOpt, check_output, write_json

UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
         "tib": 2**40}

EntryArg = Annotated[str, typer.Argument(help="FILE.py:FUNCTION returning a cocoweave.preflight.PipelineJob (or a "
                                              "Trace of a job's communication); trusted code, run in this process.")]
MemoryOpt = Annotated[str | None, typer.Option(
    "--device-memory", metavar="SIZE", help="Each device's capacity, e.g. 80GiB, 512MiB or 1e9 (bytes); overrides "
                                            "the job's device_memory.")]


def parse_bytes(text: str) -> float:
    """'80GiB' -> 85899345920.0; '1e9' -> 1e9; LoadError with a sentence otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS or float(m.group(1)) <= 0:
        raise LoadError(f"--device-memory {text!r} must be a positive size such as 80GiB, 512MiB or 1e9")
    return float(m.group(1)) * UNITS[m.group(2).lower()]


def load_job(spec: str) -> Any:
    """What FILE.py:FUNCTION returns when called without arguments: a PipelineJob or a Trace."""
    from ..ir.loader import load_module, split_spec
    from ..preflight import PipelineJob, Trace

    path, name = split_spec(spec)
    module = load_module(path, DEFAULT_LOAD_TIMEOUT_S)
    func = getattr(module, name, None)
    if not callable(func):
        raise LoadError(f"{path}: no function `{name}`")
    try:
        job = func()
    except Exception as e:  # the user's function failed: say where, in one line
        raise LoadError(f"{path}: `{name}` raised {type(e).__name__}: {e}") from None
    if not isinstance(job, PipelineJob | Trace):
        raise LoadError(f"{path}: `{name}` returned {type(job).__name__}, not a cocoweave.preflight.PipelineJob or "
                        "Trace")
    return job


@user_errors
def preflight(spec: EntryArg, device_memory: MemoryOpt = None, as_json: JsonOpt = None) -> None:
    """Prove one step of a pipeline job's communication matches up and cannot wait in a circle (every send has
    its receive, every group's collectives come in one order on all its ranks), predict each rank's peak memory
    against the device and the schedule's idle share, from torch's schedule and without running the model.

    Exit codes: 0 it runs and fits, 1 it would hang or not fit (the sentence names the ranks, operations and step,
    or the memory term), 2 bad input."""
    start = time.perf_counter()
    check_output(as_json, "--json")
    capacity = parse_bytes(device_memory) if device_memory is not None else None
    from ..preflight import PipelineJob, check_trace
    from ..preflight import preflight as run_preflight

    job = load_job(spec)
    try:
        if isinstance(job, PipelineJob):
            if capacity is not None:
                job.device_memory = capacity
            report = run_preflight(job)
            doc = report.to_json()
        else:
            timing = check_trace(job)
            doc = {"ok": True, "ranks": len(job.ranks), "max_bubble": round(timing.max_bubble, 4),
                   "operations": {str(r): len(job.ops.get(r, [])) for r in job.ranks}}
    except PreflightError as e:
        if as_json is not None:
            write_json({"ok": False, "error": str(e)}, as_json)
        raise fail(str(e), EXIT_MISMATCH) from None
    doc["seconds"] = round(time.perf_counter() - start, 3)
    if as_json != "-":
        if isinstance(job, PipelineJob):
            _print(report)
        console.print(f"ok: {doc['ranks']} ranks would run one step without waiting forever"
                      + (" and fit" if isinstance(job, PipelineJob) and job.device_memory else "")
                      + f"; the largest idle share is {100 * doc['max_bubble']:.1f}% ({doc['seconds']:.2f} s)")
    write_json(doc, as_json)


def _print(report: Any) -> None:
    mib = 2**20
    t = table(f"pre-flight of {report.job.name}: dp {report.job.dp} x pp {report.job.pp} x tp {report.job.tp}, "
              f"{report.job.schedule if isinstance(report.job.schedule, str) else 'user schedule'}, "
              f"{report.job.microbatches} micro-batches",
              {"rank": "right", "sends": "right", "recvs": "right", "collectives": "right", "idle": "right",
               "weights MiB": "right", "grads MiB": "right", "optimizer MiB": "right", "activations MiB": "right",
               "buffers MiB": "right", "programs MiB": "right", "peak MiB": "right"})
    for r in report.trace.ranks:
        ops = report.trace.ops.get(r, [])
        m = report.memory[r]
        t.add_row(str(r), str(sum(o.kind == "send" for o in ops)), str(sum(o.kind == "recv" for o in ops)),
                  str(sum(o.kind not in ("send", "recv") for o in ops)), f"{100 * report.bubble(r):.1f}%",
                  *(f"{getattr(m, k) / mib:.2f}" for k in m.TERMS), f"{m.total / mib:.2f}")
    console.print(t)
