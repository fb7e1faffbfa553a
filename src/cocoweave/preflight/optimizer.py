"""The data-parallel collectives of one optimizer step, read from the optimizer's own compiled plans: each bucket
of a cocoweave.optim distributed optimizer runs a plan whose collective stages (reduce-scatter, all-gather,
all-reduce; on one host through the shared-memory transport, which torch.distributed does not see) are listed in
the order step() runs them, bucket after bucket. Read when the pipeline's step is run under the optimizer's
`no_sync` (the reduction held until step(), as the suite trains it); a reduction launched from backward hooks
would interleave with the pipeline's sends instead."""

from __future__ import annotations

from typing import Any


def bucket_collectives(optimizer: Any) -> list[tuple[str, int, str]]:
    """(kind, elements, dtype) of each collective one step of `optimizer` runs, in order; sizes are the bucket's."""
    out = []
    for b in getattr(optimizer, "_buckets", []):
        for i in range(len(b.exe.plan.stages)):
            kind = b.exe.stage_op(i)
            if kind:
                out.append((kind, int(b.numel), str(b.dtype).removeprefix("torch.")))
    return out
