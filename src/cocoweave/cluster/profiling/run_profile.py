"""The profile of a user's training run: what `cocoweave profile` measured, the scaling model fitted on it,
its predictions (validated where a predicted size was also measured), and the planner's view of it.

The JSON document (`RunProfile.to_json`) holds the measurements and, derived from them, the fitted model,
the bottleneck sentence, the predictions and the MODELLED steps on catalog machines; `plan --profile`
reads the measurements back and derives the rest again.
"""

from __future__ import annotations

import math
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from cocoweave.cluster.catalog import Catalog
from cocoweave.cluster.planning.step_times import ProfilePoint, WorkloadProfile
from cocoweave.cluster.profiling.hardware_model import ModelledStep, WorkCounts, modelled_step
from cocoweave.cluster.profiling.host_scaling import (
    HostScaling,
    StepParts,
    Traffic,
    bottleneck,
    fit_host_scaling,
    measured_parts,
)
from cocoweave.cluster.profiling.io_summary import input_hint, measured_checkpoint
from cocoweave.cluster.profiling.worlds import WorldRun
from cocoweave.errors import PlanningError

KIND = "cocoweave-run-profile"
VERSION = 1
DEFAULT_TRAIN_STEPS = 100_000
BUSY = 0.25  # other processes using more than this share of the cores make a measurement unreliable
ADAM_STATE_PER_PARAM_BYTE = 2.0  # Adam's two moments, when the optimizer's state is not visible
MODELLED = ("MODELLED, not measured: compute from per-operation rooflines of the catalog GPU's spec sheet, "
            "communication from the alpha-beta model of its links, no overlap")


@dataclass(frozen=True)
class Prediction:
    """The predicted step on p ranks of this host, and the measured one when that world was measured too."""

    world_size: int
    parts: StepParts
    measured_ms: float | None

    @property
    def predicted_ms(self) -> float:
        return self.parts.total_ms

    @property
    def error_pct(self) -> float | None:
        if self.measured_ms is None:
            return None
        return 100.0 * (self.predicted_ms - self.measured_ms) / self.measured_ms

    def to_json(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "predicted_ms": self.predicted_ms, "measured_ms": self.measured_ms,
                "error_pct": self.error_pct, "parts": asdict(self.parts)}


