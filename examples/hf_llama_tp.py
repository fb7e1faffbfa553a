"""Hugging Face's LlamaForCausalLM (transformers, unmodified, built from a config) trained at tensor parallelism by
one `cocoweave.nn.parallelize` call, its losses checked against the same model in one process.

    pip install transformers                                         # not a cocoweave dependency
    python examples/hf_llama_tp.py --tensor-parallel 2 --steps 3     # Gloo CPU ranks on this host

`llama_plan` reads Hugging Face's module names (model.layers.N.self_attn.q_proj/k_proj/v_proj/o_proj,
mlp.gate_proj/up_proj/down_proj); every parameter becomes a DTensor, so torch's `clip_grad_norm_` (used here) is the
whole model's norm. Measured 2026-12-04 on the 2-vCPU AMD EPYC VM (torch 2.13.0+cpu, transformers 5.25.0 from the
package index): 3 clipped AdamW steps at tp 2, losses within 4.8e-7 of one process's.
"""

from __future__ import annotations

import argparse
import sys


def train(rank: int, world_size: int, steps: int) -> float:
    """Largest difference of this rank's split model's losses from the single-process model's over `steps` steps."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from cocoweave.nn import llama_plan, parallelize

    cfg = LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=512, max_position_embeddings=64, attn_implementation="sdpa")
    torch.manual_seed(0)
    whole = LlamaForCausalLM(cfg)
    split = LlamaForCausalLM(cfg)
    split.load_state_dict(whole.state_dict())
    parallelize(split, None, llama_plan(split))  # the one line: torch's parallelize_module takes the same plan
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    worst = 0.0
    optimizers = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (whole, split)}
    for _ in range(steps):
        losses = []
        for m in (whole, split):
            opt = optimizers[id(m)]
            opt.zero_grad()
            loss = m(input_ids=tokens, labels=tokens).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            opt.step()
            losses.append(float(loss.detach()))
        worst = max(worst, abs(losses[0] - losses[1]))
    return worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensor-parallel", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        print(f"transformers cannot be imported ({exc}); pip install transformers", file=sys.stderr)
        return 2
    from cocoweave.launch import LocalWorld

    with LocalWorld(args.tensor_parallel) as world:
        worst = max(world.run(train, args.steps))
    print(f"LlamaForCausalLM at tp {args.tensor_parallel}, {args.steps} clipped steps: losses' max |difference| from "
          f"one process {worst:.1e}")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
