"""A transformer training workload: the model's shape, the batch, the dtype (and optionally MoE experts),
read from YAML or from a Hugging Face-style config dict, with its parameters and FLOPs by formula.

FLOPs follow Narayanan et al. (SC'21, eq. 3) term by term, generalised to grouped-query attention, gated
(SwiGLU) MLPs and top-k experts: a matmul of (M x K) by (K x N) is 2 M K N FLOPs; attention's two batched
matmuls are 4 b s^2 h; the logits 2 b s h V. Backward is twice the forward. `tests/cluster/planning/llm` checks the
per-layer count against `torch.utils.flop_counter.FlopCounterMode` tracing one small layer.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any, Literal

from pydantic import Field, model_validator

from cocoweave.cluster.schema import Strict, validate
from cocoweave.cluster.yamlio import load_yaml
from cocoweave.errors import PlanningError

# Bytes of a stored or communicated value. float8 trains as Transformer Engine and torchao do: the linear layers'
# GEMMs run on FP8 inputs (`step.py` prices them at the GPU's FP8 peak), while weights, activations kept for
# backward and the collectives stay 16-bit (both keep bf16 weights and activations; FP8 copies are transient), but
# for the tensor-parallel all-gathers of the linear layers' inputs (`step.tp_comm_layer_s`).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 2}
# Sane physical limits of a spec, each far beyond any published model (the largest: 128-200 layers, hidden 25,600-
# 53,248, vocabularies of 256K, 10M-token contexts): a value past one is refused with the field and its limit, so
# that no input makes the planner run for minutes or overflow its arithmetic.
LIMITS = {"layers": 10_000, "hidden": 2**20, "heads": 2**16, "ffn": 2**22, "vocab": 2**24, "seq_len": 2**27,
          "global_batch": 2**24, "experts": 2**16, "cp": 2**10}


class TransformerSpec(Strict):
    """A decoder-only transformer and its training batch (sequences of `seq_len` tokens per step)."""

    name: str = Field(default="model", max_length=200)
    layers: int = Field(gt=0, le=LIMITS["layers"])
    hidden: int = Field(gt=0, le=LIMITS["hidden"])
    heads: int = Field(gt=0, le=LIMITS["heads"])
    kv_heads: int | None = Field(default=None, gt=0, le=LIMITS["heads"])  # None: as many as heads (multi-head)
    head_dim: int | None = Field(default=None, gt=0, le=LIMITS["hidden"])  # None: hidden / heads (Qwen3: 128)
    ffn: int | None = Field(default=None, gt=0, le=LIMITS["ffn"])  # None: 4 x hidden
    gated_mlp: bool = False  # SwiGLU: three FFN matrices instead of two
    vocab: int = Field(gt=0, le=LIMITS["vocab"])
    seq_len: int = Field(gt=0, le=LIMITS["seq_len"])
    global_batch: int = Field(gt=0, le=LIMITS["global_batch"])  # sequences per optimizer step
    dtype: Literal["bfloat16", "float16", "float32", "float8"] = "bfloat16"
    experts: int = Field(default=1, gt=0, le=LIMITS["experts"])  # MoE: experts per layer (1: dense)
    experts_per_token: int = Field(default=1, gt=0, le=LIMITS["experts"])
    # expert-parallel degree: each rank of an ep group holds experts / ep experts and tokens reach them by two
    # all-to-alls per MoE layer each way (None: the layout search picks it)
    expert_parallel: int | None = Field(default=None, gt=0, le=LIMITS["experts"])
    # context-parallel degree: each rank holds seq_len / cp tokens of every sequence, attention exchanges keys
    # and values around a ring (None: the layout search picks it)
    context_parallel: int | None = Field(default=None, gt=0, le=LIMITS["cp"])
    flash_attention: bool = True  # fused attention: no s x s scores stored, causal half of the work done
    tied_embeddings: bool = False

    @model_validator(mode="after")
    def _shapes(self) -> TransformerSpec:
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.heads % self.kv:
            raise ValueError(f"heads {self.heads} is not a multiple of kv_heads {self.kv}")
        if self.experts_per_token > self.experts:
            raise ValueError(f"experts_per_token {self.experts_per_token} exceeds experts {self.experts}")
        if self.expert_parallel is not None and self.experts % self.expert_parallel:
            raise ValueError(f"expert_parallel {self.expert_parallel} does not divide experts {self.experts}")
        if self.context_parallel is not None and self.seq_len % (2 * self.context_parallel):
            raise ValueError(f"context_parallel {self.context_parallel} needs seq_len {self.seq_len} to be a multiple "
                             f"of 2 x {self.context_parallel} (each rank holds two chunks, for causal balance)")
        return self

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def dim_per_head(self) -> int:
        """Width of one attention head: `head_dim`, or hidden / heads."""
        return self.head_dim or self.hidden // self.heads

    @property
    def q_width(self) -> int:
        """Width of the queries (and of the attention output): heads x head width (hidden unless head_dim says)."""
        return self.heads * self.dim_per_head

    @property
    def bytes_per_value(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    @property
    def qkv_out(self) -> int:
        """Output width of the fused QKV projection: heads x head width for queries, 2 x kv_heads x head width for
        keys and values."""
        return self.q_width + 2 * self.kv * self.dim_per_head

    # --- parameters -------------------------------------------------------------------------------
    def layer_params(self) -> int:
        """Weights of one layer (biases and norms included; all experts)."""
        return _layer_params(self)

    def expert_params(self) -> int:
        """Weights of one layer's experts (all of them; 0 for a dense model): what expert parallelism shards."""
        return _expert_params(self)

    def embedding_params(self) -> int:
        """Input embedding plus (untied) output projection."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    def params(self) -> int:
        return self.layers * self.layer_params() + self.embedding_params() + 2 * self.hidden

    # --- FLOPs (forward, per micro-batch of b sequences) -----------------------------------------
    def layer_gemm_flops(self, b: int) -> dict[str, float]:
        """Forward FLOPs of one layer's matmuls for b sequences, by matmul (the attention core at full s x s)."""
        s, h, f = self.seq_len, self.hidden, self.ffn_size
        tokens = b * s
        out = {"qkv": 2.0 * tokens * h * self.qkv_out, "proj": 2.0 * tokens * self.q_width * h,
               "mlp": 2.0 * tokens * h * f * self.mlp_matrices * self.experts_per_token,
               "attention": 4.0 * b * s * s * self.q_width}
        if self.experts > 1:
            out["router"] = 2.0 * tokens * h * self.experts
        return out

    def layer_flops(self, b: int) -> float:
        return sum(self.layer_gemm_flops(b).values())

    def logits_flops(self, b: int) -> float:
        return 2.0 * b * self.seq_len * self.hidden * self.vocab

    def model_flops_per_step(self) -> float:
        """FLOPs of one optimizer step without recomputation (3 x forward): the numerator of MFU."""
        b = self.global_batch
        return 3.0 * (self.layers * self.layer_flops(b) + self.logits_flops(b))

    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