@dataclass
class RunProfile:
    """Measured worlds of one script (`fit_world_sizes` fit the model; any others validate it)."""

    script: str
    script_args: list[str]
    fit_world_sizes: list[int]
    runs: list[WorldRun]
    host: dict[str, Any]
    train_steps: int = DEFAULT_TRAIN_STEPS
    command: str = ""
    core_sharing: dict[int, float] = field(default_factory=dict)  # measured eta per size beyond the cores
    _model: HostScaling | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.script.rsplit("/", 1)[-1].removesuffix(".py")

    def run(self, p: int) -> WorldRun | None:
        return next((r for r in self.runs if r.world_size == p), None)

    @property
    def model(self) -> HostScaling:
        if self._model is None:
            fit = [r for r in self.runs if r.world_size in self.fit_world_sizes]
            self._model = fit_host_scaling(fit, int(self.host["cores"]), self.core_sharing)
        return self._model

    def predict(self, sizes: Sequence[int]) -> list[Prediction]:
        out = []
        for p in sizes:
            run = self.run(p)
            out.append(Prediction(p, self.model.predict(p), None if run is None else run.step_ms))
        return out

    def bottleneck(self, sizes: Sequence[int] = ()) -> str:
        """The sentence naming the bottleneck over the fitted worlds and `sizes`."""
        worlds = sorted(set(self.fit_world_sizes) | set(sizes))
        parts = [measured_parts(r, self.model) if p in self.fit_world_sizes and (r := self.run(p)) else
                 self.model.predict(p) for p in worlds]
        return bottleneck(parts, self.model.cores, input_hint(min(self.runs, key=lambda r: r.world_size).io))

    def busy_warning(self) -> str | None:
        """A sentence when other processes used more than BUSY of the cores during a measured world."""
        busy = [r for r in self.runs if r.other_load is not None and r.other_load > BUSY]
        if not busy:
            return None
        worst = max(r.other_load for r in busy)
        return (f"other processes used up to {100 * worst:.0f}% of the cores while measuring "
                f"({', '.join(str(r.world_size) for r in busy)} ranks): step times on a busy machine do not repeat; "
                "profile again when it is quiet before trusting the fit or the check.")

    @staticmethod
    def validation_mape(predictions: Sequence[Prediction]) -> float | None:
        errors = [abs(p.error_pct) for p in predictions if p.error_pct is not None]
        return sum(errors) / len(errors) if errors else None

    # -- the planner's view ---------------------------------------------------------------------
    def checkpoint_bytes(self) -> tuple[float, str]:
        """Bytes of one checkpoint (parameters + optimizer state, from the smallest world) and how they were got."""
        run = min(self.runs, key=lambda r: r.world_size)
        if run.state_bytes > 0:
            return run.param_bytes + run.state_bytes, "parameters + optimizer state as measured"
        state = ADAM_STATE_PER_PARAM_BYTE * run.param_bytes
        return run.param_bytes + state, (f"parameters + optimizer state assumed 2x parameters ({run.optimizer} "
                                         "keeps its state out of optimizer.state)")

    def measure_core_sharing(self, sizes: Sequence[int], up_to: int) -> dict[int, float]:
        """Measure eta (`core_sharing.sharing_factor`) at each of `sizes` beyond the cores and up to `up_to` ranks
        when no fitted world shared the cores; refits the model with them. Returns what was measured."""
        from cocoweave.cluster.profiling.core_sharing import CoreSharingError, sharing_factor, step_spread

        cores = int(self.host["cores"])
        if any(p > cores for p in self.fit_world_sizes):
            return {}
        model = self.model
        spread = step_spread(min(self.runs, key=lambda r: r.world_size).steps_ms)  # how unequal a rank's steps are
        measured = {}
        for p in sorted(set(sizes)):
            if cores < p <= up_to:
                try:
                    measured[p] = sharing_factor(p, cores, model.busy_ms(p), spread, round(model.traffic.hops(p)),
                                                 timeout_s=max(10.0, 0.05 * p * model.busy_ms(p)))
                except CoreSharingError:  # the fitted eta (1) stands; the profile still says what it measured
                    continue
        self.core_sharing, self._model = {**self.core_sharing, **measured}, None
        return measured

    def checkpoint_measured(self) -> tuple[float, float, str] | None:
        """(seconds, bytes, operation) of one checkpoint as the script took it in the smallest world that saved
        one (the slowest rank's mean save), or None when the profiled steps saved nothing."""
        for run in sorted(self.runs, key=lambda r: r.world_size):
            if (found := measured_checkpoint(run.io)) is not None:
                return found
        return None

    def io_report(self, predictions: Sequence[Prediction]) -> dict[str, Any]:
        """The I/O figures of the document: per measured world the input pipeline (wait, its share of the step,
        bytes read, loaders), checkpoints and transfers; the fitted input term and its predicted share."""
        worlds = []
        for run in sorted(self.runs, key=lambda r: r.world_size):
            io = run.io
            wait = float(io.get("data_wait_ms", 0.0))
            worlds.append({"world_size": run.world_size, "data_wait_ms": wait,
                           "data_share_pct": 100 * wait / run.step_ms if run.step_ms else 0.0,
                           **{k: io.get(k) for k in ("data_cpu_ms", "worker_cpu_ms", "batches", "read_bytes",
                                                     "rchar", "worker_read_bytes", "worker_rchar", "loaders",
                                                     "checkpoints", "transfers")}})
        m = self.model
        ckpt = self.checkpoint_measured()
        return {"worlds": worlds,
                "input_model": {"wait_ms": m.input_ms, "wait_ms_per_extra_rank": m.input_ms_per_rank,
                                "cpu_ms": m.input_cpu_ms},
                "predicted_input": [{"world_size": p.world_size, "input_ms": p.parts.input_ms,
                                     "share_pct": 100 * p.parts.input_ms / p.predicted_ms if p.predicted_ms else 0.0}
                                    for p in predictions],
                "checkpoint": None if ckpt is None else {"seconds": ckpt[0], "bytes": ckpt[1], "operation": ckpt[2],
                                                         "mb_per_s": ckpt[1] / 1e6 / ckpt[0] if ckpt[0] else 0.0}}

    def modelled(self, catalog: Catalog, sizes: Sequence[int]) -> list[ModelledStep]:
        """MODELLED steps on every catalog machine that can be modelled, at each size."""
        work, traffic = self._work_traffic()
        return [modelled_step(work, traffic, m, p, catalog) for m in catalog.machines if catalog.modellable(m)
                for p in sizes]

    def _work_traffic(self) -> tuple[WorkCounts, Traffic]:
        multi = [r for r in self.runs if r.world_size > 1 and r.world_size in self.fit_world_sizes]
        if not multi:
            raise PlanningError("the profile has no measured world of 2+ ranks; its communication is unknown.")
        return WorkCounts.from_runs([r for r in self.runs if r.world_size in self.fit_world_sizes]), \
            Traffic.of(max(multi, key=lambda r: r.world_size))

    def global_work(self, p: int) -> float:
        """FLOPs of one step of the whole world of p ranks, relative to the smallest fitted world's."""
        model = self.model
        p0 = min(self.fit_world_sizes)
        return p * model.work_share(p) / (p0 * model.work_share(p0))

    def workload(self, catalog: Catalog, workers: Sequence[int], checkpoint_s: float) -> WorkloadProfile:
        """The planner's profile: MODELLED seconds per step on each catalog machine and worker count, in steps
        of the smallest profiled world (a world doing k times its work per step needs 1/k as many steps)."""
        work, traffic = self._work_traffic()
        need_bytes, _ = self.checkpoint_bytes()
        need_bytes += min(self.runs, key=lambda r: r.world_size).param_bytes  # gradients
        points, skipped = [], []
        input_ms = self.model.input_wait(1)  # the input pipeline runs on the host's CPU, not on the GPU
        for machine in catalog.machines:
            if not catalog.modellable(machine):
                continue
            if need_bytes > catalog.gpus[machine.gpu].memory_gb * 1e9:
                skipped.append(machine.name)
                continue
            for w in workers:
                step = modelled_step(work, traffic, machine, w, catalog)
                points.append(ProfilePoint(machine.gpu, 0, w, (step.total_ms + input_ms) / 1e3 / self.global_work(w),
                                           machine=machine.name))
        if not points:
            raise PlanningError(f"no machine of the catalog {catalog.source} can be modelled for {self.name}: it "
                                "needs 'gpus' figures and networks for its machines.")
        p0 = min(self.fit_world_sizes)
        notes = [f"{self.name}: {MODELLED}.",
                 f"steps are steps of the profiled run on {p0} rank{'s' * (p0 > 1)}; a world doing more work per step "
                 "is counted as proportionally more of them."]
        if input_ms > 0:
            notes.append(f"each MODELLED step adds the input pipeline's wait as measured on this host, "
                         f"{input_ms:.1f} ms per step (a rank alone): it runs on the host CPU, not the GPU.")
        if skipped:
            notes.append(f"left out (parameters, gradients and state exceed the GPU's memory): {', '.join(skipped)}.")
        return WorkloadProfile(self.name, checkpoint_s, tuple(points), tuple(notes), modelled=True)

    # -- JSON -------------------------------------------------------------------------------------
    def to_json(self, predict_sizes: Sequence[int] = (), catalog: Catalog | None = None) -> dict[str, Any]:
        """The document: measurements, and what is derived from them for `predict_sizes`."""
        predictions = self.predict(predict_sizes)
        doc: dict[str, Any] = {
            "kind": KIND, "version": VERSION, "script": self.script, "script_args": list(self.script_args),
            "command": self.command, "host": self.host, "train_steps": self.train_steps,
            "fit_world_sizes": list(self.fit_world_sizes), "runs": [r.to_json() for r in self.runs],
            "core_sharing": {str(p): f for p, f in sorted(self.core_sharing.items())},
            "model": self.model.to_json(), "bottleneck": self.bottleneck(predict_sizes),
            "predictions": [p.to_json() for p in predictions],
            "validation_mape_pct": self.validation_mape(predictions), "warning": self.busy_warning(),
            "io": self.io_report(predictions),
        }
        if catalog is not None and predict_sizes:
            try:
                doc["modelled"] = {"note": MODELLED, "steps": [asdict(s) | {"total_ms": s.total_ms}
                                                               for s in self.modelled(catalog, predict_sizes)]}
            except PlanningError as exc:
                doc["modelled"] = {"note": str(exc), "steps": []}
        return doc

    @classmethod
    def from_json(cls, doc: Any, source: str) -> RunProfile:
        """Read a document written by `to_json`; PlanningError naming `source` if it is not one."""
        if not isinstance(doc, dict) or doc.get("kind") != KIND:
            raise PlanningError(f"{source} is not a profile written by `cocoweave profile` (no kind: {KIND}).")
        if doc.get("version") != VERSION:
            raise PlanningError(f"{source} is a version {doc.get('version')} profile; this cocoweave reads "
                                f"version {VERSION}: profile the run again.")
        try:
            runs = [WorldRun.from_json(r) for r in doc["runs"]]
            steps = int(doc.get("train_steps", DEFAULT_TRAIN_STEPS))
            return cls(str(doc["script"]), [str(a) for a in doc.get("script_args", [])],
                       [int(p) for p in doc["fit_world_sizes"]], runs, dict(doc["host"]), steps,
                       str(doc.get("command", "")),
                       {int(p): float(f) for p, f in (doc.get("core_sharing") or {}).items()})
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanningError(f"{source} is not a valid run profile: {type(exc).__name__}: {exc}.") from None


def host_info(cores: int, threads: int) -> dict[str, Any]:
    """What the measurements depend on: cores, threads per rank, CPU, Python and torch versions."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cores": cores, "threads_per_rank": threads, "cpu": cpu, "python": platform.python_version(),
            "torch": torch.__version__, "hostname": platform.node()}


def worker_counts(max_workers: int) -> list[int]:
    """1, 2, 4, ... up to `max_workers` (and `max_workers` itself)."""
    out = [2 ** i for i in range(int(math.log2(max_workers)) + 1)]
    return sorted(set(out) | {max_workers})
