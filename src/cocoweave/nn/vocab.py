"""Megatron-style vocab-parallel embedding and cross-entropy over a tensor-parallel group: the vocabulary (the
embedding's rows, the logits' last dim) is split over the group, and no rank ever holds the whole of it.

    emb = VocabParallelEmbedding(vocab, d, group=tp)                # rows [start, stop) of the weight on each rank
    head = ColumnParallelLinear(d, vocab, bias=False, group=tp)     # logits sliced on the vocabulary
    loss = vocab_parallel_cross_entropy(head(h(emb(ids))), target, tp)

The embedding looks up the tokens this rank holds, zeroes the others' rows and sums over the group (with
`sequence_parallel=True` reduce-scatters over tokens: the output is this rank's token slice). The loss is Megatron's:
the max over the vocabulary (all-reduce max), exp(x - max) on this rank's part, its sum and the target's logit (the
target found by comparing it with the rank's vocabulary indices) summed in one all-reduce; the backward is
softmax - one_hot on this rank's part, with no communication. Both run as cocoweave programs (nn/vocab_programs.py)
with schedules, or with `schedule=None` as hand-written torch ops with the library's collectives.

The weight is a parameter as sharding.py has it (a DTensor Shard(0) on the group's mesh), drawn part by part with
the values of `full_embedding_weight(vocab, d, seed)`: nn.Embedding's normal(0, 1), from the tiles of nn/init.py.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..errors import ParallelConfigError
from ..ir.layout import slice_bounds
from ..sharding import dtensor_api, is_dtensor, local, local_data, shard_parameter, tp_mesh
from . import vocab_programs as VP
from .compiled import Programs, check_schedule
from .functional import Group, group_rank, group_size, reduce_from_parallel
from .init import partitioned_uniform_
from .layers import resolve_group

NORMAL_RADIUS, NORMAL_ANGLE = 0, 1  # the generator streams of Box-Muller's two uniforms (nn/init.py)


def partitioned_normal_(out: torch.Tensor, full_shape: tuple[int, int], start: tuple[int, int], seed: int,
                        std: float = 1.0) -> torch.Tensor:
    """Fill `out` (2-D) with its block, at `start`, of a normal(0, std) tensor of `full_shape`: Box-Muller of two
    tensors of nn/init.py's partitioned_uniform_, so any block (a rank's rows, the whole) has the same values and a
    rank draws only the tiles its block touches."""
    if out.is_meta or not out.numel():
        return out
    u = [partitioned_uniform_(torch.empty(out.shape, dtype=torch.float64), full_shape, start, 1.0, seed, stream)
         for stream in (NORMAL_RADIUS, NORMAL_ANGLE)]
    with torch.no_grad():  # uniform(-1, 1) -> radius from 1 - U in (0, 1], angle 2πU, U = (u + 1) / 2
        radius = (-2.0 * torch.log((1.0 - (u[0] + 1.0) / 2.0).clamp_min(1e-300))).sqrt()
        out.copy_(radius * torch.cos(math.pi * (u[1] + 1.0)) * std)
    return out


def full_embedding_weight(num_embeddings: int, embedding_dim: int, seed: int,
                          padding_idx: int | None = None) -> torch.Tensor:
    """The whole weight (CPU, fp32) a VocabParallelEmbedding built from `seed` holds parts of: nn.Embedding's
    normal(0, 1), its padding row zero."""
    w = partitioned_normal_(torch.empty(num_embeddings, embedding_dim), (num_embeddings, embedding_dim), (0, 0), seed)
    if padding_idx is not None:
        w[padding_idx] = 0
    return w


def _check_ids(ids: torch.Tensor, vocab: int, who: str) -> None:
    """Refuse token ids outside [0, vocab) with a sentence: another rank's masking would silently make them zero."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ParallelConfigError(f"{who}: token ids must be an integer tensor, got {ids.dtype}")
    if ids.numel():
        lo, hi = torch.aminmax(ids)
        if lo.item() < 0 or hi.item() >= vocab:
            bad = lo.item() if lo.item() < 0 else hi.item()
            raise ParallelConfigError(f"{who}: token id {bad} is outside the vocabulary [0, {vocab})")


def _programs(schedule: str | None, sequence_parallel: bool, group: Group, who: str) -> Programs | None:
    """The compiled programs of a schedule (nn/compiled.py), None for the hand-written path; sequence parallelism
    is a program schedule ("auto" unless one is named)."""
    schedule = check_schedule(schedule, who)
    if sequence_parallel and schedule is None:
        schedule = "auto"
    return Programs(schedule, group, group_size(group), group_rank(group)) if schedule else None


