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

from ..errors import ProgramError
from ..ir import Layout, Local, Program, Sliced
from ..ir.ops import all_to_all, exp, grouped_matmul, matmul


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


def moe_dropless(R: int = 2, E: int = 4, N: int = 8, D: int = 16, F: int = 32, M: int | None = None,
                 dtype: str = "float32") -> Program:
    """The dropless experts over R ranks of the mesh axis `ep`, each holding E / R of the E SwiGLU experts (hidden
    size F): N rows of width D per rank in, N out; M (default R x N, every row) rows a rank can receive.

    Each rank's rows `x` come sorted by destination rank, then by that rank's local expert; `s` and `r` count the
    rows sent to and received from each rank, `c` [R, E / R] the rows received from each source rank for each local
    expert (row i sums to r[i]: what a router's counts exchange gives). Dispatch (all_to_all_v) then leaves the
    received rows in (source rank, local expert) segments, which is the row-major order of `c`, so each expert GEMM
    is one grouped_matmul over them with no regrouping; combine sends each row back where it came from."""
    if E % R:
        raise ProgramError(f"moe_dropless: {E} experts do not divide over {R} ranks; give each rank as many")
    p = Program("moe_dropless")
    p.mesh(ep=R)
    mine, ep = Layout(ep=Local), Layout(ep=Sliced(0))
    x = p.tensor("x", (N, D), dtype, mine)
    s = p.tensor("s", (R,), "int64", mine)
    r = p.tensor("r", (R,), "int64", mine)
    c = p.tensor("c", (R, E // R), "int64", mine)
    w1 = p.tensor("w1", (E, D, F), dtype, ep)
    w3 = p.tensor("w3", (E, D, F), dtype, ep)
    w2 = p.tensor("w2", (E, F, D), dtype, ep)
    got = all_to_all(x, 0, splits=s, recv=r, rows=R * N if M is None else M)  # dispatch
    gate = grouped_matmul(got, w1, c)
    hidden = gate / (1.0 + exp(-gate)) * grouped_matmul(got, w3, c)  # silu(x w1) * (x w3)
    p.output(all_to_all(grouped_matmul(hidden, w2, c), 0, splits=r, recv=s, rows=N), "y")  # combine
    return p
