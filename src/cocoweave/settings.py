"""Every COCOWEAVE_* environment variable, declared once: name, type, default, meaning and the module that reads it.

Code reads a setting through its accessor (`settings.STORE.get()`), never os.environ (tests/test_architecture.py
checks). Unset or empty means the default; a malformed value is a SettingsError naming the variable.
docs/settings.md is generated from this table (`python -m cocoweave.settings_doc > docs/settings.md`; a test checks
it).
The launchers' rank variables (torchrun's RANK, SLURM's SLURM_PROCID...) are read by `cocoweave.rankenv`."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from .errors import SettingsError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Setting:
    """One environment variable: its value as text (`get`), or `default` when unset or empty; `default_text` says
    what the reader does instead when the default is worked out elsewhere (a folder, a count of cores)."""

    name: str
    meaning: str
    read_by: str  # the module that reads it
    default: Any = None
    default_text: str = ""
    kind: ClassVar[str] = "text"

    def text(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The variable's value as set (in os.environ unless given), None when it is unset or empty."""
        return (os.environ if environ is None else environ).get(self.name) or None

    def get(self, environ: Mapping[str, str] | None = None) -> Any:
        """The typed value, or the default when unset or empty; SettingsError when malformed."""
        text = self.text(environ)
        return self.default if text is None else self.parse(text)

    def parse(self, text: str) -> Any:
        return text

    def bad(self, text: str, expected: str) -> SettingsError:
        """The one sentence for a malformed value."""
        return SettingsError(f"{self.name} must be {expected}, got {text!r}")

    def default_doc(self) -> str:
        return self.default_text or ("unset" if self.default is None else str(self.default))

    def type_doc(self) -> str:
        return self.kind


@dataclass(frozen=True)
class PathSetting(Setting):
    """A file or folder."""

    kind: ClassVar[str] = "path"

    def get(self, environ: Mapping[str, str] | None = None) -> Path | None:
        return super().get(environ)

    def parse(self, text: str) -> Path:
        return Path(text)


@dataclass(frozen=True)
class Flag(Setting):
    """On (1, true, yes, on) or off (0, false, no, off; unset)."""

    default: Any = False
    kind: ClassVar[str] = "flag"

    def get(self, environ: Mapping[str, str] | None = None) -> bool:
        return bool(super().get(environ))

    def parse(self, text: str) -> bool:
        word = text.strip().lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
        raise self.bad(text, "1 or 0 (on or off)")

    def default_doc(self) -> str:
        return "1" if self.default else "0"

    def type_doc(self) -> str:
        return "flag: 1 or 0"


