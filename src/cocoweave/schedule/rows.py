"""Row-set chunks: how a chain through all_to_all_v (a dropless MoE's dispatch -> expert GEMMs -> combine) runs in
K chunks whose rows are decided at run time (Comet's and MegaScale-MoE's chunked dispatch and combine).

Every row of the chain lives in a *row space*: rows in consecutive segments, one per rank of the exchange's axis,
whose lengths are a runtime counts tensor (the all_to_all_v's `splits` on the sending side, `recv` on the receiving
side). Chunk k of K takes, of every segment of length n, its rows [floor(k n / K), floor((k + 1) n / K)); so the
sender's chunk of the rows it sends rank j is exactly the chunk rank j receives from it, every rank derives its
chunks from its own counts, and a grouped_matmul's per-(source, expert) counts c [P, G] split by the same rule
(the chunk's range in source i's block, cut by each expert's cumulative range of c[i, :]). Elementwise values are
per row, an all_to_all_v maps the sender's chunk k onto the receiver's, and grouped_matmul_wgrad sums over rows, so
its chunks' sums add up. `analyse` checks a chain (the static part, at schedule time); `Chunks` is the run-time
arithmetic on one rank's counts, the reference's and the torch backend's one home.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .. import collectives
from ..errors import InputError, ScheduleError
from ..ir import registry as R
from ..ir.ops import row_counts
from ..ir.semantics import host_counts

if TYPE_CHECKING:
    from ..ir.graph import Value

ACCUMULATED = "accumulated"  # a value summed over the chain's rows: its chunks' results add up
SEGMENTED = ("grouped_matmul", "grouped_matmul_wgrad")


@dataclass(frozen=True)
class RowFacts:
    """What a chunked run needs to know of a chain: `space[id(v)]` names the counts Value whose segments number the
    rows of chain value v or of an operand from outside the chain (ACCUMULATED for a grouped_matmul_wgrad, whose
    chunks are summed); `segments[id(c)]` the counts Value of the row space a grouped_matmul's counts c [P, G]
    split; `counts` every counts Value a chunk replaces (splits, recv, segment counts); `tail` the elementwise values
    (in program order) computed once more on the rows no chunk holds, the padding past the counts' rows, because they
    are read after the chain (an exchange's or a grouped GEMM's padding rows are zero; an elementwise value's are
    whatever it makes of its operands' padding rows)."""

    space: Mapping[int, Any]
    segments: Mapping[int, Any]
    counts: tuple[Any, ...]
    tail: tuple[Any, ...] = ()

    @property
    def spaces(self) -> list[Any]:
        """The counts Values that number the chain's row spaces, once each."""
        return list({id(c): c for c in self.space.values() if c is not ACCUMULATED}.values())

    def chunks(self, chunks: int, tensor: Any, where: str) -> Chunks:
        """One rank's Chunks, `tensor(c)` giving that rank's tensor of counts Value c."""
        return Chunks(chunks, {c.name: tensor(c) for c in self.spaces},
                      {c.name: (tensor(c), self.segments[id(c)].name) for c in self.counts if id(c) in self.segments},
                      where)

    def replaced(self, chunks: Chunks, c: Any, k: int) -> torch.Tensor:
        """Chunk k's counts in place of counts Value `c`: an exchange's splits or recv, or a grouped_matmul's
        segments."""
        return chunks.segments(c.name, k) if id(c) in self.segments else chunks.counts(c.name, k)


def exchanges_rows(op: str) -> bool:
    """Whether operation `op` is a collective that sends and receives rows by runtime counts (its kind's
    `row_counts`: all_to_all_v), which row-set chunks cut by the counts' arithmetic."""
    kind = collectives.kinds.find(op)
    return kind is not None and kind.row_counts


def chainable(values: Sequence[Value]) -> bool:
    """Whether a chain is one for row-set chunks: it exchanges rows with runtime counts (all_to_all_v) or computes
    on segments of runtime counts."""
    return any(exchanges_rows(v.op) or v.op in SEGMENTED for v in values)


def of_stage(stage: Any) -> RowFacts:
    """`analyse` of a lowered row-chunked stage: its values, those it keeps for later stages, its label."""
    return analyse(stage.values, {id(v) for v in stage.live_outs}, stage.label)


def analyse(values: Sequence[Value], read_after: set[int], names: str) -> RowFacts:
    """The row spaces of chain `values` (in program order); `read_after`: ids of its values read after it (or kept
    as results). ScheduleError with a sentence for a chain that row-set chunks cannot run."""
    inside = {id(v) for v in values}
    parent: dict[int, int] = {}
    fixed: dict[int, Any] = {}  # root -> the counts Value of its space
    known: dict[int, Any] = {}  # id -> Value (for messages)

    def find(i: int) -> int:
        parent.setdefault(i, i)
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def join(a: Value, b: Value | None, counts: Value | None = None) -> None:
        known[id(a)] = a
        ra = find(id(a))
        if b is not None:
            known[id(b)] = b
            rb = find(id(b))
            if ra != rb:
                ca, cb = fixed.get(ra), fixed.get(rb)
                if ca is not None and cb is not None and ca is not cb:
                    raise ScheduleError(f"cannot overlap {names}: `{a.name}` and `{b.name}` hold rows counted by "
                                        f"`{ca.name}` and by `{cb.name}`, which chunks cannot pair")
                parent[rb] = ra
                if ca is None and cb is not None:
                    fixed[ra] = cb
        if counts is not None:
            r = find(id(a))
            if fixed.get(r) is not None and fixed[r] is not counts:
                raise ScheduleError(f"cannot overlap {names}: `{a.name}`'s rows are counted by `{fixed[r].name}` "
                                    f"where `{counts.name}` counts them")
            fixed[r] = counts

    def outside_counts(c: Value, v: Value) -> None:
        if id(c) in inside:
            raise ScheduleError(f"cannot overlap {names}: `{v.name}`'s counts `{c.name}` are computed inside the "
                                "chain; chunks need them before it starts")

    def row_operand(a: Value, v: Value) -> bool:
        """Whether operand a of elementwise v has v's rows (not a scalar, not broadcast along them)."""
        return not a.is_scalar and a.ndim == v.ndim and (a.shape[0] != 1 or v.shape[0] == 1)

    segments: dict[int, Any] = {}
    seg_rows: list[tuple[Value, Value]] = []  # (segment counts, a value on their rows)
    counts: dict[int, Any] = {}
    for v in values:
        if exchanges_rows(v.op):
            x, s, r = v.args
            if v.attrs["dim"] != 0:
                raise ScheduleError(f"cannot overlap {names}: all_to_all_v `{v.name}` exchanges along dimension "
                                    f"{v.attrs['dim']}; row-set chunks cut dimension 0")
            for c in (s, r):
                outside_counts(c, v)
                counts[id(c)] = c
            join(x, None, s)
            join(v, None, r)
        elif v.op in SEGMENTED:
            x, other, c = v.args
            outside_counts(c, v)
            counts[id(c)] = c
            if c.ndim != 2:
                raise ScheduleError(f"cannot overlap {names}: {v.op} `{v.name}`'s counts `{c.name}` are not one "
                                    "line of segments per rank ([ranks, groups]), so chunks cannot split them")
            if v.op == "grouped_matmul":
                if id(x) not in inside:
                    raise ScheduleError(f"cannot overlap {names}: grouped_matmul `{v.name}` reads rows `{x.name}` "
                                        "from outside the chain, whose runs the chain's counts do not chunk")
                join(v, x)
                seg_rows.append((c, x))
            else:
                if id(x) not in inside and id(other) not in inside:
                    raise ScheduleError(f"cannot overlap {names}: grouped_matmul_wgrad `{v.name}` reads no row of "
                                        "the chain")
                join(x, other)
                seg_rows.append((c, x))
        elif R.opdef(v.op).elementwise and R.group(v.op) != R.RANDOM and not v.is_scalar:
            rows = [a for a in v.args if row_operand(a, v)]
            join(v, None)
            for a in rows:
                join(v, a)
        else:
            why = ("draws random numbers by element position, which chunks move" if v.op == "dropout"
                   else "is not an exchange of rows, a grouped GEMM or an elementwise computation")
            raise ScheduleError(f"cannot overlap {names}: `{v.name} = {v.op}(...)` {why}, so row-set chunks cannot "
                                "run it")
    space: dict[int, Any] = {}
    for i, v in known.items():
        c = fixed.get(find(i))
        if c is None:
            raise ScheduleError(f"cannot overlap {names}: no counts number the rows of `{v.name}`")
        space[i] = c
    for v in values:
        if v.op == "grouped_matmul_wgrad":
            space[id(v)] = ACCUMULATED
            users = [u for u in values if any(a is v for a in u.args)]
            if users:
                raise ScheduleError(f"cannot overlap {names}: `{users[0].name}` reads grouped_matmul_wgrad "
                                    f"`{v.name}`, which is whole only once every chunk has added to it")
    for c, x in seg_rows:
        have = segments.setdefault(id(c), space[id(x)])
        if have is not space[id(x)]:
            raise ScheduleError(f"cannot overlap {names}: counts `{c.name}` segment rows counted by `{have.name}` "
                                f"and by `{space[id(x)].name}`")
    computed = [v for v in values if not exchanges_rows(v.op) and v.op not in SEGMENTED]  # elementwise
    tail: set[int] = set()
    todo = [v for v in computed if id(v) in read_after]
    while todo:  # an elementwise value read after the chain, and the elementwise values it reads
        v = todo.pop()
        if id(v) not in tail:
            tail.add(id(v))
            todo += [a for a in v.args if any(a is u for u in computed)]
    return RowFacts(space, segments, tuple(counts.values()), tuple(v for v in computed if id(v) in tail))


def _bounds(n: int, chunks: int, k: int) -> tuple[int, int]:
    return k * n // chunks, (k + 1) * n // chunks


class Chunks:
    """One rank's row-set chunks of a chain: `spaces` maps a row space's name to its counts tensor (one count per
    rank of the exchange), `segments` a grouped_matmul's counts name to (its tensor [P, G], its space's name). The
    counts are read on the host once."""

    def __init__(self, chunks: int, spaces: Mapping[str, torch.Tensor],
                 segments: Mapping[str, tuple[torch.Tensor, str]], where: str):
        self.chunks, self.where = chunks, where
        self.n = {name: row_counts(t, t.numel(), name, where) for name, t in spaces.items()}  # InputError if < 0
        self.like = {name: t for name, t in spaces.items()}
        self.segs: dict[str, tuple[list[list[int]], str, torch.Tensor]] = {}
        for name, (c, space) in segments.items():
            lines = [host_counts(line) for line in c.reshape(c.shape[0], -1)] if c.ndim else []
            n = self.n[space]
            if len(lines) != len(n) or any(sum(line) != m for line, m in zip(lines, n)):
                raise InputError(f"{where}: the segment counts `{name}` {lines} must hold one line per rank, line i "
                                 f"summing to the {n} rows of `{space}` from rank i; row-set chunks split each line "
                                 "by its rank's rows")
            self.segs[name] = (lines, space, c)
        self._index: dict[tuple[str, int, str], torch.Tensor] = {}
        self._taken: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def counts(self, space: str, k: int) -> torch.Tensor:
        """Chunk k's counts of `space` (a chunk's all_to_all_v splits or recv), a tensor like the whole counts."""
        t = self.like[space]
        return torch.tensor([b - a for a, b in (_bounds(n, self.chunks, k) for n in self.n[space])],
                            dtype=t.dtype).reshape(t.shape)

    def rows(self, space: str, k: int) -> int:
        """How many rows chunk k of `space` holds."""
        return sum(b - a for a, b in (_bounds(n, self.chunks, k) for n in self.n[space]))

    def index(self, space: str, k: int, device: torch.device | None = None) -> torch.Tensor:
        """Chunk k's rows of `space` (int64 indices into the whole tensor's rows, in order)."""
        key = (space, k, str(device or "cpu"))
        if key not in self._index:
            at, parts = 0, []
            for n in self.n[space]:
                a, b = _bounds(n, self.chunks, k)
                parts.append(torch.arange(at + a, at + b))
                at += n
            idx = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
            self._index[key] = idx if device is None else idx.to(device)  # one copy to a device per step
        return self._index[key]

    def take(self, t: torch.Tensor, space: str, k: int) -> torch.Tensor:
        """Chunk k's rows of tensor `t` (rows numbered by `space`), as one contiguous tensor: gathered once per chunk
        however many parts read them."""
        key = (id(t), space, k)
        if key not in self._taken:
            self._taken[key] = (t, t.index_select(0, self.index(space, k, t.device)))  # t kept: its id stays its own
        return self._taken[key][1]

    def segments(self, name: str, k: int) -> torch.Tensor:
        """Chunk k's grouped_matmul counts [P, G]: of each source rank's rows in the chunk, each group's."""
        lines, space, c = self.segs[name]
        out = []
        for line, n in zip(lines, self.n[space]):
            a, b, start = *_bounds(n, self.chunks, k), 0
            for m in line:
                out.append(max(0, min(b, start + m) - max(a, start)))
                start += m
        return torch.tensor(out, dtype=c.dtype).reshape(c.shape)

    def padding(self, t: torch.Tensor, space: str) -> torch.Tensor:
        """The rows of whole tensor `t` (rows numbered by `space`) that no chunk holds: those past the counts'."""
        return t[sum(self.n[space]):]

    def zeros(self, like: torch.Tensor, space: str, rows: int) -> torch.Tensor:
        """The padding rows of a tensor of `rows` rows whose padding is zero (an exchange's, a grouped GEMM's), with
        the width and dtype of a chunk of it, `like`."""
        return like.new_zeros((rows - sum(self.n[space]), *like.shape[1:]))

    def assemble(self, pieces: Sequence[torch.Tensor], space: str, rows: int,
                 padding: torch.Tensor | None = None) -> torch.Tensor:
        """The whole tensor of `rows` rows from each chunk's rows of `space` and the rows no chunk holds, `padding`
        (zero when not given): the chunks cover the rows before the padding, so only the padding is written apart."""
        first = pieces[0]
        out = first.new_empty((rows, *first.shape[1:]))
        if padding is None:
            out[sum(self.n[space]):].zero_()
        else:
            out[sum(self.n[space]):].copy_(padding)
        for k, p in enumerate(pieces):
            out.index_copy_(0, self.index(space, k, out.device), p)
        return out


def accumulate(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """A grouped_matmul_wgrad's result from its chunks' partial sums (in chunk order; 16-bit ones added in float32
    and rounded once, as the unchunked op sums its segments)."""
    out = pieces[0].float() if pieces[0].element_size() < 4 else pieces[0].clone()
    for p in pieces[1:]:
        out += p
    return out.to(pieces[0].dtype)


__all__ = ["ACCUMULATED", "Chunks", "RowFacts", "accumulate", "analyse", "chainable", "exchanges_rows", "of_stage"]
