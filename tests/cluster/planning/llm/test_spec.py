"""The transformer spec: FLOPs by formula against torch's FlopCounterMode on one traced layer, parameters, Hugging
Face configs, and unknown keys refused with one sentence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from cocoweave.cluster.planning.llm.spec import TransformerSpec, from_hf_config, parse_spec
from cocoweave.errors import PlanningError


def _layer_flops(spec: TransformerSpec, b: int) -> float:
    """Forward FLOPs of one pre-norm layer (QKV, SDPA, projection, MLP) as FlopCounterMode counts them."""
    h, f, s, hd = spec.hidden, spec.ffn_size, spec.seq_len, spec.dim_per_head
    qkv = torch.nn.Linear(h, spec.qkv_out)
    proj = torch.nn.Linear(spec.q_width, h)
    up = torch.nn.Linear(h, f * (2 if spec.gated_mlp else 1))
    down = torch.nn.Linear(f, h)
    x = torch.randn(b, s, h)
    with FlopCounterMode(display=False) as counter:
        q, k, v = qkv(F.layer_norm(x, (h,))).split([spec.q_width, spec.kv * hd, spec.kv * hd], dim=-1)
        q = q.view(b, s, spec.heads, hd).transpose(1, 2)
        k = k.view(b, s, spec.kv, hd).transpose(1, 2).repeat_interleave(spec.heads // spec.kv, dim=1)
        v = v.view(b, s, spec.kv, hd).transpose(1, 2).repeat_interleave(spec.heads // spec.kv, dim=1)
        # the attention core as unfused kernels run it (CPU's fused SDPA is not counted by FlopCounterMode)
        a = torch.softmax(q @ k.transpose(-1, -2) / hd**0.5, dim=-1) @ v
        a = a.transpose(1, 2).reshape(b, s, spec.q_width)
        x = x + proj(a)
        u = up(F.layer_norm(x, (h,)))
        if spec.gated_mlp:
            g, u = u.chunk(2, dim=-1)
            u = F.silu(g) * u
        else:
            u = F.gelu(u)
        x = x + down(u)
    return counter.get_total_flops()


@pytest.mark.parametrize("spec", [
    TransformerSpec(layers=1, hidden=64, heads=4, vocab=100, seq_len=32, global_batch=2),
    TransformerSpec(layers=1, hidden=64, heads=8, kv_heads=2, ffn=96, gated_mlp=True, vocab=100, seq_len=16,
                    global_batch=2),
    # a head width that is not hidden / heads (Qwen3's 128 with hidden 2048 and 32 heads)
    TransformerSpec(layers=1, hidden=64, heads=4, kv_heads=2, head_dim=32, ffn=96, gated_mlp=True, vocab=100,
                    seq_len=16, global_batch=2),
])
def test_layer_flops_match_flop_counter(spec):
    assert spec.layer_flops(3) == pytest.approx(_layer_flops(spec, 3), rel=1e-9)


def test_gpt3_parameters_and_model_flops():
    gpt3 = TransformerSpec(layers=96, hidden=12288, heads=96, vocab=51200, seq_len=2048, global_batch=1536)
    assert gpt3.params() == pytest.approx(175e9, rel=0.01)
    # Narayanan et al. eq. (3) without recomputation: 72 B s l h^2 (1 + s/6h + V/12lh)
    b, s, l, h, v = 1536, 2048, 96, 12288, 51200
    assert gpt3.model_flops_per_step() == pytest.approx(72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h)))


def test_hugging_face_head_dim_is_read_and_counted():
    """Qwen3-30B-A3B's config: head_dim 128 with hidden 2048 and 32 heads; 30.5B parameters as its model card."""
    config = {"hidden_act": "silu", "hidden_size": 2048, "moe_intermediate_size": 768, "intermediate_size": 6144,
              "num_attention_heads": 32, "num_hidden_layers": 48, "num_key_value_heads": 4, "head_dim": 128,
              "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8, "max_position_embeddings": 4096}
    spec = from_hf_config(config, global_batch=8)
    assert (spec.experts, spec.experts_per_token, spec.ffn_size) == (128, 8, 768)
    assert spec.dim_per_head == 128 and spec.q_width == 4096 and spec.qkv_out == 4096 + 2 * 4 * 128
    assert spec.params() == pytest.approx(30.5e9, rel=0.02)


def test_hugging_face_config_maps_llama_keys():
    config = {"hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
              "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
              "rope_theta": 500000.0}
    spec = from_hf_config(config, global_batch=64, name="llama3-8b")
    assert (spec.layers, spec.kv, spec.ffn_size, spec.gated_mlp, spec.seq_len) == (32, 8, 14336, True, 8192)
    assert spec.params() == pytest.approx(8.03e9, rel=0.01)


def test_unknown_key_and_bad_shape_are_one_sentence():
    doc = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 10, "seq_len": 8, "global_batch": 2}
    with pytest.raises(PlanningError, match=r"m.yaml: unknown key 'tensor_parallel' in the LLM spec \(allowed keys: "
                                            r"name, layers, hidden, heads"):
        parse_spec(doc | {"tensor_parallel": 8}, "m.yaml")
    with pytest.raises(PlanningError, match="hidden 64 is not a multiple of heads 5"):
        parse_spec(doc | {"heads": 5}, "m.yaml")
    with pytest.raises(PlanningError, match=r"'layers' in the LLM spec: input should be greater than 0"):
        parse_spec(doc | {"layers": 0}, "m.yaml")


def test_shipped_examples_load():
    from pathlib import Path

    from cocoweave.cluster.planning.llm.spec import load_spec

    examples = Path(__file__).resolve().parents[4] / "examples" / "llm"
    assert load_spec(examples / "gpt3-175b.yaml").params() == pytest.approx(175e9, rel=0.01)
    assert load_spec(examples / "llama3-8b-config.json").gated_mlp


@pytest.mark.parametrize("field, value, limit", [
    ("layers", 10**9, "10000"), ("hidden", 10**9, "1048576"), ("seq_len", 10**12, "134217728"),
    ("global_batch", 10**12, "16777216")])
def test_sizes_past_physical_limits_are_refused_naming_field_and_limit(field: str, value: int, limit: str):
    doc = {"layers": 4, "hidden": 512, "heads": 8, "vocab": 32000, "seq_len": 1024, "global_batch": 64, field: value}
    with pytest.raises(PlanningError) as err:
        parse_spec(doc, "m.yaml")
    assert f"'{field}'" in str(err.value) and limit in str(err.value)


def test_a_huge_value_is_quoted_short():
    with pytest.raises(PlanningError) as err:
        parse_spec({"layers": "x" * 1_000_000, "hidden": 512}, "m.yaml")
    assert "'layers'" in str(err.value) and len(str(err.value)) < 500
