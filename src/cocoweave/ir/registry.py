"""The one table of operations: every DSL operation's name, group, attributes, builder and meaning.

`ops.py` registers each operation as it defines it (`@operation(...)`; a collective through its kind's
registration, collectives/kinds.py, which this table follows); everything else asks this table
instead of switching on name strings: rewrites rebuild a value through `REGISTRY[v.op].rebuild`, the
reference backend evaluates a computation through `REGISTRY[v.op].meaning` (semantics.py), and each
backend keeps one table of its own keyed by operation name. Adding an operation touches its builder
here (through ops.py), its meaning, and one entry per backend table; adding a collective kind is its
registration (collectives.CollectiveKind) and its implementation per backend.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..collectives import kinds
from ..errors import ProgramError

if TYPE_CHECKING:
    from .graph import Program, Value

# Groups, each a set of operations that every consumer treats alike.
SOURCE = "source"  # input, scalar, const: no operands, no computation
BINARY = "binary"  # elementwise arithmetic with broadcasting
COMPARISON = "comparison"  # elementwise, bool result
UNARY = "unary"  # elementwise, one operand
SELECT = "select"  # where
CAST = "cast"
RANDOM = "random"  # dropout
REDUCTION = "reduction"  # sum, max, min, norm over dimensions
MATMUL = "matmul"
NORMALISATION = "normalisation"  # layer_norm
LAYOUT = "layout"  # slice: a local re-layout without communication
COLLECTIVE = "collective"  # all_reduce, reduce_scatter, all_gather, all_to_all, broadcast, reduce
P2P = "p2p"  # send (and its receiving end)
STATE = "state"  # update

ELEMENTWISE_GROUPS = (BINARY, COMPARISON, UNARY, SELECT, CAST, RANDOM)
COMPUTE_GROUPS = ELEMENTWISE_GROUPS + (REDUCTION, NORMALISATION, LAYOUT)
COMMUNICATION_GROUPS = (COLLECTIVE, P2P)

Rebuild = Callable[["Program", Sequence["Value"], Mapping[str, Any]], "Value"]


@dataclass(frozen=True)
class OpDef:
    """One operation: `rebuild(program, args, attrs)` applies it again to new operands (rewrites rebuild
    programs through the checked builders), `meaning(v, args, place)` computes it on one rank's local tensors
    (computations only; set by semantics.py), `draw(v, per_rank, sizes, gen, drawn)` makes the random inputs that
    must agree for it to run (grouped_matmul's counts; a collective's is its kind's, CollectiveKind.draw)."""

    name: str
    group: str
    attrs: tuple[str, ...]
    build: Callable[..., Value] | None
    rebuild: Rebuild | None
    meaning: Callable[..., Any] | None = None
    draw: Callable[..., None] | None = None

    @property
    def elementwise(self) -> bool:
        return self.group in ELEMENTWISE_GROUPS

    @property
    def communication(self) -> bool:
        return self.group in COMMUNICATION_GROUPS


REGISTRY: dict[str, OpDef] = {}


def register(name: str, group: str, attrs: Sequence[str] = (), build: Callable[..., Value] | None = None,
             rebuild: Rebuild | None = None, draw: Callable[..., None] | None = None) -> OpDef:
    """Add operation `name` to the table (once)."""
    if name in REGISTRY:
        raise AssertionError(f"operation {name!r} is registered twice")
    d = REGISTRY[name] = OpDef(name, group, tuple(attrs), build, rebuild, draw=draw)
    return d


def unregister(name: str) -> None:
    """Remove operation `name` (a collective kind unregistered)."""
    REGISTRY.pop(name, None)


def _add_kind(kind: kinds.CollectiveKind) -> None:
    """A collective kind registered (collectives/kinds.py) becomes an operation of the COLLECTIVE group."""
    register(kind.name, COLLECTIVE, kind.attrs, kind.build,
             kind.rebuild or (lambda program, args, a: kind.build(*args)), kind.draw)


kinds.hook(_add_kind, unregister)


def set_meaning(name: str, meaning: Callable[..., Any]) -> None:
    """Attach the local semantics of computation `name` (semantics.py does this for every computation)."""
    d = REGISTRY[name]
    REGISTRY[name] = replace(d, meaning=meaning)


def opdef(name: str) -> OpDef:
    """The definition of operation `name`; ProgramError for an unknown one."""
    d = REGISTRY.get(name)
    if d is None:
        raise ProgramError(f"unknown operation {name!r}")
    return d


def names(*groups: str) -> tuple[str, ...]:
    """Names of the operations in `groups`, in registration order."""
    return tuple(n for n, d in REGISTRY.items() if d.group in groups)


def group(name: str) -> str:
    """The group of operation `name`."""
    return opdef(name).group


def is_communication(name: str) -> bool:
    return opdef(name).communication


def rebuild(program: Program, name: str, args: Sequence[Value], attrs: Mapping[str, Any]) -> Value:
    """Apply operation `name` with `attrs` to new operands of `program` (through its checked builder)."""
    d = opdef(name)
    if d.rebuild is None:
        raise ProgramError(f"operation {name!r} cannot be rebuilt")
    return d.rebuild(program, args, attrs)


def apply(name: str, *args: Any) -> Value:
    """Call the builder of operation `name` (Value's operators go through this: graph.py imports no ops)."""
    return opdef(name).build(*args)
