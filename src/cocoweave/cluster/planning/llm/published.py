"""Published training runs the LLM step model is validated on: each with the model, the layout and the hardware
the authors give, the iteration time they report (or that follows from their TFLOP/s by their own FLOPs formula)
and where each figure comes from. `role` says whether a run calibrates the efficiency constants or is held out.

Sources:
- SC'21: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
  SC'21, Table 1 (achieved TFLOP/s per GPU) and sec. 5.1 (GPT-3 175B on 1024 GPUs); layouts (micro-batch,
  layers per virtual stage, DDP kind, nodes) from the authors' scripts, Megatron-LM examples/sc21/run_table_1.sh.
  Time = their eq. (3) FLOPs / (TFLOP/s x GPUs); every run used full recomputation, fp16, seq 2048, vocab 51200,
  DGX A100 80 GB nodes (8 x 200 Gb/s HDR InfiniBand).
- Korthikanti: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022,
  Table 3 (layouts) and Table 5 (iteration seconds, full recomputation vs sequence parallelism + selective
  recomputation), the same DGX A100 80 GB cluster; interleaving as Calculon's validation files give it.
- torchtitan: pytorch/torchtitan docs/performance.md, Llama 3 on 64 A100 80 GB with FSDP2, local batch 1,
  seq 8192: tokens/s per GPU (step = 8192 / WPS). Its cluster's network is not stated: we assume DGX A100's
  8 x 200 Gb/s InfiniBand.
"""

from __future__ import annotations

from dataclasses import dataclass

from cocoweave.cluster.planning.llm.parallelism import ParallelConfig
from cocoweave.cluster.planning.llm.spec import TransformerSpec

MACHINE = "dgx-a100-80gb"


@dataclass(frozen=True)
class PublishedRun:
    """One published run: what ran, how fast, and where each figure is from."""

    name: str
    spec: TransformerSpec
    cfg: ParallelConfig
    time_s: float
    source: str
    role: str  # "calibration" or "held-out"
    stack: str  # the software stack (system.STACKS) the authors ran
    machine: str = MACHINE


def sc21_flops(spec: TransformerSpec) -> float:
    """Narayanan et al.'s eq. (3): FLOPs per iteration with full recomputation, 96 B s l h^2 (1 + s/6h + V/16lh)."""
    b, s, l, h, v = spec.global_batch, spec.seq_len, spec.layers, spec.hidden, spec.vocab
    return 96.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def _gpt(name: str, layers: int, hidden: int, heads: int, batch: int) -> TransformerSpec:
    return TransformerSpec(name=name, layers=layers, hidden=hidden, heads=heads, vocab=51200, seq_len=2048,
                           global_batch=batch, dtype="float16", flash_attention=False)


# (name, heads, hidden, layers, tp, pp, gpus, batch, TFLOP/s, micro-batch, layers per virtual stage, torch DDP)
SC21_TABLE1 = (
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 16, None, True),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 16, None, True),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 16, None, True),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135, 8, None, True),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138, 4, None, False),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 5, False),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 5, False),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 3, False),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 1, False),
    ("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, None, False),
)
SC21_CALIBRATION = {"1.7B", "18.4B", "145.6B", "529.6B"}


def _sc21_runs() -> list[PublishedRun]:
    runs = []
    for name, heads, hidden, layers, tp, pp, gpus, batch, tflops, mb, per_virtual, torch_ddp in SC21_TABLE1:
        spec = _gpt(f"GPT {name}", layers, hidden, heads, batch)
        vp = layers // pp // per_virtual if per_virtual else 1
        cfg = ParallelConfig(tp=tp, pp=pp, dp=gpus // (tp * pp), micro_batch=mb, vp=vp, recompute="full",
                             dp_overlap=torch_ddp)
        time_s = sc21_flops(spec) / (tflops * 1e12 * gpus)
        runs.append(PublishedRun(
            f"SC'21 {name}, {gpus} GPUs", spec, cfg, time_s,
            f"Narayanan et al. SC'21 Table 1: {tflops} TFLOP/s/GPU -> eq. (3) time; layout: examples/sc21/"
            "run_table_1.sh", "calibration" if name in SC21_CALIBRATION else "held-out", "megatron-2021"))
    spec = _gpt("GPT-3 175B", 96, 12288, 96, 1536)
    cfg = ParallelConfig(tp=8, pp=8, dp=16, micro_batch=1, recompute="full", dp_overlap=False)
    runs.append(PublishedRun(
        "SC'21 GPT-3 175B, 1024 GPUs", spec, cfg, sc21_flops(spec) / (140e12 * 1024),
        "Narayanan et al. SC'21 sec. 5.1: 140 TFLOP/s/GPU, batch 1536, TP 8 x PP 8 -> 31.5 s (their 34 days for "
        "300B tokens); micro-batch 1 and no interleaving ASSUMED (Megatron's defaults; not published for this run)",
        "held-out", "megatron-2021"))
    return runs


