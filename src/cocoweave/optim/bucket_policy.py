"""The bucket policy: which trainable parameters share a bucket, and how many elements a bucket's buffers hold. The
one place bucket sizes are decided: each distinct size is a program of its own (its enumeration, compile and
tuner-cache key), so a change of sizing (rounding them to fewer sizes) is made here and nowhere else."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .placements import local, shard_key

DDP_CAP_MB = 25.0  # DDP's bucket_cap_mb


@dataclass(frozen=True)
class BucketPolicy:
    """How one optimizer buckets its parameters: up to `cap_bytes` per bucket (0: one parameter per bucket, as
    Adasum combines each tensor on its own), rows (LAMB: parameters of one size, one row each, of a [T, N] bucket),
    shaped rows (parameters of one shape S, one each, of a [T, *S] bucket: a factored optimizer reduces each
    parameter along its own dims) or flat buckets padded to a multiple of `pad_to` (the world size: reduce-scatter
    and all-gather split evenly)."""

    cap_bytes: int
    rows: bool = False
    pad_to: int = 1
    shaped: bool = False

    @classmethod
    def of(cls, bucket_cap_mb: float, reduction: str, rows: bool, world_size: int,
           shaped: bool = False) -> BucketPolicy:
        """The policy of an optimizer with these options, over a group of `world_size` ranks."""
        return cls(0 if reduction == "adasum" else int(bucket_cap_mb * 2**20), rows, world_size, shaped)

    def key(self, p: torch.Tensor) -> tuple:
        """Parameters share a bucket only with the same key: dtype, device and the groups a DTensor parameter is split
        over (clipping sums a bucket's squared norm over them); rows: and size; shaped rows: and shape."""
        size = (tuple(local(p).shape),) if self.shaped else (local(p).numel(),) if self.rows else ()
        return (p.dtype, p.device, shard_key(p)) + size

    def partition(self, params: Iterable[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
        """The parameters that need gradients, by key, in reverse order of registration (the order backward produces
        gradients), each list at most `cap_bytes` unless one parameter alone is larger."""
        out: list[list[torch.nn.Parameter]] = []
        open_: dict[tuple, list[torch.nn.Parameter]] = {}
        sizes: dict[tuple, int] = {}
        for p in reversed([p for p in params if p.requires_grad]):
            key = self.key(p)
            nbytes = local(p).numel() * p.element_size()
            if key in open_ and sizes[key] + nbytes > self.cap_bytes:
                out.append(open_.pop(key))
                sizes[key] = 0
            open_.setdefault(key, []).append(p)
            sizes[key] = sizes.get(key, 0) + nbytes
        return out + list(open_.values())


def flat_size(used: int, pad_to: int) -> int:
    """The elements of a flat bucket whose parameters hold `used`: the next multiple of `pad_to` (the tail is zeros,
    which every update leaves zero). Each distinct result is a program of its own; rounding it up to fewer sizes
    (e.g. 3 significant bits) would share programs between buckets at the cost of padding (see the notes of #30)."""
    return -(-used // pad_to) * pad_to