@lru_cache(maxsize=64)
def _layer_params(spec: TransformerSpec) -> int:
    """Weights of one layer, computed once per spec (the layout search asks for every layout; specs are frozen and
    hash by their fields, so a copy with other fields is another entry)."""
    h, f = spec.hidden, spec.ffn_size
    attn = h * spec.qkv_out + spec.qkv_out + spec.q_width * h + h
    mlp = spec.experts * (spec.mlp_matrices * h * f + f + h) + (h * spec.experts if spec.experts > 1 else 0)
    return attn + mlp + 4 * h


@lru_cache(maxsize=64)
def _expert_params(spec: TransformerSpec) -> int:
    if spec.experts == 1:
        return 0
    return spec.experts * (spec.mlp_matrices * spec.hidden * spec.ffn_size + spec.ffn_size + spec.hidden)


def parse_spec(doc: Any, source: str) -> TransformerSpec:
    """Validate an LLM spec document; unknown keys and bad values get one sentence naming the file and key."""
    if isinstance(doc, dict) and isinstance(doc.get("model"), dict):
        doc = {k: v for k, v in doc.items() if k != "model"} | doc["model"]
    return validate(TransformerSpec, doc, source, "LLM spec")


HF_KEYS = {"num_hidden_layers": "layers", "n_layer": "layers", "hidden_size": "hidden", "n_embd": "hidden",
           "num_attention_heads": "heads", "n_head": "heads", "num_key_value_heads": "kv_heads",
           "intermediate_size": "ffn", "n_inner": "ffn", "vocab_size": "vocab", "num_local_experts": "experts",
           "n_routed_experts": "experts", "num_experts": "experts", "num_experts_per_tok": "experts_per_token",
           "head_dim": "head_dim",
           "tie_word_embeddings": "tied_embeddings"}


def from_hf_config(config: dict, seq_len: int | None = None, global_batch: int = 1, name: str | None = None,
                   dtype: str = "bfloat16") -> TransformerSpec:
    """A spec from a Hugging Face `config.json` dict (Llama, Mistral, Mixtral, Qwen3(-MoE), GPT-2 key names; an
    MoE's `moe_intermediate_size` is its experts' width); a SiLU/SwiGLU
    activation means a gated MLP. Keys that do not shape the FLOPs or memory (dropout, rope...) are ignored."""
    doc: dict[str, Any] = {HF_KEYS[k]: v for k, v in config.items() if k in HF_KEYS and v is not None}
    if doc.get("experts", 1) > 1 and config.get("moe_intermediate_size"):  # Qwen-MoE, DeepSeek: the experts' width
        doc["ffn"] = config["moe_intermediate_size"]
    act = str(config.get("hidden_act", config.get("activation_function", "gelu")))
    doc["gated_mlp"] = act in ("silu", "swiglu", "swish")
    seq = seq_len or config.get("max_position_embeddings") or config.get("n_positions")
    if seq is None:
        raise PlanningError("the Hugging Face config names no max_position_embeddings: give the sequence length.")
    doc |= {"seq_len": seq, "global_batch": global_batch, "dtype": dtype,
            "name": name or config.get("_name_or_path") or config.get("model_type") or "hf-model"}
    return validate(TransformerSpec, doc, "Hugging Face config", "LLM spec")


def load_spec(path: str | os.PathLike) -> TransformerSpec:
    """Read an LLM spec YAML: our keys, or a Hugging Face config (recognised by `num_hidden_layers`) plus
    seq_len and global_batch."""
    doc = load_yaml(path, "LLM spec")
    if isinstance(doc, dict) and ("num_hidden_layers" in doc or "n_layer" in doc):
        extra = {k: doc[k] for k in ("seq_len", "global_batch", "dtype", "name") if k in doc}
        return from_hf_config(doc, extra.get("seq_len"), extra.get("global_batch", 1), extra.get("name"),
                              extra.get("dtype", "bfloat16"))
    return parse_spec(doc, str(path))
