# cocoweave profile: --tensor-parallel 1 --batch 24
"""Train a tiny character-level GPT data-parallel x tensor-parallel with cocoweave.nn, and check that its loss
curve equals the same model trained in one process with plain torch.

    python examples/train_gpt.py --steps 200 --out runs/gpt          # a local Gloo world of 4 CPU ranks
    torchrun --nproc-per-node 4 examples/train_gpt.py --steps 200     # the same under torchrun

World ranks r = dp * tp_size + tp: transformer blocks split their attention heads and MLP units over the
tensor-parallel group (cocoweave.nn.TransformerBlock; fused bias + dropout + residual epilogues with
cocoweave's counter-based dropout), the global batch is split over the data-parallel group and
cocoweave.optim.DistributedAdamW(process_group=dp_group) averages the gradients over it. Each rank initialises
only its part of every block (the values the single-process block holds). The single-process reference
(cocoweave.nn.ReferenceBlock: torch.nn layers and the same dropout hash) sees the whole global batch. Writes
losses.json and loss.png to --out.

Checkpoints (--ckpt-dir) hold every tensor-parallel part once (cocoweave.nn.sharded_state_dict and
sharded_optimizer_state_dict through cocoweave.checkpoint): a run saved at one --tensor-parallel size resumes at
another, on the same curve.

Elastic training (cocoweave.elastic): the samples are the corpus cut into windows, taken in a global order fixed
by (seed, epoch) whose position is saved in every checkpoint, so a job restarted at another world size goes on
with the next samples. `--batch-policy keep_global` (the default) keeps the global batch at every world size
(uneven shares, `--micro-batch` caps a rank's forward with gradient accumulation): the loss curve is the same as
an uninterrupted run's. `--batch-policy scale --lr-rule linear|sqrt|adascale` keeps each rank's batch, so the
global batch follows the world size, and scales the learning rate by the rule; the reference then replays the
same world sizes step by step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cocoweave import checkpoint, faults
from cocoweave.elastic import LR_RULES, MODES, AdaScale, BatchPolicy, ElasticSampler, StepPlan, gradient_moments
from cocoweave.errors import CocoweaveError
from cocoweave.nn import (
    ReferenceBlock,
    TransformerBlock,
    parallel_groups,
    sharded_optimizer_state_dict,
    sharded_state_dict,
    unshard,
)
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
    batch: int = 16  # global batch (sequences per step; scale: at base_world ranks), split over the dp ranks
    dropout: float = 0.1
    lr: float = 3e-3
    weight_decay: float = 0.01
    seed: int = 0
    corpus_chars: int = 20_000
    batch_policy: str = "keep_global"  # cocoweave.elastic.BatchPolicy: keep_global | scale
    lr_rule: str | None = None  # scale: linear (the default) | sqrt | adascale
    base_world: int | None = None  # scale: the data-parallel size `batch` and `lr` are for (None: where it starts)
    micro_batch: int | None = None  # the most sequences a rank runs forward at once (gradient accumulation)
    schedule: str | None = None  # the blocks' schedule= (None: as written; "auto"; a schedule's name)

    @property
    def data_parallel(self) -> int:
        return self.world_size // self.tensor_parallel

    def policy(self, base_world: int | None = None) -> BatchPolicy:
        """The batch policy, scale's base world being `base_world` unless the config names one."""
        if self.batch_policy == "scale":
            return BatchPolicy.scale(self.batch, self.base_world or base_world or self.data_parallel,
                                     self.lr_rule or "linear", self.micro_batch)
        return BatchPolicy(self.batch_policy, self.batch, lr_rule=self.lr_rule,
                           micro_batch=self.micro_batch)

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
        # A policy it cannot use, a batch it cannot split (scale's base world may come from a checkpoint: its
        # split is checked when training starts).
        self.policy(base_world=1).plan(self.data_parallel)
        if self.lr_rule == "adascale" and self.tensor_parallel > 1:
            raise CocoweaveError("--lr-rule adascale needs --tensor-parallel 1: its gradient statistics are "
                                 "taken over whole data-parallel replicas")
        if CharData.windows(self) < 1:
            raise CocoweaveError(f"--corpus-chars {self.corpus_chars} holds no sample of {self.block + 1} "
                                 "characters")
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
    """The corpus as token ids, cut into samples: window i is characters [i * block, (i + 1) * block] (inputs
    and next-character targets). The same on every rank."""

    def __init__(self, cfg: Config) -> None:
        text = corpus(cfg.corpus_chars, cfg.seed)
        self.vocab = sorted(set(text))
        self.ids = torch.tensor([self.vocab.index(c) for c in text], dtype=torch.long)
        self.cfg = cfg
        self.num_samples = self.windows(cfg)

    @staticmethod
    def windows(cfg: Config) -> int:
        """How many samples the corpus of `cfg` holds."""
        return (cfg.corpus_chars - 1) // cfg.block

    def sampler(self) -> ElasticSampler:
        """The global sample order of this run (fixed by the seed and the epoch)."""
        return ElasticSampler(self.num_samples, seed=self.cfg.seed)

    def samples(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the given samples: [len(indices), block] each."""
        b = self.cfg.block
        x = torch.stack([self.ids[i * b:(i + 1) * b] for i in indices])
        y = torch.stack([self.ids[i * b + 1:(i + 1) * b + 1] for i in indices])
        return x, y

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch at `step` of a run whose global batch is always cfg.batch (keep_global)."""
        return self.samples(self.sampler().indices(step * self.cfg.batch, self.cfg.batch))


# ---------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------


class GPT(nn.Module):
    """Token and position embeddings, transformer blocks, a final LayerNorm and the vocabulary head.
    `blocks` are ReferenceBlocks (one process) or tensor-parallel TransformerBlocks; the other layers are drawn
    from cfg.seed (the same on every rank and in the reference)."""

    def __init__(self, vocab: int, cfg: Config, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            self.tok = nn.Embedding(vocab, cfg.d_model)
            self.pos = nn.Embedding(cfg.block, cfg.d_model)
            self.ln = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, vocab)

    def forward(self, idx: torch.Tensor, step: int = 0, index_offset: int = 0) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x, step=step, index_offset=index_offset)
        return self.head(self.ln(x))


