"""What every command shares, so that they follow one convention: the program argument and its sizes, world
sizes (`-n 4`, `1-8` or `1,2,4`; 4 by default), timeouts (`--timeout`: how long a rank may wait for the
others; `--wall-timeout`: the whole run), `--json PATH` (`-` for stdout), output paths checked before a run,
and a refusal of sizes this machine cannot hold."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from .. import jsonable, settings
from ..errors import BackendError, LoadError
from ..ir.graph import Program
from ..ir.layout import Sliced
from ..ir.loader import load_program, parse_sizes, symbolic_sizes
from ..ir.types import DTYPES, bind_shape
from ..launch import check_local_ranks, check_seconds
from ..schedule.enumerate import enumerate_schedules
from ..schedule.schedule import Schedule
from ..storage.atomic import write_text

DEFAULT_WORLD = "4"
DEFAULT_TIMEOUT_S = 60.0
LOAD_TIMEOUT_ENV = settings.LOAD_TIMEOUT.name
DEFAULT_LOAD_TIMEOUT_S = 60.0

SizeOpt = Annotated[list[str] | None, typer.Option("--size", "-s", help="A size as NAME=INT (repeatable).")]
SpecArg = Annotated[str, typer.Argument(help="A program: FILE.py:FUNCTION (trusted code: it runs in this process).")]
WorldOpt = Annotated[str, typer.Option("--world-size", "-n", help="Ranks: 4, a range 1-8 or a list 1,2,4 "
                                                                  "(each size in turn).")]
TimeoutOpt = Annotated[float, typer.Option(help="Seconds a rank may wait for the others (in each collective, "
                                                "and for the last ranks to finish) before the run fails.")]
WallTimeoutOpt = Annotated[float | None, typer.Option(
    "--wall-timeout", help="Seconds the whole run of one world may take (default: no limit).")]
JsonOpt = Annotated[str | None, typer.Option(
    "--json", metavar="PATH", help="Write the results as JSON to PATH ('-': to stdout, alone: no tables are "
                                   "printed).")]
Device = Literal["cpu", "cuda"]  # an enum: --help lists the choices, typer refuses others
DeviceOpt = Annotated[Device, typer.Option(help="Device of the ranks: cpu (Gloo) or cuda.")]


def parse_world_sizes(text: str) -> list[int]:
    """'4' -> [4]; '1-8' -> [1..8]; '1,2,4' -> [1, 2, 4]."""
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            if hi and int(hi) - int(lo) > 100_000:
                raise LoadError(f"world sizes {text!r} span more than 100000 sizes")
            out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    except ValueError:
        raise LoadError(f"world sizes {text!r} must look like 4, 1-8 or 1,2,4") from None
    if not out or min(out) < 1:
        raise LoadError(f"world sizes {text!r} must be positive")
    return out


def parse_seconds(seconds: float, option: str = "--timeout") -> float:
    """A timeout option's seconds; LoadError (bad input) unless finite, above 0 and at most a week, as the local
    world checks them (launch.check_seconds)."""
    try:
        return check_seconds(seconds, option)
    except BackendError as exc:
        raise LoadError(str(exc)) from None


def parse_timeouts(timeout: float, wall_timeout: float | None) -> tuple[float, float | None]:
    """(--timeout, --wall-timeout) checked; the wall timeout stays None when not given."""
    return parse_seconds(timeout), None if wall_timeout is None else parse_seconds(wall_timeout, "--wall-timeout")


def load_timeout() -> float:
    """How long loading a program file may take: $COCOWEAVE_LOAD_TIMEOUT seconds, default 60."""
    seconds = settings.LOAD_TIMEOUT.get()
    return DEFAULT_LOAD_TIMEOUT_S if seconds is None else parse_seconds(seconds, LOAD_TIMEOUT_ENV)


def select(program: Program, name: str | None, device: str | None = "cpu") -> list[Schedule]:
    """All schedules for tensors on `device`, or the one called `name`."""
    schedules = enumerate_schedules(program, device or "cpu")
    if name is None:
        return schedules
    for s in schedules:
        if s.name == name:
            return [s]
    raise LoadError(f"program `{program.name}` has no schedule {name!r}; its schedules are: "
                    + ", ".join(s.name for s in schedules))


def check_output(path: str | os.PathLike[str] | None, option: str) -> Path | None:
    """The file an output option names, checked before any work: LoadError if it is a folder, its folder is
    missing or not writable, or the file is not writable. None and '-' (stdout) pass through as None."""
    if path is None or str(path) == "-":
        return None
    p = Path(path)
    if p.is_dir():
        raise LoadError(f"{option} {p} is a folder; give a file path")
    folder = p.parent
    if not folder.is_dir():
        raise LoadError(f"{option} {p}: the folder {folder} does not exist")
    if p.exists() and not os.access(p, os.W_OK):
        raise LoadError(f"{option} {p} is not writable")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise LoadError(f"{option} {p}: the folder {folder} is not writable")
    return p


def write_json(doc: Any, path: str | None) -> None:
    """Write `doc` as JSON to `path` ('-': stdout); LoadError with a sentence if the file cannot be written."""
    text = jsonable.dumps(doc, indent=2) + "\n"
    if path is None:
        return
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    try:
        write_text(Path(path), text)
    except OSError as exc:
        raise LoadError(f"--json {path} could not be written: {exc.strerror or exc}") from None


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return None


def _human(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if n < 1024 or unit == "EiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} EiB"


def check_fits(program: Program, sizes: dict[str, int], world_sizes: Iterable[int],
               given: dict[str, int] | None = None) -> None:
    """LoadError when the program's inputs alone (a copy per rank, but one of a sliced tensor) need more than
    this machine's memory: sizes like N=10**15 would otherwise fail deep inside torch. `sizes` bind the
    symbolic dimensions; `given` are the sizes as the user gave them (for the message)."""
    memory = _memory_bytes()
    if memory is None:
        return
    largest = max(world_sizes, default=1)
    need = 0
    for v in program.tensor_inputs:
        try:
            shape = bind_shape(v.shape, sizes)
        except KeyError:
            return  # a missing size: the run names it
        copies = 1 if isinstance(v.layout, Sliced) else largest
        need += math.prod(shape) * DTYPES[v.dtype].itemsize * copies
    if need > memory:
        at = ", ".join(f"{k}={v}" for k, v in (given or sizes).items()) or "its default sizes"
        raise LoadError(f"program `{program.name}` at {at} needs {_human(need)} for its inputs on {largest} "
                        f"rank{'s' if largest != 1 else ''}, more than this machine's {_human(memory)} of memory; "
                        "use smaller sizes or fewer ranks")


def check_local_worlds(world_sizes: Iterable[int]) -> None:
    """LoadError when a world size is more ranks than a local world may start on this machine."""
    for w in world_sizes:
        try:
            check_local_ranks(w)
        except BackendError as exc:
            raise LoadError(str(exc)) from None


def load(spec: str, size: list[str] | None) -> tuple[Program, dict[str, int], dict[str, int]]:
    """The program `spec` names, built with the `--size` items (within the loading timeout), the sizes
    given, and the subset of them that binds its symbolic dimensions."""
    sizes = parse_sizes(size)
    program = load_program(spec, sizes, timeout_s=load_timeout())
    return program, sizes, symbolic_sizes(program, sizes)
