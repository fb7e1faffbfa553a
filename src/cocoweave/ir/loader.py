"""Load a program from `FILE.py:FUNC` with sizes: a Python file with a function that takes size
arguments and returns a Program. Every failure is a `LoadError` (or the `ProgramError` the
program raised) with one sentence naming the file and, where known, the line.

Program files are trusted code: they run in this process, like `python file.py`, and can do anything
that can (read or delete files, start processes). What the loader guards against is mistakes, not
attacks: `exit()` and `os._exit()` become a LoadError instead of ending the process, and with
`timeout_s` (main thread, Unix: SIGALRM) a file that runs too long is stopped with a LoadError.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType

from ..errors import LoadError, ProgramError
from .graph import Program


def parse_sizes(items: list[str] | None) -> dict[str, int]:
    """['N=1024', 'B=8'] -> {'N': 1024, 'B': 8}; also accepts 'N=1024,B=8'."""
    sizes: dict[str, int] = {}
    for item in items or []:
        for part in filter(None, item.split(",")):
            name, eq, value = part.partition("=")
            if not eq or not name.strip().isidentifier():
                raise LoadError(f"size {part!r} must look like NAME=INT, e.g. N=1024")
            try:
                sizes[name.strip()] = int(value.replace("_", ""))
            except ValueError:
                raise LoadError(f"size {name.strip()} must be an integer, got {value!r}") from None
            if sizes[name.strip()] < 0:
                raise LoadError(f"size {name.strip()} must not be negative, got {value!r}")
    return sizes


def split_spec(spec: str) -> tuple[str, str]:
    """'examples/adam.py:adam' -> ('examples/adam.py', 'adam')."""
    path, sep, func = spec.rpartition(":")
    if not sep or not path or not func.isidentifier():
        raise LoadError(f"{spec!r} must be FILE.py:FUNCTION, e.g. examples/adam.py:adam")
    return path, func


def _user_line(exc: BaseException, path: str) -> str:
    """'file:line' of the innermost traceback frame inside the program file."""
    target = os.path.abspath(path)
    where = path
    for frame in traceback.extract_tb(exc.__traceback__):
        if os.path.abspath(frame.filename) == target:
            where = f"{path}:{frame.lineno}"
    return where


def _describe(exc: BaseException, path: str) -> str:
    where = _user_line(exc, path)
    if isinstance(exc, AttributeError) and getattr(exc, "obj", None) is not None \
            and getattr(exc.obj, "__name__", "") == "cocoweave":
        return f"{where}: unknown operation `{exc.name}` (not part of the cocoweave DSL)"
    return f"{where}: {type(exc).__name__}: {exc}"


def import_module_file(name: str, path: str | None) -> ModuleType:
    """The module `name`: already imported, importable by name (from `path`, when given), or else loaded
    from the file `path` under that name (a module pytest or `load_module` imported under a name this
    process cannot import, a generated kernel). Raises ImportError."""
    module = sys.modules.get(name)
    if module is not None:
        return module
    if not path:
        return importlib.import_module(name)
    # Imported by name only when the name finds this very file: a module of that name planted earlier on sys.path
    # is never executed (find_spec locates it without running it).
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        found = None
    if found is not None and found.origin and os.path.realpath(found.origin) == os.path.realpath(path):
        return importlib.import_module(name)
    file_spec = importlib.util.spec_from_file_location(name, path)  # type: ignore[arg-type]
    if file_spec is None or file_spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[name] = module
    try:
        file_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


class _Stop(BaseException):
    """Raised inside a program file's code to stop it (a BaseException: `except Exception` does not catch it)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


@contextlib.contextmanager
def _guarded(path: str, timeout_s: float | None) -> Iterator[None]:
    """Run a program file's code: `os._exit` raises LoadError instead of ending the process, and with
    `timeout_s` (in the main thread, where Unix signals can interrupt it) code running longer is stopped."""

    def refuse_exit(code: int = 0) -> None:
        raise _Stop(f"the program called os._exit({code}); a program file must return a Program, "
                    "not end the process")

    def alarm(signum: int, frame: object) -> None:
        raise _Stop(f"still running after {timeout_s:g} s of loading; a program file must build and return "
                    "its Program promptly")

    timed = timeout_s is not None and hasattr(signal, "setitimer") and \
        threading.current_thread() is threading.main_thread()
    real_exit, os._exit = os._exit, refuse_exit  # type: ignore[assignment]
    previous = signal.signal(signal.SIGALRM, alarm) if timed else None
    if timed:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        yield
    except _Stop as stop:
        raise LoadError(f"{_user_line(stop, path)}: {stop.why}") from None
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        os._exit = real_exit


