"""Analytic cost model: a schedule's step time from its Plan.

Each collective costs alpha + beta x bytes moved per rank (by operation and algorithm, as the table of collective
algorithms says and collectives/pricing.py reads it: the bytes a rank moves, and a line fitted on another algorithm's
calls carried to this one's message steps), each computation op costs a launch overhead + bytes / bandwidth (a
roofline on memory traffic), a matmul an overhead + flops / rate; a chunked (overlapped) chain runs as a pipeline:
every part's per-chunk time, plus (chunks - 1) x the slowest part, plus a per-chunk overhead. The constants come
from `perf calibrate` (`Calibration`); `fit_alpha_beta` fits them from microbenchmarks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import collectives, settings
from ..collectives import pricing
from ..errors import CocoweaveError
from ..ir import registry as R
from ..ir.graph import Value
from ..ir.layout import largest_position, part_shape
from ..ir.types import DTYPES, bind_shape
from ..plan import P2P, Collective, Compute, FusedCollective, MatMul, Overlap, Plan, Stage
from ..schedule import rows
from ..schedule.stages import RowChunks
from ..storage.atomic import write_text
from ..storage.statedir import state_dir

COLLECTIVE_OPS = R.names(R.COLLECTIVE)
COMM_OPS = R.names(R.COLLECTIVE, R.P2P)
MATMUL_OPS = R.names(R.MATMUL)
FREE_OPS = ("update",)  # aliases: the write happens in the end-of-step state copy
CALIBRATION_ENV = settings.CALIBRATION_DIR.name


@dataclass(frozen=True)
class AlphaBeta:
    """time_ms = alpha_ms + beta_ms_per_mb x megabytes (1 MB = 1e6 bytes)."""

    alpha_ms: float
    beta_ms_per_mb: float

    def __call__(self, nbytes: float) -> float:
        return self.alpha_ms + self.beta_ms_per_mb * nbytes / 1e6


@dataclass
class Calibration:
    """Fitted constants of the analytic model for one (backend, device, world size)."""

    backend: str
    device: str
    world_size: int
    collectives: dict[str, AlphaBeta]  # "all_reduce/library", "reduce_scatter/ring", "p2p/library", ...
    kernels: dict[str, AlphaBeta]  # dtype -> launch + ms per MB of memory traffic
    matmuls: dict[str, AlphaBeta]  # dtype -> overhead + ms per 1e6 flop (the "MB" unit counts flops here)
    chunk_overhead_ms: float = 0.05
    fused_kernels: bool = False  # whether fused stages run as one generated kernel (Triton on CUDA)
    meta: dict[str, Any] = field(default_factory=dict)

    def collective(self, op: str, algorithm: str) -> AlphaBeta:
        """The fitted line of `op` with `algorithm`, falling back to the lines of the algorithm the table prices it
        as (the library's), then all_reduce's; UnknownAlgorithmError for an algorithm the table does not know."""
        return self._line(op, algorithm)[1]

    def collective_at(self, op: str, algorithm: str, p: int) -> AlphaBeta:
        """`collective`'s line for `op` on `algorithm` at p ranks: a line of `op` fitted on the calls of the
        algorithm it is priced as, its per-call latency carried to this algorithm's message steps."""
        fitted_on, line = self._line(op, algorithm)
        if fitted_on is None or fitted_on == algorithm:
            return line
        return AlphaBeta(line.alpha_ms * pricing.latency_scale(op, p, algorithm, fitted_on), line.beta_ms_per_mb)

    def _line(self, op: str, algorithm: str) -> tuple[str | None, AlphaBeta]:
        """(the algorithm whose `op` calls the line was fitted on, or None for another operation's line; the line)."""
        priced_as = collectives.get(algorithm).priced_as
        for o in (op, "all_reduce"):
            for a in (algorithm, priced_as):
                if a is not None and f"{o}/{a}" in self.collectives:
                    return (a if o == op else None), self.collectives[f"{o}/{a}"]
        return None, AlphaBeta(0.0, 0.0)

    def kernel(self, dtype: str) -> AlphaBeta:
        """The memory-traffic line of computation in `dtype` (float32's if that dtype was not calibrated)."""
        return self.kernels.get(dtype) or self.kernels.get("float32") or AlphaBeta(0.01, 0.0)

    def matmul(self, dtype: str) -> AlphaBeta:
        """The flops line of matmuls in `dtype` (float32's if that dtype was not calibrated)."""
        return self.matmuls.get(dtype) or self.matmuls.get("float32") or AlphaBeta(0.01, 0.0)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (`from_json` reads it back)."""
        return asdict(self)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], where: str = "calibration") -> Calibration:
        """Read `to_json`'s dict; CocoweaveError naming `where` if it is not one."""
        try:
            lines = {k: {n: AlphaBeta(**v) for n, v in doc[k].items()} for k in ("collectives", "kernels", "matmuls")}
            return cls(backend=str(doc["backend"]), device=str(doc["device"]), world_size=int(doc["world_size"]),
                       chunk_overhead_ms=float(doc.get("chunk_overhead_ms", 0.05)),
                       fused_kernels=bool(doc.get("fused_kernels", False)), meta=dict(doc.get("meta", {})), **lines)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CocoweaveError(f"{where} is not a valid calibration file: {type(exc).__name__}: {exc}") from None


def calibration_dir() -> Path:
    """$COCOWEAVE_CALIBRATION_DIR if set, else .cocoweave/ under the current directory."""
    return settings.CALIBRATION_DIR.get() or state_dir()


def calibration_path(backend: str, device: str, world_size: int, folder: Path | None = None) -> Path:
    """Where the calibration of (backend, device type, world size) lives."""
    return (folder or calibration_dir()) / f"calibration-{backend}-{device}-w{world_size}.json"


def save_calibration(cal: Calibration, path: Path) -> Path:
    """Write `cal` as JSON atomically (temporary file + rename)."""
    try:
        write_text(path, json.dumps(cal.to_json(), indent=2, sort_keys=True) + "\n")
    except OSError as exc:
        raise CocoweaveError(f"cannot write the calibration {path}: {exc.strerror or exc}.") from None
    return path


def load_calibration(backend: str, device: str, world_size: int, folder: Path | None = None) -> Calibration | None:
    """The stored calibration for (backend, device, world size), or None if there is none."""
    path = calibration_path(backend, device, world_size, folder)
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CocoweaveError(f"calibration file {path} is unreadable: {exc}") from None
    return Calibration.from_json(doc, str(path))


# ----------------------------------------------------------------------------------------------------------
# Fitting
# ----------------------------------------------------------------------------------------------------------


def fit_alpha_beta(x: Sequence[float], t_ms: Sequence[float]) -> AlphaBeta:
    """Non-negative alpha, beta minimising the relative error of alpha + beta x x / 1e6 against `t_ms`."""
    from scipy.optimize import nnls

    xs, ts = np.asarray(x, dtype=float), np.asarray(t_ms, dtype=float)
    if xs.shape != ts.shape or xs.size < 2 or not np.all(ts > 0):
        raise CocoweaveError(f"fitting alpha and beta needs >= 2 positive timings of equal count, got {ts.size}.")
    a = np.stack([np.ones_like(xs), xs / 1e6], axis=1) / ts[:, None]
    (alpha, beta), _ = nnls(a, np.ones_like(ts))
    return AlphaBeta(float(alpha), float(beta))


# ----------------------------------------------------------------------------------------------------------
# Terms of a plan
# ----------------------------------------------------------------------------------------------------------


def _itemsize(dtype: str) -> int:
    return DTYPES[dtype].itemsize


def largest_part(v: Value, sizes: Mapping[str, int], world_size: int) -> tuple[int, ...]:
    """The shape of the largest per-rank part of `v` (the whole tensor unless it is sliced; on a mesh, nested
    parts at their largest along every axis; uneven shares at the largest share)."""
    full = bind_shape(v.shape, sizes)
    if v.group is None or not v.layout.is_sliced:
        return tuple(full)
    mesh = v.group.mesh
    shape = mesh.shape if mesh is not None else (v.group.size(world_size),)
    return part_shape(v.layout, full, largest_position(v.layout, full, shape))


def local_bytes(v: Value, sizes: Mapping[str, int], world_size: int) -> int:
    """Bytes of the largest per-rank part of `v` (the whole tensor unless it is sliced)."""
    if v.is_scalar:
        return 0
    return math.prod(largest_part(v, sizes, world_size)) * _itemsize(v.dtype)


@dataclass
class Term:
    """One priced piece of a stage: a collective, a computation op, a matmul."""

    kind: str  # "comm", "kernel", "matmul"
    key: str  # "all_reduce/library", dtype
    amount: float  # bytes moved, bytes of memory traffic, or flops
    count: int = 1  # launches (ops) this term stands for
    ranks: int = 0  # a collective's group size (its message steps depend on it)


def _comm_term(v: Value, algorithm: str, sizes: Mapping[str, int], world_size: int, backend_wire: str) -> Term:
    src = v.args[0]
    if v.op == "send":
        return Term("comm", "p2p/library", local_bytes(src, sizes, world_size))
    p = v.group.axis_size(world_size, v.attrs.get("axis")) if v.group is not None else world_size
    whole = local_bytes(src if v.op != "all_gather" else v, sizes, world_size)
    if backend_wire == "gloo" and v.dtype in ("float16", "bfloat16"):
        whole *= 2  # Gloo reduces half types in float32
    moved = pricing.moved(v.op, p, algorithm)
    return Term("comm", f"{v.op}/{algorithm}", whole * moved if p > 1 else 0.0, 1 if p > 1 else 0, p)


def _kernel_terms(values: Sequence[Value], sizes: Mapping[str, int], world_size: int, fused: bool,
                  outside_users: set[int]) -> list[Term]:
    ops = [v for v in values if v.op not in FREE_OPS and not v.is_scalar]
    if not ops:
        return []
    dtype = ops[-1].dtype
    if fused:
        inside = {id(v) for v in values}
        reads = {id(a): a for v in ops for a in v.args if id(a) not in inside and not a.is_scalar}
        writes = [v for v in ops if id(v) in outside_users]
        traffic = sum(local_bytes(a, sizes, world_size) for a in reads.values())
        traffic += sum(local_bytes(v, sizes, world_size) for v in writes or ops[-1:])
        return [Term("kernel", dtype, traffic, 1)]
    traffic = sum(local_bytes(v, sizes, world_size) + sum(local_bytes(a, sizes, world_size) for a in v.args)
                  for v in ops)
    return [Term("kernel", dtype, traffic, len(ops))]


def _matmul_term(v: Value, sizes: Mapping[str, int], world_size: int) -> Term:
    """2 x the result's elements x the inner dimension (a grouped_matmul_wgrad's: 2 x its rows x K x N); a
    grouped_matmul's at its capacity (every row in a segment: sum(counts) x K x N x 2 at run time is at most this;
    the counts are unknown statically)."""
    if v.op == "grouped_matmul_wgrad":  # [G, K, N] from rows [M, K] and [M, N]: 2 M K N, the rows contracted
        (m, k_dim), n = largest_part(v.args[0], sizes, world_size), largest_part(v.args[1], sizes, world_size)[-1]
        return Term("matmul", v.dtype, 2.0 * m * k_dim * n)
    out = local_bytes(v, sizes, world_size) // _itemsize(v.dtype)
    k_dim = largest_part(v.args[0], sizes, world_size)[-1]  # the inner dimension of this rank's part
    return Term("matmul", v.dtype, 2.0 * out * k_dim)


class PlanCoster:
    """Prices the stages of one plan for one world size under a calibration."""

    def __init__(self, plan: Plan, sizes: Mapping[str, int], world_size: int, cal: Calibration) -> None:
        self.plan, self.sizes, self.world_size, self.cal = plan, dict(sizes), world_size, cal
        self.wire = "gloo" if cal.device == "cpu" or cal.meta.get("wire") == "gloo" else "nccl"

    def terms(self, stage: Stage, fused_override: bool | None = None) -> list[Term]:
        """The priced pieces of a (non-chunked) stage."""
        sz, w = self.sizes, self.world_size
        if isinstance(stage, FusedCollective):
            out = [_comm_term(stage.reduce_scatter, stage.algorithm, sz, w, self.wire)]
            if stage.kernel is not None:
                out += self.terms(stage.kernel)
            out += [_comm_term(ag, stage.algorithm, sz, w, self.wire) for ag in stage.all_gathers]
            return out
        if isinstance(stage, Collective):
            return [_comm_term(v, stage.algorithm, sz, w, self.wire) for v in stage.values if v.op in COMM_OPS]
        if isinstance(stage, P2P):
            return [_comm_term(v, "library", sz, w, self.wire) for v in stage.values if v.op == "send"]
        if isinstance(stage, MatMul):
            return [_matmul_term(v, sz, w) for v in stage.values if v.op in MATMUL_OPS]
        if isinstance(stage, Compute):
            fused = (stage.fused and self.cal.fused_kernels) if fused_override is None else fused_override
            return _kernel_terms(stage.values, sz, w, fused, {id(v) for v in stage.live_outs})
        return []

    def price(self, term: Term, chunks: int = 1) -> float:
        """Milliseconds of one term, run as one of `chunks` equal chunks."""
        if term.count == 0:
            return 0.0
        if term.kind == "comm":
            line = self.cal.collective_at(*term.key.split("/"), term.ranks)
        elif term.kind == "kernel":
            line = self.cal.kernel(term.key)
        else:
            line = self.cal.matmul(term.key)
        return term.count * line.alpha_ms + line.beta_ms_per_mb * term.amount / chunks / 1e6

    def stage_ms(self, stage: Stage) -> float:
        """Predicted milliseconds of one top-level stage."""
        if isinstance(stage, Overlap):  # the plan runs a fused collective among its parts as RS, C and AGs
            k = max(stage.chunks, 1)
            per_chunk = [sum(self.price(t, k) for t in self.terms(s)) for s in stage.parts]
            copies = sum(self.price(t) for t in self._row_copies(stage)) if isinstance(stage, RowChunks) else 0.0
            if not collectives.get(getattr(stage, "algorithm", collectives.DEFAULT)).overlaps:
                return k * sum(per_chunk) + k * self.cal.chunk_overhead_ms + copies  # each exchange waited for
            return sum(per_chunk) + (k - 1) * max(per_chunk, default=0.0) + k * self.cal.chunk_overhead_ms + copies
        return sum(self.price(t) for t in self.terms(stage))

    def _row_copies(self, stage: RowChunks) -> list[Term]:
        """What row-set chunks copy that the chain as written does not: each chunk's rows of the tensors from
        outside gathered, and its results put back into the whole tensors read after the chain (read and written
        once each, one op per chunk), a weight gradient's partial sums added (schedule/rows.py)."""
        facts = rows.of_stage(stage)
        inside, k = {id(v) for v in stage.values}, stage.chunks
        outside = {id(a): a for v in stage.values for a in v.args if id(a) not in inside and id(a) in facts.space}
        moved = [*outside.values(), *stage.live_outs]
        return [Term("kernel", v.dtype, (2 if facts.space.get(id(v)) is not rows.ACCUMULATED else k)
                     * local_bytes(v, self.sizes, self.world_size), k) for v in moved]


@dataclass
class Prediction:
    """An analytic step-time prediction with its per-stage breakdown and the features the learned
    correction uses."""

    total_ms: float
    stage_ms: dict[str, float]
    features: dict[str, float]


FEATURES = ("analytic_ms", "comm_ms", "kernel_ms", "matmul_ms", "state_ms", "overlap_saved_ms", "n_stages",
            "n_comm", "n_kernel_ops", "chunks", "world_size", "comm_mb", "traffic_mb", "gflop")


def predict_plan(plan: Plan, sizes: Mapping[str, int], world_size: int, cal: Calibration) -> Prediction:
    """Predicted step time of `plan` on `world_size` ranks (the slowest rank: sliced parts at their largest)."""
    coster = PlanCoster(plan, sizes, world_size, cal)
    stage_ms: dict[str, float] = {}
    totals = dict.fromkeys(("comm_ms", "kernel_ms", "matmul_ms"), 0.0)
    amounts = {"comm": 0.0, "kernel": 0.0, "matmul": 0.0}
    counts = {"comm": 0, "kernel": 0, "matmul": 0}
    serial, chunks = 0.0, 0
    for i, stage in enumerate(plan.stages):
        ms = coster.stage_ms(stage)
        stage_ms[f"{i}:{stage.label}"] = ms
        inner = stage.parts if isinstance(stage, Overlap) else [stage]
        for s in inner:
            for t in coster.terms(s):
                totals[f"{t.kind}_ms"] += coster.price(t)
                amounts[t.kind] += t.amount
                counts[t.kind] += t.count
        if isinstance(stage, Overlap):
            chunks = max(chunks, stage.chunks)
            serial += sum(coster.price(t) for s in inner for t in coster.terms(s))
        else:
            serial += ms
    state_bytes = sum(2 * local_bytes(v, sizes, world_size) for v in plan.state.values())
    state_ms = coster.price(Term("kernel", "float32", state_bytes, len(plan.state))) if plan.state else 0.0
    total = sum(stage_ms.values()) + state_ms
    features = {"analytic_ms": total, **totals, "state_ms": state_ms,
                "overlap_saved_ms": max(serial + state_ms - total, 0.0), "n_stages": float(len(plan.stages)),
                "n_comm": float(counts["comm"]), "n_kernel_ops": float(counts["kernel"]), "chunks": float(chunks),
                "world_size": float(world_size), "comm_mb": amounts["comm"] / 1e6,
                "traffic_mb": amounts["kernel"] / 1e6, "gflop": amounts["matmul"] / 1e9}
    return Prediction(total, stage_ms, features)
