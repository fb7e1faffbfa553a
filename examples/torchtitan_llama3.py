"""torchtitan's own Llama 3 (the package from the index, unmodified) split by one `cocoweave.nn.parallelize` call,
its forward checked against the same model in one process, or (`--steps N`) N clipped AdamW steps of both compared.

    pip install --no-deps torchtitan==0.3.0 spmd_types tyro docstring_parser   # its model's imports, nothing else
    python examples/torchtitan_llama3.py --tensor-parallel 2                     # Gloo CPU ranks on this host
    python examples/torchtitan_llama3.py --tensor-parallel 2 --device cuda --steps 20   # on a GPU (Gloo ranks
                                                # sharing it): the single-process loss curve within 1e-5, clipping on

What it shows: torchtitan's module names (the fused `qkv_linear.wqkv`, laid out KV group by KV group so that
contiguous row parts are whole groups, `feed_forward.w1/w2/w3`) take `llama_plan` as they are, and the split model
computes the single-process logits (2026-12-04, 2-vCPU AMD EPYC VM, torch 2.13.0+cpu: max |difference| 9.5e-7 at
tp 2, the "debugmodel" config: dim 256, 6 layers, 16 heads, vocab 2048). Training it here is not possible:
torchtitan 0.3.0 dropped SDPA for its language models (FlexAttention or varlen only), and torch 2.13 has no
FlexAttention backward on the CPU; on a GPU the same call trains it. cocoweave.nn.Llama (the same names, SDPA) is the
model the tests train (tests/nn/test_parallelize.py).
"""

from __future__ import annotations

import argparse
import sys


def _twins(config: str) -> tuple:
    """torchtitan's Llama 3 `config` built twice with the same initial weights: (whole, to be split)."""
    import torch
    from torchtitan.models.llama3 import llama3_configs

    cfg = llama3_configs[config]("flex")
    torch.manual_seed(0)
    whole = cfg.build()
    if hasattr(whole, "init_weights"):
        whole.init_weights()
    split = cfg.build()
    split.load_state_dict(whole.state_dict())
    return whole, split


def check(rank: int, world_size: int, config: str, seq: int) -> float:
    """Max |difference| of the split model's logits from the single-process model's, on this rank."""
    import torch

    from cocoweave.nn import llama_plan, parallelize

    whole, split = _twins(config)
    tokens = torch.randint(0, whole.config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(seq).unsqueeze(0).expand(2, seq)
    masks = whole.get_attention_masks(positions)
    with torch.no_grad():
        want = whole(tokens, positions=positions, attention_masks=masks)
        parallelize(split, None, llama_plan(split))  # the one line: torch's parallelize_module takes the same plan
        got = split(tokens, positions=positions, attention_masks=masks)
    return float((got - want).abs().max())


LR, CLIP, BATCH = 3e-3, 0.05, 2  # a clip this small acts at every step (as tests/nn/test_parallelize.py's)


def train(rank: int, world_size: int, config: str, seq: int, steps: int, device: str) -> dict:
    """`steps` clipped AdamW steps of the split model and of the whole one (in this process, on the same device),
    on the same batches: both loss curves and the norms torch's clip_grad_norm_ returned (fp32, TF32 off)."""
    import torch
    import torch.nn.functional as F

    from cocoweave.nn import llama_plan, parallelize

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    whole, split = (m.to(dev) for m in _twins(config))
    parallelize(split, None, llama_plan(split))
    positions = torch.arange(seq + 1, device=dev)[:-1].unsqueeze(0).expand(BATCH, seq)
    out: dict[str, list[float]] = {}
    for name, model in (("whole", whole), ("split", split)):
        masks = model.get_attention_masks(positions)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses, norms = [], []
        for step in range(steps):
            tokens = torch.randint(0, whole.config.vocab_size, (BATCH, seq + 1),
                                   generator=torch.Generator().manual_seed(1000 + step)).to(dev)
            opt.zero_grad()
            logits = model(tokens[:, :-1], positions=positions, attention_masks=masks)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            losses.append(float(loss.detach()))
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        out[f"{name}_losses"], out[f"{name}_norms"] = losses, norms
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensor-parallel", type=int, default=2)
    ap.add_argument("--config", default="debugmodel")
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--steps", type=int, default=0, help="train this many clipped steps both ways (0: forward only)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--json", default=None, help="write the curves and differences here")
    args = ap.parse_args(argv)
    try:
        import torchtitan.models.llama3  # noqa: F401
    except ImportError as exc:
        print(f"torchtitan's Llama 3 cannot be imported ({exc}); install it as this file's docstring says",
              file=sys.stderr)
        return 2
    from cocoweave.errors import CocoweaveError
    from cocoweave.launch import LocalWorld

    if args.steps <= 0:
        with LocalWorld(args.tensor_parallel) as world:
            diffs = world.run(check, args.config, args.seq)
        print(f"torchtitan Llama 3 {args.config!r} at tp {args.tensor_parallel}: logits' max |difference| from one "
              f"process {max(diffs):.1e}")
        return 0 if max(diffs) < 1e-4 else 1
    try:
        with LocalWorld(args.tensor_parallel, device=args.device, backend="gloo") as world:
            runs = world.run(train, args.config, args.seq, args.steps, args.device)
    except CocoweaveError as exc:
        if "backward on CPU" in str(exc):
            print("torchtitan's Llama 3 attends with FlexAttention, which has no backward on the CPU in this torch: "
                  "train it on a GPU (--device cuda)", file=sys.stderr)
            return 2
        raise
    worst = max(max(abs(a - b) for a, b in zip(r[f"split_{k}"], r[f"whole_{k}"], strict=True))
                for r in runs for k in ("losses", "norms"))
    print(f"torchtitan Llama 3 {args.config!r} at tp {args.tensor_parallel} on {args.device}, {args.steps} clipped "
          f"steps: loss {runs[0]['whole_losses'][0]:.4f} -> {runs[0]['whole_losses'][-1]:.4f}; the split model's "
          f"losses and norms within {worst:.1e} of one process's")
    if args.json:
        import json

        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"config": args.config, "tensor_parallel": args.tensor_parallel, "device": args.device,
                       "steps": args.steps, "max_difference": worst, "ranks": runs}, f, indent=1)
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
