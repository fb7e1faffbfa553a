"""How a transformer is laid out on N GPUs: tensor (tp), context (cp), pipeline (pp, with vp virtual stages per
GPU) and data (dp) parallel degrees, the expert-parallel degree (ep, carved out of cp x dp for the experts), the
ZeRO stage of the data-parallel group (0: DDP, 1: distributed optimizer, 2: + gradients,
3: FSDP), sequence parallelism, activation recomputation and the micro-batch size.

Ranks are laid out as Megatron-LM does (its order tp-cp-ep-dp-pp): tp innermost (a tp group is tp consecutive GPUs
of one node), then cp, then dp, then pp; so a cp group strides by tp, a dp group by tp x cp, an ep group (expert
tensor parallelism equal to tp) by tp, and a pipeline's neighbours are N / pp ranks apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from cocoweave.cluster.planning.llm.spec import TransformerSpec

Recompute = Literal["none", "selective", "full"]
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class ParallelConfig:
    """One layout of the training job; `problems` says why it cannot run on a machine, if it cannot."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1  # context parallelism: each rank holds seq_len / cp tokens of a sequence
    ulysses: bool = False  # context parallelism by all-to-all (DeepSpeed-Ulysses: heads scattered, the sequence
    # gathered around attention) instead of the ring (keys and values passed round)
    ep: int = 1  # expert parallelism: each rank of an ep group holds experts / ep experts
    micro_batch: int = 1
    vp: int = 1  # virtual pipeline stages (model chunks) per GPU: Megatron's interleaved 1F1B
    zero: int = 0  # 0 DDP, 1 distributed optimizer / ZeRO-1, 2 ZeRO-2, 3 FSDP / ZeRO-3
    reshard: bool = True  # FSDP: each layer's gathered weights freed after its forward and gathered again for its
    # backward; False keeps them from forward to backward (FSDP1's SHARD_GRAD_OP, FSDP2's
    # reshard_after_forward=False): one gather a micro-batch, the unsharded weights held
    sp: bool = False  # sequence parallelism (Korthikanti et al. 2022): LayerNorm/dropout sharded over tp
    recompute: Recompute = "none"
    recompute_layers: int = 0  # with recompute "none": this many layers of each stage fully recomputed (Megatron's
    # recompute_method=block, as Megatron-Bridge's H100 Llama 3 8B recipe sets 5); priced, not in the memory model
    dp_overlap: bool = True  # data-parallel traffic overlapped with backward (torch DDP, FSDP); False: Megatron's
    # 2021 "local" DDP, whose all-reduce runs after the pipeline flush
    tp_overlap: bool = False  # tp collectives hidden behind GEMMs (a cocoweave schedule, TE's userbuffers,
    # torch's async TP): the stack's `Efficiency.tp_overlap` says how much of them
    gather_overlap: bool = False  # ZeRO-1/2's parameter all-gather hidden behind the next step's first forward
    # (Megatron's --overlap-param-gather)
    grad_bytes: int = 2  # bytes per gradient value reduced across dp (4: fp32 main gradients)
    stages: tuple[int, ...] | None = None  # layers of each pipeline stage as stated; None: `split_layers`'s split

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def micro_batches(self, spec: TransformerSpec) -> int:
        """Micro-batches each pipeline runs per step (global batch / (dp x micro-batch))."""
        return spec.global_batch // (self.dp * self.micro_batch)

    def stage_layers(self, spec: TransformerSpec) -> tuple[int, ...]:
        """Layers of each pipeline stage, first to last: the stated split, or `split_layers`'s."""
        return self.stages if self.stages is not None else split_layers(spec.layers, self.pp)

    def problems(self, spec: TransformerSpec, gpus_per_node: int) -> list[str]:
        """Why this layout cannot run `spec` (empty when it can)."""
        out = []
        if self.tp > gpus_per_node:
            out.append(f"tp {self.tp} exceeds a node's {gpus_per_node} GPUs")
        if spec.heads % self.tp or spec.kv % self.tp and self.tp % spec.kv:
            out.append(f"{spec.heads} heads ({spec.kv} KV heads) do not split over tp {self.tp}")
        if self.stages is not None and (len(self.stages) != self.pp or sum(self.stages) != spec.layers
                                        or min(self.stages) < 1):
            out.append(f"the stated stages {list(self.stages)} are not pp {self.pp} stages of at least one layer "
                       f"adding up to the {spec.layers} layers")
        elif spec.layers < self.pp:
            out.append(f"{spec.layers} layers cannot fill pp {self.pp} stages")
        elif self.vp > 1 and self.stages is None and spec.layers % (self.pp * self.vp):
            out.append(f"{spec.layers} layers do not split evenly into pp {self.pp} x vp {self.vp} stages (uneven "
                       "stages are split automatically without interleaving only: state them to interleave)")
        elif self.vp > 1 and self.stages is not None and min(self.stages) < self.vp:
            out.append(f"the stated stages {list(self.stages)} cannot each give vp {self.vp} chunks a layer")
        if spec.global_batch % (self.dp * self.micro_batch):
            out.append(f"global batch {spec.global_batch} is not a multiple of dp {self.dp} x micro-batch "
                       f"{self.micro_batch}")
        elif self.vp > 1 and self.micro_batches(spec) % self.pp:
            out.append(f"the interleaved schedule needs micro-batches ({self.micro_batches(spec)}) to be a "
                       f"multiple of pp {self.pp}")
        if self.cp > 1 and spec.seq_len % (2 * self.cp):
            out.append(f"seq_len {spec.seq_len} does not split into 2 x cp {self.cp} chunks")
        if self.ulysses and (self.cp == 1 or spec.heads % (self.tp * self.cp) or spec.kv % (self.tp * self.cp)):
            out.append(f"Ulysses context parallelism needs cp > 1 and the {spec.heads} heads and {spec.kv} KV heads "
                       f"to split over tp x cp {self.tp * self.cp}")
        if self.ep > 1 and (spec.experts % self.ep or (self.cp * self.dp) % self.ep):
            out.append(f"ep {self.ep} must divide the {spec.experts} experts and cp x dp {self.cp * self.dp}")
        if self.recompute_layers and (self.recompute != "none" or self.recompute_layers > min(
                self.stage_layers(spec))):
            out.append(f"recomputing {self.recompute_layers} layers a stage needs recompute 'none' and that many "
                       "layers in every stage")
        if self.sp and self.tp == 1:
            out.append("sequence parallelism needs tp > 1")
        if self.zero == 3 and self.pp > 1:
            out.append("FSDP (ZeRO-3) with pipeline parallelism is not modelled")
        if not self.reshard and self.zero != 3:
            out.append("keeping gathered weights from forward to backward (reshard False) needs FSDP (zero 3)")
        return out

    def describe(self) -> str:
        split = f"[{','.join(map(str, self.stages))}]" if self.stages is not None else ""
        parts = [f"tp{self.tp}"] + ([f"cp{self.cp}" + ("u" if self.ulysses else "")] if self.cp > 1 else []) + [
            f"pp{self.pp}" + (f"x{self.vp}" if self.vp > 1 else "") + split, f"dp{self.dp}"] + (
            [f"ep{self.ep}"] if self.ep > 1 else []) + [f"mb{self.micro_batch}"]
        if self.zero:
            parts.append(("fsdp" if self.reshard else "fsdp-grad-op") if self.zero == 3 else f"zero{self.zero}")
        if self.sp:
            parts.append("sp")
        if self.recompute != "none":
            parts.append(f"{self.recompute}-recompute")
        if self.recompute_layers:
            parts.append(f"recompute-{self.recompute_layers}-layers")
        return " ".join(parts)


@lru_cache(maxsize=4096)
def split_layers(layers: int, pp: int) -> tuple[int, ...]:
    """Layers per pipeline stage when they do not divide evenly: every stage gets layers // pp, and the rest go to
    the middle stages first, so the first and last stages, which also run the embedding and the logits, get fewer;
    then to the last stage (the first holds the most micro-batches in flight). This is the split the Llama 3 paper
    (Dubey et al. 2024, sec. 3.3.2) describes for 126 layers on 16 stages (7, 8 x 14, 7) and Megatron-DeepSpeed's
    partitioning gave BLOOM's 70 on 12 (5, 6 x 10, 5)."""
    base, rest = divmod(layers, pp)
    order = list(range(1, pp - 1)) + [pp - 1, 0]
    extra = set(order[:rest])
    return tuple(base + (i in extra) for i in range(pp))
