# cocoweave profile: --tensor-parallel 1 --batch 24
"""Train a tiny character-level GPT data-parallel x tensor-parallel with cocoweave.nn, and check that its loss
curve equals the same model trained in one process with plain torch.

    python examples/train_gpt.py --steps 200 --out runs/gpt          # a local Gloo world of 4 CPU ranks
    torchrun --nproc-per-node 4 examples/train_gpt.py --steps 200     # the same under torchrun

World ranks r = dp * tp_size + tp: transformer blocks split their attention heads and MLP units over the
tensor-parallel group (cocoweave.nn.TransformerBlock; fused bias + dropout + residual epilogues with
cocoweave's counter-based dropout), the global batch is split over the data-parallel group and the
gradients are averaged over it. The single-process reference (cocoweave.nn.ReferenceBlock: torch.nn layers
and the same dropout hash) sees the whole global batch. Writes losses.json and loss.png to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cocoweave import checkpoint, faults
from cocoweave.errors import CocoweaveError
from cocoweave.nn import ReferenceBlock, TransformerBlock, parallel_groups
from cocoweave.nn.functional import group_rank, group_size

# ---------------------------------------------------------------------------------------------------------
# Configuration and data
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Config:
    """Everything that defines a run (the same on every rank)."""

    steps: int = 200
    tensor_parallel: int = 2
    world_size: int = 4
    layers: int = 2
    d_model: int = 64
    heads: int = 4
    block: int = 32  # context length
    batch: int = 16  # global batch (sequences per step), split over the data-parallel ranks
    dropout: float = 0.1
    lr: float = 3e-3
    weight_decay: float = 0.01
    seed: int = 0
    corpus_chars: int = 20_000

    @property
    def data_parallel(self) -> int:
        return self.world_size // self.tensor_parallel

    def validate(self) -> Config:
        """Raise CocoweaveError (one sentence) for a configuration that cannot run; returns self."""
        if self.steps < 1:
            raise CocoweaveError(f"--steps must be at least 1, got {self.steps}")
        if self.tensor_parallel < 1 or self.world_size % self.tensor_parallel:
            raise CocoweaveError(f"--tensor-parallel {self.tensor_parallel} must divide the world size "
                                 f"{self.world_size}")
        if self.heads % self.tensor_parallel:
            raise CocoweaveError(f"{self.heads} attention heads cannot be split over "
                                 f"--tensor-parallel {self.tensor_parallel} ranks")
        if self.batch % self.data_parallel:
            raise CocoweaveError(f"the global batch of {self.batch} sequences cannot be split over "
                                 f"{self.data_parallel} data-parallel ranks")
        return self


_SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the robot", "a small bird", "the teacher"]
_VERBS = ["sees", "likes", "follows", "paints", "finds", "carries", "remembers"]
_OBJECTS = ["the moon", "a red ball", "the river", "an apple", "the tall tree", "a letter", "the garden"]
_ENDINGS = [".", " today.", " at night.", " again.", " in the rain.", " slowly."]


def corpus(chars: int, seed: int = 0) -> str:
    """A deterministic pseudo-English text of about `chars` characters (simple sentences from a word list)."""
    rnd = random.Random(seed)
    out: list[str] = []
    n = 0
    while n < chars:
        s = f"{rnd.choice(_SUBJECTS)} {rnd.choice(_VERBS)} {rnd.choice(_OBJECTS)}{rnd.choice(_ENDINGS)}\n"
        out.append(s)
        n += len(s)
    return "".join(out)[:chars]


class CharData:
    """The corpus as token ids and the batch of step s: the same on every rank, drawn from (seed, step)."""

    def __init__(self, cfg: Config) -> None:
        text = corpus(cfg.corpus_chars, cfg.seed)
        self.vocab = sorted(set(text))
        self.ids = torch.tensor([self.vocab.index(c) for c in text], dtype=torch.long)
        self.cfg = cfg

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the global batch at `step`: [batch, block] each."""
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.ids) - self.cfg.block - 1, (self.cfg.batch,), generator=gen)
        x = torch.stack([self.ids[s:s + self.cfg.block] for s in starts.tolist()])
        y = torch.stack([self.ids[s + 1:s + 1 + self.cfg.block] for s in starts.tolist()])
        return x, y


