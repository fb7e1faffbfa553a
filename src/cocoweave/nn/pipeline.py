"""Pipeline parallelism with stages that are tensor-parallel inside, on torch.distributed.pipelining's engine
(its micro-batching, schedules and loss handling), with CoCoNet's sliced stage boundary.

The activation leaving a stage is replicated over that stage's tensor-parallel group, so each rank sends only
its 1/t slice to its peer (the rank with the same tp index in the next stage) and the next stage all-gathers the
slices over its group; the gradient goes back the same way (Megatron's scatter-gather). Inside the engine this
is the last op of a stage module (keep this rank's slice) and the first op of the next (all-gather).

    mesh = parallel_mesh(tensor_parallel=2, pipeline_parallel=2)
    pipe = Pipeline(mesh, n_blocks=8, block=lambda i: TransformerBlock(512, 8, group=mesh.get_group("tp")),
                    first=lambda: Embed(...), last=lambda: Head(...), loss_fn=cross_entropy,
                    microbatches=8, pipeline_schedule="1f1b")
    opt = DistributedAdamW(pipe.parameters(), process_group=mesh.get_group("dp"))
    opt.zero_grad(); loss = pipe.step(tokens, targets, step=s); opt.step()

PipelineBoundary is the same boundary by hand (send_forward / recv_forward), outside any schedule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ParallelConfigError
from ..ir.layout import slice_bounds
from .functional import Group, all_gather_cat, group_rank, group_size, part
from .groups import agree_on_build
from .transformer import sequence_gather, sequence_slice


def group_device(group: Group = None) -> torch.device:
    """The device a collective of `group` takes tensors on: the current CUDA device under NCCL, else the CPU."""
    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class PipelineBoundary(nn.Module):
    """Point-to-point transfer of a stage-replicated activation (forward) and its gradient (backward) between
    this rank and `peer` (a global rank), by hand. With `scatter_gather` (the default) only a 1/t slice crosses
    between stages and the receiving side all-gathers it over `group` (this stage's tensor-parallel group);
    tensors whose size t does not divide go whole.

        # stage s (sends)                          # stage s + 1 (receives)
        y = stage_model(x)                          h = boundary.recv_forward(shape, dtype)
        boundary.send_forward(y)                    loss = next_model(h).sum(); loss.backward()
        boundary.recv_backward(y)  # y.backward     boundary.send_backward(h)
    """

    def __init__(self, peer: int, group: Group = None, scatter_gather: bool = True) -> None:
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise ParallelConfigError("PipelineBoundary needs an initialised torch.distributed process group")
        if not 0 <= peer < dist.get_world_size() or peer == dist.get_rank():
            raise ParallelConfigError(f"PipelineBoundary: peer {peer} must be another rank of the world of "
                                      f"{dist.get_world_size()}")
        self.peer, self.group, self.scatter_gather = peer, group, scatter_gather

    def _sliced(self, numel: int) -> bool:
        t = group_size(self.group)
        return self.scatter_gather and t > 1 and numel % t == 0

    def _send(self, t: torch.Tensor) -> None:
        flat = t.detach().contiguous().view(-1)
        if self._sliced(flat.numel()):
            flat = part(flat, 0, group_size(self.group), group_rank(self.group))
        # messages live on the group's device: host memory under Gloo, whose send and recv take no CUDA tensor
        dist.send(flat.to(group_device(self.group)).contiguous(), self.peer)

    def _recv(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: Any) -> torch.Tensor:
        numel = torch.Size(shape).numel()
        sliced = self._sliced(numel)
        buf = torch.empty(numel // group_size(self.group) if sliced else numel, dtype=dtype,
                          device=group_device(self.group))
        dist.recv(buf, self.peer)
        buf = buf.to(device)
        return (all_gather_cat(buf, 0, self.group) if sliced else buf).view(shape)

    def send_forward(self, activation: torch.Tensor) -> None:
        """Send this stage's output (replicated over `group`) to the next stage."""
        self._send(activation)

    def recv_forward(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32,
                     device: Any = None) -> torch.Tensor:
        """Receive the previous stage's output: a leaf tensor that requires grad (call `send_backward` on it).
        `device` defaults to the group's (CUDA under NCCL, which refuses CPU tensors)."""
        return self._recv(shape, dtype, group_device(self.group) if device is None else device).requires_grad_(True)

    def send_backward(self, received: torch.Tensor) -> None:
        """Send the gradient of a tensor returned by `recv_forward` back to the previous stage."""
        if received.grad is None:
            raise ParallelConfigError("PipelineBoundary.send_backward: the received activation has no gradient; "
                                      "run backward through it first")
        self._send(received.grad)

    def recv_backward(self, activation: torch.Tensor) -> None:
        """Receive the gradient of the activation given to `send_forward` and backpropagate it."""
        activation.backward(self._recv(activation.shape, activation.dtype, activation.device))


# ---------------------------------------------------------------------------------------------------------
# Stage modules: a contiguous run of blocks, the first stage's input module, the last stage's output module
# ---------------------------------------------------------------------------------------------------------


def stage_blocks(n_blocks: int, stages: int, index: int) -> range:
    """The blocks of stage `index` when `n_blocks` are cut into `stages` contiguous, balanced runs."""
    if stages < 1 or n_blocks < stages:
        raise ParallelConfigError(f"{n_blocks} blocks cannot be cut into {stages} pipeline stages "
                                  "(each stage needs at least one block)")
    return range(*slice_bounds(n_blocks, stages, index))


class StageModule(nn.Module):
    """One pipeline stage: `first` (the model's input module, first stage only), `blocks` called as
    block(x, step=step, index_offset=...), `last` (the output module, last stage only). With `sliced` and a
    tensor-parallel `group`, a stage that sends ends by keeping this rank's 1/t token slice of its (batch, seq, d)
    output (`sequence_slice`: rows of its (batch * seq, d) view) and a stage that receives begins by all-gathering
    the slices over `group` (`sequence_gather`): only slices cross. With `sequence_parallel` the blocks themselves
    take and return token slices (Megatron-SP: the last row-parallel matmul of a stage reduce-scatters and runs its
    epilogue on the slice, the next stage all-gathers before its first column-parallel matmul): the first stage
    slices the embeddings, the slice crosses as it is, the last stage gathers before `last`.

    forward(x, step=, positions=): `positions` are the micro-batch's samples' positions in the global batch
    (the engine chunks them with the batch), so each block draws the dropout mask of those samples."""

    def __init__(self, blocks: Sequence[nn.Module], *, first: nn.Module | None = None, last: nn.Module | None = None,
                 receives: bool = False, sends: bool = False, group: Group = None, sliced: bool = True,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        for i, blk in enumerate(blocks):
            if bool(getattr(blk, "sequence_parallel", False)) != sequence_parallel:
                raise ParallelConfigError(f"block {i} of a stage has sequence_parallel="
                                          f"{getattr(blk, 'sequence_parallel', False)} but the stage was built with "
                                          f"sequence_parallel={sequence_parallel}; build both alike")
        if sequence_parallel and not sliced:
            raise ParallelConfigError("sequence-parallel stages hold token slices: they cannot send whole activations "
                                      "(sliced=False)")
        self.first, self.blocks, self.last = first, nn.ModuleList(blocks), last
        self.receives, self.sends, self.group = receives, sends, group
        self.tp = group_size(group)
        self.sliced, self.sequence_parallel = sliced and self.tp > 1, sequence_parallel

    def _batch(self, positions: torch.Tensor | None) -> int:
        if positions is None:
            raise ParallelConfigError("a stage that receives token slices needs positions= (the micro-batch's "
                                      "samples) to know the batch it gathers")
        return positions.numel()

    def _even(self, rows: int) -> None:
        if rows % self.tp:
            raise ParallelConfigError(f"the sliced stage boundary splits {rows} tokens over {self.tp} tensor-parallel "
                                      "ranks, which does not divide them; use a batch x sequence length it divides "
                                      "or sliced=False")

    def forward(self, x: torch.Tensor, *, step: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        shape: tuple[int, int] | None = None  # (batch, seq) of the micro-batch while x holds token slices
        if self.receives and (self.sliced or self.sequence_parallel):
            b = self._batch(positions)
            shape = (b, x.shape[0] * self.tp // b)
            if not self.sequence_parallel:
                x, shape = sequence_gather(x, shape, self.group), None
        if self.first is not None:
            x = self.first(x)
            if self.sequence_parallel:
                shape = (x.shape[0], x.shape[1])
                self._even(shape[0] * shape[1])
                x = sequence_slice(x, self.group)
        start = int(positions[0]) if positions is not None and positions.numel() else 0
        per_sample = shape[1] * x.shape[-1] if shape is not None else x[0].numel()
        for blk in self.blocks:
            kw = {"batch_shape": shape} if self.sequence_parallel else {}
            x = blk(x, step=step, index_offset=start * per_sample, **kw)
        if self.last is not None:
            x = self.last(sequence_gather(x, shape, self.group) if self.sequence_parallel else x)
        if self.sends and self.sliced and not self.sequence_parallel:
            self._even(x.shape[0] * x.shape[1])
            x = sequence_slice(x, self.group)
        return x


def _warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    warnings.warn(f"{old} is renamed {new} (a schedule in cocoweave is a CoCoNet Schedule); the old name goes in "
                  "the next release", DeprecationWarning, stacklevel=stacklevel)


def _renamed_schedule_keyword(schedule: str, pipeline_schedule: str) -> str:
    """The pipeline schedule named by the deprecated keyword `schedule=`, with a DeprecationWarning; refused when
    `pipeline_schedule=` names another."""
    if pipeline_schedule != "1f1b" and pipeline_schedule != schedule:
        raise ParallelConfigError(f"Pipeline got schedule={schedule!r} and pipeline_schedule={pipeline_schedule!r}; "
                                  "give pipeline_schedule= only (schedule= is its old name)")
    _warn_renamed("Pipeline(schedule=...)", "Pipeline(pipeline_schedule=...)", stacklevel=4)
    return schedule


class Pipeline:
    """This rank's part of a model cut into pipeline stages over `mesh` (parallel_mesh's dims "dp", "pp", "tp"),
    run by a torch.distributed.pipelining schedule. `block(i)` builds block i (called only for this rank's
    blocks), `first()` the input module of stage 0, `last()` the output module of the last stage; `loss_fn(output,
    target)` is the mean loss of a micro-batch. `pipeline_schedule` names torch's pipeline schedule (SCHEDULES:
    gpipe, 1f1b, interleaved1f1b, loopedbfs; `schedule=` is its old name, kept for one release with a
    DeprecationWarning: a "schedule" in cocoweave is a CoCoNet Schedule). `sliced` sends 1/tp of each activation
    between stages; `sequence_parallel` says the blocks were built with sequence_parallel=True (see StageModule).

    `pipeline_schedule_name` is that name and `pipeline_schedule` torch's schedule object that `step` runs."""

    def __init__(self, mesh: Any, *, n_blocks: int, block: Callable[[int], nn.Module],
                 first: Callable[[], nn.Module] | None = None, last: Callable[[], nn.Module] | None = None,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], microbatches: int,
                 pipeline_schedule: str = "1f1b", sliced: bool = True, sequence_parallel: bool = False,
                 device: torch.device | None = None, schedule: str | None = None) -> None:
        if schedule is not None:
            pipeline_schedule = _renamed_schedule_keyword(schedule, pipeline_schedule)
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if not {"dp", "pp", "tp"} <= set(names):
            raise ParallelConfigError(f"Pipeline needs a DeviceMesh with dims 'dp', 'pp' and 'tp' "
                                      f"(cocoweave.nn.parallel_mesh), got dims {names}")
        pp = mesh.size(names.index("pp"))
        from .pipeline_engine import CountingStage, check_schedule  # the engine, imported on first use

        cls, per_rank = check_schedule(pipeline_schedule, microbatches, pp)
        if dist.is_initialized() and mesh.size() == dist.get_world_size():  # every rank runs the same pipeline
            agree_on_build(None, "a pipeline", "Pipeline", pipeline_schedule=pipeline_schedule,
                           microbatches=microbatches,
                           n_blocks=n_blocks, sliced=sliced, sequence_parallel=sequence_parallel,
                           mesh=dict(zip(names, mesh.shape)))
        self.mesh, self.microbatches, self.pipeline_schedule_name = mesh, microbatches, pipeline_schedule
        self.n_blocks, self.sliced = n_blocks, sliced
        self.preflight = True  # step() checks the schedule's communication before the first step (no tensors)
        self.tp_group, self.pp_group, self.dp_group = (mesh.get_group(d) for d in ("tp", "pp", "dp"))
        self.pp_rank, self.pp_size = group_rank(self.pp_group), pp
        self.dp_size = group_size(self.dp_group)
        self.num_stages = pp * per_rank
        self.device = group_device(self.tp_group) if device is None else device
        if torch.device(self.device).type != "cpu" and group_device(self.pp_group).type == "cpu":
            raise ParallelConfigError(f"Pipeline on {self.device} needs NCCL between stages: torch's pipelining "
                                      "engine sends activations on the stage's device, and Gloo's send and recv "
                                      "take host tensors only (use one GPU per rank with NCCL, or the CPU)")
        self.stage_ids = [self.pp_rank + c * pp for c in range(per_rank)]  # interleaved: rank r holds r, r + pp, ...
        self.modules: list[StageModule] = []
        self.stages: list[Any] = []  # pipeline_engine.CountingStage
        for s in self.stage_ids:
            is_first, is_last = s == 0, s == self.num_stages - 1
            blocks = [block(i) for i in stage_blocks(n_blocks, self.num_stages, s)]
            mod = StageModule(blocks, first=first() if is_first and first else None,
                              last=last() if is_last and last else None, receives=not is_first, sends=not is_last,
                              group=self.tp_group, sliced=sliced, sequence_parallel=sequence_parallel).to(self.device)
            self.modules.append(mod)
            self.stages.append(CountingStage(mod, s, self.num_stages, self.device, group=self.pp_group))
        stage_arg = self.stages if per_rank > 1 else self.stages[0]
        # The loss of each micro-batch is divided by their number instead of the engine dividing the gradients
        # after the backwards (scale_grads): a data-parallel optimizer that reduces gradients as they arrive
        # (DistributedAdamW) refuses gradients changed after backward, and the sum is the batch's mean either way.
        self.loss_fn = loss_fn
        self.pipeline_schedule = cls(stage_arg, microbatches, loss_fn=self._scaled_loss, scale_grads=False)
        self.has_first = 0 in self.stage_ids
        self.has_last = self.num_stages - 1 in self.stage_ids

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target) / self.microbatches

    @property
    def schedule(self) -> Any:
        """Deprecated name of `pipeline_schedule` (torch's schedule object); kept for one release."""
        _warn_renamed("Pipeline.schedule", "Pipeline.pipeline_schedule")
        return self.pipeline_schedule

    @property
    def schedule_name(self) -> Any:
        """Deprecated name of `pipeline_schedule_name`; kept for one release."""
        _warn_renamed("Pipeline.schedule_name", "Pipeline.pipeline_schedule_name")
        return self.pipeline_schedule_name

    @schedule_name.setter
    def schedule_name(self, value: Any) -> None:
        _warn_renamed("Pipeline.schedule_name", "Pipeline.pipeline_schedule_name")
        self.pipeline_schedule_name = value

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (all its stages)."""
        for m in self.modules:
            yield from m.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters named by stage: 'stage{s}.blocks.0.qkv.weight'."""
        for s, m in zip(self.stage_ids, self.modules):
            for name, p in m.named_parameters():
                yield f"stage{s}.{name}", p

    def state_dict(self) -> dict[str, Any]:
        """Each of this rank's stages' state, keyed by stage index ('stage0': {...})."""
        return {f"stage{s}": m.state_dict() for s, m in zip(self.stage_ids, self.modules)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what state_dict returned (at the same layout)."""
        for s, m in zip(self.stage_ids, self.modules):
            m.load_state_dict(state[f"stage{s}"])

    def train(self, mode: bool = True) -> Pipeline:
        for m in self.modules:
            m.train(mode)
        return self

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None, *, step: int = 0,
             positions: torch.Tensor | None = None, no_sync: Callable[[], Any] | None = None) -> float:
        """Forward and backward of one batch in micro-batches (gradients accumulate: zero them before, step the
        optimizer after). Every rank passes the same `inputs`/`targets` of its data-parallel replica (only the first
        stage reads inputs, only the last reads targets). `positions` (default 0..batch-1) are the samples'
        positions in the global batch (dropout masks); `no_sync` (an optimizer's no_sync) holds the data-parallel
        reduction until the optimizer steps. Returns the global batch's mean loss (all replicas), on every rank."""
        given = next((t for t in (inputs, targets, positions) if t is not None), None)
        if given is None:
            raise ParallelConfigError("Pipeline.step needs the batch's inputs, targets or positions on every rank "
                                      "(they say how many samples the micro-batches split)")
        batch = given.shape[0] if given.dim() else 0
        if batch < 1:
            raise ParallelConfigError(f"Pipeline.step got an empty batch (shape {tuple(given.shape)}): it needs at "
                                      f"least {self.microbatches} samples, one per micro-batch")
        if batch % self.microbatches:
            raise ParallelConfigError(f"a batch of {batch} samples cannot be split into {self.microbatches} "
                                      "equal micro-batches")
        for needed, stage, what, value in ((self.has_first, "first", "inputs", inputs),
                                           (self.has_last, "last", "targets", targets)):
            if needed and value is None:
                raise ParallelConfigError(f"Pipeline.step: this rank holds the {stage} stage and needs the batch's "
                                          f"{what}")
        if positions is None:
            positions = torch.arange(batch)
        if self.preflight:  # once: a schedule that would hang is one sentence on every rank, before any send
            self.preflight = False
            shaped = next((t for t in (inputs, targets) if t is not None and t.dim() > 1), None)
            self.check(batch=batch, seq=shaped.shape[1] if shaped is not None else 1, memory=False)
        args = (inputs.to(self.device),) if self.has_first else ()
        losses: list[torch.Tensor] = []
        kwargs = {"target": targets.to(self.device) if self.has_last else None, "losses": losses,
                  "step": int(step), "positions": positions.to(self.device)}
        with (no_sync() if no_sync is not None else contextlib.nullcontext()):
            self.pipeline_schedule.step(*args, **kwargs)
        total = torch.stack([x.detach().double() for x in losses]).sum() if losses else \
            torch.zeros((), dtype=torch.float64, device=self.device)
        if self.pp_size > 1:
            dist.all_reduce(total, group=self.pp_group)  # the last stage's loss, everywhere in the pipeline
        if self.dp_size > 1:
            dist.all_reduce(total, group=self.dp_group)  # equal replicas' batches: the global batch's mean
            total /= self.dp_size
        return float(total)

    def check(self, *, batch: int, seq: int, d_model: int | None = None, device_memory: float | None = None,
              memory: bool = True, optimizer: Any = None, stage_costs: Mapping[int, tuple[float, float]] | None = None,
              link: Any = None) -> Any:
        """Pre-flight (cocoweave.preflight, no tensors): one step's communication for every rank of the mesh from
        torch's schedule for a batch of `batch` samples of `seq` tokens per replica, checked to match up and never
        wait in a circle (with `optimizer`, its step's collectives after it); with `memory`, this rank's peak memory
        against `device_memory` bytes (without: the communication of one dp x tp replica, which the others
        mirror). Returns the Report; raises PreflightError with one sentence if the step would hang or not fit.
        `stage_costs` and `link` time the idle share as PipelineJob's do (seconds per micro-batch, the receives'
        link). step() runs it (without memory) before the first step unless `preflight` is set False."""
        from ..preflight import job_of, mesh_position, preflight

        job = job_of(self, batch=batch, seq=seq, d_model=d_model, device_memory=device_memory, need_width=memory,
                     optimizer=optimizer)
        job = dataclasses.replace(job, stage_costs=stage_costs, link=link)
        return preflight(job, ranks=[mesh_position(self.mesh)] if memory else [], one_replica=not memory)

    def boundary_bytes(self) -> dict[str, int]:
        """Bytes this rank's stages sent so far: activations ("forward") and gradients ("backward")."""
        return {k: sum(s.sent[k] for s in self.stages) for k in ("forward", "backward")}

    def boundary_messages(self) -> dict[str, int]:
        """Point-to-point sends this rank's stages made so far, by direction."""
        return {k: sum(s.messages[k] for s in self.stages) for k in ("forward", "backward")}


__all__ = ["Pipeline", "PipelineBoundary", "StageModule", "group_device",
           "stage_blocks"]


def __getattr__(name: str) -> Any:
    """SCHEDULES and CountingStage from pipeline_engine, imported when first asked for (PEP 562)."""
    if name in ("SCHEDULES", "CountingStage"):
        from . import pipeline_engine

        return getattr(pipeline_engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
