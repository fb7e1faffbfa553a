"""cocoweave: distributed workloads with computation and communication as first-class operations.

    import cocoweave as cw
    p = cw.Program("adam")
    g = p.tensor("g", ("N",), "float32", cw.Local)
    ...
"""

import logging as _logging

from . import errors
from .ir import WORLD, Group, Layout, Local, Mesh, Program, Replicated, Sliced, Value
from .ir.ops import (
    abs,
    add,
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    cast,
    div,
    dropout,
    eq,
    exp,
    ge,
    grouped_matmul,
    grouped_matmul_wgrad,
    gt,
    layer_norm,
    le,
    lt,
    matmul,
    max,
    maximum,
    min,
    minimum,
    mul,
    ne,
    neg,
    norm,
    pow,
    recv,
    reduce,
    reduce_scatter,
    rsqrt,
    send,
    sigmoid,
    silu,
    silu_grad,
    slice,
    sqrt,
    sub,
    sum,
    update,
    where,
)
from .version import __version__ as __version__

_logging.getLogger(__name__).addHandler(_logging.NullHandler())  # quiet unless the application configures logging


def __getattr__(name: str):
    """`cw.compile` and `cw.Schedule`, imported on first use (they pull in the backends)."""
    if name == "compile":
        from .compiler import compile

        return compile
    if name == "Schedule":
        from .schedule.schedule import Schedule

        return Schedule
    raise AttributeError(f"module 'cocoweave' has no attribute {name!r}")

__all__ = [
    "WORLD", "Group", "Layout", "Local", "Mesh", "Program", "Replicated", "Sliced", "Value", "errors",
    "abs", "add", "all_gather", "all_reduce", "all_to_all", "broadcast", "cast", "div", "dropout", "eq", "exp", "ge",
    "grouped_matmul", "grouped_matmul_wgrad", "gt", "layer_norm", "le", "lt", "matmul", "max", "maximum", "min",
    "minimum", "mul", "ne", "neg", "norm", "pow", "recv", "reduce", "reduce_scatter", "rsqrt", "sigmoid", "silu",
    "silu_grad", "slice", "send", "sqrt", "sub", "sum", "update", "where",
]
