"""torch.distributed.pipelining's side of nn/pipeline.py: the schedules offered by name and the stage that counts
what crosses a boundary. A module of its own because importing the engine pulls in DTensor (3.8 of the 8.4 s that
`import cocoweave.nn` took under `-X importtime` on a loaded 2-core VM): the import does not pay it, a Pipeline does
on first use."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)

from ..errors import ParallelConfigError

# name -> (schedule class, stages per rank it runs: 1 = one stage per rank, 2 = interleaved virtual stages)
SCHEDULES: dict[str, tuple[type, int]] = {
    "gpipe": (ScheduleGPipe, 1), "1f1b": (Schedule1F1B, 1),
    "interleaved1f1b": (ScheduleInterleaved1F1B, 2), "loopedbfs": (ScheduleLoopedBFS, 2),
}


class CountingStage(PipelineStage):
    """torch's PipelineStage that counts the bytes and messages of every activation and gradient it sends."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sent = {"forward": 0, "backward": 0}
        self.messages = {"forward": 0, "backward": 0}

    def _count(self, ops: list[dist.P2POp], kind: str) -> list[dist.P2POp]:
        for op in ops:
            self.sent[kind] += op.tensor.numel() * op.tensor.element_size()
            self.messages[kind] += 1
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._count(super().get_fwd_send_ops(fwd_chunk_id), "forward")

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._count(super().get_bwd_send_ops(bwd_chunk_id), "backward")


def check_schedule(schedule: str, microbatches: int, stages: int) -> tuple[type, int]:
    """The schedule class named `schedule` and its stages per rank, or one sentence on why it cannot run here."""
    if schedule not in SCHEDULES:
        raise ParallelConfigError(f"unknown pipeline schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    cls, per_rank = SCHEDULES[schedule]
    if microbatches < 1:
        raise ParallelConfigError(f"microbatches must be at least 1, got {microbatches}")
    if schedule != "gpipe" and microbatches < stages:
        raise ParallelConfigError(f"schedule {schedule!r} needs at least as many micro-batches as pipeline ranks "
                                  f"({stages}), got {microbatches}")
    if per_rank > 1 and microbatches % stages:
        raise ParallelConfigError(f"schedule {schedule!r} needs micro-batches ({microbatches}) divisible by the "
                                  f"pipeline ranks ({stages})")
    return cls, per_rank
