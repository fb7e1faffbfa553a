"""Collective algorithms, below every layer that reads them: the table (`algorithms`) and what each collective
moves (`traffic`)."""

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
from .traffic import moved, steps

__all__ = ["DEFAULT", "FUSED", "Algorithm", "UnknownAlgorithmError", "algorithms", "choose", "generation", "get",
           "implement", "implementation", "implementations", "moved", "names", "register", "steps", "unregister",
           "uses"]
