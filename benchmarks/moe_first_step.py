"""The MoE layer's first steps: what `experts_schedule="auto"` costs before it runs at its steady speed.

"auto" compiles the experts' programs and measures their schedules on its first step (docs/moe.md); the choice is
kept in the tuning cache (COCOWEAVE_TUNE_CACHE) and the generated code in the code cache (COCOWEAVE_CACHE), so a later
run of the same shapes skips both. This times each of the first steps of moe_step.py's models (same shapes, ep 2 on
2 Gloo ranks, fresh rank processes per run) for the default layer and for "auto": once with empty caches (a user's
first run: "cold") and once more with the caches that run left ("warm"). Wall time of the step on the slowest rank,
between barriers. Prints a table, writes JSON to benchmarks/results/.

    .venv/bin/python benchmarks/moe_first_step.py [--steps 5] [--models mixtral,deepseek]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe_step  # noqa: E402  the models, their variants and the house's machine record
from train_step import machine, results_path  # noqa: E402

VARIANTS = ("cocoweave", "cocoweave-program")  # the default layer, and experts_schedule="auto"


def first_steps(rank: int, world_size: int, variant: str, model: str, steps: int) -> list[float]:
    """Seconds of each of this rank's first `steps` steps of `variant` (a fresh model), between barriers."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "ep"))
    shape = {"batch": moe_step.BATCH, "seq": moe_step.SEQ, "layers": moe_step.LAYERS}
    tokens = torch.randint(0, moe_step.VOCAB, (shape["batch"], shape["seq"] + 1),
                           generator=torch.Generator().manual_seed(100 + rank))
    net = moe_step.Variant(variant, model, mesh, shape)
    out = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        net.step(tokens)
        dist.barrier()
        out.append(time.perf_counter() - start)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mixtral,deepseek")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    from cocoweave.launch import LocalWorld

    doc: dict[str, Any] = {
        "command": "benchmarks/moe_first_step.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(), "models": {m: moe_step.MODELS[m] for m in args.models.split(",")},
        "shape": {"layers": moe_step.LAYERS, "batch_per_rank": moe_step.BATCH, "seq": moe_step.SEQ, "ep": 2},
        "rows": []}
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    print(f"{'model':9} {'variant':18} {'caches':6} " + " ".join(f"{f'step {i + 1}':>7}" for i in range(args.steps)))
    saved = {k: os.environ.get(k) for k in ("COCOWEAVE_TUNE_CACHE", "COCOWEAVE_CACHE")}
    try:
        for model in args.models.split(","):
            for variant in VARIANTS:
                with tempfile.TemporaryDirectory() as caches:  # the rank processes inherit these
                    os.environ["COCOWEAVE_TUNE_CACHE"] = os.path.join(caches, "tune-cache.json")
                    os.environ["COCOWEAVE_CACHE"] = os.path.join(caches, "code")
                    for state in ("cold", "warm"):
                        with LocalWorld(2, timeout_s=1800) as world:
                            per_rank = world.run(first_steps, variant, model, args.steps)
                        slowest = [max(s) for s in zip(*per_rank)]
                        doc["rows"].append({"model": model, "variant": variant, "caches": state,
                                            "step_s": slowest, "load_average": os.getloadavg()})
                        print(f"{model:9} {variant:18} {state:6} " + " ".join(f"{s:7.2f}" for s in slowest))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    doc["machine"]["load_average_end"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    path = results_path(args.out, "moe_first_step", ap, {"models": args.models})
    path.write_text(json.dumps(doc, indent=1))
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