class _EmbeddingReduce(torch.autograd.Function):
    """The masked lookup reduced over the group by the embedding's programs; the backward masks the gradient (and
    with `sp` all-gathers it first) by its program."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, valid: torch.Tensor, programs: Programs, sp: bool) -> torch.Tensor:
        prog = VP.embedding_forward(y.shape[0], y.shape[1], _dtype(y), sp)
        out, = programs.run("forward", prog, {"y": y, "valid": valid}, y.device, ("out",))
        ctx.save_for_backward(valid)
        ctx.programs, ctx.sp, ctx.dim = programs, sp, y.shape[1]
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        valid, = ctx.saved_tensors
        prog = VP.embedding_backward(valid.shape[0], ctx.dim, _dtype(grad), ctx.sp)
        gy, = ctx.programs.run("backward", prog, {"g": grad.contiguous(), "valid": valid}, grad.device, ("gy",))
        return gy, None, None, None


def _dtype(t: torch.Tensor) -> str:
    from ..ir.types import canonical_dtype

    return canonical_dtype(t.dtype)


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding with its rows (the vocabulary) split across `group`: the ids are replicated, each rank looks up
    the ones it holds and the rows are summed over the group (with `sequence_parallel`, reduce-scattered over the
    flattened tokens: the output is this rank's (tokens_part, embedding_dim) slice, torch.tensor_split sizes).

    `num_embeddings` must divide the group size (the weight is a DTensor Shard(0), torch.chunk parts). State dict:
    the weight under nn.Embedding's name; `load_state_dict` also takes the whole (unsharded) weight and keeps this
    rank's rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group: Any = None, padding_idx: int | None = None,
                 seed: int = 0, device: Any = None, dtype: torch.dtype | None = None, schedule: str | None = "auto",
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        for name, v in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ParallelConfigError(f"VocabParallelEmbedding: {name} must be a positive int, got {v!r}")
        pg = resolve_group(group)
        self.num_embeddings, self.embedding_dim, self.group, self.init_seed = num_embeddings, embedding_dim, pg, seed
        self.tp_size, self.tp_rank = group_size(pg), group_rank(pg)
        if num_embeddings % self.tp_size:
            raise ParallelConfigError(f"VocabParallelEmbedding: a vocabulary of {num_embeddings} does not split "
                                      f"evenly over {self.tp_size} ranks; pad it to a multiple of {self.tp_size}")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ParallelConfigError(f"VocabParallelEmbedding: padding_idx {padding_idx} is outside the "
                                          f"vocabulary of {num_embeddings}")
            padding_idx %= num_embeddings
        self.padding_idx = padding_idx
        self.start, self.stop = slice_bounds(num_embeddings, self.tp_size, self.tp_rank)
        self.mesh = tp_mesh(group)
        rows = torch.empty(self.stop - self.start, embedding_dim, device=device, dtype=dtype)
        self.weight = shard_parameter(rows, self.mesh, 0)
        self.sequence_parallel = bool(sequence_parallel)
        self.programs = _programs(schedule, self.sequence_parallel, pg, "VocabParallelEmbedding")
        self.reset_parameters()

    @property
    def local_padding_idx(self) -> int | None:
        """The padding row's index in this rank's part, None where another rank holds it (or there is none)."""
        p = self.padding_idx
        return None if p is None or not self.start <= p < self.stop else p - self.start

    @property
    def schedule(self) -> str:
        """The schedule each of the layer's programs runs (or 'as written': the hand-written path)."""
        return "as written" if self.programs is None else self.programs.describe()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw this rank's rows of `full_embedding_weight(..., seed)`, and only those (nothing on meta)."""
        w = local_data(self.weight)
        partitioned_normal_(w, (self.num_embeddings, self.embedding_dim), (self.start, 0), self.init_seed)
        if self.local_padding_idx is not None and not w.is_meta:
            w[self.local_padding_idx] = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Embeddings of `ids` (any shape): ids.shape + (embedding_dim,), replicated; with sequence parallelism
        this rank's slice of the (ids.numel(), embedding_dim) rows."""
        _check_ids(ids, self.num_embeddings, "VocabParallelEmbedding")
        w = local(self.weight)
        flat = ids.reshape(-1)
        valid = (flat >= self.start) & (flat < self.stop)
        y = F.embedding((flat - self.start) * valid, w, padding_idx=self.local_padding_idx)
        if self.programs is not None:
            out = _EmbeddingReduce.apply(y, valid.unsqueeze(1), self.programs, self.sequence_parallel)
            return out if self.sequence_parallel else out.view(*ids.shape, self.embedding_dim)
        if self.tp_size > 1:
            y = reduce_from_parallel(y.masked_fill(~valid.unsqueeze(1), 0.0), self.group)
        return y.view(*ids.shape, self.embedding_dim)

    def sliced(self) -> dict[str, tuple[int, int]]:
        """The parameters split across the group: name -> (dim, whole size along it) (nn/state.py)."""
        return {"weight": (0, self.num_embeddings)}

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        """Take this rank's rows of a whole (unsharded) weight, and the part of a checkpoint.Shard for this rank;
        a plain tensor becomes this rank's part of the DTensor."""
        from ..checkpoint import Shard as CheckpointShard

        key = prefix + "weight"
        value = state_dict.get(key)
        rows = self.stop - self.start
        if isinstance(value, CheckpointShard):
            if (value.dim, value.total, value.index, value.count) != (0, self.num_embeddings, self.tp_rank,
                                                                      self.tp_size):
                raise ParallelConfigError(f"{key}: the Shard is part {value.index} of {value.count} along dim "
                                          f"{value.dim}, this rank holds part {self.tp_rank} of {self.tp_size} "
                                          "along dim 0")
            value = value.part
        if isinstance(value, torch.Tensor) and not is_dtensor(value):
            if tuple(value.shape) == (self.num_embeddings, self.embedding_dim):
                value = value.narrow(0, self.start, rows)
            elif tuple(value.shape) != (rows, self.embedding_dim):
                raise ParallelConfigError(
                    f"{key} has shape {list(value.shape)}: this rank holds [{rows}, {self.embedding_dim}] of the "
                    f"whole [{self.num_embeddings}, {self.embedding_dim}]; load the whole weight, or a checkpoint "
                    "saved at another tensor-parallel size through cocoweave.nn.sharded_state_dict")
            if is_dtensor(self.weight):
                api = dtensor_api()
                value = api.DTensor.from_local(value.to(self.weight.dtype), self.mesh, [api.Shard(0)],
                                               run_check=False)
            state_dict[key] = value
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor) -> None:
        """Copy this rank's rows of a whole (num_embeddings, embedding_dim) weight."""
        if tuple(weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ParallelConfigError(f"VocabParallelEmbedding: the whole weight has shape {list(weight.shape)}, "
                                      f"expected [{self.num_embeddings}, {self.embedding_dim}]")
        local_data(self.weight).copy_(weight[self.start:self.stop])

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group: Any = None, **kwargs: Any) -> VocabParallelEmbedding:
        """This layer holding this rank's rows of a whole nn.Embedding (its padding_idx kept)."""
        for name in ("max_norm", "sparse"):
            if getattr(emb, name, None):
                raise ParallelConfigError(f"VocabParallelEmbedding.from_embedding: an nn.Embedding with {name} "
                                          "cannot be split over the vocabulary")
        layer = cls(emb.num_embeddings, emb.embedding_dim, group=group, padding_idx=emb.padding_idx,
                    device=emb.weight.device, dtype=emb.weight.dtype, **kwargs)
        layer.load_full(emb.weight.detach())
        return layer

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}"
                + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else "")
                + f", part={self.tp_rank}/{self.tp_size} [{self.start}:{self.stop}], schedule={self.schedule}"
                + (", sequence_parallel=True" if self.sequence_parallel else ""))