# ---------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------


class GPT(nn.Module):
    """Token and position embeddings, transformer blocks, a final LayerNorm and the vocabulary head.
    `blocks` are ReferenceBlocks (one process) or tensor-parallel TransformerBlocks."""

    def __init__(self, vocab: int, cfg: Config, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.block, cfg.d_model)
        self.blocks = nn.ModuleList(blocks)
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, vocab)

    def forward(self, idx: torch.Tensor, step: int = 0, index_offset: int = 0) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x, step=step, index_offset=index_offset)
        return self.head(self.ln(x))


def reference_model(vocab: int, cfg: Config) -> GPT:
    """The single-process model, initialised from cfg.seed (every rank builds the same one)."""
    torch.manual_seed(cfg.seed)
    blocks = [ReferenceBlock(cfg.d_model, cfg.heads, dropout=cfg.dropout, seed=cfg.seed * 100 + i)
              for i in range(cfg.layers)]
    return GPT(vocab, cfg, blocks)


def parallel_model(vocab: int, cfg: Config, tp_group: Any) -> GPT:
    """The tensor-parallel model holding this rank's part of the reference model's weights."""
    ref = reference_model(vocab, cfg)
    blocks = [TransformerBlock(cfg.d_model, cfg.heads, dropout=cfg.dropout, group=tp_group).load_reference(b)
              for b in ref.blocks]
    model = GPT(vocab, cfg, blocks)
    with torch.no_grad():
        for name in ("tok", "pos", "ln", "head"):
            getattr(model, name).load_state_dict(getattr(ref, name).state_dict())
    return model


def loss_of(model: GPT, x: torch.Tensor, y: torch.Tensor, step: int, index_offset: int = 0) -> torch.Tensor:
    logits = model(x, step=step, index_offset=index_offset)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# ---------------------------------------------------------------------------------------------------------
# Optimizers
# ---------------------------------------------------------------------------------------------------------


def make_optimizer(model: nn.Module, cfg: Config, dp_group: Any) -> tuple[Any, str]:
    """cocoweave.optim.DistributedAdamW over the data-parallel group (None: the whole world, when there is no
    tensor parallelism): it replaces DDP + torch.optim.AdamW. Returns the optimizer and its name."""
    from cocoweave.optim import DistributedAdamW

    group = None if cfg.tensor_parallel == 1 else dp_group
    opt = DistributedAdamW(list(model.parameters()), lr=cfg.lr, weight_decay=cfg.weight_decay, process_group=group)
    return opt, "cocoweave.optim.DistributedAdamW"


# ---------------------------------------------------------------------------------------------------------
# Training loops (a step counter and explicit state: checkpoint/resume hooks go at the marked places)
# ---------------------------------------------------------------------------------------------------------


@dataclass
class TrainState:
    """What a checkpoint would hold: the step to run next, the model, the optimizer and the losses so far."""

    step: int
    model: nn.Module
    optimizer: Any
    losses: list[float]


