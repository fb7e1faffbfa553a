"""Collective kinds and algorithms, below every layer that reads them: the table of kinds (`kinds`: all_reduce,
all_to_all, ... each one registration), the table of algorithms (`algorithms`) and what each collective moves
(`traffic`)."""

from .algorithms import (
    DEFAULT,
    FUSED,
    Algorithm,
    UnknownAlgorithmError,
    algorithms,
    choose,
    generation,
    get,
    implement,
    implementation,
    implementations,
    names,
    register,
    unregister,
    uses,
)
from .kinds import CollectiveKind, UnknownKindError, all_kinds, kind
from .kinds import register as register_kind
from .kinds import unregister as unregister_kind
from .traffic import moved, steps

__all__ = ["DEFAULT", "FUSED", "Algorithm", "CollectiveKind", "UnknownAlgorithmError", "UnknownKindError",
           "algorithms", "all_kinds", "choose", "generation", "get", "implement", "implementation",
           "implementations", "kind", "moved", "names", "register", "register_kind", "steps", "unregister",
           "unregister_kind", "uses"]
