"""Pre-flight's `programs` memory term is what the tensor-parallel layers' executables really keep: for every schedule
a layer may run (each candidate "auto" measures, on shared memory and on the library's collectives), the bytes
predicted from the plan equal `Executable.held_bytes()` after two calls on 2 Gloo ranks and on one rank; and a
TransformerBlock's layers together hold what `block_program_bytes` predicts for its schedule."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cocoweave.preflight import PipelineJob
from cocoweave.preflight.programs import block_program_bytes, plan_bytes

ROWS, D, D_FF, DROP = 6, 12, 24, 0.1  # 6 x 12 fp32 = 288 bytes: slots padded to the 64-byte line


def _programs() -> list[Any]:
    from cocoweave.nn import programs as P

    return [P.row_forward(ROWS, D, D, drop=DROP), P.row_forward(ROWS, D_FF, D, drop=DROP, sp=True),
            P.row_backward(ROWS, D, D, drop=DROP), P.row_backward(ROWS, D_FF, D, drop=DROP, sp=True),
            P.column_backward(ROWS, D, D_FF), P.column_backward(ROWS, D, 3 * D, sp=True),
            P.column_forward_sp(ROWS, D, D_FF), P.grad_all_reduce(1, 2 * D)]


def _held_vs_predicted(rank: int, world_size: int) -> list[tuple[str, str, int, int]]:
    """(program, schedule, held bytes after two calls with the outputs released, predicted) for every candidate."""
    from cocoweave.compiler import compile as compile_schedule
    from cocoweave.ir.types import DTYPES
    from cocoweave.nn.compiled import candidates
    from cocoweave.plan.lower import lower

    out = []
    for program in _programs():
        for shared in ((True, False) if world_size > 1 else (False,)):
            for s in candidates(program, shared):
                exe = compile_schedule(s, "torch", rank=rank, world_size=world_size, kernels="torch")
                g = torch.Generator().manual_seed(rank)
                inputs = {v.name: 7 if v.is_scalar else torch.randn(exe.local_shape(v.name), generator=g,
                                                                    dtype=DTYPES[v.dtype])
                          for v in program.inputs.values()}
                for _ in range(2):
                    res = exe.run(inputs).outputs
                    for name in res:
                        exe.release(res[name])
                out.append((program.name, s.name, exe.held_bytes(), plan_bytes(lower(s), rank, world_size, shared)))
    return out


def _check(rows: list[tuple[str, str, int, int]]) -> None:
    wrong = [f"{p} {s}: held {h}, predicted {q}" for p, s, h, q in rows if h != q]
    assert not wrong, "; ".join(wrong)
    assert any(h > 0 for _, _, h, _ in rows)


def test_plan_bytes_equal_what_executables_hold_on_two_ranks(local_world: Any) -> None:
    results = local_world(2).run(_held_vs_predicted)
    for rows in results:
        _check(rows)
    schedules = {s for _, s, _, _ in results[0]}
    assert {"MM-AR@shm-C", "MM-fuse(RS-C-AG)@shm", "MM-RS-AG-C", "C-AG@shm-MM-C"} <= schedules


def test_plan_bytes_equal_what_executables_hold_on_one_rank() -> None:
    _check(_held_vs_predicted(0, 1))


def _block_held(rank: int, world_size: int, schedule: str, sp: bool) -> int:
    """Bytes a tp 2 TransformerBlock's layers keep after two forward and backward passes."""
    from cocoweave.nn import TransformerBlock
    from cocoweave.nn.transformer import sequence_slice

    block = TransformerBlock(D, 2, D_FF, dropout=DROP, seed=3, schedule=schedule, sequence_parallel=sp)
    x = torch.randn(2, ROWS // 2, D, generator=torch.Generator().manual_seed(0), requires_grad=True)
    for step in range(2):
        y = block(sequence_slice(x), step=step, batch_shape=(2, ROWS // 2)) if sp else block(x, step=step)
        y.square().sum().backward()
    total = 0
    for layer in (block.qkv, block.proj, block.fc1, block.fc2):
        total += sum(exe.held_bytes() for exe in layer.programs._exes.values())
        total += layer.programs._posted.held_bytes()  # ASYNC_SHM's posted all-reduce
    return total


def _job(schedule: str, sp: bool) -> PipelineJob:
    return PipelineJob(pp=1, tp=2, microbatches=1, n_blocks=1, batch=2, seq=ROWS // 2, d_model=D, heads=2, d_ff=D_FF,
                       dropout=DROP, layer_schedule=schedule, sequence_parallel=sp)


@pytest.mark.parametrize("schedule,sp", [("MM-AR@shm-C", False), ("MM-RS@shm-C-AG@shm", False),
                                         ("MM-AR-C", False), ("MM-RS@shm-C", True), ("MM-AR@shm||MMw", False)])
def test_a_blocks_layers_hold_what_is_predicted(local_world: Any, schedule: str, sp: bool) -> None:
    """Named schedules (under "auto" the choice is measured, or recalled from the tuning cache: not repeatable)."""
    held = local_world(2).run(_block_held, schedule, sp)
    assert held == [block_program_bytes(_job(schedule, sp))] * 2


def test_hand_written_layers_keep_nothing() -> None:
    assert block_program_bytes(_job("MM-AR@shm-C", False)) > 0
    assert block_program_bytes(PipelineJob(pp=1, tp=2, microbatches=1, n_blocks=1, batch=2, seq=3, d_model=D,
                                           layer_schedule=None)) == 0
