"""Train a small transformer language model data-parallel with plain PyTorch: DDP + torch.optim.AdamW.

    torchrun --nproc-per-node 2 examples/train_lm.py --steps 50       # two Gloo ranks on CPUs
    python examples/train_lm.py --steps 50                            # one process
    cocoweave profile examples/train_lm.py --world-sizes 1,2,3 --predict 4 --json lm.json

The model is nn.Embedding (tokens and positions), a stack of nn.TransformerEncoderLayer (causal mask)
and a Linear head. Every rank trains on its own batch of `--batch` sequences each step (the global
batch grows with the world, as in most DDP jobs), drawn from a seeded synthetic corpus. Prints the
loss of rank 0 every `--log-every` steps and the mean step time at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class TransformerLM(nn.Module):
    """Token + position embeddings, `layers` pre-norm encoder layers with a causal mask, a vocabulary head."""

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, context: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=4 * d_model, dropout=dropout,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        n = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(n, device=idx.device))
        x = self.blocks(x, mask=self.mask[:n, :n], is_causal=True)
        return self.head(self.ln(x))


def batch(step: int, rank: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (inputs, targets) at `step`: a repeating pattern with noise, so the loss falls."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    start = torch.randint(0, args.vocab, (args.batch, 1), generator=gen)
    seq = (start + torch.arange(args.context + 1) * 7) % args.vocab
    noise = torch.rand(seq.shape, generator=gen) < 0.1
    seq = torch.where(noise, torch.randint(0, args.vocab, seq.shape, generator=gen), seq)
    return seq[:, :-1], seq[:, 1:]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50, help="training steps (default %(default)s)")
    ap.add_argument("--vocab", type=int, default=256, help="vocabulary size")
    ap.add_argument("--d-model", type=int, default=128, help="model width")
    ap.add_argument("--heads", type=int, default=4, help="attention heads")
    ap.add_argument("--layers", type=int, default=2, help="transformer layers")
    ap.add_argument("--context", type=int, default=64, help="sequence length")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=10, help="print rank 0's loss every N steps (0: never)")
    args = ap.parse_args(argv)
    for name in ("steps", "vocab", "d_model", "heads", "layers", "context", "batch"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.d_model % args.heads:
        ap.error(f"--heads {args.heads} must divide --d-model {args.d_model}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(args.seed)  # every rank starts from the same weights
    model: nn.Module = TransformerLM(args.vocab, args.d_model, args.heads, args.layers, args.context, args.dropout)
    if distributed:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model.train()
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = batch(step, rank, args)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), y.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if rank == 0 and args.log_every and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    if rank == 0:
        print(f"{args.steps} steps, {1e3 * (time.perf_counter() - start) / args.steps:.1f} ms per step")
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
