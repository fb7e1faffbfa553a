"""Dtypes, (symbolic) shapes and broadcasting."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

# Dimension: a concrete int or the name of a size bound when the program runs.
Dim = int | str
Shape = tuple[Dim, ...]

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
_RANK = {"bool": 0, "int32": 1, "int64": 2, "float16": 3, "bfloat16": 3, "float32": 4, "float64": 5}
ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32",
           "fp64": "float64", "double": "float64", "int": "int64", "long": "int64"}


def canonical_dtype(dtype: str | torch.dtype) -> str:
    """Canonical dtype name for a string alias or a torch dtype; ValueError if unknown."""
    if isinstance(dtype, torch.dtype):
        for name, td in DTYPES.items():
            if td == dtype:
                return name
        raise ValueError(f"unsupported dtype {dtype}")
    name = ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return name


def promote(a: str, b: str) -> str:
    """Result dtype of a binary op on two tensors (torch-like; float16 with bfloat16 gives float32)."""
    if a == b:
        return a
    if {a, b} == {"float16", "bfloat16"}:
        return "float32"
    return a if _RANK[a] >= _RANK[b] else b


def is_float(dtype: str) -> bool:
    return dtype in FLOAT_DTYPES


def format_shape(shape: Shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def broadcast_shapes(shapes: Sequence[Shape]) -> Shape | None:
    """Numpy broadcasting over int or symbolic dims; None if incompatible."""
    ndim = max(len(s) for s in shapes)
    out: list[Dim] = []
    for i in range(ndim):
        dim: Dim = 1
        for s in shapes:
            j = i - (ndim - len(s))
            if j < 0:
                continue
            d = s[j]
            if d == 1:
                continue
            if dim == 1:
                dim = d
            elif dim != d:
                return None
        out.append(dim)
    return tuple(out)


def bind_shape(shape: Shape, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """Replace symbolic dims by their bound sizes; KeyError names the missing size."""
    out = []
    for d in shape:
        if isinstance(d, str):
            if d not in sizes:
                raise KeyError(d)
            out.append(int(sizes[d]))
        else:
            out.append(d)
    return tuple(out)
