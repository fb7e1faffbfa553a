"""The checker over a whole job's trace: every send has its receive (same size and dtype), every collective is
entered by every member of its group in the same order, and the step's blocking order waits in no circle. The
last is decided by running the trace: posts never block, a wait on a receive completes once its send is posted
and a wait on a send once its receive is posted (a rendezvous, as NCCL's and Gloo's unbuffered sends are), a
collective completes when its whole group has entered it, compute takes its cost. When no rank can move, the
ranks waiting for each other are named. The same run times the step (compute in units of one block's forward,
a backward twice that, or the job's stage costs; a received message costs its receiver the job's receive cost
after the wait, when the job states a link), which gives each rank's idle share: the schedule's bubble."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import PreflightError
from .trace import P2P, Event, Op, Trace


@dataclass(frozen=True)
class Timing:
    """The simulated step: its length (in the job's cost units: block forwards, or seconds), and per rank the time
    busy computing and the idle share (the bubble)."""

    makespan: float
    busy: dict[int, float]

    def bubble(self, rank: int) -> float:
        return 1.0 - self.busy[rank] / self.makespan if self.makespan > 0 else 0.0

    @property
    def max_bubble(self) -> float:
        return max((self.bubble(r) for r in self.busy), default=0.0)


def _at(trace: Trace, rank: int, op_id: int) -> str:
    """Where an op sits in its rank's events: 'event 7 (1F2)' style, for sentences."""
    for i, ev in enumerate(trace.events.get(rank, [])):
        if op_id in ev.ops:
            return f"at its event {i}"
    return f"at its operation {op_id}"


def match_p2p(trace: Trace) -> dict[tuple[int, int], tuple[int, int]]:
    """(rank, op id) -> (peer, op id) of its matching operation: the k-th send from a to b with the k-th receive
    b posts from a. PreflightError when one is missing or the two differ in size or dtype."""
    chan: dict[tuple[int, int, str], list[int]] = defaultdict(list)
    for r in trace.ranks:
        for i, op in enumerate(trace.ops.get(r, [])):
            if op.kind in P2P:
                chan[(r, op.peer, op.kind)].append(i)  # type: ignore[index]
    out: dict[tuple[int, int], tuple[int, int]] = {}
    step = trace.step
    for (src, dst, kind), sends in sorted(chan.items()):
        if kind != "send":
            continue
        recvs = chan.get((dst, src, "recv"), [])
        for s, r in zip(sends, recvs):
            a, b = trace.ops[src][s], trace.ops[dst][r]
            if (a.numel, a.dtype) != (b.numel, b.dtype):
                raise PreflightError(f"in step {step}, rank {src}'s {a.describe()} is received by rank {dst}'s "
                                     f"{b.describe()}: {a.numel} {a.dtype} sent, {b.numel} {b.dtype} expected")
            out[(src, s)], out[(dst, r)] = (dst, r), (src, s)
        if len(sends) > len(recvs):
            a = trace.ops[src][sends[len(recvs)]]
            raise PreflightError(f"in step {step}, rank {src}'s {a.describe()} {_at(trace, src, sends[len(recvs)])} "
                                 f"has no matching receive on rank {dst}, which posts {len(recvs)} receives from "
                                 f"rank {src} for {len(sends)} sends; rank {src} would wait forever")
    for (dst, src, kind), recvs in sorted(chan.items()):
        if kind == "recv" and len(recvs) > len(chan.get((src, dst, "send"), [])):
            n = len(chan.get((src, dst, "send"), []))
            b = trace.ops[dst][recvs[n]]
            raise PreflightError(f"in step {step}, rank {dst}'s {b.describe()} {_at(trace, dst, recvs[n])} has no "
                                 f"matching send on rank {src}, which sends it {n} messages for {len(recvs)} "
                                 f"receives; rank {dst} would wait forever")
    return out


def check_collective_order(trace: Trace) -> None:
    """Every member of a group enters the group's collectives in the same order, with the same sizes."""
    seq: dict[tuple[int, ...], dict[int, list[Op]]] = defaultdict(lambda: defaultdict(list))
    for r in trace.ranks:
        for op in trace.ops.get(r, []):
            if op.kind not in P2P:
                seq[op.group][r].append(op)
    for group, per in sorted(seq.items()):
        for a, b in zip(group, group[1:]):
            ours, theirs = per.get(a, []), per.get(b, [])
            for k, (x, y) in enumerate(zip(ours, theirs)):
                if (x.kind, x.numel, x.dtype) != (y.kind, y.numel, y.dtype):
                    raise PreflightError(f"in step {trace.step}, ranks {a} and {b} enter group {list(group)} in "
                                         f"different orders: its collective {k} is rank {a}'s {x.describe()} but "
                                         f"rank {b}'s {y.describe()}; both would wait forever")
            if len(ours) != len(theirs):
                few, many = (a, b) if len(ours) < len(theirs) else (b, a)
                extra = per[many][min(len(ours), len(theirs))]
                raise PreflightError(f"in step {trace.step}, rank {many} enters group {list(group)} "
                                     f"{len(per[many])} times but rank {few} only {len(per.get(few, []))}: rank "
                                     f"{many}'s {extra.describe()} would wait forever for rank {few}")


def _describe_wait(trace: Trace, rank: int, pc: int, ev: Event, needs: list[int]) -> str:
    ops = " and ".join(trace.ops[rank][i].describe() for i in ev.ops)
    verb = "in" if ev.what == "collective" else "on"
    return f"rank {rank} waits {verb} its {ops} (event {pc}) for rank{'s' if len(needs) > 1 else ''} " \
           f"{', '.join(map(str, needs))}"


def simulate(trace: Trace, matches: dict[tuple[int, int], tuple[int, int]] | None = None,
             receive: Callable[[Op], float] | None = None) -> Timing:
    """Run the trace (see the module docstring); PreflightError naming the circle of waiting ranks when it
    cannot finish. `receive`: the time a received message costs its receiver once it has arrived (not busy:
    the rank is not computing)."""
    matches = match_p2p(trace) if matches is None else matches
    ranks = trace.ranks
    pc = dict.fromkeys(ranks, 0)
    now = dict.fromkeys(ranks, 0.0)
    busy = dict.fromkeys(ranks, 0.0)
    posted: dict[tuple[int, int], float] = {}
    count: dict[tuple[int, tuple[int, ...]], int] = defaultdict(int)  # (rank, group) -> collectives entered
    arrived: dict[tuple[tuple[int, ...], int], dict[int, float]] = defaultdict(dict)
    entered: dict[int, tuple[tuple[int, ...], int]] = {}  # rank -> the collective it waits in

    def blocked_on(r: int) -> list[int] | None:
        """None when rank r can take its next event now (and takes it), else the ranks it waits for."""
        ev = trace.events[r][pc[r]]
        if ev.what == "post":
            for i in ev.ops:
                posted[(r, i)] = now[r]
        elif ev.what == "compute":
            now[r] += ev.cost
            busy[r] += ev.cost
        elif ev.what == "reduce_grad":
            pass
        elif ev.what == "wait":
            missing = [matches[(r, i)] for i in ev.ops if matches[(r, i)] not in posted]
            if missing:
                return sorted({p for p, _ in missing})
            now[r] = max([now[r]] + [posted[matches[(r, i)]] for i in ev.ops])
            if receive is not None:
                now[r] += sum(receive(op) for i in ev.ops if (op := trace.ops[r][i]).kind == "recv")
        else:  # a collective
            op = trace.ops[r][ev.ops[0]]
            if r not in entered:
                key = (op.group, count[(r, op.group)])
                count[(r, op.group)] += 1
                arrived[key][r] = now[r]
                entered[r] = key
            key = entered[r]
            waiting = [m for m in op.group if m not in arrived[key]]
            if waiting:
                return waiting
            now[r] = max(arrived[key].values())
            del entered[r]
        pc[r] += 1
        return None

    stuck: dict[int, list[int]] = {}
    while True:
        moved = False
        stuck = {}
        for r in ranks:
            while pc[r] < len(trace.events[r]):
                needs = blocked_on(r)
                if needs is not None:
                    stuck[r] = needs
                    break
                moved = True
        if not stuck:
            break
        if not moved:
            raise PreflightError(_circle(trace, stuck, pc))
    return Timing(max(now.values(), default=0.0), busy)


def _circle(trace: Trace, stuck: dict[int, list[int]], pc: dict[int, int]) -> str:
    """The sentence naming ranks that wait for each other in a circle (or for a rank that has finished)."""
    start = min(stuck)
    path, seen = [start], {start}
    while True:
        nxt = next((p for p in stuck[path[-1]] if p in stuck), None)
        if nxt is None:
            r = path[-1]
            ev = trace.events[r][pc[r]]
            return (f"in step {trace.step}, {_describe_wait(trace, r, pc[r], ev, stuck[r])}, which finished the step "
                    "without it; it would wait forever")
        if nxt in seen:
            loop = path[path.index(nxt):]
            parts = [_describe_wait(trace, r, pc[r], trace.events[r][pc[r]], [b])
                     for r, b in zip(loop, loop[1:] + loop[:1])]
            names = ", ".join(map(str, loop[:-1])) + f" and {loop[-1]}" if len(loop) > 1 else str(loop[0])
            return f"ranks {names} would wait for each other forever in step {trace.step}: " + "; ".join(parts)
        path.append(nxt)
        seen.add(nxt)


def check_reduce_grad(trace: Trace) -> None:
    """Each stage's gradient reduction (torch's REDUCE_GRAD, or the end of a single-stage schedule) runs once, after
    the stage's last backward (B or W): a schedule whose backward bypasses it (pytorch #144530) leaves a
    data-parallel (DDP, FSDP) stage's gradients partly unreduced. Traces without reduction markers (recorded ones,
    hand-written ones) are not held to it."""
    for rank in trace.ranks:
        events = trace.events.get(rank, [])
        if not any(ev.what == "reduce_grad" for ev in events) and not any(ev.what == "compute" for ev in events):
            continue
        for s in sorted({ev.stage for ev in events if ev.what == "compute" and ev.stage is not None}):
            backs = [i for i, ev in enumerate(events) if ev.what == "compute" and ev.stage == s
                     and ev.label[len(str(s))] in "BW"]
            reduces = [i for i, ev in enumerate(events) if ev.what == "reduce_grad" and ev.stage == s]
            if len(reduces) == 1 and not (backs and reduces[0] < backs[-1]):
                continue
            late = [events[i].label for i in backs if reduces and i > reduces[0]]
            why = (f"never reduces stage {s}'s gradients" if not reduces else
                   f"reduces stage {s}'s gradients {len(reduces)} times" if len(reduces) > 1 else
                   f"reduces stage {s}'s gradients before its backward {', '.join(late)}")
            raise PreflightError(f"rank {rank}'s schedule {why} in step {trace.step} ({s}REDUCE_GRAD must follow the "
                                 "stage's last backward): a data-parallel stage would step on gradients its replicas "
                                 "never summed")


def check_trace(trace: Trace, receive: Callable[[Op], float] | None = None) -> Timing:
    """All the checks (matching, order per group, circles, gradient reductions); the simulated timing when the
    trace passes them (`receive`: as simulate's)."""
    matches = match_p2p(trace)
    check_collective_order(trace)
    timing = simulate(trace, matches, receive)
    check_reduce_grad(trace)
    return timing
