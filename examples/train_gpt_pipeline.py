# cocoweave profile: --pipeline-parallel 2 --tensor-parallel 2 --steps 4
"""Train the tiny character-level GPT of train_gpt.py data x pipeline x tensor parallel (cocoweave.nn.Pipeline on
torch.distributed.pipelining), and check that its loss curve equals the same model trained in one process.

    python examples/train_gpt_pipeline.py --pipeline-parallel 2 --tensor-parallel 2            # a local world of 4
    python examples/train_gpt_pipeline.py --pipeline-parallel 2 --tensor-parallel 2 --world-size 8   # and dp 2
    torchrun --nproc-per-node 4 examples/train_gpt_pipeline.py --pipeline-parallel 2 --tensor-parallel 2

World ranks r = (dp * pp_size + pp) * tp_size + tp (cocoweave.nn.parallel_mesh). The blocks are cut into
pp contiguous stages (the embeddings on the first, the final LayerNorm and head on the last); each stage splits
its blocks' heads and MLP units over its tensor-parallel group (cocoweave.nn.TransformerBlock) and sends only its
1/tp slice of the activation to the next stage, which all-gathers it. A replica's batch runs in --microbatches
micro-batches under the --schedule of torch.distributed.pipelining; cocoweave.optim.DistributedAdamW averages the
gradients over the data-parallel group and steps. Dropout masks are drawn at the samples' positions in the global
batch, so the single-process reference (train_gpt.py's, the whole batch at once) draws the same ones.

With --ckpt-dir each stage saves its part (every tensor-parallel rank of every stage its own entry; data-parallel
replicas of one write the same entry once) every --ckpt-every steps, and a run started again resumes from the
newest complete checkpoint at the same layout. Writes losses.json to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from train_gpt import GPT, CharData, Config, reference_model, train_reference  # noqa: E402 - the model and data

from cocoweave import checkpoint  # noqa: E402
from cocoweave.errors import CocoweaveError  # noqa: E402
from cocoweave.nn import Pipeline, TransformerBlock, parallel_mesh  # noqa: E402
from cocoweave.nn.functional import group_rank  # noqa: E402
from cocoweave.nn.groups import mesh_shape  # noqa: E402
from cocoweave.nn.pipeline import SCHEDULES  # noqa: E402


class Embed(nn.Module):
    """The GPT's token and position embeddings: the first stage's input module."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.tok, self.pos = gpt.tok, gpt.pos

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Head(nn.Module):
    """The GPT's final LayerNorm and vocabulary head: the last stage's output module."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.ln, self.head = gpt.ln, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(x))


def check_layout(cfg: Config, pp: int, microbatches: int, schedule: str) -> int:
    """The data-parallel size of this layout, or CocoweaveError saying what cannot run."""
    if microbatches < 1:
        raise CocoweaveError(f"--microbatches must be at least 1, got {microbatches}")
    dp = mesh_shape(cfg.world_size, cfg.tensor_parallel, pp)[0]
    if cfg.heads % cfg.tensor_parallel:
        raise CocoweaveError(f"{cfg.heads} attention heads cannot be split over --tensor-parallel "
                             f"{cfg.tensor_parallel} ranks")
    if cfg.layers < pp:
        raise CocoweaveError(f"--layers {cfg.layers} cannot be cut into --pipeline-parallel {pp} stages")
    if cfg.batch % (dp * microbatches):
        raise CocoweaveError(f"--batch {cfg.batch} cannot be split into {dp} data-parallel replicas of "
                             f"--microbatches {microbatches} equal micro-batches")
    if schedule not in SCHEDULES:
        raise CocoweaveError(f"--schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    return dp


def _ckpt_state(pipe: Pipeline, opt: Any, step: int, losses: list[float]) -> dict[str, Any]:
    """This rank's part of a checkpoint: its stages' parameters and optimizer state under its (pp, tp) place."""
    key = f"pp{pipe.pp_rank}.tp{group_rank(pipe.tp_group)}"
    return {key: {"model": pipe.state_dict(), "optim": opt.state_dict()}, "step": step, "losses": json.dumps(losses)}


def train_pipeline(rank: int, world_size: int, cfg_dict: dict[str, Any], pp: int, microbatches: int,
                   schedule: str, ckpt_dir: str | None = None, ckpt_every: int = 0) -> dict[str, Any]:
    """Run on every rank of an initialised world: train cfg.steps steps; returns the global loss per step."""
    from cocoweave.optim import DistributedAdamW

    cfg = Config(**cfg_dict)
    dp = check_layout(cfg, pp, microbatches, schedule)
    data = CharData(cfg)
    mesh = parallel_mesh(tensor_parallel=cfg.tensor_parallel, pipeline_parallel=pp)
    tp_group, dp_group = mesh.get_group("tp"), mesh.get_group("dp")
    ref = reference_model(len(data.vocab), cfg)  # every rank draws the same full model and keeps its part

    def block(i: int) -> nn.Module:
        return TransformerBlock(cfg.d_model, cfg.heads, dropout=cfg.dropout, group=tp_group).load_reference(
            ref.blocks[i])

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    pipe = Pipeline(mesh, n_blocks=cfg.layers, block=block, first=lambda: Embed(ref), last=lambda: Head(ref),
                    loss_fn=loss_fn, microbatches=microbatches, pipeline_schedule=schedule).train()
    opt = DistributedAdamW(list(pipe.parameters()), lr=cfg.lr, weight_decay=cfg.weight_decay, process_group=dp_group)
    step, losses = 0, []
    path = checkpoint.latest(ckpt_dir) if ckpt_dir else None
    if path is not None:
        loaded = checkpoint.load(path, _ckpt_state(pipe, opt, 0, []))
        key = next(k for k in loaded if k.startswith("pp"))
        pipe.load_state_dict(loaded[key]["model"])
        opt.load_state_dict(loaded[key]["optim"])
        step, losses = loaded["step"], json.loads(loaded["losses"])
    share = cfg.batch // dp
    mine = slice(group_rank(dp_group) * share, (group_rank(dp_group) + 1) * share)
    start = time.perf_counter()
    while step < cfg.steps:
        x, y = data.batch(step)
        opt.zero_grad()
        losses.append(pipe.step(x[mine], y[mine], step=step, positions=torch.arange(cfg.batch)[mine],
                                no_sync=opt.no_sync))
        opt.step()
        step += 1
        if ckpt_dir and ckpt_every > 0 and (step % ckpt_every == 0 or step == cfg.steps):
            checkpoint.save(checkpoint.step_path(ckpt_dir, step), _ckpt_state(pipe, opt, step, losses), step=step)
    return {"losses": losses, "seconds": time.perf_counter() - start, "boundary_bytes": pipe.boundary_bytes(),
            "rank": rank, "dp": dp, "resumed_at": 0 if path is None else int(loaded["step"])}


def compare(cfg: Config, parallel: dict[str, Any], layout: dict[str, Any]) -> dict[str, Any]:
    """The pipeline run's loss curve beside the single-process reference's and their largest difference."""
    reference = train_reference(cfg, [parallel["dp"]] * cfg.steps)
    diffs = [abs(a - b) for a, b in zip(parallel["losses"], reference)]
    return {"config": asdict(cfg), "layout": layout, "parallel": parallel["losses"], "reference": reference,
            "max_abs_diff": max(diffs, default=0.0), "parallel_seconds": parallel["seconds"],
            "boundary_bytes_rank0": parallel["boundary_bytes"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pipeline-parallel", type=int, default=2, help="pipeline stages (default %(default)s)")
    ap.add_argument("--tensor-parallel", type=int, default=2, help="tensor-parallel size (default %(default)s)")
    ap.add_argument("--world-size", type=int, default=4, help="ranks of the local world (default %(default)s)")
    ap.add_argument("--schedule", default="1f1b", help=f"one of {', '.join(SCHEDULES)} (default %(default)s)")
    ap.add_argument("--microbatches", type=int, default=4, help="micro-batches per replica (default %(default)s)")
    ap.add_argument("--steps", type=int, default=20, help="training steps (default %(default)s)")
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks (default %(default)s)")
    ap.add_argument("--batch", type=int, default=Config.batch, help="global batch (default %(default)s)")
    ap.add_argument("--seed", type=int, default=Config.seed)
    ap.add_argument("--ckpt-dir", default=None, help="resume from the newest checkpoint here and save new ones")
    ap.add_argument("--ckpt-every", type=int, default=0, help="save a checkpoint every N steps (and at the end)")
    ap.add_argument("--out", type=Path, default=Path("runs/train_gpt_pipeline"), help="output directory")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from cocoweave.launch import LocalWorld, in_torchrun, init_from_env, shutdown

    pp, m, sched = args.pipeline_parallel, args.microbatches, args.schedule
    run = (pp, m, sched, args.ckpt_dir, args.ckpt_every)
    try:
        if in_torchrun():
            rank, world_size, _ = init_from_env()
        else:
            rank, world_size = 0, args.world_size
        cfg = Config(steps=args.steps, tensor_parallel=args.tensor_parallel, world_size=world_size, seed=args.seed,
                     layers=args.layers, batch=args.batch)
        if args.steps < 1:
            raise CocoweaveError(f"--steps must be at least 1, got {args.steps}")
        check_layout(cfg, pp, m, sched)
        if in_torchrun():
            parallel = train_pipeline(rank, world_size, asdict(cfg), *run)
            shutdown()  # every rank leaves the group together
            if rank != 0:
                return 0
        else:
            with LocalWorld(world_size, timeout_s=600) as world:
                parallel = world.run(train_pipeline, asdict(cfg), *run)[0]
    except CocoweaveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    layout = {"pipeline_parallel": pp, "tensor_parallel": args.tensor_parallel, "data_parallel": parallel["dp"],
              "schedule": sched, "microbatches": m}
    result = compare(cfg, parallel, layout)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "losses.json").write_text(json.dumps(result, indent=1))
    resumed = f" (resumed at step {parallel['resumed_at']})" if parallel["resumed_at"] else ""
    print(f"dp {parallel['dp']} x pp {pp} x tp {args.tensor_parallel}, schedule {sched}, {m} micro-batches, "
          f"{len(result['parallel'])} steps{resumed}\n"
          f"loss: first {result['parallel'][0]:.4f}, last {result['parallel'][-1]:.4f} (reference "
          f"{result['reference'][-1]:.4f}); max |difference| {result['max_abs_diff']:.2e}\n"
          f"rank 0 sent {parallel['boundary_bytes']['forward']} activation bytes across its boundary; parallel "
          f"training took {parallel['seconds']:.1f} s; wrote {args.out / 'losses.json'}")
    return 0 if result["max_abs_diff"] < 1e-3 else 1  # NaN compares False


if __name__ == "__main__":
    sys.exit(main())
