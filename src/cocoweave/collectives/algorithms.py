"""The table of collective algorithms: what each one implements, where it is legal and offered, whether it fuses
or overlaps, what it moves, and each backend's implementations registered against it.

One entry per algorithm ("library": torch.distributed's call; "ring": point-to-point messages, CoCoNet's fused
ring; "shm": shared memory between the ranks of one host). Enumeration, schedule legality, the torch code
generator, the cost model, calibration and the optimizer's automatic choice all read this table; adding an
algorithm is one `register` call. An algorithm the table does not know is an `UnknownAlgorithmError`.

An algorithm registered `inside` another runs only within that one's call, which picks it by itself where it is
faster ("tree": NCCL's double binary tree inside the library's all-reduce): it is priced with that call
(collectives/pricing.py: the LLM planner's NCCL), never scheduled on its own, so `get`, `names` and enumeration do
not offer it; `variants` lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from ..errors import CocoweaveError
from . import kinds
from .traffic import moved, tree_moved, tree_steps
from .traffic import steps as message_steps

DEFAULT = "library"  # the algorithm of a stage nobody chose one for
FUSED = "fused"  # the operation name of a fused RS-C-AG stage run as one (for `Algorithm.fuses`)
# The bases enumeration moves onto an algorithm (schedule/enumerate.py): the program as written with its
# computations fused ("written"), every rewrite with its computations fused ("each"), every rewrite with its
# RS-C-AG runs fused ("fused").
BASES = ("written", "each", "fused")
Auto = Literal["default", "preferred", "never"]
S = TypeVar("S")


class UnknownAlgorithmError(CocoweaveError):
    """A collective algorithm the table does not know, or an operation a backend has not implemented on one."""


@dataclass(frozen=True)
class Algorithm:
    """One collective algorithm. `collectives`: the operations it runs ("send" for point to point, "fused" for a
    fused RS-C-AG stage as one); `reductions`: those it reduces with (None: all); `fuses`: it runs a fused RS-C-AG
    stage as one, applying the computation piece by piece (elementwise computations sliced along the scattered
    dimension only); `overlaps`: its calls can be issued asynchronously (chunked, launched ahead of a step);
    `devices`: the device types whose tensors it serves (None: all); `one_host`: its ranks must share a host (else
    the backend runs the library's); `enumerated`: (base, stage kinds) enumeration moves onto it; `auto`: how the
    optimizer's automatic choice treats schedules on it; `priced_as`: whose calibrated lines price it where a
    calibration has none of its own; `traffic(op, p)`: the fraction of the tensor a rank moves; `steps(op, p)`:
    its message steps (each paying a link's latency); `inside`: the algorithm whose call runs it where faster (not
    schedulable on its own); `every_kind`: it runs every registered collective kind
    (collectives/kinds.py) besides `collectives`."""

    name: str
    collectives: tuple[str, ...]
    reductions: tuple[str, ...] | None = None
    fuses: bool = False
    overlaps: bool = False
    devices: tuple[str, ...] | None = None
    one_host: bool = False
    enumerated: tuple[tuple[str, tuple[str, ...]], ...] = ()
    auto: Auto = "default"
    priced_as: str | None = DEFAULT
    traffic: Callable[[str, int], float] = moved
    steps: Callable[[str, int], int] = message_steps
    inside: str | None = None
    doc: str = ""
    every_kind: bool = False

    def implements(self, op: str) -> bool:
        """Whether this algorithm runs operation `op` (a collective, "send", or "fused")."""
        return op in self.collectives or (self.every_kind and kinds.find(op) is not None)

    def reduces(self, op: str | None) -> bool:
        """Whether it can reduce with `op` (None: the operation does not reduce)."""
        return op is None or self.reductions is None or op in self.reductions

    def offered(self, device: str, shared_host: bool = True) -> bool:
        """Whether it serves tensors on `device` ("cpu", "cuda:0", "meta"...) for ranks that do (or not) share a
        host."""
        on = self.devices is None or str(device).split(":")[0] in self.devices
        return on and (shared_host or not self.one_host)


_TABLE: dict[str, Algorithm] = {}
_VARIANTS: dict[str, Algorithm] = {}  # those registered inside another's call, by name
_INSIDE: dict[str, tuple[Algorithm, ...]] = {}  # the variants by the algorithm they run inside (what pricing asks)
_GENERATION = [0]  # bumped by every change of the table: memoised enumerations key on it
_IMPLEMENTATIONS: dict[str, dict[tuple[str, str], Callable[..., Any]]] = {}  # backend -> (algorithm, op) -> fn


def register(algorithm: Algorithm, implementations: Mapping[str, Mapping[str, Callable[..., Any]]] | None = None
             ) -> Algorithm:
    """Add `algorithm` to the table, with its implementations per backend ({"torch": {"all_reduce": fn}}), and
    return it. A name is registered once. One registered `inside` another joins that one's variants instead (it
    has no implementations of its own)."""
    if algorithm.name in _TABLE or algorithm.name in _VARIANTS:
        raise CocoweaveError(f"collective algorithm {algorithm.name!r} is already registered")
    if not algorithm.name.isidentifier():
        raise CocoweaveError(f"collective algorithm name {algorithm.name!r} is not an identifier")
    for base, _ in algorithm.enumerated:
        if base not in BASES:
            raise CocoweaveError(f"algorithm {algorithm.name!r} names enumeration base {base!r}; "
                                 f"choose one of {', '.join(BASES)}")
    if algorithm.inside is not None:
        get(algorithm.inside)
        if implementations or algorithm.enumerated:
            raise CocoweaveError(f"collective algorithm {algorithm.name!r} runs inside the {algorithm.inside} "
                                 "algorithm's call; it has no implementations or enumerated schedules of its own")
        _VARIANTS[algorithm.name] = algorithm
        _changed()
        return algorithm
    _TABLE[algorithm.name] = algorithm
    _changed()
    for backend, ops in (implementations or {}).items():
        implement(backend, algorithm.name, **ops)
    return algorithm


def unregister(name: str) -> None:
    """Remove algorithm `name` and its implementations (an algorithm registered for a while, as a test's)."""
    if name == DEFAULT:
        raise CocoweaveError(f"the {DEFAULT} algorithm cannot be removed")
    _TABLE.pop(name, None)
    _VARIANTS.pop(name, None)
    _changed()
    for impls in _IMPLEMENTATIONS.values():
        for key in [k for k in impls if k[0] == name]:
            del impls[key]


def _changed() -> None:
    """Bump the generation and regroup the variants after a change of the table."""
    _GENERATION[0] += 1
    _INSIDE.clear()
    for variant in _VARIANTS.values():
        _INSIDE[variant.inside] = (*_INSIDE.get(variant.inside, ()), variant)


def get(name: str) -> Algorithm:
    """The table's entry for `name`; UnknownAlgorithmError if there is none."""
    try:
        return _TABLE[name]
    except KeyError:
        raise UnknownAlgorithmError(f"unknown collective algorithm {name!r}; "
                                    f"choose one of {', '.join(_TABLE)}") from None


def entry(name: str) -> Algorithm:
    """The registration of `name`, schedulable or a variant run inside another's call (what pricing reads);
    UnknownAlgorithmError if there is none."""
    return _VARIANTS[name] if name in _VARIANTS else get(name)


def variants(name: str) -> tuple[Algorithm, ...]:
    """The algorithms registered inside `name`'s call, in registration order."""
    return _INSIDE.get(name, ())


def generation() -> int:
    """A number that changes whenever an algorithm or a collective kind is registered or removed (what was
    enumerated before is stale)."""
    return _GENERATION[0] + kinds.version()


def names() -> tuple[str, ...]:
    """The registered algorithms' names, in registration order."""
    return tuple(_TABLE)


def algorithms() -> tuple[Algorithm, ...]:
    """The registered algorithms, in registration order."""
    return tuple(_TABLE.values())


def implement(backend: str, algorithm: str, **ops: Callable[..., Any]) -> None:
    """Register `backend`'s implementation of each operation on `algorithm` (which the table must know and
    say it implements)."""
    entry = get(algorithm)
    impls = _IMPLEMENTATIONS.setdefault(backend, {})
    for op, fn in ops.items():
        if not entry.implements(op):
            raise CocoweaveError(f"the {algorithm} algorithm does not implement {op}; it implements "
                                 f"{', '.join(entry.collectives)}")
        same = next((k for k, f in impls.items() if f.__name__ == fn.__name__ and f is not fn), None)
        if same is not None:  # generated code calls an implementation by its name
            raise CocoweaveError(f"{backend}'s implementation of {op} on {algorithm} is named {fn.__name__!r}, as "
                                 f"its implementation of {same[1]} on {same[0]} is; give it another name")
        impls[(algorithm, op)] = fn
    _GENERATION[0] += 1  # the backends' lookups by name are stale


def implementation(backend: str, algorithm: str, op: str) -> Callable[..., Any]:
    """`backend`'s implementation of `op` on `algorithm`; UnknownAlgorithmError if it has none."""
    get(algorithm)
    fn = _IMPLEMENTATIONS.get(backend, {}).get((algorithm, op))
    if fn is None:
        raise UnknownAlgorithmError(f"the {backend} backend has no implementation of {op} on the {algorithm} "
                                    "algorithm (collectives.implement registers one)")
    return fn


def implementations(backend: str) -> dict[str, Callable[..., Any]]:
    """`backend`'s registered implementations by their function names."""
    return {fn.__name__: fn for fn in _IMPLEMENTATIONS.get(backend, {}).values()}


def uses(stages: Iterable[Any]) -> frozenset[str]:
    """The algorithms other than the default that `stages` (a schedule's or plan's) run on."""
    return frozenset(getattr(s, "algorithm", DEFAULT) for s in stages) - {DEFAULT}


def choose(schedules: Sequence[S], device: str, shared_host: bool) -> list[S]:
    """The optimizer's automatic choice among equally good `schedules` (objects with `.stages`), best first: those
    on an algorithm it prefers where that is offered, else those on the default algorithm alone, else any on no
    algorithm it never picks."""
    usable = [s for s in schedules if all(get(a).auto != "never" for a in uses(s.stages))]
    preferred = [s for s in usable if any(get(a).auto == "preferred" and get(a).offered(device, shared_host)
                                          for a in uses(s.stages))]
    default = [s for s in usable if not uses(s.stages)]
    return preferred or default or usable


ORDERED = ("sum", "avg", "max", "min")  # the reductions that combine piece by piece in any order of ranks
def _forget_kind(op: str) -> None:
    """Drop every implementation of collective kind `op` (unregistered)."""
    for impls in _IMPLEMENTATIONS.values():
        for key in [k for k in impls if k[1] == op]:
            del impls[key]


kinds.hook(lambda kind: None, _forget_kind)
LIBRARY = register(Algorithm(
    DEFAULT, ("send",), overlaps=True, priced_as=None, every_kind=True,
    doc="torch.distributed's call (NCCL, Gloo): asynchronous, chunked under overlap"))
RING = register(Algorithm(
    "ring", ("all_reduce", "reduce_scatter", "all_gather", FUSED), ORDERED, fuses=True,
    enumerated=(("written", ("collective",)), ("fused", ("fused",))), auto="never",
    doc="a ring of point-to-point messages; a fused RS-C-AG computes each piece as it is reduced (CoCoNet)"))
SHM = register(Algorithm(
    "shm", ("all_reduce", "reduce_scatter", "all_gather", "all_to_all_v", "send"), ORDERED, devices=("cpu",),
    one_host=True,
    enumerated=(("each", ("collective", "fused", "p2p")), ("fused", ("collective", "fused", "p2p"))),
    auto="preferred",
    doc="shared memory between the ranks of one host, CPU tensors only (its segments are the host's memory)"))
TREE = register(Algorithm(
    "tree", ("all_reduce",), traffic=tree_moved, steps=tree_steps, inside=DEFAULT,
    doc="NCCL's double binary tree, which the library's all-reduce runs instead of its ring where it is faster"))