def block_seed(cfg: Config, i: int) -> int:
    """The seed of block i: its weights and its dropout masks."""
    return cfg.seed * 100 + i


def reference_model(vocab: int, cfg: Config) -> GPT:
    """The single-process model, initialised from cfg.seed (every rank builds the same one)."""
    blocks = [ReferenceBlock(cfg.d_model, cfg.heads, dropout=cfg.dropout, seed=block_seed(cfg, i))
              for i in range(cfg.layers)]
    return GPT(vocab, cfg, blocks)


def parallel_model(vocab: int, cfg: Config, tp_group: Any) -> GPT:
    """The tensor-parallel model: each rank draws only its part of the reference model's block weights."""
    blocks = [TransformerBlock(cfg.d_model, cfg.heads, dropout=cfg.dropout, group=tp_group, seed=block_seed(cfg, i),
                               schedule=cfg.schedule) for i in range(cfg.layers)]
    return GPT(vocab, cfg, blocks)


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
    """What a checkpoint holds: the step to run next, the model, the optimizer, the position in the sample order,
    per step so far the loss, data-parallel size and learning rate, scale's base world and AdaScale's averages."""

    step: int
    model: nn.Module
    optimizer: Any
    losses: list[float]
    sampler: ElasticSampler
    worlds: list[int] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    base_world: int | None = None
    adascale: AdaScale | None = None


