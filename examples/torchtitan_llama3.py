"""torchtitan's own Llama 3 (the package from the index, unmodified) split by one `cocoweave.nn.parallelize` call,
its forward checked against the same model in one process.

    pip install --no-deps torchtitan==0.3.0 spmd_types tyro docstring_parser   # its model's imports, nothing else
    python examples/torchtitan_llama3.py --tensor-parallel 2                     # Gloo CPU ranks on this host

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


def check(rank: int, world_size: int, config: str, seq: int) -> float:
    """Max |difference| of the split model's logits from the single-process model's, on this rank."""
    import torch
    from torchtitan.models.llama3 import llama3_configs

    from cocoweave.nn import llama_plan, parallelize

    cfg = llama3_configs[config]("flex")
    torch.manual_seed(0)
    whole = cfg.build()
    if hasattr(whole, "init_weights"):
        whole.init_weights()
    split = cfg.build()
    split.load_state_dict(whole.state_dict())
    tokens = torch.randint(0, whole.config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(seq).unsqueeze(0).expand(2, seq)
    masks = whole.get_attention_masks(positions)
    with torch.no_grad():
        want = whole(tokens, positions=positions, attention_masks=masks)
        parallelize(split, None, llama_plan(split))  # the one line: torch's parallelize_module takes the same plan
        got = split(tokens, positions=positions, attention_masks=masks)
    return float((got - want).abs().max())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensor-parallel", type=int, default=2)
    ap.add_argument("--config", default="debugmodel")
    ap.add_argument("--seq", type=int, default=16)
    args = ap.parse_args(argv)
    try:
        import torchtitan.models.llama3  # noqa: F401
    except ImportError as exc:
        print(f"torchtitan's Llama 3 cannot be imported ({exc}); install it as this file's docstring says",
              file=sys.stderr)
        return 2
    from cocoweave.launch import LocalWorld

    with LocalWorld(args.tensor_parallel) as world:
        diffs = world.run(check, args.config, args.seq)
    print(f"torchtitan Llama 3 {args.config!r} at tp {args.tensor_parallel}: logits' max |difference| from one "
          f"process {max(diffs):.1e}")
    return 0 if max(diffs) < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
