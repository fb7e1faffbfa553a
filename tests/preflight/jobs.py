"""Jobs for `cocoweave preflight` in the tests (and docs/preflight.md): FILE.py:FUNCTION entries."""

from __future__ import annotations

from cocoweave.preflight import Op, PipelineJob, Trace


def pp2_tp2() -> PipelineJob:
    """The tiny GPT of the pipeline tests at pp 2 x tp 2, 1F1B, 4 micro-batches (4 ranks)."""
    return PipelineJob(pp=2, tp=2, schedule="1f1b", microbatches=4, n_blocks=4, batch=8, seq=8, d_model=16, heads=4,
                       vocab=11, block_params=1688, first_params=304, last_params=219, name="pp2_tp2")


def big_gpipe() -> PipelineJob:
    """GPipe holding 16 micro-batches of 2048 tokens at width 1024 on a 4 GiB device: does not fit."""
    return PipelineJob(pp=2, dp=2, schedule="gpipe", microbatches=16, n_blocks=8, batch=16, seq=2048, d_model=1024,
                       heads=16, block_params=12_600_000, device_memory=4 * 2**30, name="big_gpipe")


def both_receive_first() -> PipelineJob:
    """A hand-written schedule whose two stages each wait to receive before they send."""
    return PipelineJob(pp=2, microbatches=1, n_blocks=2, batch=1, seq=8, d_model=16, schedule_format="compute_comms",
                       schedule={0: ["0F0", "0RECV_B0", "0B0", "0SEND_F0"], 1: ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]})


def crossed_groups() -> Trace:
    """A plain dp x tp step written as a trace: ranks 0 and 1 enter their shared group's collectives in different
    orders."""
    t = Trace()
    grads, params = (Op("all_reduce", (0, 1), None, 4, "float32", "grads"),
                     Op("all_gather", (0, 1), None, 8, "float32", "params"))
    for rank, ops in ((0, (grads, params)), (1, (params, grads))):
        for op in ops:
            t.collective(rank, op)
    return t


def not_a_job() -> int:
    return 3
