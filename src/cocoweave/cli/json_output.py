"""`--json PATH` for the perf, plan and profile commands: PATH gets the JSON, `-` means stdout (and the
human-readable output then goes to stderr, so that stdout is only JSON)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from ..atomic import write_text
from ..errors import CocoweaveError
from .common import console, err_console

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
    """Write `doc` to `json_path` (atomically) or to stdout for '-'; nothing for None."""
    if json_path is None:
        return
    text = json.dumps(doc, indent=2, default=str) + "\n"
    if json_path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    try:
        write_text(Path(json_path), text)
    except OSError as exc:
        raise CocoweaveError(f"cannot write {json_path}: {exc.strerror or exc}.") from None
    err_console.print(f"results written to {json_path}", highlight=False)
