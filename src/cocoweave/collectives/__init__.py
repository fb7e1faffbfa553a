"""Collective kinds and algorithms, below every layer that reads them: the table of kinds (`kinds`: all_reduce,
all_to_all, ... each one registration), the table of algorithms (`algorithms`), what each collective moves
(`traffic`) and the one pricing model of collectives on a link (`pricing`)."""

from .algorithms import (
    DEFAULT,
    FUSED,
    Algorithm,
    UnknownAlgorithmError,
    algorithms,
    choose,
    entry,
    generation,
    get,
    implement,
    implementation,
    implementations,
    names,
    register,
    unregister,
    uses,
    variants,
)
from .kinds import CollectiveKind, UnknownKindError, all_kinds, kind
from .kinds import register as register_kind
from .kinds import unregister as unregister_kind
from .traffic import moved, steps

__all__ = ["DEFAULT", "FUSED", "Algorithm", "CollectiveKind", "UnknownAlgorithmError", "UnknownKindError",
           "algorithms", "all_kinds", "choose", "entry", "generation", "get", "implement", "implementation",
           "implementations", "kind", "moved", "names", "register", "register_kind", "steps", "unregister",
           "unregister_kind", "uses", "variants"]
