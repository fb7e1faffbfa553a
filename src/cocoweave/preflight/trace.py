"""A communication trace: per rank, the ordered events of one training step. Point-to-point operations are
posted (non-blocking) and later waited on, as torch.distributed.pipelining's runtime does; collectives block;
compute events (a stage's forward or backward of one micro-batch) carry no communication but say where a rank
is busy. Predicted traces (predict.py) and recorded ones (record.py) share this form, so `compare` can hold one
against the other."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

P2P = ("send", "recv")


@dataclass(frozen=True)
class Op:
    """One communication operation a rank issues: `kind` (send, recv, all_reduce, all_gather, ...), the global
    ranks of its `group`, the `peer` (a global rank; point-to-point only), `numel` elements of `dtype`, and a
    `label` saying where it comes from (a torch schedule action such as 1SEND_F3, or the stage boundary)."""

    kind: str
    group: tuple[int, ...]
    peer: int | None
    numel: int
    dtype: str
    label: str = ""

    def key(self) -> tuple[Any, ...]:
        """What a recorded operation must equal (the label is only a description)."""
        return self.kind, self.group, self.peer, self.numel, self.dtype

    def describe(self) -> str:
        """'send of 256 float32 to rank 2 (1SEND_F3)'."""
        where = {"send": f" to rank {self.peer}", "recv": f" from rank {self.peer}"}.get(
            self.kind, f" over ranks {list(self.group)}")
        return f"{self.kind} of {self.numel} {self.dtype}{where}" + (f" ({self.label})" if self.label else "")

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "group": list(self.group), "peer": self.peer, "numel": self.numel,
                "dtype": self.dtype, "label": self.label}


@dataclass(frozen=True)
class Event:
    """One step of a rank: `what` is post (point-to-point ops start), wait (this rank blocks until they
    complete), collective (blocks until every member of the group enters it) or compute (a forward F, backward
    B or weight-gradient W of `stage` on `microbatch`, lasting `cost` units). `ops` index the rank's ops."""

    what: str
    ops: tuple[int, ...] = ()
    label: str = ""
    stage: int | None = None
    microbatch: int | None = None
    cost: float = 0.0


@dataclass
class Trace:
    """Per rank: the operations in the order they are issued (`ops`) and the events that post, wait on and
    compute (`events`). `step` is the training step the trace is of (0 when predicted)."""

    ops: dict[int, list[Op]] = field(default_factory=lambda: defaultdict(list))
    events: dict[int, list[Event]] = field(default_factory=lambda: defaultdict(list))
    step: int = 0

    def add_op(self, rank: int, op: Op) -> int:
        self.ops[rank].append(op)
        return len(self.ops[rank]) - 1

    def post(self, rank: int, ops: list[Op], label: str = "") -> tuple[int, ...]:
        ids = tuple(self.add_op(rank, op) for op in ops)
        if ids:
            self.events[rank].append(Event("post", ids, label))
        return ids

    def wait(self, rank: int, ids: tuple[int, ...], label: str = "") -> None:
        if ids:
            self.events[rank].append(Event("wait", ids, label))

    def collective(self, rank: int, op: Op) -> None:
        self.events[rank].append(Event("collective", (self.add_op(rank, op),), op.label))

    def compute(self, rank: int, label: str, stage: int, microbatch: int | None, cost: float) -> None:
        self.events[rank].append(Event("compute", (), label, stage, microbatch, cost))

    @property
    def ranks(self) -> list[int]:
        return sorted(set(self.ops) | set(self.events))

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "ranks": {str(r): [op.to_json() for op in self.ops.get(r, [])]
                                             for r in self.ranks}}


def compare(predicted: Trace, recorded: Trace, ranks: list[int] | None = None) -> list[str]:
    """The differences between two traces' operations, rank by rank, in issue order (empty when equal): one line
    per rank that differs, naming the first operation where they part."""
    out = []
    for r in sorted(ranks if ranks is not None else set(predicted.ranks) | set(recorded.ranks)):
        want, got = predicted.ops.get(r, []), recorded.ops.get(r, [])
        for i, (a, b) in enumerate(zip(want, got)):
            if a.key() != b.key():
                out.append(f"rank {r}, operation {i}: predicted {a.describe()}, recorded {b.describe()}")
                break
        else:
            if len(want) != len(got):
                extra = want[len(got)] if len(want) > len(got) else got[len(want)]
                out.append(f"rank {r}: predicted {len(want)} operations, recorded {len(got)} (first unmatched: "
                           f"{extra.describe()})")
    return out