def train_parallel(rank: int, world_size: int, cfg_dict: dict[str, Any], ckpt_dir: str | None = None,
                   ckpt_every: int = 0, log_file: str | None = None) -> dict[str, Any]:
    """Run on every rank of an initialised world: train the data x tensor parallel model for cfg.steps steps.
    Returns the global loss per step (averaged over the data-parallel ranks) and what was used.

    With `ckpt_dir`, resumes from its newest complete checkpoint and saves one every `ckpt_every` steps
    (cocoweave.checkpoint); rank 0 appends "step loss" lines to `log_file` (steps after the checkpoint a
    restarted run resumes from are dropped from it: they are run again)."""
    cfg = Config(**cfg_dict).validate()
    if world_size != cfg.world_size:
        raise CocoweaveError(f"the config is for {cfg.world_size} ranks, the world has {world_size}")
    data = CharData(cfg)
    tp_group, dp_group = parallel_groups(cfg.tensor_parallel)
    dp_rank, dp_size = group_rank(dp_group), group_size(dp_group)
    local = cfg.batch // dp_size
    model = parallel_model(len(data.vocab), cfg, tp_group)
    optimizer, opt_name = make_optimizer(model, cfg, dp_group)
    state = TrainState(0, model, optimizer, [])
    if ckpt_dir is not None:
        resume(state, ckpt_dir, group_rank(tp_group))
    if rank == 0 and log_file is not None:
        start_log(Path(log_file), state.step)
    start = time.perf_counter()
    model.train()
    while state.step < cfg.steps:
        faults.maybe_fault(rank, state.step, "train_step")  # COCOWEAVE_FAULT=...,label=train_step (tests)
        x, y = data.batch(state.step)
        x, y = x[dp_rank * local:(dp_rank + 1) * local], y[dp_rank * local:(dp_rank + 1) * local]
        offset = dp_rank * local * cfg.block * cfg.d_model  # logical index of this shard's activations
        loss = loss_of(model, x, y, state.step, offset)
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
        reported = loss.detach().clone()
        if dp_size > 1:
            dist.all_reduce(reported, op=dist.ReduceOp.AVG, group=dp_group)
        state.losses.append(reported.item())
        if rank == 0 and log_file is not None:
            with open(log_file, "a") as f:
                f.write(f"{state.step} {state.losses[-1]!r}\n")
        state.step += 1
        if ckpt_dir is not None and ckpt_every > 0 and (state.step % ckpt_every == 0 or state.step == cfg.steps):
            checkpoint.save(checkpoint.step_path(ckpt_dir, state.step), _ckpt_state(state, group_rank(tp_group)),
                            step=state.step)
    return {"losses": state.losses, "optimizer": opt_name, "seconds": time.perf_counter() - start,
            "rank": rank, "tp": group_rank(tp_group), "dp": dp_rank}


def _ckpt_state(state: TrainState, tp_rank: int) -> dict[str, Any]:
    """What a checkpoint holds. Model and optimizer state differ between tensor-parallel ranks and are equal
    on the data-parallel replicas of one, which all write the same entry (DCP stores it once)."""
    return {f"tp{tp_rank}": {"model": state.model.state_dict(), "optim": state.optimizer.state_dict()},
            "step": state.step, "losses": json.dumps(state.losses)}


def resume(state: TrainState, ckpt_dir: str, tp_rank: int) -> None:
    """Load the newest complete checkpoint of `ckpt_dir` into `state`, if there is one."""
    path = checkpoint.latest(ckpt_dir)
    if path is None:
        return
    loaded = checkpoint.load(path, _ckpt_state(state, tp_rank))
    state.model.load_state_dict(loaded[f"tp{tp_rank}"]["model"])
    state.optimizer.load_state_dict(loaded[f"tp{tp_rank}"]["optim"])
    state.step, state.losses = loaded["step"], json.loads(loaded["losses"])


def start_log(log: Path, step: int) -> None:
    """Keep the log's lines of the steps before `step` (a resumed run repeats the later ones)."""
    kept = []
    if log.exists():
        for line in log.read_text().splitlines():
            parts = line.split()
            if line.startswith("#") or (len(parts) == 2 and parts[0].isdigit() and int(parts[0]) < step):
                kept.append(line + "\n")
    if step > 0:
        kept.append(f"# resumed at step {step}\n")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("".join(kept))


