"""One JSON encoding for everything cocoweave writes (results, reports, traces): it knows the project's types
(numpy scalars and arrays, paths, dates, torch dtypes and devices, sets) and refuses any other object with a
TypeError naming its type, instead of writing its `str()` where a number or a list was meant."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import os
from typing import Any

import numpy as np
import torch


class Encoder(json.JSONEncoder):
    """`json.JSONEncoder` that turns the project's types into JSON values and refuses the rest."""

    def default(self, o: Any) -> Any:
        if isinstance(o, np.generic):  # numpy bool, integer, float scalars: the Python value
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
        if isinstance(o, os.PathLike):
            return os.fspath(o)
        if isinstance(o, datetime.date | datetime.time):
            return o.isoformat()
        if isinstance(o, torch.dtype | torch.device):
            return str(o)
        if isinstance(o, enum.Enum):
            return o.value
        if isinstance(o, set | frozenset):
            return sorted(o, key=repr)
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            return dataclasses.asdict(o)
        raise TypeError(f"cocoweave does not write {type(o).__module__}.{type(o).__qualname__} objects as JSON "
                        f"(got {o!r:.80})")


def dumps(doc: Any, **kwargs: Any) -> str:
    """`json.dumps(doc, **kwargs)` with the project's Encoder."""
    return json.dumps(doc, cls=Encoder, **kwargs)
