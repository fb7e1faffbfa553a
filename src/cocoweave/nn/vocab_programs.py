"""The cocoweave programs behind the vocab-parallel embedding and cross-entropy (nn/vocab.py): Megatron-core's
VocabParallelEmbedding and vocab_parallel_cross_entropy over the tensor-parallel group, built once per shape,
dtype and options.

The vocabulary is `Sliced(1)` of a (1, vocab) tensor of vocabulary indices (`ids`, rank r holds its part, an
arange): comparing it with the targets is how a rank finds the target logit it holds (Megatron's masking) without
a gather by index, which the DSL does not have. The DSL has no `log` either: the programs return the all-reduced
sum of exponentials and the caller takes its log (one value per token).

The embedding's lookup (a gather of weight rows by token id) and its backward (a scatter-add into the rows) are
not DSL operations: nn/vocab.py runs them in torch around these programs, which mask the rows of the tokens
another rank holds and reduce over the group.
"""

from __future__ import annotations

import functools

from ..ir import Local, Program, Replicated, Sliced
from ..ir.ops import all_gather, all_reduce, eq, exp, reduce_scatter, where
from ..ir.ops import max as reduce_max
from ..ir.ops import sum as reduce_sum


@functools.lru_cache(maxsize=256)
def embedding_forward(rows: int, dim: int, dtype: str = "float32", sp: bool = False) -> Program:
    """out = all_reduce(where(valid, y, 0)): `y` this rank's lookup of every token (Local: the rows of the tokens
    another rank holds are garbage), `valid` whether this rank holds the token; with `sp` the sum is
    reduce-scattered over tokens (out = this rank's token slice)."""
    p = Program("vocab_embedding_forward" + ("_sp" if sp else ""))
    y = p.tensor("y", (rows, dim), dtype, Local)
    valid = p.tensor("valid", (rows, 1), "bool", Local)
    masked = where(valid, y, 0.0)
    p.output(reduce_scatter(masked, "sum", 0) if sp else all_reduce(masked, "sum"), "out")
    return p


@functools.lru_cache(maxsize=256)
def embedding_backward(rows: int, dim: int, dtype: str = "float32", sp: bool = False) -> Program:
    """The gradient of this rank's lookup from its output's `g`: g where this rank holds the token, else 0 (the
    all-reduce's gradient is the identity); with `sp`, g is a token slice and is all-gathered first."""
    p = Program("vocab_embedding_backward" + ("_sp" if sp else ""))
    g = p.tensor("g", (rows, dim), dtype, Sliced(0) if sp else Replicated)
    valid = p.tensor("valid", (rows, 1), "bool", Local)
    p.output(where(valid, all_gather(g, 0) if sp else g, 0.0), "gy")
    return p


@functools.lru_cache(maxsize=256)
def cross_entropy_forward(rows: int, vocab: int, dtype: str = "float32", smoothing: bool = False) -> Program:
    """Megatron's vocab-parallel cross-entropy forward on logits `x` sliced on the vocabulary: m = the max over the
    vocabulary (all-reduce max), e = exp(x - m) (this rank's part, kept for the backward), and in ONE all-reduce
    (sum) the columns of `sums`: s = Σ e, tl = x[target] - m (found by `ids == t`), with `smoothing` zs = Σ (x - m).
    The loss of a token is log(s) - tl (the caller takes the log).

    The DSL has no concatenation: the columns are placed by `where(cols == k, ...)` over `cols`, a (1, k) input
    holding 0 .. k-1, which broadcasts the (rows, 1) partial sums to (rows, k)."""
    p = Program("vocab_cross_entropy_forward" + ("_smoothing" if smoothing else ""))
    x = p.tensor("x", (rows, vocab), dtype, Sliced(1))
    ids = p.tensor("ids", (1, vocab), "int64", Sliced(1))
    t = p.tensor("t", (rows, 1), "int64", Replicated)
    cols = p.tensor("cols", (1, 3 if smoothing else 2), "int64", Replicated)
    z = x - all_reduce(reduce_max(x, 1, keepdim=True), "max")
    e = exp(z)
    p.output(e, "e")
    s = reduce_sum(e, 1, keepdim=True)
    tl = reduce_sum(where(eq(ids, t), z, 0.0), 1, keepdim=True)
    last = where(eq(cols, 1), tl, reduce_sum(z, 1, keepdim=True)) if smoothing else tl
    p.output(all_reduce(where(eq(cols, 0), s, last), "sum"), "sums")
    return p


@functools.lru_cache(maxsize=256)
def cross_entropy_backward(rows: int, vocab: int, dtype: str = "float32", smoothing: float = 0.0) -> Program:
    """The logits' gradient on this rank's part only, no communication: (e / s - (1 - ε)·onehot(t) - ε / vocab)·g,
    g the gradient of each token's loss (0 for ignored tokens)."""
    p = Program("vocab_cross_entropy_backward" + ("_smoothing" if smoothing else ""))
    e = p.tensor("e", (rows, vocab), dtype, Sliced(1))
    s = p.tensor("s", (rows, 1), dtype, Replicated, init="positive")
    ids = p.tensor("ids", (1, vocab), "int64", Sliced(1))
    t = p.tensor("t", (rows, 1), "int64", Replicated)
    g = p.tensor("g", (rows, 1), dtype, Replicated)
    d = e / s - where(eq(ids, t), 1.0 - smoothing, 0.0)
    if smoothing:
        d = d - smoothing / vocab
    p.output(d * g, "gx")
    return p
