"""Plans: the lowered form of a schedule that backends execute (stages, buffers, state)."""

from .lower import lower
from .plan import P2P, Chunked, Collective, FusedCollective, Kernel, MatMul, Plan, PlanStage

__all__ = ["P2P", "Chunked", "Collective", "FusedCollective", "Kernel", "MatMul", "Plan", "PlanStage", "lower"]
