"""Write the generated source of every schedule of every example and workload program to a folder, one file per
(program, schedule, world size, rank), so a refactor can show its generated code is byte-identical:

    python scripts/codegen_snapshot.py /tmp/before      # on the old tree
    python scripts/codegen_snapshot.py /tmp/after       # on the new tree
    diff -r /tmp/before /tmp/after && echo identical

Covers the torch step functions (CPU and CUDA schedule sets) and the Triton kernels of fused stages.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from cocoweave.backends.torch.codegen import generate
from cocoweave.ir import Program
from cocoweave.ir.loader import load_program
from cocoweave.nn import programs as nnp
from cocoweave.plan import lower
from cocoweave.schedule.enumerate import enumerate_schedules
from cocoweave.workloads import meshes, optimizers, parallel

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"N": 4096, "B": 2, "S": 8, "H": 16}


def programs() -> Iterator[tuple[str, Callable[[], Program]]]:
    """Every example file's program and a spread of the library's workloads, at small sizes."""
    for spec in ["adam.py:adam", "adamw.py:adamw", "lamb.py:lamb", "sgd.py:sgd", "model_parallel.py:layer",
                 "pipeline_parallel.py:boundary", "tp2d.py:mlp", "tp3d.py:mlp"]:
        file, func = spec.split(":")
        sizes = {"N": SMALL["N"]} if func in ("adam", "adamw", "lamb", "sgd") else \
            {k: v for k, v in SMALL.items() if k != "N"}
        yield f"{file[:-3]}.{func}", lambda s=f"{ROOT / 'examples' / file}:{func}", z=sizes: load_program(s, z)
    for name in ("sgd", "adam", "adamw", "lamb", "adam_l2"):
        for grad in optimizers.GRADS:
            for red in ("avg", "sum"):
                for dt in ("float32", "bfloat16"):
                    fn = getattr(optimizers, name)
                    yield (f"opt.{name}.{grad}.{red}.{dt}",
                           lambda fn=fn, g=grad, r=red, d=dt: fn(4096, grad=g, reduction=r, param_dtype=d))
    yield "opt.reduce_gradient", lambda: optimizers.reduce_gradient((4096,))
    yield "mesh.mlp_1d", lambda: meshes.mlp_1d()
    yield "mesh.mlp_2d", lambda: meshes.mlp_2d()
    yield "mesh.mlp_3d", lambda: meshes.mlp_3d()
    yield "parallel.layer", lambda: parallel.layer(2, 8, 16)
    yield "parallel.boundary", lambda: parallel.boundary(2, 8, 16)
    for sp in (False, True):
        for drop in (0.0, 0.1):
            yield f"nn.row_forward.sp{sp}.p{drop}", lambda sp=sp, d=drop: nnp.row_forward(16, 8, 8, drop=d, sp=sp)
            yield f"nn.row_backward.sp{sp}.p{drop}", lambda sp=sp, d=drop: nnp.row_backward(16, 8, 8, drop=d, sp=sp)
        yield f"nn.column_backward.sp{sp}", lambda sp=sp: nnp.column_backward(16, 8, 8, sp=sp)
        yield f"nn.grad_all_reduce.sp{sp}", lambda sp=sp: nnp.grad_all_reduce(16, 8, sp=sp)
    yield "nn.column_forward_sp", lambda: nnp.column_forward_sp(16, 8, 8)


def _name(s: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in s)
    return safe if len(safe) < 100 else safe[:80] + "_" + hashlib.sha1(s.encode()).hexdigest()[:10]


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    count = 0
    for label, build in programs():
        program = build()
        sizes: dict[str, int] = {}  # every dimension is concrete at these sizes
        seen: set[str] = set()
        for device in ("cpu", "cuda"):
            for s in enumerate_schedules(program, device):
                if s.name in seen:
                    continue
                seen.add(s.name)
                plan = lower(s)
                for world in (2, 4, 8):
                    try:
                        for g in program.groups:
                            g.ranks(world)
                    except Exception:  # noqa: BLE001 - a group that this world cannot form
                        continue
                    for rank in sorted({0, world - 1}):
                        text = generate(plan, rank, world, sizes, {})
                        text += _kernels(plan, rank, world, sizes)
                        (out / f"{_name(label)}__{_name(s.name)}__w{world}r{rank}.py").write_text(text)
                        count += 1
    print(f"{count} generated sources written to {out}")
    return 0


def _kernels(plan, rank: int, world: int, sizes: dict[str, int]) -> str:  # noqa: ANN001
    """The Triton kernel source of each fused stage (the generator runs without Triton installed on a GPU)."""
    try:
        from cocoweave.kernels.codegen import NoKernel, kernel_spec
    except ImportError:
        return ""
    text = ""
    for i in range(len(plan.stages)):
        try:
            spec = kernel_spec(plan, i, rank, world, sizes)
        except NoKernel:
            continue
        text += f"\n\n# ---- Triton kernel of stage {i} ----\n" + str(getattr(spec, "source", spec))
    return text


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/codegen_snapshot")))
