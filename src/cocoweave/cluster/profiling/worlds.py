"""Profile a training script written for torchrun on local worlds of several sizes.

Each world runs `python -m torch.distributed.run --standalone --nproc-per-node K -m
cocoweave.cluster.profiling.rank_entry SCRIPT ARGS...` with the step recorder installed (`recorder`), every
rank limited to `threads` intra-op threads. A world's step time is the house definition: per step the
slowest rank's time, then the median over the timed steps. Phase and CPU times are per-rank medians,
averaged over the ranks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from cocoweave.cluster.profiling import recorder
from cocoweave.cluster.profiling.io_summary import merge_io, summarise_io
from cocoweave.errors import CocoweaveError
from cocoweave.launch.lifetime import run_bounded
from cocoweave.rankenv import cores

PHASES = ("data_ms", "forward_ms", "backward_ms", "update_ms")
CPU = ("cpu_main_ms", "cpu_other_ms")
LOG_TAIL = 12  # lines of a failed world's output quoted in the error


class ProfileError(CocoweaveError):
    """A training script could not be profiled (it failed, hung, or never stepped an optimizer)."""


@dataclass
class WorldRun:
    """What one world size measured."""

    world_size: int
    step_ms: float
    steps_ms: list[float]
    phases_ms: dict[str, float]
    cpu_ms: dict[str, float]
    collectives: dict[str, dict[str, float]]  # "all_reduce/p2" -> count, bytes, ms per step (rank mean)
    optimizer_phases_ms: dict[str, float] | None
    counts: dict[str, dict[str, float]]  # "forward_backward"/"update" -> flops, bytes, ops (per rank)
    optimizer: str
    param_bytes: float
    state_bytes: float
    threads: int
    load_avg: list[float]
    seconds: float
    per_rank_step_ms: list[float] = field(default_factory=list)  # each rank's median step time
    other_load: float | None = None  # share of the machine's cores other processes used during the run
    io: dict[str, Any] = field(default_factory=dict)  # input pipeline, checkpoints, transfers (io_summary.py)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> WorldRun:
        return cls(**doc)


def machine_busy_s() -> float | None:
    """Seconds all CPUs of the machine have been busy (or stolen by the hypervisor) since boot; None off Linux."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def default_script_args(script: Path) -> list[str]:
    """The arguments a script asks to be profiled with when none are given: a comment line
    `# cocoweave profile: ARGS` (e.g. a data-parallel layout that runs on any number of ranks)."""
    try:
        text = script.read_text(errors="replace")
    except OSError:
        return []
    for line in text.splitlines():
        match = re.match(r"^#\s*cocoweave profile:\s*(.*)$", line.strip())
        if match:
            try:
                return shlex.split(match[1])
            except ValueError as exc:
                raise ProfileError(f"{script}: the '# cocoweave profile:' line cannot be split: {exc}.") from None
    return []


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def _read_rank(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    header: dict[str, Any] = {}
    steps: list[dict[str, Any]] = []
    counts: dict[str, Any] = {}
    for line in path.read_text().splitlines():
        doc = json.loads(line)
        kind = doc.pop("type", None)
        if kind == "header":
            header = doc
        elif kind == "step":
            steps.append(doc)
        elif kind == "counts":
            counts = doc
    return header, steps, counts


def summarise(world_size: int, folder: Path, seconds: float) -> WorldRun:
    """Combine the ranks' JSON lines in `folder` into one WorldRun."""
    ranks = [folder / f"rank{r}.jsonl" for r in range(world_size)]
    missing = [p.name for p in ranks if not p.is_file()]
    if missing:
        raise ProfileError(f"the {world_size}-rank run wrote no step records for {', '.join(missing)}: does the "
                           "script step a torch.optim optimizer?")
    parsed = [_read_rank(p) for p in ranks]
    if any(not steps for _, steps, _ in parsed):
        raise ProfileError(f"the {world_size}-rank run never finished an optimizer step: does the script step a "
                           "torch.optim optimizer?")
    timed = [[s for s in steps if s["timed"]] for _, steps, _ in parsed]
    n = min(len(t) for t in timed)
    if n == 0:
        raise ProfileError(f"the {world_size}-rank run ended before any timed step: give the script more steps "
                           "or lower --warmup.")
    per_step = [max(t[i]["wall_ms"] for t in timed) for i in range(n)]
    phases = {k: statistics.fmean(_median([s[k] for s in t]) for t in timed) for k in PHASES}
    cpu = {k: statistics.fmean(_median([s[k] for s in t]) for t in timed) for k in CPU}
    colls: dict[str, dict[str, float]] = {}
    for t in timed:
        for s in t:
            for key, (count, nbytes, ms) in s["collectives"].items():
                acc = colls.setdefault(key, {"count": 0.0, "bytes": 0.0, "ms": 0.0})
                acc["count"] += count / (n * world_size)
                acc["bytes"] += nbytes / (n * world_size)
                acc["ms"] += ms / (n * world_size)
    opt_phases = None
    if all(s["optimizer_phases_ms"] for t in timed for s in t[:n]):
        keys = set.intersection(*(set(s["optimizer_phases_ms"]) for t in timed for s in t[:n]))
        opt_phases = {k: statistics.fmean(_median([s["optimizer_phases_ms"][k] for s in t[:n]]) for t in timed)
                      for k in sorted(keys)}
    header0, _, counts0 = parsed[0]
    per_rank = [_median([s["wall_ms"] for s in t]) for t in timed]
    return WorldRun(
        world_size=world_size, step_ms=slowest_rank_step(per_rank), steps_ms=per_step, phases_ms=phases, cpu_ms=cpu,
        collectives=colls, optimizer_phases_ms=opt_phases, counts=counts0, optimizer=header0.get("optimizer", "?"),
        param_bytes=float(header0.get("param_bytes", 0)), state_bytes=float(header0.get("state_bytes", 0)),
        threads=int(header0.get("threads", 1)), load_avg=list(header0.get("load_avg", [])), seconds=seconds,
        per_rank_step_ms=per_rank,
        io=summarise_io([t[:n] for t in timed], [steps for _, steps, _ in parsed]))


def slowest_rank_step(per_rank_ms: Sequence[float]) -> float:
    """A world's step from each rank's median step time: the slowest rank's. Ranks that meet every step take as long
    per step over a run (the run's pace); taking the slowest rank's time per step before the median (the definition
    until late 2026-11-27) adds the spread of when each rank's step boundary falls: 2-8% at 3 ranks on 2 cores
    (docs/profiling.md)."""
    return max(per_rank_ms)


def ranks(n: int) -> str:
    """'1 rank', '3 ranks'."""
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _tail(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " | ".join(lines[-LOG_TAIL:])


def _rank_failure(logs: Path) -> str | None:
    """The root cause of a failed world: the first rank to raise, from the error files torch elastic's `@record`
    writes under torchrun's --log-dir (rank_entry.main is recorded). A script that exits without raising
    (`print(...); sys.exit(2)`) writes none: then the last lines of the first rank log that reports an error."""
    failures = []
    for f in logs.rglob("error.json"):
        try:
            failures.append(ProcessFailure(int(f.parent.name) if f.parent.name.isdigit() else -1, 0, 1, str(f)))
        except (ValueError, KeyError, TypeError):  # a file cut short by a dying rank
            continue
    if failures:
        first = min(failures, key=lambda failure: (failure.timestamp, failure.local_rank))
        message = first.message.get("message", "") if isinstance(first.message, dict) else str(first.message)
        return f"rank {first.local_rank}: {_tail(message)}"
    for log in sorted(logs.rglob("stderr.log")):
        text = log.read_text(errors="replace")
        if "Error" in text or "error" in text or "Traceback" in text:
            return f"rank {log.parent.name}: {_tail(text)}"
    return None


def torchrun_command(script: Path, script_args: Sequence[str], world_size: int, logs: Path) -> list[str]:
    """The command that starts `world_size` ranks of `script` under the step recorder, as torchrun would;
    each rank's output goes to its own files under `logs`."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
            f"--log-dir={logs}", "--redirects=3", "-m", "cocoweave.cluster.profiling.rank_entry", str(script),
            *script_args]


def run_world(script: Path, script_args: Sequence[str], world_size: int, steps: int, warmup: int,
              threads: int, timeout_s: float) -> WorldRun:
    """Run `script` on `world_size` local ranks under the recorder and summarise what they measured."""
    with tempfile.TemporaryDirectory(prefix=f"cocoweave-profile-w{world_size}-") as tmp:
        folder, logs = Path(tmp), Path(tmp) / "logs"
        env = dict(os.environ)
        env.update({recorder.DIR_ENV: str(folder), recorder.STEPS_ENV: str(steps),
                    recorder.WARMUP_ENV: str(warmup), "OMP_NUM_THREADS": str(threads),
                    "PYTHONUNBUFFERED": "1"})
        src = str(Path(__file__).resolve().parents[3])  # the cocoweave sources, for the ranks' imports
        env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
        start, busy0, ours0 = time.perf_counter(), machine_busy_s(), _children_cpu_s()
        try:
            # its own session and a parent-death signal: ended with this command on every exit path (launch/lifetime.py)
            proc = run_bounded(torchrun_command(script, script_args, world_size, logs), env, timeout_s)
        except subprocess.TimeoutExpired:
            raise ProfileError(f"{script} on {ranks(world_size)} did not finish within {timeout_s:g} s (raise "
                               f"--timeout); {_rank_failure(logs) or 'no rank reported an error'}") from None
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            why = _rank_failure(logs) or _tail(proc.stderr + proc.stdout) or "no output"
            raise ProfileError(f"{script} failed on {ranks(world_size)} (exit code {proc.returncode}): {why}")
        run = summarise(world_size, folder, seconds)
        busy1, ours = machine_busy_s(), _children_cpu_s() - ours0
        if busy0 is not None and busy1 is not None:
            run.other_load = max(busy1 - busy0 - ours, 0.0) / (seconds * cores())
        return run


def merge_rounds(runs: Sequence[WorldRun]) -> WorldRun:
    """One world measured in several rounds as one: every round's steps, each rank's median step over the rounds
    (the median of its rounds' medians) and the slowest of those as the world's step, round means of the phase, CPU
    and collective figures and of the others' load."""
    first = runs[0]
    if len(runs) == 1:
        return first
    steps = [s for r in runs for s in r.steps_ms]

    def mean(get) -> dict[str, float]:
        return {k: statistics.fmean(get(r)[k] for r in runs) for k in get(first)}

    colls = {key: {f: statistics.fmean(r.collectives.get(key, {}).get(f, 0.0) for r in runs) for f in c}
             for key, c in first.collectives.items()}
    loads = [r.other_load for r in runs if r.other_load is not None]
    per_rank = [_median(x) for x in zip(*(r.per_rank_step_ms for r in runs))]  # a slow round moves it least
    return dataclasses.replace(
        first, step_ms=slowest_rank_step(per_rank), steps_ms=steps,
        phases_ms=mean(lambda r: r.phases_ms), cpu_ms=mean(lambda r: r.cpu_ms), collectives=colls,
        seconds=sum(r.seconds for r in runs), per_rank_step_ms=per_rank,
        other_load=statistics.fmean(loads) if loads else None, io=merge_io([r.io for r in runs]))


def profile_worlds(script: Path, script_args: Sequence[str], world_sizes: Sequence[int], steps: int = 20,
                   warmup: int = 3, threads: int = 1, timeout_s: float = 300.0, rounds: int = 1,
                   progress: Callable[[int], None] | None = None) -> list[WorldRun]:
    """Run every world size in turn (smallest first) and return what each measured. With several `rounds`
    the sizes take turns, `steps` timed steps each per round, so that a slow spell of a shared machine
    does not fall on one size only; a size's rounds are merged (`merge_rounds`)."""
    if not script.is_file():
        raise ProfileError(f"training script {script} does not exist.")
    if script.suffix != ".py":
        raise ProfileError(f"training script {script} must be a Python file (.py).")
    if steps < 1 or warmup < 2 or rounds < 1:
        raise ProfileError(f"profiling needs at least 1 timed step, 2 warm-up steps and 1 round, got {steps}, "
                           f"{warmup} and {rounds}.")
    measured: dict[int, list[WorldRun]] = {}
    for _ in range(rounds):
        for p in sorted(set(world_sizes)):
            if progress is not None:
                progress(p)
            measured.setdefault(p, []).append(run_world(script, script_args, p, steps, warmup, threads, timeout_s))
    return [merge_rounds(runs) for _, runs in sorted(measured.items())]
