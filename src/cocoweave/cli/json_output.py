"""`--json PATH` for the perf, plan and profile commands: PATH gets the JSON, `-` means stdout (and the
human-readable output then goes to stderr, so that stdout is only JSON)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from ..errors import CocoweaveError
from .common import console, err_console
from .options import write_json as write_json_file

JsonOpt = Annotated[str | None, typer.Option(
    "--json", help="Write the results as JSON to this file ('-': stdout, the tables then go to stderr).")]


def human(json_path: str | None) -> Console:
    """Where tables and sentences go: stderr when the JSON takes stdout."""
    return err_console if json_path == "-" else console


def check_writable(json_path: str | None) -> None:
    """Refuse, before any work, a --json path that is a folder."""
    if json_path not in (None, "-") and Path(json_path).is_dir():
        raise CocoweaveError(f"--json {json_path} is a folder; give a file name.")


def write_json(json_path: str | None, doc: Any) -> None:
    """Write `doc` to `json_path` (atomically) or to stdout for '-'; nothing for None. Says where it went."""
    write_json_file(doc, json_path)
    if json_path not in (None, "-"):
        err_console.print(f"results written to {json_path}", highlight=False)