# (name, heads, hidden, layers, gpus, batch, micro-batch, pp, interleave, full-recompute s, SP+selective s)
KORTHIKANTI_TABLE5 = (
    ("22B", 64, 6144, 48, 8, 4, 4, 1, 1, 1.42, 1.10),
    ("175B", 96, 12288, 96, 64, 64, 1, 8, 3, 18.13, 13.75),
    ("530B", 128, 20480, 105, 280, 280, 1, 35, 3, 49.05, 37.83),
    ("1T", 160, 25600, 128, 512, 512, 1, 64, 1, 94.42, 71.49),
)


def _korthikanti_runs() -> list[PublishedRun]:
    runs = []
    for name, heads, hidden, layers, gpus, batch, mb, pp, vp, full_s, seqsel_s in KORTHIKANTI_TABLE5:
        spec = _gpt(f"GPT {name}", layers, hidden, heads, batch)
        base = ParallelConfig(tp=8, pp=pp, dp=gpus // (8 * pp), micro_batch=mb, vp=vp, dp_overlap=False)
        src = "Korthikanti et al. 2022 Table 5 ({}); layout Table 3, interleaving as Calculon's validation/{}.json"
        runs.append(PublishedRun(f"Korthikanti {name} full recompute", spec,
                                 ParallelConfig(**{**base.__dict__, "recompute": "full"}), full_s,
                                 src.format("full recomputation", f"{name}_full"), "calibration",
                                 "megatron-2022"))
        runs.append(PublishedRun(f"Korthikanti {name} SP + selective", spec,
                                 ParallelConfig(**{**base.__dict__, "recompute": "selective", "sp": True}),
                                 seqsel_s, src.format("sequence parallelism + selective recomputation",
                                                      f"{name}_seqsel"), "held-out", "megatron-2022"))
    return runs


def _torchtitan_runs() -> list[PublishedRun]:
    common = {"vocab": 128256, "seq_len": 8192, "global_batch": 64, "gated_mlp": True, "kv_heads": 8}
    llama8 = TransformerSpec(name="Llama 3 8B", layers=32, hidden=4096, heads=32, ffn=14336, **common)
    llama70 = TransformerSpec(name="Llama 3 70B", layers=80, hidden=8192, heads=64, ffn=28672, **common)
    src = ("torchtitan docs/performance.md, Llama 3 on 64 A100 80 GB, FSDP2, local batch 1: {} tokens/s/GPU "
           "-> 8192 / WPS; network ASSUMED 8 x 200 Gb/s InfiniBand")
    return [
        PublishedRun("torchtitan Llama 3 8B, 64 GPUs", llama8,
                     ParallelConfig(dp=64, zero=3, recompute="selective", grad_bytes=4), 8192 / 2973,
                     src.format(2973) + "; selective (op) recomputation", "calibration", "torchtitan-2024"),
        PublishedRun("torchtitan Llama 3 70B, 64 GPUs", llama70,
                     ParallelConfig(dp=64, zero=3, recompute="full", grad_bytes=4), 8192 / 331,
                     src.format(331) + "; full recomputation", "held-out", "torchtitan-2024"),
    ]


def published_runs() -> list[PublishedRun]:
    """Every run of the validation table, calibration rows first."""
    runs = _sc21_runs() + _korthikanti_runs() + _torchtitan_runs()
    return sorted(runs, key=lambda r: r.role != "calibration")