# ---------------------------------------------------------------------------------------------------------
# Vocab-parallel cross-entropy
# ---------------------------------------------------------------------------------------------------------

REDUCTIONS = ("mean", "sum", "none")
_IDS: dict[tuple[int, int, torch.device], torch.Tensor] = {}  # (1, stop - start) int64 aranges: vocabulary indices
_LOSS_PROGRAMS: dict[tuple[Any, str], Programs] = {}  # the function's programs, by (group, schedule)


def _vocab_ids(start: int, stop: int, device: torch.device) -> torch.Tensor:
    key = (start, stop, device)
    if key not in _IDS:
        _IDS[key] = torch.arange(start, stop, dtype=torch.int64, device=device).unsqueeze(0)
    return _IDS[key]


class _VocabCrossEntropy(torch.autograd.Function):
    """Per-token losses (0 where ignored) of logits sliced on the vocabulary; saves exp(x - max) (this rank's part)
    and the sum of exponentials for the backward, which is local."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, t: torch.Tensor, valid: torch.Tensor, start: int, vocab: int,
                smoothing: float, programs: Programs | None, group: Group) -> torch.Tensor:
        ids = _vocab_ids(start, start + x.shape[1], x.device)
        t2 = t.unsqueeze(1)
        if programs is not None:
            prog = VP.cross_entropy_forward(x.shape[0], vocab, _dtype(x), smoothing > 0)
            cols = _vocab_ids(0, 3 if smoothing else 2, x.device)
            e, sums = programs.run("forward", prog, {"x": x, "ids": ids, "t": t2, "cols": cols}, x.device,
                                   ("e", "sums"))
        else:
            e, sums = _forward_as_written(x, t2, start, smoothing > 0, group)
        s = sums[:, :1]
        loss = s.log() - (1.0 - smoothing) * sums[:, 1:2]
        if smoothing:
            loss = loss - smoothing / vocab * sums[:, 2:]
        ctx.save_for_backward(e, s, t2, valid)
        ctx.start, ctx.vocab, ctx.smoothing, ctx.programs = start, vocab, smoothing, programs
        return loss.squeeze(1).masked_fill(~valid, 0.0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        e, s, t2, valid = ctx.saved_tensors
        g = grad.masked_fill(~valid, 0.0).unsqueeze(1).to(e.dtype)
        if ctx.programs is not None:
            prog = VP.cross_entropy_backward(e.shape[0], ctx.vocab, _dtype(e), ctx.smoothing)
            ids = _vocab_ids(ctx.start, ctx.start + e.shape[1], e.device)
            gx, = ctx.programs.run("backward", prog, {"e": e, "s": s, "ids": ids, "t": t2, "g": g}, e.device,
                                   ("gx",))
        else:
            gx = e / s  # not in place (Megatron's): a second backward (retain_graph) needs e
            local_t, here = _local_target(t2, ctx.start, e.shape[1])
            gx.scatter_add_(1, local_t, -(1.0 - ctx.smoothing) * here.to(gx.dtype))
            if ctx.smoothing:
                gx.sub_(ctx.smoothing / ctx.vocab)
            gx.mul_(g)
        return gx, None, None, None, None, None, None, None


def _local_target(t2: torch.Tensor, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's index in this rank's part (0 where another rank holds it) and whether this rank holds it."""
    here = (t2 >= start) & (t2 < start + width)
    return (t2 - start) * here, here


