"""Plans: the lowered form of a schedule that backends execute (stages with their facts, state, outputs)."""

from ..schedule.stages import P2P, Collective, Compute, FusedCollective, MatMul, Overlap, Stage
from .lower import lower
from .memory import FusedStage, GatherInto, Memory, OwnPart
from .plan import Plan
from .view import RankView

__all__ = ["P2P", "Collective", "Compute", "FusedCollective", "FusedStage", "GatherInto", "MatMul", "Memory", "Overlap",
           "OwnPart", "Plan", "RankView", "Stage", "lower"]
