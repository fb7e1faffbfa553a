"""Collective algorithms, below every layer that reads them: the table (`algorithms`), what each collective
moves (`traffic`) and the one pricing model of collectives on a link (`pricing`)."""

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
from .traffic import moved, steps

__all__ = ["DEFAULT", "FUSED", "Algorithm", "UnknownAlgorithmError", "algorithms", "choose", "entry", "generation",
           "get", "implement", "implementation", "implementations", "moved", "names", "register", "steps",
           "unregister", "uses", "variants"]
