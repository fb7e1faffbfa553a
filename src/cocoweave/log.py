"""cocoweave's logging: every module logs to `logging.getLogger(__name__)`, under `cocoweave.*`. The package's
logger has a NullHandler (cocoweave/__init__.py), so nothing is printed unless the application configures
logging, or `cocoweave -v` (log_to_stderr) asks for it."""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(name)s %(levelname)s: %(message)s"


class _Stderr(logging.StreamHandler):
    """A StreamHandler on whatever sys.stderr is when a record is written (a test runner or a notebook may swap it)."""

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def log_to_stderr(level: int = logging.INFO, name: str = "cocoweave") -> logging.Handler:
    """Print the records of logger `name` (and below) at `level` or above on stderr; returns the handler (once
    per logger: a second call only sets the level)."""
    logger = logging.getLogger(name)
    logger.setLevel(level)
    for handler in logger.handlers:
        if getattr(handler, "_cocoweave", False):
            return handler
    handler = _Stderr()
    handler.setFormatter(logging.Formatter(FORMAT, "%H:%M:%S"))
    handler._cocoweave = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    return handler