@dataclass(frozen=True)
class Whole(Setting):
    """A whole number of at least `minimum`."""

    minimum: int = 0
    kind: ClassVar[str] = "int"

    def parse(self, text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = self.minimum - 1
        if value < self.minimum:
            raise self.bad(text, f"a whole number of at least {self.minimum}")
        return value

    def type_doc(self) -> str:
        return f"whole number >= {self.minimum}"


@dataclass(frozen=True)
class Number(Setting):
    """A finite number of `unit`, above 0 when `positive` (else the reader checks its range)."""

    unit: str = ""
    positive: bool = True
    kind: ClassVar[str] = "float"

    def parse(self, text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or (self.positive and value <= 0):
            raise self.bad(text, f"a number of {self.unit}" + (" above 0" if self.positive else ""))
        return value

    def type_doc(self) -> str:
        return f"number of {self.unit}" + (" > 0" if self.positive else "")


@dataclass(frozen=True)
class Choice(Setting):
    """One of `choices`."""

    choices: tuple[str, ...] = ()
    kind: ClassVar[str] = "choice"

    def parse(self, text: str) -> str:
        if text not in self.choices:
            raise self.bad(text, f"one of {', '.join(self.choices)}")
        return text

    def type_doc(self) -> str:
        return "one of " + ", ".join(self.choices)


# -- the table --------------------------------------------------------------------------------------------------

BACKEND = Setting(
    "COCOWEAVE_BACKEND", "the process-group backend of a rank started by torchrun or SLURM (init_from_env)",
    "cocoweave.rankenv", default_text="NCCL with one GPU per local rank, else Gloo")
KERNELS = Choice(
    "COCOWEAVE_KERNELS", "how fused stages run unless an executable is told otherwise: generated Triton and "
    "compiled code (auto), Triton kernels, torch.compile, or torch ops one by one",
    "cocoweave.backends.torch.executable", default="auto", choices=("auto", "triton", "compiled", "torch"))
CHECK_FINITE = Flag(
    "COCOWEAVE_CHECK_FINITE", "refuse NaN or Inf in the inputs of every run (one pass over each input; read at "
    "import)", "cocoweave.backends.inputs")
CODE_CACHE = PathSetting(
    "COCOWEAVE_CACHE", "the generated-code cache (modules go to its plans/ folder)", "cocoweave.storage.codecache",
    default_text="$XDG_CACHE_HOME/cocoweave, else ~/.cache/cocoweave")
CACHE_MAX_FILES = Number(
    "COCOWEAVE_CACHE_MAX_FILES", "how many files the generated-code cache keeps", "cocoweave.storage.codecache",
    default=1000.0, default_text="1000", unit="files")
CACHE_MAX_MB = Number(
    "COCOWEAVE_CACHE_MAX_MB", "how many megabytes the generated-code cache keeps", "cocoweave.storage.codecache",
    default=100.0, default_text="100", unit="megabytes")
TUNE_CACHE = PathSetting(
    "COCOWEAVE_TUNE_CACHE", "the tuning cache file (the best schedule per program, sizes and world)",
    "cocoweave.tune.cache", default_text=".cocoweave/tune-cache.json")
STORE = PathSetting(
    "COCOWEAVE_STORE", "the measurement store folder (Parquet)", "cocoweave.perf.store",
    default_text=".cocoweave/store")
CALIBRATION_DIR = PathSetting(
    "COCOWEAVE_CALIBRATION_DIR", "where calibrations of the cost model are kept", "cocoweave.perf.costmodel",
    default_text=".cocoweave/")
CMDARE_DATA = PathSetting(
    "COCOWEAVE_CMDARE_DATA", "the CM-DARE data folder (`cocoweave cluster`)", "cocoweave.cluster.cmdare.tables",
    default_text="the copy shipped with the package")
PROFILE_DIR = PathSetting(
    "COCOWEAVE_PROFILE_DIR", "where each rank under `cocoweave profile` writes rank<R>.jsonl (set by the "
    "profiler for its ranks)", "cocoweave.cluster.profiling.recorder", default_text="unset: nothing is recorded")
PROFILE_STEPS = Whole(
    "COCOWEAVE_PROFILE_STEPS", "steps each profiled rank times (set by the profiler)",
    "cocoweave.cluster.profiling.recorder", default=20, minimum=0)
PROFILE_WARMUP = Whole(
    "COCOWEAVE_PROFILE_WARMUP", "steps each profiled rank runs before timing (set by the profiler)",
    "cocoweave.cluster.profiling.recorder", default=3, minimum=0)
FAULT = Setting(
    "COCOWEAVE_FAULT", "a fault to inject, e.g. rank=1,stage=2,action=exit (reliability tests; read at import, "
    "a malformed one is logged and not armed)", "cocoweave.faults")
LOAD_TIMEOUT = Number(
    "COCOWEAVE_LOAD_TIMEOUT", "seconds the CLI may take to load a program file", "cocoweave.cli.options",
    default_text="60", unit="seconds", positive=False)
DEBUG = Flag(
    "COCOWEAVE_DEBUG", "show the traceback of an internal error of the CLI", "cocoweave.cli.common")
MAX_LOCAL_RANKS = Whole(
    "COCOWEAVE_MAX_LOCAL_RANKS", "the most ranks a LocalWorld may start on this machine", "cocoweave.launch.ranks",
    default_text="4 per core, at least 16", minimum=1)
SPAWN_RANKS = Flag(
    "COCOWEAVE_SPAWN_RANKS", "start a LocalWorld's ranks with spawn (each imports torch itself) instead of forking "
    "them from a server that imported torch once", "cocoweave.launch.worker")
TORCHRUN_REPEATS = Whole(
    "COCOWEAVE_TORCHRUN_REPEATS", "how many times the test suite repeats its torchrun test "
    "(scripts/torchrun_repeat.sh sets 50)", "tests/cli/test_torchrun.py", default=3, minimum=1)

SETTINGS: tuple[Setting, ...] = tuple(v for v in list(globals().values()) if isinstance(v, Setting))

