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
from ..ir import Layout, Local, Program, Sliced, Value
from ..ir.ops import all_to_all, grouped_matmul, grouped_matmul_wgrad, matmul, silu, silu_grad


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
    hidden = silu(gate) * matmul(mine, w3)
    p.output(all_to_all(matmul(hidden, w2), 0), "y")  # combine: back to the ranks the tokens came from
    return p


SAVED = ("got", "gate", "up", "hidden")  # what moe_dropless's `save` form outputs and moe_dropless_backward takes


def _on_ep(name: str, R: int, E: int) -> tuple[Program, Layout, Layout]:
    """Program `name` on the mesh axis `ep` of R ranks holding E experts (refused unless E / R each); its Local and
    its expert-sliced layout."""
    if E % R:
        raise ProgramError(f"{name}: {E} experts do not divide over {R} ranks; give each rank as many")
    p = Program(name)
    p.mesh(ep=R)
    return p, Layout(ep=Local), Layout(ep=Sliced(0))


def _counts(p: Program, R: int, E: int) -> tuple[Value, Value, Value]:
    """The dropless programs' runtime counts: rows sent to (`s`) and received from (`r`) each rank, and `c`
    [R, E / R] received from each source rank for each local expert."""
    mine = Layout(ep=Local)
    return (p.tensor("s", (R,), "int64", mine), p.tensor("r", (R,), "int64", mine),
            p.tensor("c", (R, E // R), "int64", mine))


def moe_dropless(R: int = 2, E: int = 4, N: int = 8, D: int = 16, F: int = 32, M: int | None = None,
                 dtype: str = "float32", save: bool = False) -> Program:
    """The dropless experts over R ranks of the mesh axis `ep`, each holding E / R of the E SwiGLU experts (hidden
    size F): N rows of width D per rank in, N out; M (default R x N, every row) rows a rank can receive.

    Each rank's rows `x` come sorted by destination rank, then by that rank's local expert; `s` and `r` count the
    rows sent to and received from each rank, `c` [R, E / R] the rows received from each source rank for each local
    expert (row i sums to r[i]: what a router's counts exchange gives). Dispatch (all_to_all_v) then leaves the
    received rows in (source rank, local expert) segments, which is the row-major order of `c`, so each expert GEMM
    is one grouped_matmul over them with no regrouping; combine sends each row back where it came from. With `save`
    the program also outputs what moe_dropless_backward takes: the received rows `got`, the two first GEMMs'
    results `gate` (got w1) and `up` (got w3), and the last GEMM's operand `hidden` (silu(gate) * up), as autograd
    saves them."""
    p, mine, ep = _on_ep("moe_dropless", R, E)
    x = p.tensor("x", (N, D), dtype, mine)
    s, r, c = _counts(p, R, E)
    w1 = p.tensor("w1", (E, D, F), dtype, ep)
    w3 = p.tensor("w3", (E, D, F), dtype, ep)
    w2 = p.tensor("w2", (E, F, D), dtype, ep)
    got = all_to_all(x, 0, splits=s, recv=r, rows=R * N if M is None else M)  # dispatch
    gate, up = grouped_matmul(got, w1, c), grouped_matmul(got, w3, c)
    hidden = silu(gate) * up
    p.output(all_to_all(grouped_matmul(hidden, w2, c), 0, splits=r, recv=s, rows=N), "y")  # combine
    if save:
        for v, name in zip((got, gate, up, hidden), SAVED, strict=True):
            p.output(v, name)
    return p


def moe_dropless_backward(R: int = 2, E: int = 4, N: int = 8, D: int = 16, F: int = 32, M: int | None = None,
                          dtype: str = "float32") -> Program:
    """moe_dropless's gradients from its output's gradient `g` [N, D] and what its `save` form output (`got`,
    `gate`, `up`, `hidden`; counts `s`, `r`, `c` as in the forward): the input gradient `dx` [N, D] (combine's
    adjoint is a dispatch, each row's gradient sent to the rank that computed it; the GEMMs' with the transposed
    weights `w2t`, `w1t`, `w3t` (views of w2, w1, w3 with their last two dimensions swapped); SwiGLU's elementwise
    backward, silu recomputed and silu_grad, the three passes autograd makes and one; the dispatch's adjoint a
    combine) and this rank's experts' weight gradients `gw1`, `gw3` [E / R, D, F] and `gw2` [E / R, F, D]
    (grouped_matmul_wgrad over the same segments)."""
    m = R * N if M is None else M
    p, mine, ep = _on_ep("moe_dropless_backward", R, E)
    g = p.tensor("g", (N, D), dtype, mine)
    s, r, c = _counts(p, R, E)
    got = p.tensor("got", (m, D), dtype, mine)
    gate = p.tensor("gate", (m, F), dtype, mine)
    up = p.tensor("up", (m, F), dtype, mine)
    hidden = p.tensor("hidden", (m, F), dtype, mine)
    w1t = p.tensor("w1t", (E, F, D), dtype, ep)
    w3t = p.tensor("w3t", (E, F, D), dtype, ep)
    w2t = p.tensor("w2t", (E, D, F), dtype, ep)
    gy = all_to_all(g, 0, splits=s, recv=r, rows=m)  # combine's adjoint: each row's gradient to its expert's rank
    dh = grouped_matmul(gy, w2t, c)
    p.output(grouped_matmul_wgrad(hidden, gy, c), "gw2")
    dup = dh * silu(gate)
    dgate = silu_grad(dh * up, gate)
    p.output(grouped_matmul_wgrad(got, dgate, c), "gw1")
    p.output(grouped_matmul_wgrad(got, dup, c), "gw3")
    dgot = grouped_matmul(dgate, w1t, c) + grouped_matmul(dup, w3t, c)
    p.output(all_to_all(dgot, 0, splits=r, recv=s, rows=N), "dx")  # dispatch's adjoint: back where each row came
    return p