def _forward_as_written(x: torch.Tensor, t2: torch.Tensor, start: int, smoothing: bool,
                        group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward program's outputs (e, sums) by torch ops and the library's collectives (Megatron's code, the
    target logit gathered by index)."""
    parallel = group_size(group) > 1
    m = x.max(dim=1, keepdim=True).values
    if parallel:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    z = x - m
    local_t, here = _local_target(t2, start, x.shape[1])
    sums = [None, z.gather(1, local_t) * here]
    if smoothing:
        sums.append(z.sum(dim=1, keepdim=True))
    e = z.exp_()
    sums[0] = e.sum(dim=1, keepdim=True)
    both = torch.cat(sums, dim=1)
    if parallel:
        dist.all_reduce(both, group=group)
    return e, both


def _check_vocab(width: int, vocab_size: int | None, tp: int, rank: int, group: Group) -> tuple[int, int]:
    """(the whole vocabulary, this rank's first index) of logits `width` wide here: with `vocab_size`, checked
    against this rank's part (torch.tensor_split sizes); without, every rank's width must be the same (one small
    all-reduce checks it on every rank, so that every rank refuses together)."""
    if vocab_size is not None:
        start, stop = slice_bounds(vocab_size, tp, rank)
        if width != stop - start:
            raise ParallelConfigError(f"vocab_parallel_cross_entropy: the logits have {width} classes on rank "
                                      f"{rank}, its part of a vocabulary of {vocab_size} over {tp} ranks is "
                                      f"{stop - start}")
        return vocab_size, start
    if tp > 1:
        w = torch.tensor([width, -width], dtype=torch.int64)
        if dist.get_backend(group) == "nccl":
            w = w.cuda()
        dist.all_reduce(w, op=dist.ReduceOp.MAX, group=group)
        if int(w[0]) != -int(w[1]):
            raise ParallelConfigError(f"vocab_parallel_cross_entropy: the ranks' logits have between {-int(w[1])} "
                                      f"and {int(w[0])} classes; pass vocab_size= for parts of unequal width")
    return width * tp, width * rank


def _check_loss_args(logits: torch.Tensor, target: torch.Tensor, reduction: str, label_smoothing: float) -> None:
    if reduction not in REDUCTIONS:
        raise ParallelConfigError(f"vocab_parallel_cross_entropy: reduction must be one of {', '.join(REDUCTIONS)}, "
                                  f"got {reduction!r}")
    if not isinstance(label_smoothing, int | float) or not 0.0 <= label_smoothing <= 1.0:
        raise ParallelConfigError(f"vocab_parallel_cross_entropy: label_smoothing must be in [0, 1], got "
                                  f"{label_smoothing!r}")
    if not logits.is_floating_point() or logits.dim() < 1:
        raise ParallelConfigError(f"vocab_parallel_cross_entropy: logits must be a floating-point tensor with the "
                                  f"vocabulary last, got {logits.dtype} of shape {list(logits.shape)}")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ParallelConfigError(f"vocab_parallel_cross_entropy: target has shape {list(target.shape)}, the logits "
                                  f"{list(logits.shape)} need {list(logits.shape[:-1])}")
    if target.is_floating_point() or target.dtype == torch.bool:
        raise ParallelConfigError(f"vocab_parallel_cross_entropy: target must hold class indices (an integer "
                                  f"tensor), got {target.dtype}")


def vocab_parallel_cross_entropy(logits_local: torch.Tensor, target: torch.Tensor, group: Any = None, *,
                                 ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                                 vocab_size: int | None = None, schedule: str | None = "auto",
                                 programs: Programs | None = None) -> torch.Tensor:
    """F.cross_entropy(logits, target) where each rank of `group` holds its part of the logits' last (vocabulary)
    dim (a ColumnParallelLinear's output with gather_output=False) and the target is replicated. No rank holds
    more than its part of the logits: only (tokens, 1) sums cross the group. Reductions, ignore_index and
    label_smoothing as torch's. Parts of unequal width need `vocab_size`. `schedule`: of the loss's programs
    ("auto", a name), or None for the hand-written torch ops (`programs`: a VocabParallelCrossEntropy's own)."""
    pg = resolve_group(group)
    _check_loss_args(logits_local, target, reduction, label_smoothing)
    tp, rank = group_size(pg), group_rank(pg)
    vocab, start = _check_vocab(logits_local.shape[-1], vocab_size, tp, rank, pg)
    t = target.reshape(-1)
    valid = t != ignore_index
    _check_ids(t[valid], vocab, "vocab_parallel_cross_entropy: target")
    if programs is None and check_schedule(schedule, "vocab_parallel_cross_entropy") is not None:
        key = (pg, schedule)
        programs = _LOSS_PROGRAMS.get(key) or _LOSS_PROGRAMS.setdefault(
            key, _programs(schedule, False, pg, "vocab_parallel_cross_entropy"))
    x = logits_local.reshape(-1, logits_local.shape[-1])
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()  # Megatron's: the softmax's sums in fp32
    loss = _VocabCrossEntropy.apply(x, t, valid, start, vocab, float(label_smoothing), programs, pg)
    if reduction == "none":
        return loss.view(target.shape).to(logits_local.dtype)
    total = loss.sum()
    return (total / valid.sum() if reduction == "mean" else total).to(logits_local.dtype)


class VocabParallelCrossEntropy(nn.Module):
    """vocab_parallel_cross_entropy as a module (nn.CrossEntropyLoss's arguments), holding its own programs."""

    def __init__(self, group: Any = None, *, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, vocab_size: int | None = None, schedule: str | None = "auto") -> None:
        super().__init__()
        self.group = resolve_group(group)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.vocab_size = vocab_size
        self.programs = _programs(schedule, False, self.group, "VocabParallelCrossEntropy")

    def forward(self, logits_local: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits_local, target, self.group, ignore_index=self.ignore_index,
                                            reduction=self.reduction, label_smoothing=self.label_smoothing,
                                            vocab_size=self.vocab_size, schedule=None, programs=self.programs)


__all__ = ["VocabParallelCrossEntropy", "VocabParallelEmbedding", "full_embedding_weight", "partitioned_normal_",
           "vocab_parallel_cross_entropy"]