def train_parallel(rank: int, world_size: int, cfg_dict: dict[str, Any], ckpt_dir: str | None = None,
                   ckpt_every: int = 0, log_file: str | None = None, samples_log: str | None = None,
                   device: str = "cpu") -> dict[str, Any]:
    """Run on every rank of an initialised world: train the data x tensor parallel model for cfg.steps steps.
    Returns the global loss per step (the mean over the global batch), the data-parallel size and learning rate
    of every step, and what was used. The model and batches go on `device` (init_from_env's: NCCL needs the GPU).

    With `ckpt_dir`, resumes from its newest complete checkpoint (saved at any world size) and saves one every
    `ckpt_every` steps (cocoweave.checkpoint); rank 0 appends "step loss" lines to `log_file`, and "step
    data-parallel-size lr samples-of-rank-0|samples-of-rank-1|..." lines to `samples_log` (steps after the
    checkpoint a restarted run resumes from are dropped from both: they are run again)."""
    cfg = Config(**cfg_dict).validate()
    if world_size != cfg.world_size:
        raise CocoweaveError(f"the config is for {cfg.world_size} ranks, the world has {world_size}")
    data = CharData(cfg)
    tp_group, dp_group = parallel_groups(cfg.tensor_parallel)
    tp_rank, dp_rank, dp_size = group_rank(tp_group), group_rank(dp_group), group_size(dp_group)
    model = parallel_model(len(data.vocab), cfg, tp_group).to(device)  # init_from_env's device (NCCL: the GPU)
    optimizer, opt_name = make_optimizer(model, cfg, dp_group)
    state = TrainState(0, model, optimizer, [], data.sampler(),
                       adascale=AdaScale(cfg.batch) if cfg.lr_rule == "adascale" else None)
    saved_policy = resume(state, ckpt_dir) if ckpt_dir is not None else None
    policy = cfg.policy(saved_policy["base_world"] if saved_policy else dp_size)
    if saved_policy is not None and saved_policy != asdict(policy):
        raise CocoweaveError(f"the checkpoints in {ckpt_dir} were trained with batch policy "
                             f"{BatchPolicy(**saved_policy).describe()}, not {policy.describe()}")
    state.base_world = policy.base_world
    plan = policy.plan(dp_size)
    for path in (log_file, samples_log):
        if rank == 0 and path is not None:
            start_log(Path(path), state.step)
    start = time.perf_counter()
    model.train()
    while state.step < cfg.steps:
        faults.maybe_fault(rank, state.step, "train_step")  # COCOWEAVE_FAULT=...,label=train_step (tests)
        loss, lr, used = train_step(state, data, cfg, plan, dp_rank, dp_group)
        state.losses.append(loss)
        state.worlds.append(dp_size)
        state.lrs.append(lr)
        if samples_log is not None:
            shares: list[Any] = [used]
            if dp_size > 1:
                shares = [None] * dp_size
                dist.all_gather_object(shares, used, group=dp_group)
            if rank == 0:
                with open(samples_log, "a") as f:
                    f.write(f"{state.step} {dp_size} {lr!r} {'|'.join(','.join(map(str, s)) for s in shares)}\n")
        if rank == 0 and log_file is not None:
            with open(log_file, "a") as f:
                f.write(f"{state.step} {state.losses[-1]!r}\n")
        state.step += 1
        if ckpt_dir is not None and ckpt_every > 0 and (state.step % ckpt_every == 0 or state.step == cfg.steps):
            checkpoint.save(checkpoint.step_path(ckpt_dir, state.step), _ckpt_state(state, policy),
                            step=state.step)
    return {"losses": state.losses, "worlds": state.worlds, "lrs": state.lrs, "base_world": state.base_world,
            "adascale": state.adascale.state_dict() if state.adascale else None, "optimizer": opt_name,
            "seconds": time.perf_counter() - start, "rank": rank, "tp": tp_rank, "dp": dp_rank}


