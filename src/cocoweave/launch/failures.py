"""What went wrong in a rank, in one sentence: the first line of an exception without Gloo's and NCCL's C++
location, whether the process group itself failed, a picklable description for the parent, a BackendError."""

from __future__ import annotations

import pickle
import re
import traceback
from typing import Any, NoReturn

import torch.distributed as dist

from ..errors import BackendError

_CPP_LOCATION = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")
_COMM_FAILURE = re.compile(r"gloo|nccl|pair closure|closed by peer|timed out waiting|connection reset", re.I)


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message, without the C++ source location Gloo and NCCL put first."""
    text = str(exc).strip()
    return _CPP_LOCATION.sub("", text.splitlines()[0]) if text else ""


def _is_comm_failure(exc: BaseException) -> bool:
    """Whether `exc` comes from the process group itself (after which Gloo and NCCL groups are unusable)."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and bool(_COMM_FAILURE.search(str(exc)))


def _describe(exc: BaseException, context: str = "") -> dict[str, Any]:
    """A picklable description of an exception raised in a rank (the exception itself as bytes, if it can)."""
    try:
        original: bytes | None = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - unpicklable exceptions travel as text only
        original = None
    summary = f"{type(exc).__name__}: {_first_line(exc) or type(exc).__name__}"
    return {"summary": f"{context}: {summary}" if context else summary, "comm": _is_comm_failure(exc),
            "traceback": "".join(traceback.format_exception(exc)), "exception": original}


def _undescribe(pickled: bytes | None) -> BaseException | None:
    """The exception a rank raised, where this process can unpickle it."""
    try:
        return pickle.loads(pickled) if pickled is not None else None
    except Exception:  # noqa: BLE001 - e.g. its class lives in a module only the rank can import
        return None



def _raise(message: str, **attrs: Any) -> NoReturn:
    err = BackendError(message)
    for key, value in attrs.items():
        setattr(err, key, value)
    raise err

