"""Functions sent to ranks: by module, qualified name and file where a rank can import them, else by value
(cloudpickle); and the framing of messages on a rank's pipe."""

from __future__ import annotations

import functools
import pickle
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle

from ..errors import BackendError
from ..ir.loader import import_module_file
from .failures import _first_line


def _fn_name(fn: Callable[..., Any]) -> str:
    if isinstance(fn, functools.partial):
        return _fn_name(fn.func)
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _fn_spec(fn: Callable[..., Any]) -> tuple[Any, ...]:
    """How a rank finds `fn`: by module, qualified name and file (plain functions); lambdas, nested functions and
    functions of a module without a file (a notebook's) by value with cloudpickle; anything else pickled."""
    if not callable(fn):
        raise BackendError(f"world.run needs a callable, got {type(fn).__name__}")
    if isinstance(fn, functools.partial):
        return ("partial", _fn_spec(fn.func), fn.args, fn.keywords)
    qualname = getattr(fn, "__qualname__", "")
    if hasattr(fn, "__code__") and hasattr(fn, "__module__"):
        path = getattr(sys.modules.get(fn.__module__), "__file__", None)
        if "<" in qualname or path is None:  # <lambda>, <locals>, a notebook's function: ranks cannot import it
            try:
                return ("cloudpickle", cloudpickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL))
            except Exception as exc:  # noqa: BLE001 - whatever its closure holds
                raise BackendError(f"`{qualname}` cannot be sent to ranks: {type(exc).__name__}: "
                                   f"{_first_line(exc)}") from None
        return ("ref", fn.__module__, qualname, path)
    return ("value", fn)


def _resolve(spec: tuple[Any, ...]) -> Callable[..., Any]:
    """The function a `_fn_spec` names, imported in this rank."""
    if spec[0] == "value":
        return spec[1]
    if spec[0] == "cloudpickle":
        return pickle.loads(spec[1])
    if spec[0] == "partial":
        return functools.partial(_resolve(spec[1]), *spec[2], **spec[3])
    _, module_name, qualname, path = spec
    try:
        obj: Any = import_module_file(module_name, path)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # noqa: BLE001
        raise BackendError(f"cannot find `{qualname}` in module {module_name} ({type(exc).__name__}: "
                           f"{_first_line(exc)}); functions sent to ranks must be module-level in a file"
                           ) from None
    return obj


def _send(conn: Connection, msg: Any) -> None:
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

