"""How a profiled training step scales with the number of local ranks on this host, and where its time goes.

Fitted on the worlds `cocoweave profile` measured (`worlds.WorldRun`), per rank and step:

- compute c(p) = a + b x w(p): the main thread's CPU time, with w(p) the rank's share of the work
  (its FLOPs relative to the smallest world's, counted in one step; 1/p when a global batch is split,
  1 when each rank has its own batch) and `a` what does not shrink (Python, per-op overhead);
- communication CPU k(p) = gamma x MB(p) + delta x hops(p): Gloo's threads' CPU time, with MB(p) the
  bytes a rank moves (all-reduce 2(p-1)/p of the tensor, reduce-scatter and all-gather (p-1)/p, ...)
  and hops(p) the message steps of ring algorithms (the alpha-beta model of perf/costmodel.py, fitted
  on the measured collectives rather than on microbenchmarks);
- waiting w(p) = omega x hops(p): wall time not spent on a CPU while ranks have a core each (latency, skew),
  beyond the idle time one rank alone shows (other processes, I/O), which is kept as a constant;
- input d(p) = u + v x (p - 1): wall time a rank waits inside its DataLoader per step (decoding, reading,
  workers that fall behind), fitted on the worlds where ranks have a core each: u what one rank waits, v how
  much more each rank sharing the host (its disk, page cache, memory bandwidth) adds; its CPU time (the rank's
  thread inside the loader plus the loader's worker processes), i, is kept for core sharing. The data-making
  CPU time is taken out of c, so decoding is not counted as the model's computation;
- busy cores: a rank's CPU time per step is longer when the other cores are busy too (shared caches and memory
  bandwidth, SMT siblings, clock boost, on a VM the host's own sharing): every CPU term above is the time of a rank
  with the host to itself, times 1 + kappa x s(p), s(p) = min(p - 1, K - 1) / (K - 1) the share of the other cores
  busy; kappa is fitted with the terms (the smallest kappa that explains the worlds' CPU times: 0 when a change
  of the work share explains them as well) and holds beyond the cores, where every core is busy;
- core sharing: with p ranks of one thread on K cores, p > K, the ranks share the cores, and the step takes
  eta(p) x p x (c + k + i) / K (waiting is then another rank's time on the core), with
  eta(p) = eta_bal x (1 + mu x imbalance(p)), imbalance(p) = ceil(p / K) x K / p - 1 (how much busier the busiest
  core is than the mean: 1/3 for 3 ranks on 2 cores, 0 for 4, 0.2 for 5). eta_bal: ranks meeting every step lose
  time to each other even with a core each; it is the K-rank world's step over a rank's measured CPU time there
  (so the formula taken at K meets the step within the cores where the model's CPU time is the measured one; the
  model's own step at K when no K-rank world was fitted), together with the evenly spread oversubscribed worlds'
  (p a multiple of K: the stored 4-rank worlds on 2 cores show the K-rank ratio, docs/profiling.md). An uneven spread
  leaves the cores with fewer ranks idle while the busiest finishes, partly recovered by the scheduler moving
  ranks: mu (>= 0) is fitted on the unevenly spread oversubscribed worlds (step over p x measured CPU / K, over
  eta_bal). Beyond the cores a rank's CPU time is the model's times shared_cpu, the oversubscribed worlds' measured
  CPU time over the model's (ranks sharing a core spent more per step than the terms fitted across all the worlds
  give there). When no fitted world oversubscribed the cores none of the three is measured beyond them: eta(p) is
  eta_bal times the synthetic factor measured at each predicted size by `core_sharing.sharing_factor` (processes
  of the predicted CPU time per step meeting at a barrier every step: what sharing the cores adds; eta_bal, what
  the real ranks lose to each other beyond their CPU time, which the synthetic ones do not have), else eta_bal
  (mu = 0, shared_cpu = 1).

The step is c + k + w + idle + d while p <= K, and eta(p) x p x (c + k + i) / K beyond (c, k, i times shared_cpu).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np
from scipy.optimize import nnls

from cocoweave.cluster.profiling.io_summary import input_cpu_ms, input_main_cpu_ms, input_wait_ms
from cocoweave.cluster.profiling.worlds import WorldRun, ranks
from cocoweave.collectives.pricing import known, moved, steps
from cocoweave.errors import CocoweaveError

KAPPAS = [k / 100 for k in range(101)]  # the busy-cores factors tried (0 to +100% CPU time with every core busy)
LABELS = {"all_reduce": "all-reduce", "reduce_scatter": "reduce-scatter", "all_gather": "all-gather"}


class ScalingFitError(CocoweaveError):
    """The measured worlds cannot determine the scaling model (too few, or no work counted)."""


@dataclass(frozen=True)
class Traffic:
    """Collectives of one step per rank, independent of the world size: kind -> (calls, bytes of the tensor)."""

    kinds: dict[str, tuple[float, float]]

    @classmethod
    def of(cls, run: WorldRun) -> Traffic:
        kinds: dict[str, list[float]] = {}
        for key, c in run.collectives.items():
            parts = key.split("/")
            group = int(parts[-1].removeprefix("p")) if parts[-1].startswith("p") else run.world_size
            if group < 2:
                continue
            acc = kinds.setdefault(parts[0], [0.0, 0.0])
            acc[0] += c["count"]
            acc[1] += c["bytes"]
        return cls({k: (v[0], v[1]) for k, v in kinds.items()})

    def megabytes(self, p: int) -> float:
        """MB a rank moves per step on p ranks (the library's algorithms; a kind of unknown traffic as a message)."""
        return sum(moved(known_kind(k), p) * b for k, (_, b) in self.kinds.items()) / 1e6

    def hops(self, p: int) -> float:
        """Message steps per rank per step on p ranks."""
        return sum(steps(known_kind(k), p) * n for k, (n, _) in self.kinds.items())

    def shares(self, p: int) -> dict[str, float]:
        """Each kind's share of the bytes moved at p ranks (equal shares when nothing moves)."""
        by_kind = {k: moved(known_kind(k), p) * b for k, (_, b) in self.kinds.items()}
        total = sum(by_kind.values())
        return {k: (v / total if total else 1.0 / len(by_kind)) for k, v in by_kind.items()}


def known_kind(kind: str) -> str:
    """`kind` where the collectives table knows its traffic, else a point-to-point message's."""
    return kind if known(kind) else "p2p"


@dataclass(frozen=True)
class StepParts:
    """A predicted (or measured) step on p ranks of this host, in ms per step."""

    world_size: int
    total_ms: float
    compute_ms: float
    comm_cpu_ms: float
    wait_ms: float  # off the CPU, waiting for peers (latency, skew)
    contention_ms: float
    comm_by_kind_ms: dict[str, float]
    idle_ms: float = 0.0  # off the CPU with no peer to wait for (other processes, I/O): what one rank shows
    input_ms: float = 0.0  # waiting for data (the input pipeline); its CPU time when ranks share the cores

    @property
    def comm_ms(self) -> float:
        return self.comm_cpu_ms + self.wait_ms


def imbalance(p: int, cores: int) -> float:
    """How unevenly p ranks spread over the cores beyond them: the busiest core's ranks over the mean, minus 1
    (ceil(p / K) x K / p - 1: 1/3 for 3 ranks on 2 cores, 0 for 4, 0.2 for 5); 0 within the cores."""
    return math.ceil(p / cores) * cores / p - 1.0 if p > cores else 0.0


def counted_total(counts: dict, key: str) -> float:
    """A run's counted `key` ("flops" or "bytes") over the counted step: forward + backward and the update."""
    return sum(float(counts.get(part, {}).get(key, 0.0)) for part in ("forward_backward", "update"))


def work_share_fit(sizes: Sequence[int], flops: Sequence[float]) -> tuple[float, float]:
    """Non-negative (f0, f1) with per-rank FLOPs = f0 + f1 / p, fitted by relative least squares."""
    p = np.asarray(sizes, dtype=float)
    f = np.asarray(flops, dtype=float)
    a = np.stack([np.ones_like(p), 1.0 / p], axis=1) / f[:, None]
    (f0, f1), _ = nnls(a, np.ones_like(f))
    return float(f0), float(f1)


@dataclass(frozen=True)
class HostScaling:
    """The fitted model (see the module docstring); `predict(p)` gives the step on p ranks of this host."""

    cores: int
    a_ms: float  # compute that does not shrink with the work share
    b_ms: float  # compute of the whole work of the smallest world
    flops0: float  # per-rank FLOPs = flops0 + flops1 / p
    flops1: float
    gamma_ms_per_mb: float
    delta_ms_per_hop: float
    omega_ms_per_hop: float
    eta_bal: float  # step over ideal core sharing with the ranks spread evenly over the cores (as at K ranks)
    traffic: Traffic
    reference_flops: float  # per-rank FLOPs of the smallest world (work share 1)
    idle_ms: float = 0.0  # off-CPU time of a step with no peers (measured on one rank)
    input_ms: float = 0.0  # u: a rank's wait for data per step, alone on the host
    input_ms_per_rank: float = 0.0  # v: what each further rank sharing the host adds to it
    input_cpu_ms: float = 0.0  # i: CPU time of a rank's input pipeline per step (its thread + loader workers)
    sharing: dict[int, float] = field(default_factory=dict)  # eta measured at sizes beyond the cores (core_sharing)
    kappa: float = 0.0  # CPU time of a rank with every core busy over alone, minus 1 (busy cores)
    mu: float = 0.0  # how much of an uneven spread's imbalance the step keeps (0: none, 1: all of it)
    shared_cpu: float = 1.0  # a rank's CPU time sharing a core over the model's (measured beyond the cores)

    def busy_cores(self, p: int) -> float:
        """1 + kappa x the share of the other cores busy at p ranks, times shared_cpu beyond the cores: what a
        rank's CPU time is multiplied by."""
        share = min(p - 1, self.cores - 1) / (self.cores - 1) if self.cores > 1 else 0.0
        return (1.0 + self.kappa * share) * (self.shared_cpu if p > self.cores else 1.0)

    def sharing_at(self, p: int) -> float:
        """eta at p ranks beyond the cores: eta_bal x the synthetic factor measured at p (or the largest size below
        it measured) when no fitted world shared the cores, else eta_bal x (1 + mu x imbalance(p))."""
        below = [q for q in self.sharing if q <= p]
        if below:
            return self.eta_bal * self.sharing[max(below)]
        return self.eta_bal * (1.0 + self.mu * imbalance(p, self.cores))

    def busy_ms(self, p: int) -> float:
        """CPU time of one rank's step on p ranks: computation, communication and its input pipeline."""
        return _busy(self, p) + self.input_cpu_ms * self.busy_cores(p)

    def input_wait(self, p: int) -> float:
        """Predicted wall time a rank waits for data per step on p ranks of this host (no core sharing)."""
        return self.input_ms + self.input_ms_per_rank * (p - 1)

    def work_share(self, p: int) -> float:
        if self.reference_flops <= 0:
            return 1.0
        return (self.flops0 + self.flops1 / p) / self.reference_flops

    def predict(self, p: int) -> StepParts:
        busy = self.busy_cores(p)
        compute = busy * (self.a_ms + self.b_ms * self.work_share(p))
        comm = busy * (self.gamma_ms_per_mb * self.traffic.megabytes(p) + self.delta_ms_per_hop * self.traffic.hops(p))
        by_share = self.traffic.shares(p) if p > 1 else {}
        if p > self.cores:  # ranks share the cores: time off the CPU is another rank's time on it
            data = busy * self.input_cpu_ms
            total = self.sharing_at(p) * p * (compute + comm + data) / self.cores
            return StepParts(p, total, compute, comm, 0.0, total - compute - comm - data,
                             {k: s * comm for k, s in by_share.items()}, 0.0, data)
        wait = self.omega_ms_per_hop * self.traffic.hops(p)
        data = self.input_wait(p)
        total = compute + comm + wait + self.idle_ms + data
        return StepParts(p, total, compute, comm, wait, 0.0, {k: s * (comm + wait) for k, s in by_share.items()},
                         self.idle_ms, data)

    def to_json(self) -> dict:
        doc = asdict(self)
        doc["traffic"] = {k: list(v) for k, v in self.traffic.kinds.items()}
        return doc


def fit_host_scaling(runs: Sequence[WorldRun], cores: int, sharing: dict[int, float] | None = None) -> HostScaling:
    """Fit the model on measured worlds (at least two sizes, one of them with two or more ranks); `sharing`: core
    sharing factors measured at sizes beyond the cores, used when no fitted world oversubscribed them."""
    runs = sorted(runs, key=lambda r: r.world_size)
    sizes = [r.world_size for r in runs]
    if len(set(sizes)) < 2 or max(sizes) < 2:
        raise ScalingFitError(f"fitting the scaling model needs at least two world sizes, one of 2+ ranks; "
                              f"got {sizes}.")
    multi = [r for r in runs if r.world_size > 1]
    traffic = Traffic.of(multi[-1])
    flops = [counted_total(r.counts, "flops") for r in runs]
    if all(f > 0 for f in flops):
        flops0, flops1 = work_share_fit(sizes, flops)
        reference = flops0 + flops1 / sizes[0]
    else:  # no counts (a script without floating-point work?): treat the work per rank as constant
        flops0, flops1, reference = 1.0, 0.0, 1.0
    idle = runs[0].cpu_ms["cpu_other_ms"] if sizes[0] == 1 else 0.0
    cpu = [measured_cpu_ms(r) for r in runs]
    model = min((_fit_cpu(runs, cpu, cores, kappa, flops0, flops1, reference, traffic, idle) for kappa in KAPPAS),
                key=lambda fitted: fitted[0])[1]
    # off the CPU with no peer (one rank): other processes, I/O; with peers, the rest is waiting for them
    idle = max(runs[0].step_ms - _busy(model, 1) - model.input_wait(1), 0.0) if sizes[0] == 1 else 0.0
    uncontended = [r for r in multi if r.world_size <= cores]
    waits = [(r.step_ms - _busy(model, r.world_size) - model.input_wait(r.world_size) - idle,
              traffic.hops(r.world_size)) for r in uncontended]
    omega = max(sum(w for w, _ in waits) / sum(h for _, h in waits), 0.0) if waits and traffic.hops(2) else 0.0
    return fit_core_sharing(replace(model, omega_ms_per_hop=float(omega), idle_ms=idle), runs, sharing)


def fit_core_sharing(model: HostScaling, runs: Sequence[WorldRun], sharing: dict[int, float] | None = None
                     ) -> HostScaling:
    """eta_bal, mu and shared_cpu (module docstring) on the fitted worlds, for a model whose other terms are fitted;
    `sharing` (synthetic factors per size) is kept when no world oversubscribed the cores."""
    cores = model.cores
    shared = [r for r in runs if r.world_size > cores]
    at_cores = next((r for r in runs if r.world_size == cores), None)
    # the K-rank world's step over a rank's CPU time there: measured, else the model's own
    balanced = (model.predict(cores).total_ms / model.busy_ms(cores) if at_cores is None
                else at_cores.step_ms / measured_cpu_ms(at_cores))
    if not shared:
        return replace(model, eta_bal=max(balanced, 1.0), mu=0.0, shared_cpu=1.0, sharing=dict(sharing or {}))
    eta_bal, mu = spread_factors(balanced, [(imbalance(r.world_size, cores),
                                             r.step_ms / (r.world_size * measured_cpu_ms(r) / cores)) for r in shared])
    return replace(model, eta_bal=eta_bal, mu=mu, sharing={},
                   shared_cpu=geomean([measured_cpu_ms(r) / model.busy_ms(r.world_size) for r in shared]))


def spread_factors(balanced: float, ratios: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(eta_bal, mu) from the K-rank world's ratio `balanced` and the oversubscribed worlds' (imbalance, step over
    ideal sharing): eta_bal over the K-rank and evenly spread worlds, mu (>= 0) over the uneven ones."""
    eta_bal = max(geomean([balanced, *(x for imb, x in ratios if imb == 0)]), 1.0)
    uneven = [(x / eta_bal - 1.0) / imb for imb, x in ratios if imb > 0]
    return eta_bal, max(statistics.fmean(uneven), 0.0) if uneven else 0.0


def geomean(xs: Sequence[float]) -> float:
    """The geometric mean of positive `xs`."""
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def _fit_cpu(runs: Sequence[WorldRun], cpu: Sequence[float], cores: int, kappa: float, flops0: float, flops1: float,
             reference: float, traffic: Traffic, idle: float) -> tuple[float, HostScaling]:
    """The CPU terms (compute, communication, input) fitted for a given kappa on the measured CPU times taken back
    to a rank alone, and the relative squared error of the whole CPU time per rank (`cpu`, measured) they then
    predict (plus a tie-breaker favouring the smaller kappa)."""
    sizes = [r.world_size for r in runs]
    probe = HostScaling(cores, 0.0, 0.0, flops0, flops1, 0.0, 0.0, 0.0, 1.0, traffic, reference, kappa=kappa)
    alone = {r.world_size: probe.busy_cores(r.world_size) for r in runs}
    share = [probe.work_share(p) for p in sizes]
    a, b = _relative_nnls([[1.0] * len(share), share], [model_cpu_ms(r) / alone[r.world_size] for r in runs])
    # communication CPU: gamma x MB + delta x hops on the worlds with peers, above what one rank's other
    # threads spend without any peer
    multi = [r for r in runs if r.world_size > 1]
    gamma, delta = _relative_nnls([[traffic.megabytes(r.world_size) for r in multi],
                                   [traffic.hops(r.world_size) for r in multi]],
                                  [max(r.cpu_ms["cpu_other_ms"] / alone[r.world_size] - idle, 1e-6) for r in multi])
    u, v, i = fit_input(runs, cores, alone)
    model = HostScaling(cores, a, b, flops0, flops1, gamma, delta, 0.0, 1.0, traffic, reference, 0.0, u, v, i,
                        kappa=kappa)
    error = sum(((model.busy_ms(r.world_size) + idle * alone[r.world_size]) / m - 1.0) ** 2
                for r, m in zip(runs, cpu, strict=True))
    return error + 1e-9 * kappa, model


def measured_cpu_ms(run: WorldRun) -> float:
    """A rank's whole CPU time per step as measured: the model's computation, its other threads, its input pipeline."""
    return model_cpu_ms(run) + run.cpu_ms["cpu_other_ms"] + input_cpu_ms(run.io)


def model_cpu_ms(run: WorldRun) -> float:
    """The main thread's CPU time per step without what it spent making data (the model's computation)."""
    return max(run.cpu_ms["cpu_main_ms"] - input_main_cpu_ms(run.io), 1e-6)


def fit_input(runs: Sequence[WorldRun], cores: int, alone: dict[int, float] | None = None) -> tuple[float, float,
                                                                                                   float]:
    """(u, v, i) of the input term (module docstring) from the worlds where ranks have a core each (all worlds
    when none has); `alone` divides a world's CPU time to a rank's alone (busy cores); zeros for a script that
    takes no batch from a DataLoader."""
    if not any(r.io.get("batches", 0) for r in runs):
        return 0.0, 0.0, 0.0
    own = [r for r in runs if r.world_size <= cores] or list(runs)
    cpu = statistics.fmean(input_cpu_ms(r.io) / (alone or {}).get(r.world_size, 1.0) for r in own)
    if len({r.world_size for r in own}) < 2:
        return statistics.fmean(input_wait_ms(r.io) for r in own), 0.0, cpu
    u, v = _relative_nnls([[1.0] * len(own), [r.world_size - 1.0 for r in own]],
                          [max(input_wait_ms(r.io), 1e-6) for r in own])
    return u, v, cpu


def _relative_nnls(columns: Sequence[Sequence[float]], y: Sequence[float]) -> tuple[float, ...]:
    """Non-negative coefficients of y ~ sum(coef x column), minimising the relative error (as MAPE does)."""
    target = np.asarray(y, dtype=float)
    design = np.asarray(columns, dtype=float).T / target[:, None]
    return tuple(float(x) for x in nnls(design, np.ones_like(target))[0])


def _busy(model: HostScaling, p: int) -> float:
    """Predicted CPU time of one rank's step (compute + communication) on p ranks."""
    parts = model.predict(p)
    return parts.compute_ms + parts.comm_cpu_ms


def measured_parts(run: WorldRun, model: HostScaling) -> StepParts:
    """A measured world split as the model splits a prediction: CPU times measured; the off-CPU rest is core
    sharing beyond the cores, else the model's idle time and then waiting for peers."""
    compute, comm = model_cpu_ms(run), run.cpu_ms["cpu_other_ms"]
    p = run.world_size
    data = input_cpu_ms(run.io) if p > model.cores else input_wait_ms(run.io)
    data = min(data, max(run.step_ms - compute - comm, 0.0))
    off_cpu = max(run.step_ms - compute - comm - data, 0.0)
    contention = off_cpu if p > model.cores else 0.0
    idle = 0.0 if p > model.cores else (off_cpu if p == 1 else min(model.idle_ms, off_cpu))
    wait = off_cpu - contention - idle
    by_kind = {k: s * (comm + wait) for k, s in model.traffic.shares(p).items()} if p > 1 else {}
    return StepParts(p, run.step_ms, compute, comm, wait, contention, by_kind, idle, data)


def bottleneck(parts: Sequence[StepParts], cores: int, input_hint: str = "raise num_workers, or pre-tokenise") -> str:
    """One sentence naming what bounds the step, from the smallest world where it is not computation;
    `input_hint` says what to change when it is the input pipeline."""
    ordered = sorted(parts, key=lambda s: s.world_size)
    for s in ordered:
        pieces = {"compute": s.compute_ms, "communication": s.comm_ms, "contention": s.contention_ms,
                  "idle": s.idle_ms, "input": s.input_ms}
        name = max(pieces, key=lambda n: pieces[n])
        share = pieces[name] / s.total_ms if s.total_ms else 0.0
        at = ranks(s.world_size)
        if name == "communication":
            kind, ms = max(s.comm_by_kind_ms.items(), key=lambda kv: kv[1])
            return (f"communication-bound from {at}: the {LABELS.get(kind, kind)} is {100 * ms / s.total_ms:.0f}% "
                    f"of the step ({100 * share:.0f}% communication in all).")
        if name == "contention":
            return (f"core-bound from {at}: {s.world_size} ranks share {cores} cores and waiting for a core is "
                    f"{100 * share:.0f}% of the step (communication {100 * s.comm_ms / s.total_ms:.0f}%, "
                    f"computation {100 * s.compute_ms / s.total_ms:.0f}%).")
        if name == "input":
            return (f"input-bound from {at}: ranks wait {100 * share:.0f}% of the step for data: {input_hint} "
                    f"(computation {100 * s.compute_ms / s.total_ms:.0f}%).")
        if name == "idle":
            return (f"bound by time off the CPU from {at}: the ranks wait {100 * share:.0f}% of the step for the CPU "
                    "or I/O with no peer to wait for (other processes on this machine?).")
    last = ordered[-1]
    return (f"compute-bound up to {ranks(last.world_size)}: computation is "
            f"{100 * last.compute_ms / last.total_ms:.0f}% of the step at {ranks(last.world_size)}.")
