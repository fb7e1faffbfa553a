"""`--json PATH` for the perf, plan and profile commands, as every command has it: PATH gets the JSON, `-` means
stdout, and then the tables are not printed at all, so that stdout is only JSON."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from .common import console, err_console
from .options import JsonOpt as JsonOpt
from .options import check_output
from .options import write_json as write_json_file

_QUIET = Console(quiet=True)


def human(json_path: str | None) -> Console:
    """Where tables and sentences go: nowhere when the JSON takes stdout (as `run`, `show`... do)."""
    return _QUIET if json_path == "-" else console


def check_writable(json_path: str | None) -> None:
    """Refuse, before any work, a --json path that cannot be written (a folder, a missing folder...)."""
    check_output(json_path, "--json")


def write_json(json_path: str | None, doc: Any) -> None:
    """Write `doc` to `json_path` (atomically) or to stdout for '-'; nothing for None. Says where it went."""
    write_json_file(doc, json_path)
    if json_path not in (None, "-"):
        err_console.print(f"results written to {json_path}", highlight=False)