def load_module(path: str, timeout_s: float | None = None) -> ModuleType:
    """Import a program file as a fresh module (stopped after `timeout_s` seconds, if given)."""
    with _guarded(path, timeout_s):
        return _load_module(path)


def _load_module(path: str) -> ModuleType:
    if not os.path.isfile(path):
        raise LoadError(f"{path}: no such program file")
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except UnicodeDecodeError as e:
        raise LoadError(f"{path}: not a UTF-8 text file (byte {e.start} cannot be decoded)") from None
    except OSError as e:
        raise LoadError(f"{path}: cannot be read: {e.strerror}") from None
    try:
        code = compile(source, path, "exec")
    except (SyntaxError, ValueError) as e:  # ValueError: null bytes, on some Python versions
        line = f":{e.lineno}" if getattr(e, "lineno", None) else ""
        raise LoadError(f"{path}{line}: syntax error: {getattr(e, 'msg', None) or e}") from None
    name = f"cocoweave_user_{abs(hash(os.path.abspath(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)  # noqa: S102 - the user's program file; no .pyc is written next to it
    except ProgramError:
        raise
    except (Exception, SystemExit) as e:  # the user's file failed while importing: say where
        raise LoadError(_describe(e, path)) from None
    return module


def load_program(spec: str, sizes: Mapping[str, int] | None = None, timeout_s: float | None = None) -> Program:
    """Build the Program that `FILE.py:FUNC` returns for the given sizes; with `timeout_s`, loading the file
    and calling FUNC together may take that long (see the module docstring)."""
    path, _ = split_spec(spec)
    with _guarded(path, timeout_s):
        return _load_program(spec, sizes)


def _load_program(spec: str, sizes: Mapping[str, int] | None) -> Program:
    path, func_name = split_spec(spec)
    module = _load_module(path)
    func = getattr(module, func_name, None)
    if not callable(func):
        defined = sorted(n for n, f in vars(module).items()
                         if inspect.isfunction(f) and f.__module__ == module.__name__)
        raise LoadError(f"{path}: no function `{func_name}`; it defines: {', '.join(defined) or 'no functions'}")
    params = inspect.signature(func).parameters
    sizes = dict(sizes or {})
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in sizes]
    if missing:
        raise LoadError(f"{path}: `{func_name}` needs size `{missing[0]}`; pass --size {missing[0]}=...")
    try:
        program = func(**{n: s for n, s in sizes.items() if n in params})
    except ProgramError:
        raise
    except (Exception, SystemExit) as e:  # SystemExit: the function called exit()
        raise LoadError(_describe(e, path)) from None
    if not isinstance(program, Program):
        raise LoadError(f"{path}: `{func_name}` returned {type(program).__name__}, not a cocoweave Program")
    unknown = [n for n in sizes if n not in params and n not in program.size_names()]
    if unknown:
        takes = list(params) + program.size_names()
        raise LoadError(f"{path}: `{func_name}` has no size `{unknown[0]}`; it takes: {', '.join(takes) or 'none'}")
    return program


def symbolic_sizes(program: Program, sizes: Mapping[str, int]) -> dict[str, int]:
    """The subset of `sizes` that binds the program's symbolic dimensions."""
    return {n: sizes[n] for n in program.size_names() if n in sizes}


def examples_dir() -> Path:
    """The repository's examples/ folder (next to src/)."""
    return Path(__file__).resolve().parents[3] / "examples"


def load_example(spec: str, **sizes: int) -> Program:
    """An example program by `FILE.py:FUNC` relative to examples/, e.g. load_example("adam.py:adam", N=8)."""
    return load_program(str(examples_dir() / spec), sizes)
