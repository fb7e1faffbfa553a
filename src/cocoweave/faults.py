"""Fault injection and stage tracking for tests of reliability: make one rank exit, die, hang or raise
at a chosen stage, and know which stage every rank was in when a world failed.

    COCOWEAVE_FAULT="rank=1,stage=2,action=exit"          # read once per process (or `configure(...)`)

Keys: `rank` (the rank that faults; default every rank), `stage` (the stage index; default any),
`label` (only stages with this label, e.g. `RS` or `train_step`), `hit` (fault on the n-th matching
entry, default 1), `action` (`exit`: os._exit(code); `kill`: SIGKILL itself; `sleep`: sleep `seconds`
(default 3600); `raise`: raise `InjectedFault`), `code` (exit code, default 13), `once` (a marker file:
the fault fires only if it does not exist, and creates it first, so a restarted run proceeds).

Generated step code calls `enter(rank, stage, label)` at the entry of every stage, but only when the
module-level flag `ACTIVE` is set (a fault is configured, or a LocalWorld records stage progress), so
the fast path costs one attribute check.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from . import settings
from .errors import CocoweaveError
from .log import log_to_stderr

log = logging.getLogger(__name__)

ENV_VAR = settings.FAULT.name
ACTIONS = ("exit", "kill", "sleep", "raise")

ACTIVE = False  # whether `enter` must be called at stage entries (checked inline by the runtime)


class InjectedFault(RuntimeError):
    """Raised by a fault with action `raise` (a stand-in for an error inside a stage)."""


@dataclass(frozen=True)
class Fault:
    """Where and how a rank faults."""

    action: str
    rank: int | None = None
    stage: int | None = None
    label: str | None = None
    hit: int = 1
    code: int = 13
    seconds: float = 3600.0
    once: str | None = None

    def matches(self, rank: int, stage: int, label: str) -> bool:
        return ((self.rank is None or rank == self.rank) and (self.stage is None or stage == self.stage)
                and (self.label is None or label == self.label))


class Progress(ctypes.Structure):
    """The stage a rank is in, in shared memory (`multiprocessing.RawValue(Progress)`): -1 when none."""

    _fields_ = [("stage", ctypes.c_int64), ("label", ctypes.c_char * 32)]

    def describe(self) -> str | None:
        return where(self.stage, self.label.decode(errors="replace")) if self.stage >= 0 else None


_FAULT: Fault | None = None
_HITS = 0
_PROGRESS: Any = None  # a shared-memory slot (launch.LocalWorld) the parent reads when a rank fails
_CURRENT: tuple[int, str] | None = None
_LABELS: dict[str, bytes] = {}  # stage label -> its bytes in Progress (labels repeat every step)


def parse(spec: str) -> Fault:
    """'rank=1,stage=2,action=exit' -> Fault; a malformed spec raises CocoweaveError naming the key."""
    fields: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise CocoweaveError(f"{ENV_VAR}: {item!r} must look like KEY=VALUE, e.g. rank=1,stage=2,action=exit")
        fields[key.strip()] = value.strip()
    unknown = sorted(set(fields) - {"action", "rank", "stage", "label", "hit", "code", "seconds", "once"})
    if unknown:
        raise CocoweaveError(f"{ENV_VAR}: unknown key {unknown[0]!r}; keys are action, rank, stage, label, hit, "
                             "code, seconds, once")
    action = fields.pop("action", "")
    if action not in ACTIONS:
        raise CocoweaveError(f"{ENV_VAR}: action must be one of {', '.join(ACTIONS)}, got {action!r}")
    try:
        ints = {k: int(fields[k]) for k in ("rank", "stage", "hit", "code") if k in fields}
        seconds = float(fields.get("seconds", 3600.0))
    except ValueError as exc:
        raise CocoweaveError(f"{ENV_VAR}: {exc}") from None
    return Fault(action=action, label=fields.get("label"), seconds=seconds, once=fields.get("once"), **ints)


def configure(spec: str | None) -> Fault | None:
    """Arm the fault `spec` in this process (None or '' disarms it); returns the parsed fault."""
    global _FAULT, _HITS, ACTIVE
    _FAULT = parse(spec) if spec else None
    _HITS = 0
    ACTIVE = _FAULT is not None or _PROGRESS is not None
    return _FAULT


def track(progress: Any) -> None:
    """Record the stage each `enter` reports into `progress` (a shared-memory `Progress`, or None to stop)."""
    global _PROGRESS, ACTIVE
    _PROGRESS = progress
    ACTIVE = _FAULT is not None or _PROGRESS is not None


def reset_stage() -> None:
    """Forget the current stage (at the start of a new piece of work)."""
    global _CURRENT
    _CURRENT = None
    if _PROGRESS is not None:
        _PROGRESS.stage, _PROGRESS.label = -1, b""


def current_stage() -> tuple[int, str] | None:
    """(stage index, label) of the last stage this process entered since `reset_stage`, if any."""
    return _CURRENT


def where(stage: int, label: str) -> str:
    """How errors name a stage: "stage 2 (RS)"."""
    return f"stage {stage} ({label})" if label else f"stage {stage}"


def enter(rank: int, stage: int, label: str) -> None:
    """Called at the entry of a stage: record it, and fire the armed fault if it matches."""
    global _CURRENT
    _CURRENT = (stage, label)
    progress = _PROGRESS
    if progress is not None:
        progress.stage = stage
        encoded = _LABELS.get(label)
        if encoded is None:
            encoded = _LABELS[label] = label.encode()[:31]
        progress.label = encoded
    if _FAULT is not None:
        maybe_fault(rank, stage, label)


def maybe_fault(rank: int, stage: int, label: str) -> None:
    """Fire the armed fault if (rank, stage, label) matches it (and its hit count and marker allow)."""
    global _HITS
    fault = _FAULT
    if fault is None or not fault.matches(rank, stage, label):
        return
    _HITS += 1
    if _HITS != fault.hit:
        return
    if fault.once:
        try:
            os.close(os.open(fault.once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # fired on an earlier attempt
    at = where(stage, label)
    log.warning("injected fault: rank %d %s at %s", rank, fault.action, at)
    for handler in log.handlers + logging.getLogger("cocoweave").handlers:
        handler.flush()  # before os._exit or SIGKILL
    if fault.action == "exit":
        os._exit(fault.code)
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.action == "sleep":
        time.sleep(fault.seconds)
        return
    raise InjectedFault(f"injected fault on rank {rank} at {at}")


def configure_from_env() -> None:
    """Arm the fault COCOWEAVE_FAULT asks for now (at import, and in a rank once it has its starter's environment);
    a malformed one is logged and not armed: never fail an import or a rank's start."""
    if settings.FAULT.text():  # faults asked for in the environment announce themselves on stderr
        log_to_stderr(logging.WARNING, __name__)
    try:
        configure(settings.FAULT.text())
    except CocoweaveError as exc:
        log.warning("fault not armed: %s", exc)


configure_from_env()