def train_reference(cfg: Config) -> list[float]:
    """The same model and data in one process with plain torch (torch.optim.AdamW, the whole global batch)."""
    data = CharData(cfg)
    model = reference_model(len(data.vocab), cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    state = TrainState(0, model, optimizer, [])
    model.train()
    while state.step < cfg.steps:
        x, y = data.batch(state.step)
        loss = loss_of(model, x, y, state.step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        state.losses.append(loss.item())
        state.step += 1
    return state.losses


def run_local(cfg: Config, world: Any = None) -> dict[str, Any]:
    """Train on a LocalWorld (started here unless given), then the reference in this process."""
    from cocoweave.launch import LocalWorld

    own = world is None
    world = world or LocalWorld(cfg.world_size, timeout_s=600)
    try:
        per_rank = world.run(train_parallel, asdict(cfg))
    finally:
        if own:
            world.close()
    return compare(cfg, per_rank[0], train_reference(cfg))


def compare(cfg: Config, parallel: dict[str, Any], reference: list[float]) -> dict[str, Any]:
    """The two loss curves and their largest difference."""
    diffs = [abs(a - b) for a, b in zip(parallel["losses"], reference)]
    return {"config": asdict(cfg), "parallel": parallel["losses"], "reference": reference,
            "max_abs_diff": max(diffs, default=0.0), "optimizer": parallel["optimizer"],
            "parallel_seconds": parallel["seconds"]}


def write_outputs(result: dict[str, Any], out: Path) -> Path:
    """losses.json and loss.png (both curves) in `out`; returns the plot's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "losses.json").write_text(json.dumps(result, indent=1))
    cfg = result["config"]
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = range(1, len(result["reference"]) + 1)
    ax.plot(steps, result["reference"], label="one process (torch)", linewidth=3, alpha=0.5)
    ax.plot(steps, result["parallel"], label=f"dp {cfg['world_size'] // cfg['tensor_parallel']} x "
            f"tp {cfg['tensor_parallel']} (cocoweave.nn, Gloo)", linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(f"tiny GPT: max |difference| {result['max_abs_diff']:.2e}")
    ax.legend()
    fig.tight_layout()
    path = out / "loss.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=Config.steps, help="training steps (default %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("runs/train_gpt"), help="output directory")
    ap.add_argument("--tensor-parallel", type=int, default=Config.tensor_parallel, help="tensor-parallel size")
    ap.add_argument("--batch", type=int, default=Config.batch, help="global batch, split over data-parallel ranks")
    ap.add_argument("--world-size", type=int, default=Config.world_size, help="ranks of the local world")
    ap.add_argument("--seed", type=int, default=Config.seed)
    ap.add_argument("--ckpt-dir", default=None, help="resume from the newest checkpoint here and save new ones")
    ap.add_argument("--ckpt-every", type=int, default=0, help="save a checkpoint every N steps (and at the end)")
    ap.add_argument("--log-file", default=None, help="append 'step loss' lines here (rank 0)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from cocoweave.launch import in_torchrun, init_from_env

    try:
        if in_torchrun():
            rank, world_size, _ = init_from_env()
            cfg = Config(steps=args.steps, tensor_parallel=args.tensor_parallel, world_size=world_size,
                         seed=args.seed, batch=args.batch).validate()
            parallel = train_parallel(rank, world_size, asdict(cfg), args.ckpt_dir, args.ckpt_every, args.log_file)
            if rank != 0:
                dist.destroy_process_group()
                return 0
            result = compare(cfg, parallel, train_reference(cfg))
            dist.destroy_process_group()
        else:
            cfg = Config(steps=args.steps, tensor_parallel=args.tensor_parallel, world_size=args.world_size,
                         seed=args.seed, batch=args.batch).validate()
            result = run_local(cfg)
    except CocoweaveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    plot = write_outputs(result, args.out)
    cfg_d = result["config"]
    print(f"dp {cfg_d['world_size'] // cfg_d['tensor_parallel']} x tp {cfg_d['tensor_parallel']}, "
          f"{len(result['parallel'])} steps, optimizer: {result['optimizer']}")
    print(f"loss: first {result['parallel'][0]:.4f}, last {result['parallel'][-1]:.4f} "
          f"(reference {result['reference'][-1]:.4f}); max |difference| {result['max_abs_diff']:.2e}")
    print(f"parallel training took {result['parallel_seconds']:.1f} s; wrote {plot} and "
          f"{os.path.join(args.out, 'losses.json')}")
    ok = math.isfinite(result["max_abs_diff"]) and result["max_abs_diff"] < 1e-3
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
