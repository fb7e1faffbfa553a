"""Options and parsers every command shares: the program argument, sizes, world sizes and schedule selection."""

from __future__ import annotations

from typing import Annotated

import typer

from ..errors import LoadError
from ..schedule.enumerate import enumerate_schedules
from ..schedule.schedule import Schedule

SizeOpt = Annotated[list[str] | None, typer.Option("--size", "-s", help="A size as NAME=INT (repeatable).")]
SpecArg = Annotated[str, typer.Argument(help="A program: FILE.py:FUNCTION.")]


def parse_world_sizes(text: str) -> list[int]:
    """'4' -> [4]; '1-8' -> [1..8]; '1,2,4' -> [1, 2, 4]."""
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    except ValueError:
        raise LoadError(f"world sizes {text!r} must look like 4, 1-8 or 1,2,4") from None
    if not out or min(out) < 1:
        raise LoadError(f"world sizes {text!r} must be positive")
    return out


def select(program, name: str | None) -> list[Schedule]:
    """All schedules, or the one called `name`."""
    schedules = enumerate_schedules(program)
    if name is None:
        return schedules
    for s in schedules:
        if s.name == name:
            return [s]
    raise LoadError(f"program `{program.name}` has no schedule {name!r}; its schedules are: "
                    + ", ".join(s.name for s in schedules))
