# cocoweave profile: --ckpt-every 5
"""A DDP training script whose input pipeline is the bottleneck: every sample is read from a compressed shard
file and decoded (bz2, about 4 ms of CPU per sample on the 2-core VM) in a single-process DataLoader.

    torchrun --nproc-per-node 2 examples/slow_input.py --steps 30     # two Gloo ranks on CPUs
    python examples/slow_input.py --steps 30                           # one process
    cocoweave profile examples/slow_input.py -n 1,2 --predict 3        # names the input pipeline as the bottleneck

Each rank builds its shard once (`--records` compressed records of `--raw-kb` KiB of token bytes, in a
temporary folder), then trains a small transformer language model (DDP + AdamW) on batches of `--batch`
samples; a sample is one record read from the file (seek + read) and decompressed, its first `--context + 1`
bytes the tokens. `--workers N` moves the decoding to N loader processes (the fix the profiler suggests).
The shard is kept in $TMPDIR/cocoweave-slow-input-<uid> for later runs.
`--ckpt-every K` saves rank 0's model and optimizer with torch.save every K steps (what `cocoweave profile`
times as a checkpoint; the file is overwritten each time). `--device cuda` trains on the GPU (rank r on GPU
r mod the GPUs there, Gloo between ranks) and copies each batch there (`--pin-memory`: from pinned memory, without
blocking): what the profiler times as host-device transfers.
"""

from __future__ import annotations

import argparse
import bz2
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def write_shard(path: Path, records: int, raw_kb: int, vocab: int, seed: int) -> list[tuple[int, int]]:
    """Write `records` bz2-compressed records of token bytes (a noisy repeating pattern) to `path`; their
    (offset, length)."""
    rng = np.random.default_rng(seed)
    index, offset = [], 0
    with open(path, "wb") as f:
        for _ in range(records):
            start = int(rng.integers(vocab))
            tokens = (start + 7 * np.arange(raw_kb * 1024)) % vocab
            noise = rng.random(tokens.shape) < 0.1
            tokens = np.where(noise, rng.integers(0, vocab, tokens.shape), tokens).astype(np.uint8)
            blob = bz2.compress(tokens.tobytes(), 9)
            f.write(blob)
            index.append((offset, len(blob)))
            offset += len(blob)
    return index


def shard_index(path: Path, records: int, raw_kb: int, vocab: int, seed: int) -> list[tuple[int, int]]:
    """The shard at `path`, written first unless a run before wrote it (its index is then recomputed)."""
    index_path = path.with_suffix(".index.npy")
    if path.is_file() and index_path.is_file():
        return [tuple(map(int, row)) for row in np.load(index_path)]
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    index = write_shard(tmp, records, raw_kb, vocab, seed)
    np.save(index_path.with_name(f".{os.getpid()}.npy"), np.asarray(index))
    os.replace(index_path.with_name(f".{os.getpid()}.npy"), index_path)
    os.replace(tmp, path)
    return index


class ShardDataset(Dataset):
    """Samples read from a shard file and decoded on demand: the slow part of this input pipeline."""

    def __init__(self, path: Path, index: list[tuple[int, int]], context: int) -> None:
        self.path, self.index, self.context = path, index, context

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        offset, length = self.index[i]
        with open(self.path, "rb") as f:
            f.seek(offset)
            raw = bz2.decompress(f.read(length))
        seq = torch.frombuffer(bytearray(raw[: self.context + 1]), dtype=torch.uint8).long()
        return seq[:-1], seq[1:]


class TinyLM(nn.Module):
    """Token + position embeddings, one pre-norm encoder layer, a vocabulary head."""

    def __init__(self, vocab: int, d_model: int, context: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.block = nn.TransformerEncoderLayer(d_model, 2, dim_feedforward=4 * d_model, dropout=0.0,
                                                batch_first=True, norm_first=True)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.block(x))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="training steps (default %(default)s)")
    ap.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    ap.add_argument("--workers", type=int, default=0, help="DataLoader worker processes (0: decode in the rank)")
    ap.add_argument("--records", type=int, default=64, help="records in each rank's shard")
    ap.add_argument("--raw-kb", type=int, default=128, help="KiB of tokens per record before compression")
    ap.add_argument("--vocab", type=int, default=256, help="vocabulary size (at most 256: tokens are bytes)")
    ap.add_argument("--d-model", type=int, default=64, help="model width")
    ap.add_argument("--context", type=int, default=64, help="sequence length")
    ap.add_argument("--ckpt-every", type=int, default=0, help="torch.save rank 0's state every K steps (0: never)")
    ap.add_argument("--ckpt-dir", type=Path, default=None, help="checkpoint folder (default: a temporary one)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model trains")
    ap.add_argument("--pin-memory", action="store_true", help="pinned batches, copied without blocking (cuda)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in ("steps", "batch", "records", "raw_kb", "vocab", "d_model", "context"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.vocab > 256 or args.context + 1 > args.raw_kb * 1024:
        ap.error("--vocab must be at most 256 and --context shorter than a record")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a GPU, and torch sees none here")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    folder = Path(tempfile.gettempdir()) / f"cocoweave-slow-input-{os.getuid()}"  # reused by later runs
    folder.mkdir(exist_ok=True)
    shard = folder / f"shard-{args.records}x{args.raw_kb}k-v{args.vocab}-s{args.seed + rank}.bz2"
    data = ShardDataset(shard, shard_index(shard, args.records, args.raw_kb, args.vocab, args.seed + rank),
                        args.context)
    sampler = DistributedSampler(data, shuffle=True, seed=args.seed) if distributed else None
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, shuffle=sampler is None, drop_last=True,
                        num_workers=args.workers, persistent_workers=args.workers > 0,
                        pin_memory=args.pin_memory and device.type == "cuda")
    torch.manual_seed(args.seed)  # every rank starts from the same weights
    model: nn.Module = TinyLM(args.vocab, args.d_model, args.context).to(device)
    if distributed:
        model = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = (args.ckpt_dir or folder) / f"rank{rank}.pt"
    start, step, epoch = time.perf_counter(), 0, 0
    while step < args.steps:
        if sampler is not None:
            sampler.set_epoch(epoch)
        for x, y in loader:
            if device.type == "cuda":
                x, y = x.to(device, non_blocking=args.pin_memory), y.to(device, non_blocking=args.pin_memory)
            loss = F.cross_entropy(model(x).reshape(-1, args.vocab), y.reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if args.ckpt_every and step % args.ckpt_every == 0 and rank == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, ckpt)
            if step >= args.steps:
                break
        epoch += 1
    if rank == 0:
        print(f"{args.steps} steps, {1e3 * (time.perf_counter() - start) / args.steps:.1f} ms per step, "
              f"loss {loss.item():.3f}")
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
