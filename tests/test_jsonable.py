"""The one JSON encoding: the project's types become the JSON values they stand for (a numpy integer a number,
not the string "3"), and any other object is refused instead of written as its str()."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest
import torch

from cocoweave import jsonable


def test_project_types_become_their_json_values():
    doc = {"i": np.int64(3), "f": np.float32(0.5), "b": np.bool_(True), "a": np.arange(3), "p": Path("/tmp/x"),
           "t": datetime(2026, 1, 2, tzinfo=UTC), "dtype": torch.float32, "dev": torch.device("cpu"), "s": {2, 1}}
    assert json.loads(jsonable.dumps(doc)) == {"i": 3, "f": 0.5, "b": True, "a": [0, 1, 2], "p": "/tmp/x",
                                               "t": "2026-01-02T00:00:00+00:00", "dtype": "torch.float32",
                                               "dev": "cpu", "s": [1, 2]}


def test_other_objects_are_refused_naming_their_type():
    class Opaque:
        pass

    with pytest.raises(TypeError, match="does not write .*Opaque objects as JSON"):
        jsonable.dumps({"x": Opaque()})
    with pytest.raises(TypeError, match="Tensor"):
        jsonable.dumps([torch.ones(2)])