def train_step(state: TrainState, data: CharData, cfg: Config, plan: StepPlan, dp_rank: int,
               dp_group: Any) -> tuple[float, float, list[int]]:
    """One optimizer step on this rank's share of the next global batch: its micro-batches with gradient
    accumulation, each mean loss weighted so that the averaged gradient is the global batch's mean, and dropout
    masks drawn at the samples' positions in the global batch (the same at every world size). Returns the global
    batch's mean loss, the learning rate used and the samples this rank trained on."""
    indices = state.sampler.next_batch(plan.global_batch)
    parts = plan.micro_batches(dp_rank)
    state.optimizer.zero_grad()
    device = next(state.model.parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    used: list[int] = []
    # One micro-batch on every rank: its backward launches the reduction (overlap). More on some rank: all ranks
    # accumulate under no_sync and step() reduces (after no_sync backwards, DistributedAdamW's hooks launch at the
    # first gradient of the synced one, before the rest of it is in). The ranks must agree on where the reduction
    # starts. AdaScale reads the local gradients before any reduction.
    sync = plan.accumulation == 1 and state.adascale is None
    for part in parts:
        mine = [indices[i] for i in part]
        x, y = (t.to(device) for t in data.samples(mine))
        loss = loss_of(state.model, x, y, state.step, part.start * cfg.block * cfg.d_model)
        with contextlib.nullcontext() if sync else state.optimizer.no_sync():
            (loss * plan.weight(len(part))).backward()
        total += loss.detach().double() * len(part)
        used += mine
    lr = cfg.lr * plan.lr_scale
    if state.adascale is not None:
        grads = [p.grad for p in state.model.parameters() if p.grad is not None]
        state.adascale.update(*gradient_moments(grads, dp_group), plan.world_size, plan.shares[0])
        lr *= state.adascale.step(plan.global_batch)
    for group in state.optimizer.param_groups:
        group["lr"] = lr
    state.optimizer.step()
    if plan.world_size > 1:
        dist.all_reduce(total, group=dp_group)
    return float(total) / plan.global_batch, lr, used


def _ckpt_state(state: TrainState, policy: BatchPolicy | None = None) -> dict[str, Any]:
    """What a checkpoint holds. Each tensor-parallel part of the model and of its optimizer state is a Shard (its
    place in the whole tensor: the checkpoint loads at another tensor-parallel size), written once by the
    data-parallel replicas that hold it; the rest is replicated (stored once) or plain values, the same on every
    rank."""
    model, optim = sharded_state_dict(state.model), sharded_optimizer_state_dict(state.model, state.optimizer)
    return {"model": model, "optim": optim,
            "step": state.step, "losses": json.dumps(state.losses), "worlds": json.dumps(state.worlds),
            "lrs": json.dumps(state.lrs), "sampler": state.sampler.state_dict(),
            "policy": json.dumps(asdict(policy) if policy else None),
            "adascale": json.dumps(state.adascale.state_dict() if state.adascale else None)}


def resume(state: TrainState, ckpt_dir: str) -> dict[str, Any] | None:
    """Load the newest complete checkpoint of `ckpt_dir` into `state`, if there is one; returns the batch policy
    it was trained with (BatchPolicy's fields), None without a checkpoint."""
    path = checkpoint.latest(ckpt_dir)
    if path is None:
        return None
    loaded = checkpoint.load(path, _ckpt_state(state))
    state.model.load_state_dict(unshard(loaded["model"]))
    state.optimizer.load_state_dict(unshard(loaded["optim"]))
    state.step, state.losses = loaded["step"], json.loads(loaded["losses"])
    state.worlds, state.lrs = json.loads(loaded["worlds"]), json.loads(loaded["lrs"])
    state.sampler.load_state_dict(loaded["sampler"])
    adascale = json.loads(loaded["adascale"])
    if (adascale is None) != (state.adascale is None):
        raise CocoweaveError(f"checkpoint {path} was trained {'with' if adascale else 'without'} AdaScale; resume "
                             "it with the learning-rate rule it was trained with")
    if state.adascale is not None:
        state.adascale.load_state_dict(adascale)
    return json.loads(loaded["policy"])


def start_log(log: Path, step: int) -> None:
    """Keep the log's lines of the steps before `step` (a resumed run repeats the later ones)."""
    kept = []
    if log.exists():
        for line in log.read_text().splitlines():
            parts = line.split()
            if line.startswith("#") or (len(parts) >= 2 and parts[0].isdigit() and int(parts[0]) < step):
                kept.append(line + "\n")
    if step > 0:
        kept.append(f"# resumed at step {step}\n")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("".join(kept))


def train_reference(cfg: Config, worlds: list[int] | None = None, base_world: int | None = None) -> list[float]:
    """The same model and data in one process with plain torch (torch.optim.AdamW, the whole global batch), the
    batch policy replayed at the data-parallel size of every step (`worlds`; cfg's size when not given). AdaScale
    needs each rank's gradient: the global batch is then run rank share by rank share."""
    data = CharData(cfg)
    policy = cfg.policy(base_world)
    model = reference_model(len(data.vocab), cfg)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sampler = data.sampler()
    adascale = AdaScale(cfg.batch) if cfg.lr_rule == "adascale" else None
    losses = []
    model.train()
    for step in range(cfg.steps):
        plan = policy.plan(worlds[step] if worlds else cfg.data_parallel)
        x, y = data.samples(sampler.next_batch(plan.global_batch))
        optimizer.zero_grad(set_to_none=True)
        lr = cfg.lr * plan.lr_scale
        if adascale is None:
            loss = loss_of(model, x, y, step)
            loss.backward()
        else:
            shares = [plan.rank_range(r) for r in range(plan.world_size)]
            partial = [loss_of(model, x[s.start:s.stop], y[s.start:s.stop], step, s.start * cfg.block * cfg.d_model)
                       for s in shares]
            grads = [torch.autograd.grad(part, params) for part in partial]
            for p, *g in zip(params, *grads):
                p.grad = torch.stack(g).mean(0)
            local = sum(sum(float(t.double().pow(2).sum()) for t in g) for g in grads)
            mean = sum(float(p.grad.double().pow(2).sum()) for p in params)
            adascale.update(local, mean, plan.world_size, plan.shares[0])
            lr *= adascale.step(plan.global_batch)
            loss = sum(part.detach() * len(s) for part, s in zip(partial, shares)) / plan.global_batch
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


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
    return compare(cfg, per_rank[0])


def compare(cfg: Config, parallel: dict[str, Any]) -> dict[str, Any]:
    """The parallel run's loss curve, the reference's (replaying its world sizes) and their largest difference."""
    reference = train_reference(cfg, parallel["worlds"], parallel["base_world"])
    diffs = [abs(a - b) for a, b in zip(parallel["losses"], reference)]
    return {"config": asdict(cfg), "parallel": parallel["losses"], "reference": reference,
            "max_abs_diff": max(diffs, default=0.0), "optimizer": parallel["optimizer"],
            "parallel_seconds": parallel["seconds"], "worlds": parallel["worlds"], "lrs": parallel["lrs"],
            "policy": cfg.policy(parallel["base_world"]).describe(), "adascale": parallel["adascale"]}


def worlds_label(worlds: list[int]) -> str:
    """'4 -> 2 -> 3': the data-parallel sizes a run went through."""
    sizes = [w for i, w in enumerate(worlds) if i == 0 or worlds[i - 1] != w]
    return " -> ".join(map(str, sizes))


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
    ax.plot(steps, result["parallel"], label=f"dp {worlds_label(result['worlds'])} x "
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
    ap.add_argument("--world-size", type=int, default=Config.world_size, help="ranks of the local world")
    ap.add_argument("--seed", type=int, default=Config.seed)
    ap.add_argument("--ckpt-dir", default=None, help="resume from the newest checkpoint here and save new ones")
    ap.add_argument("--ckpt-every", type=int, default=0, help="save a checkpoint every N steps (and at the end)")
    ap.add_argument("--log-file", default=None, help="append 'step loss' lines here (rank 0)")
    ap.add_argument("--samples-log", default=None,
                    help="append 'step dp-size lr samples-of-each-rank' lines here (rank 0; a gather per step)")
    ap.add_argument("--batch", type=int, default=Config.batch,
                    help="global batch in sequences (scale: at --base-world ranks; default %(default)s)")
    ap.add_argument("--batch-policy", choices=MODES, default=Config.batch_policy,
                    help="keep_global: the global batch stays fixed when the world resizes; scale: each rank's "
                         "batch stays, the learning rate follows --lr-rule (default %(default)s)")
    ap.add_argument("--lr-rule", choices=LR_RULES, default=None,
                    help="scale's learning-rate rule (default linear)")
    ap.add_argument("--base-world", type=int, default=None,
                    help="scale: the data-parallel size --batch and the learning rate are for (default: the size "
                         "the run starts at)")
    ap.add_argument("--micro-batch", type=int, default=None,
                    help="the most sequences a rank runs forward at once (gradient accumulation beyond)")
    ap.add_argument("--corpus-chars", type=int, default=Config.corpus_chars, help="size of the training text")
    ap.add_argument("--schedule", default=Config.schedule,
                    help="the blocks' schedule: 'as written' (the default), 'auto' (measured) or a schedule's name")
    return ap.parse_args(argv)


def config_from(args: argparse.Namespace, world_size: int) -> Config:
    """The run's Config from the command line, for a world of `world_size` ranks (checked)."""
    return Config(steps=args.steps, tensor_parallel=args.tensor_parallel, world_size=world_size, seed=args.seed,
                  batch=args.batch, batch_policy=args.batch_policy, lr_rule=args.lr_rule, base_world=args.base_world,
                  micro_batch=args.micro_batch, corpus_chars=args.corpus_chars, schedule=args.schedule).validate()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from cocoweave.launch import in_torchrun, init_from_env, shutdown

    try:
        if in_torchrun():
            rank, world_size, device = init_from_env()
            cfg = config_from(args, world_size)
            parallel = train_parallel(rank, world_size, asdict(cfg), args.ckpt_dir, args.ckpt_every, args.log_file,
                                      args.samples_log, str(device))
            shutdown()  # every rank leaves the group together (a live Gloo group can abort the exit)
            if rank != 0:
                return 0
            result = compare(cfg, parallel)
        else:
            result = run_local(config_from(args, args.world_size))
    except CocoweaveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    plot = write_outputs(result, args.out)
    cfg_d = result["config"]
    print(f"dp {worlds_label(result['worlds'])} x tp {cfg_d['tensor_parallel']}, "
          f"{len(result['parallel'])} steps, optimizer: {result['optimizer']}; batch policy {result['policy']}")
    print(f"loss: first {result['parallel'][0]:.4f}, last {result['parallel'][-1]:.4f} "
          f"(reference {result['reference'][-1]:.4f}); max |difference| {result['max_abs_diff']:.2e}")
    print(f"parallel training took {result['parallel_seconds']:.1f} s; wrote {plot} and "
          f"{os.path.join(args.out, 'losses.json')}")
    ok = math.isfinite(result["max_abs_diff"]) and result["max_abs_diff"] < 1e-3
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
