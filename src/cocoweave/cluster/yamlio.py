"""Read a planner input file (catalog or profile) as YAML, turning every failure into one sentence."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from cocoweave.errors import PlanningError


def load_yaml(path: str | os.PathLike, what: str) -> Any:
    """The parsed document of `path`; PlanningError names the file, and the line for syntax errors."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise PlanningError(f"cannot read {what} {path}: {exc.strerror or exc}.") from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or "syntax error"
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise PlanningError(f"{what} {path} is not valid YAML{where}: {problem}.") from exc
