"""The experts of a mixture-of-experts layer with expert parallelism, as one program: dispatch, SwiGLU expert
GEMMs, combine.

Tokens arrive routed and packed as [source rank, expert, capacity, d] (each rank's tokens for every expert, padded to
the capacity), Sliced by source rank. Dispatch is an all_to_all that slices them by expert instead, so each rank holds
every rank's tokens for its own experts; each expert applies its SwiGLU FFN (w2 (silu(x w1) * (x w3))) to its tokens
with one batched matmul per weight; combine is the all_to_all back. The schedules worth having overlap the two
all-to-alls with the expert GEMMs chunk by chunk of the capacity (Comet, MegaScale-MoE): `cocoweave schedules`
enumerates them and `cocoweave check` proves each equal to this program.
"""

from __future__ import annotations

from ..ir import Program, Sliced
from ..ir.ops import all_to_all, exp, matmul


def moe_experts(R: int = 2, E: int = 4, C: int = 8, D: int = 16, F: int = 32, dtype: str = "float32") -> Program:
    """R source ranks' tokens for E experts of capacity C and width D; SwiGLU experts of hidden size F, sliced by
    expert over the ranks."""
    p = Program("moe_experts")
    x = p.tensor("x", (R, E, C, D), dtype, Sliced(0))
    w1 = p.tensor("w1", (E, D, F), dtype, Sliced(0))
    w3 = p.tensor("w3", (E, D, F), dtype, Sliced(0))
    w2 = p.tensor("w2", (E, F, D), dtype, Sliced(0))
    mine = all_to_all(x, 1)  # dispatch: every rank's tokens for this rank's experts
    gate = matmul(mine, w1)
    hidden = gate / (1.0 + exp(-gate)) * matmul(mine, w3)  # silu(x w1) * (x w3)
    p.output(all_to_all(matmul(hidden, w2), 0), "y")  # combine: back to the ranks the tokens came from
    return p
