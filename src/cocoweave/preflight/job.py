"""What a pre-flight check needs to know of a pipeline job, without its tensors: the mesh (dp x pp x tp), the
schedule (a name `Pipeline` takes, or a user-written one in torch's action form), the micro-batches, the stage
split and the activation crossing each boundary, plus the parameter counts and the device capacity the memory
check uses. `job_of(pipeline, ...)` reads one from a built `Pipeline`; `cocoweave preflight FILE.py:FUNC` takes
one a function returns."""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..collectives import pricing
from ..collectives.pricing import Link
from ..errors import ParallelConfigError
from .optimizer import bucket_collectives

DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


@dataclass
class PipelineJob:
    """A dp x pp x tp pipeline job as `cocoweave.nn.Pipeline` runs it.

    `schedule` is a name (gpipe, 1f1b, interleaved1f1b, loopedbfs) or a user-written schedule: per pipeline rank a
    list of torch action strings ('0F0', '1B3', '0SEND_F1', ...), as rows of torch's CSV form; `schedule_format` is
    then "compute_only" (torch adds the sends and receives) or "compute_comms" (they are written out). `batch` is
    the samples one replica runs per step, `seq` x `d_model` one sample's activation. `stage_split` (blocks per
    stage) defaults to Pipeline's balanced split. `block_params` is one block's parameters on one tp rank;
    `first_params` / `last_params` the input and output modules'; `stage_params` (global stage -> parameters on
    one rank) overrides them. `device_memory` is the capacity in bytes the memory check holds the step against.
    `optimizer_steps` (pipeline rank -> (kind, elements, dtype) of each data-parallel collective of one optimizer
    step, as `optimizer.bucket_collectives` reads them) adds the optimizer's step after the pipeline's.
    `layer_schedule` is the schedule of the blocks' tensor-parallel layers (TransformerBlock's `schedule`: "auto",
    a schedule's name, or None for the hand-written path) and `dropout` their dropout: the buffers their compiled
    programs keep count in each rank's memory (preflight.programs). `stage_costs` (stage -> (forward, backward) of
    one micro-batch) replace the unit costs (a block's forward 1, a backward 2); with `link` as well (the link the
    pipeline's sends cross, collectives.pricing.Link) they are seconds and each message a rank receives costs it
    `receive_cost` after it has arrived (Gloo's CPU receives: docs/preflight.md)."""

    pp: int
    microbatches: int
    n_blocks: int
    batch: int
    seq: int
    d_model: int
    tp: int = 1
    dp: int = 1
    schedule: str | Mapping[int, Sequence[str]] = "1f1b"
    schedule_format: str = "compute_only"
    dtype: str = "float32"
    sliced: bool = True
    sequence_parallel: bool = False
    stage_split: Sequence[int] | None = None
    heads: int = 1
    d_ff: int | None = None
    vocab: int = 0
    block_params: int = 0
    first_params: int = 0
    last_params: int = 0
    stage_params: Mapping[int, int] | None = None
    optimizer: str | None = "distributed_adamw"
    dropout: float = 0.0
    layer_schedule: str | None = "auto"
    fused_attention: bool = True  # cocoweave's blocks call scaled_dot_product_attention: no seq x seq scores kept
    optimizer_steps: Mapping[int, Sequence[tuple[str, int, str]]] | None = None
    device_memory: float | None = None
    stage_costs: Mapping[int, tuple[float, float]] | None = None
    link: Link | None = None
    name: str = "job"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def value_bytes(self) -> int:
        if self.dtype not in DTYPE_BYTES:
            raise ParallelConfigError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        return DTYPE_BYTES[self.dtype]

    def check_sizes(self) -> None:
        """One sentence on the first size that cannot describe a job."""
        for name in ("pp", "microbatches", "n_blocks", "batch", "seq", "d_model", "tp", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ParallelConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.batch % self.microbatches:
            raise ParallelConfigError(f"a batch of {self.batch} samples cannot be split into {self.microbatches} "
                                      "equal micro-batches")
        self.value_bytes  # noqa: B018 - checks the dtype
        if self.link is not None and self.stage_costs is None:
            raise ParallelConfigError("a link prices each receive in seconds: state the stages' costs in seconds too "
                                      "(stage_costs), or leave the link out for the unit-cost bubble")

    @property
    def micro_batch(self) -> int:
        return self.batch // self.microbatches

    def activation_numel(self) -> int:
        """Elements of one micro-batch's activation at a stage boundary (whole, before any slicing)."""
        return self.micro_batch * self.seq * self.d_model

    def boundary_sliced(self) -> bool:
        """Whether only 1/tp of the activation crosses (StageModule's rule: sliced or sequence-parallel, tp > 1)."""
        return self.tp > 1 and (self.sliced or self.sequence_parallel)

    def boundary_numel(self) -> int:
        n = self.activation_numel()
        return n // self.tp if self.boundary_sliced() else n

    def compute_cost(self, stage: int, kind: str, blocks: int) -> float:
        """The simulated time of `kind` (F forward, B full backward, I input-gradient or W weight-gradient half of
        one) of one micro-batch on `stage` of `blocks` blocks: `stage_costs` when given, else the block count with a
        backward twice a forward."""
        forward, backward = (self.stage_costs or {}).get(stage, (blocks, 2 * blocks))
        return float({"F": forward, "B": backward}.get(kind, backward / 2))

    def receive_cost(self, numel: int, dtype: str) -> float:
        """Seconds the receiving rank spends on a message of `numel` values of `dtype` once it has arrived: one
        point-to-point message priced on `link` (collectives.pricing, the one pricing model); 0 without a link."""
        if self.link is None:
            return 0.0
        return pricing.seconds("p2p", numel * DTYPE_BYTES.get(dtype, 4), 2, self.link)

    def custom_actions(self) -> dict[int, list[str]] | None:
        """The user-written schedule's action strings per pipeline rank, or None for a named schedule."""
        if isinstance(self.schedule, str):
            return None
        return {int(r): [str(a) for a in row] for r, row in dict(self.schedule).items()}


def read_schedule_csv(path: str | Path) -> dict[int, list[str]]:
    """torch's CSV form of a schedule (one row of actions per pipeline rank) as {rank: [action, ...]}."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ParallelConfigError(f"schedule file {path} cannot be read: {e.strerror or e}") from None
    return {r: [c.strip() for c in row if c.strip()] for r, row in enumerate(csv.reader(io.StringIO(text)))}


def count_params(module: torch.nn.Module) -> int:
    """Elements of a module's parameters as this rank holds them (a DTensor counts its local part)."""
    from ..sharding import local

    return sum(local(p).numel() for p in module.parameters())


def job_of(pipeline: Any, *, batch: int, seq: int, d_model: int | None = None, dtype: str | None = None,
           device_memory: float | None = None, need_width: bool = True, optimizer: Any = None) -> PipelineJob:
    """The PipelineJob of a built `cocoweave.nn.Pipeline` for a batch of `batch` samples of `seq` tokens per
    replica. `d_model` and `dtype` default to the first block's (without `need_width`, blocks that do not say
    their width get 1: the communication order does not depend on it); parameter counts are this rank's
    stages'. With this rank's distributed `optimizer`, its step's collectives are added for this pipeline rank (its
    replicas hold the same stages, so the same buckets)."""
    mods = list(pipeline.modules)
    blocks = [b for m in mods for b in m.blocks]
    if d_model is None:
        d_model = getattr(blocks[0], "d_model", None) if blocks else None
        if d_model is None and not need_width:
            d_model = 1
        if d_model is None:
            raise ParallelConfigError("Pipeline.check needs d_model= (its blocks do not say their width)")
    if dtype is None:
        p = next(iter(pipeline.parameters()), None)
        dtype = str(p.dtype).removeprefix("torch.") if p is not None else "float32"
    first = mods[0]
    proj = getattr(blocks[0], "proj", None) if blocks else None  # a TransformerBlock's row-parallel layer
    layer_programs = getattr(proj, "programs", None)
    heads = getattr(blocks[0], "local_heads", 1) * first.tp if blocks else 1
    d_ff = getattr(getattr(blocks[0], "fc1", None), "out_features", None) if blocks else None
    names = tuple(pipeline.mesh.mesh_dim_names)
    sizes = dict(zip(names, pipeline.mesh.shape))
    return PipelineJob(pp=pipeline.pp_size, tp=sizes["tp"], dp=sizes["dp"], schedule=pipeline.pipeline_schedule_name,
                       microbatches=pipeline.microbatches, n_blocks=pipeline.n_blocks, batch=batch, seq=seq,
                       d_model=int(d_model), dtype=dtype, sliced=bool(getattr(pipeline, "sliced", True)), heads=heads,
                       d_ff=d_ff, dropout=float(getattr(proj, "p", 0.0)),
                       layer_schedule=None if layer_programs is None else layer_programs.schedule,
                       sequence_parallel=first.sequence_parallel,
                       stage_params={s: count_params(m) for s, m in zip(pipeline.stage_ids, mods)},
                       device_memory=device_memory, name="pipeline",
                       optimizer_steps=None if optimizer is None else {pipeline.pp_rank: bucket_collectives(optimizer)})


def mesh_position(mesh: Any) -> int:
    """This rank's place in a dp x pp x tp DeviceMesh, numbered as the mesh's ranks would be from 0 (its global rank
    when the mesh is the whole world)."""
    names = tuple(mesh.mesh_dim_names)
    coord = dict(zip(names, mesh.get_coordinate()))
    size = dict(zip(names, mesh.shape))
    return (coord["dp"] * size["pp"] + coord["pp"]) * size["tp"] + coord["tp"]
