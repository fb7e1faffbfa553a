"""The table of collective kinds: each kind (all_reduce, all_to_all, ...) is one registration holding every fact
about it that the layers above read, so that adding one touches its registration and its implementations.

A `CollectiveKind` says: its name and schedule token ("A2A"); its DSL builder, which checks the operand's layout
and gives the result's (the layout rule); its meaning on the ranks' tensors (the reference backend's oracle); the
arguments the torch code generator passes to its runtime call; what it moves (collectives/traffic.py's formula
unless it brings its own); its calibration benchmark; the torch.distributed functions the profiler's recorder
counts as it. `register` also adds the operation to the IR's table (ir/registry.py, through the hook ir sets), so
the DSL, enumeration and the backends see it; `unregister` forgets it everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import CocoweaveError

Calls = tuple[tuple[Any, ...], tuple[tuple[str, Any], ...]]


@dataclass(frozen=True)
class CollectiveKind:
    """One collective kind. `build(x, ...)`: the DSL operation (checks its operand, infers the result's layout);
    `attrs`: the value's attributes; `rebuild(program, args, attrs)`: the operation applied again by rewrites;
    `reference(v, parts, combine)`: the results per rank of the group's operands `parts` (`combine(op, parts,
    weights)` reduces tensors as the reference backend does); `call(v, local_shape)`: the runtime call's arguments
    after the operand, as (before the group, after it) with keyword pairs (a None value left out); `shares(v)`: the
    part sizes it passes as `shares=` (None: equal); `moved(p)`/`steps(p)`: its traffic where traffic.py has no
    formula for it; `benchmark(b)`: the library call calibration times on `b` (x, part, full, exchanged: float32
    tensors of n, n/p, n and n elements; p, rank); `recorded`: torch.distributed function -> (index of the tensor
    whose bytes count, whether it is one rank's part) the profiler counts as this kind; `chunkable`: an overlapped
    chain may chunk it; `opens_chain`: enumeration chunks it with the matmul after it (MoE's dispatch);
    `row_counts`: its operands are (rows, splits, recv), rows sent and received by runtime counts, so an overlapped
    chain through it runs in row-set chunks (schedule/rows.py: all_to_all_v);
    `draw(v, per_rank, sizes, gen, drawn)`: makes random inputs of its operands agree across ranks (all_to_all_v's
    counts; `drawn`: the input names already drawn, which it extends)."""

    name: str
    token: str
    build: Callable[..., Any]
    reference: Callable[[Any, list[Any], Callable[..., Any]], list[Any]]
    call: Callable[[Any, tuple[int, ...]], Calls]
    attrs: tuple[str, ...] = ()
    rebuild: Callable[..., Any] | None = None
    shares: Callable[[Any], tuple[int, ...] | None] = field(default=lambda v: None)
    moved: Callable[[int], float] | None = None
    steps: Callable[[int], int] | None = None
    benchmark: Callable[[Any], Callable[[], Any]] | None = None
    recorded: Mapping[str, tuple[int, bool]] = field(default_factory=dict)
    chunkable: bool = True
    opens_chain: bool = False
    row_counts: bool = False
    draw: Callable[..., None] | None = None
    doc: str = ""


class UnknownKindError(CocoweaveError):
    """A collective kind the table does not know."""


_KINDS: dict[str, CollectiveKind] = {}
_VERSION = [0]  # bumped by every change of the table (algorithms.generation() counts it)
_HOOKS: list[tuple[Callable[[CollectiveKind], None], Callable[[str], None]]] = []  # (on register, on unregister)


def hook(on_register: Callable[[CollectiveKind], None], on_unregister: Callable[[str], None]) -> None:
    """Call `on_register(kind)` for every kind registered (those already there included) and `on_unregister(name)`
    for every one removed: how the IR's operation table (and the algorithms' implementations) follow this one
    without collectives importing ir."""
    _HOOKS.append((on_register, on_unregister))
    for k in _KINDS.values():
        on_register(k)


def register(kind: CollectiveKind) -> CollectiveKind:
    """Add `kind` to the table (a name once) and return it."""
    if kind.name in _KINDS:
        raise CocoweaveError(f"collective kind {kind.name!r} is already registered")
    if not kind.name.isidentifier():
        raise CocoweaveError(f"collective kind name {kind.name!r} is not an identifier")
    clash = next((k.name for k in _KINDS.values() if k.token == kind.token), None)
    if clash is not None:
        raise CocoweaveError(f"collective kind {kind.name!r} has token {kind.token!r}, as {clash!r} does")
    _KINDS[kind.name] = kind
    _VERSION[0] += 1
    for on_register, _ in _HOOKS:
        on_register(kind)
    return kind


def unregister(name: str) -> None:
    """Remove kind `name` (one registered for a while, as a test's) from this table, the IR's and the algorithms'
    implementations."""
    if _KINDS.pop(name, None) is None:
        return
    _VERSION[0] += 1
    for _, on_unregister in _HOOKS:
        on_unregister(name)


def version() -> int:
    """A number that changes whenever a kind is registered or removed."""
    return _VERSION[0]


def kind(name: str) -> CollectiveKind:
    """The table's entry for `name`; UnknownKindError if there is none."""
    try:
        return _KINDS[name]
    except KeyError:
        raise UnknownKindError(f"unknown collective kind {name!r}; choose one of {', '.join(_KINDS)}") from None


def find(name: str) -> CollectiveKind | None:
    """The entry for `name`, or None (a computation, send, ...)."""
    return _KINDS.get(name)


def all_kinds() -> tuple[CollectiveKind, ...]:
    """The registered kinds, in registration order."""
    return tuple(_KINDS.values())


def token(op: str) -> str:
    """The schedule token of collective `op` ("AR", "A2A")."""
    return kind(op).token


def recorded() -> dict[str, tuple[str, int, bool]]:
    """torch.distributed function -> (kind, index of the tensor whose bytes count, whether it holds one rank's part),
    over every registered kind: what the profiler's recorder wraps."""
    return {fn: (k.name, index, part) for k in _KINDS.values() for fn, (index, part) in k.recorded.items()}
