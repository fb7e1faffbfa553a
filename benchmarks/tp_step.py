"""One tensor-parallel training step (zero_grad + forward + backward + AdamW step) of cocoweave.nn's layers against
Megatron-style layers written by hand and torch's own tensor parallelism (DTensor `parallelize_module`), in the
same rank processes, interleaved and repeated, on a LocalWorld of Gloo CPU ranks.

    .venv/bin/python benchmarks/tp_step.py                                  # d 256 and 512, tp 2, dropout 0.1 and 0
    .venv/bin/python benchmarks/tp_step.py --sizes 1024 --dropouts 0.1
    .venv/bin/python benchmarks/tp_step.py --layouts tp4,dp2xtp2 --sizes 256  # 4 ranks: oversubscribed on 2 cores
    .venv/bin/python benchmarks/tp_step.py --schedules as-written,auto      # cocoweave.nn's schedule= per variant
    .venv/bin/python benchmarks/tp_step.py --quick                          # smoke: tiny model, one round

The model: 4 pre-LayerNorm transformer blocks (8 heads, d_ff 4 x d_model, causal attention, dropout after the
attention projection and after the MLP), batch 8 x seq 128, loss = mean of the squared output; the same initial
weights (cocoweave.nn.ReferenceBlock, seed 0) in every variant. Variants:

  megatron        column/row-parallel linears by hand: Megatron's f and g as autograd functions over
                  dist.all_reduce, the bias + dropout + residual epilogue as eager torch ops (torch's dropout)
  torch-tp        torch.distributed.tensor.parallel.parallelize_module: ColwiseParallel / RowwiseParallel
  torch-tp-sp     the same with SequenceParallel on the LayerNorms (torch's recommended TP + SP plan: the row
                  outputs reduce-scattered along the sequence, the column inputs all-gathered)
  cocoweave[:S]   cocoweave.nn.TransformerBlock, schedule=S passed through when the layers take `schedule=`
                  (names from --schedules: "as-written", "auto", a schedule's name; S+sp adds
                  sequence_parallel=True; without the keyword the layers run as they are, once)
  floor           the hand-written block with its all-reduces skipped: the same sharded compute with no
                  communication. A limit, not a peer: it computes something else (partial sums).
  floor-sync      the floor with the ranks meeting (a shared-memory barrier, no bytes) where Megatron's 16
                  all-reduces are: what lockstep alone costs, the limit of any tensor-parallel step whose ranks
                  wait for each other there (Gloo's barrier where the ranks do not share memory)

Every variant uses torch.optim.AdamW(fused=True), one per kind of parameter (torch's fused kernel refuses a list
mixing DTensor and plain tensors). With dp > 1 every variant but the floor averages its gradients over the
data-parallel group with one flat all-reduce after backward (the same helper everywhere: DDP refuses DTensor
parameters). Groups come from a DeviceMesh ("dp", "tp"), tensor-parallel ranks adjacent.

Before timing, every variant runs two steps at dropout 0 from the same weights and input: the losses must equal the
hand-written one's (`same_work`, the largest difference, is in the table and the JSON; the floors are not compared).
Each round times every variant for --steps steps after a warm-up step (3 in the first round), in a rotated order;
a variant's step time is the median over its steps of the slowest rank's time (each step starts after a barrier).
Then one profiled step per variant gives its communication share (time of the Gloo collectives on the rank's
collective thread and of cocoweave's shared-memory ones, over the step's wall time, the largest rank's) and its
peak memory: the largest running sum, in time order, of the net bytes each op of the step allocated (the largest
rank's), beside the parameters, gradients and optimizer state a rank holds. JSON goes to
benchmarks/results/tp_step-<options>-cpu<cores>-<date>.json with the machine, versions, date and load average.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import machine, results_path  # noqa: E402  the house's machine record and results path

LAYERS, HEADS, BATCH, SEQ = 4, 8, 8, 128
ADAMW = {"lr": 3e-4, "weight_decay": 0.1}
PEERS = ("megatron", "torch-tp", "torch-tp-sp")
LIMITS = ("floor", "floor-sync")  # not peers: they skip the communication


# ---------------------------------------------------------------------------------------------------------
# The Megatron-style block by hand (and the communication-free floor)
# ---------------------------------------------------------------------------------------------------------


# Megatron's f and g written out here rather than imported from cocoweave.nn.functional: the peer must stay plain
# dist.all_reduce whatever route cocoweave's own layers take.
class _F(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _G(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Meet(torch.autograd.Function):
    """The ranks meet (no bytes) forward (`forward_=True`, where g all-reduces) or backward (where f does)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, meet: Any, forward_: bool) -> torch.Tensor:
        ctx.meet, ctx.forward_ = meet, forward_
        if forward_:
            meet()
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if not ctx.forward_:
            ctx.meet()
        return grad, None, None


def meeting(group: Any) -> Any:
    """A barrier of `group` that moves no bytes: cocoweave's shared-memory one where the ranks share this host's
    memory (what cocoweave's collectives wait in), else the library's."""
    from cocoweave.backends.torch import shm

    g = shm.group_for(group)
    return g.barrier if g is not None else (lambda: dist.barrier(group=group))


class HandBlock(nn.Module):
    """One pre-LN block with this rank's heads and MLP columns; `communicate=False` is the floor, `sync=True` with
    it the floor whose ranks meet where the all-reduces were."""

    def __init__(self, ref: nn.Module, group: Any, p: float, communicate: bool = True, sync: bool = False) -> None:
        from cocoweave.nn.functional import part

        super().__init__()
        t, r = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.p, self.communicate = group, p, communicate
        self.meet = meeting(group) if sync and not communicate else None
        self.heads, self.head_dim = ref.n_heads // t, ref.head_dim
        self.ln1, self.ln2 = copy.deepcopy(ref.ln1), copy.deepcopy(ref.ln2)

        def param(t_: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t_.detach().clone().contiguous())

        self.qkv_w, self.qkv_b = param(part(ref.qkv.weight, 0, t, r)), param(part(ref.qkv.bias, 0, t, r))
        self.proj_w, self.proj_b = param(part(ref.proj.weight, 1, t, r)), param(ref.proj.bias)
        self.fc1_w, self.fc1_b = param(part(ref.fc1.weight, 0, t, r)), param(part(ref.fc1.bias, 0, t, r))
        self.fc2_w, self.fc2_b = param(part(ref.fc2.weight, 1, t, r)), param(ref.fc2.bias)

    def _f(self, x: torch.Tensor) -> torch.Tensor:
        if self.meet is not None:
            return _Meet.apply(x, self.meet, False)
        return _F.apply(x, self.group) if self.communicate else x

    def _g(self, x: torch.Tensor) -> torch.Tensor:
        if self.meet is not None:
            return _Meet.apply(x, self.meet, True)
        return _G.apply(x, self.group) if self.communicate else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from cocoweave.nn.transformer import _attend

        a = _attend(F.linear(self._f(self.ln1(x)), self.qkv_w, self.qkv_b), self.heads, self.head_dim, True)
        x = F.dropout(self._g(F.linear(a, self.proj_w)) + self.proj_b, self.p, self.training) + x
        h = F.gelu(F.linear(self._f(self.ln2(x)), self.fc1_w, self.fc1_b))
        return F.dropout(self._g(F.linear(h, self.fc2_w)) + self.fc2_b, self.p, self.training) + x


# ---------------------------------------------------------------------------------------------------------
# torch's tensor parallelism (DTensor)
# ---------------------------------------------------------------------------------------------------------


class TorchBlock(nn.Module):
    """The block as plain torch.nn layers, for parallelize_module; heads counted from the sharded q/k/v width."""

    def __init__(self, ref: nn.Module, p: float) -> None:
        super().__init__()
        self.p, self.head_dim = p, ref.head_dim
        for name in ("ln1", "ln2", "qkv", "proj", "fc1", "fc2"):
            setattr(self, name, copy.deepcopy(getattr(ref, name)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from cocoweave.nn.transformer import _attend

        qkv = self.qkv(self.ln1(x))
        a = _attend(qkv, qkv.shape[-1] // (3 * self.head_dim), self.head_dim, True)
        x = x + F.dropout(self.proj(a), self.p, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.p, self.training)


def torch_tp(refs: list[nn.Module], p: float, mesh: Any, sequence_parallel: bool) -> nn.Module:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    blocks = nn.Sequential(*[TorchBlock(r, p) for r in refs])
    for blk in blocks:
        if sequence_parallel:
            plan = {"ln1": SequenceParallel(), "qkv": ColwiseParallel(input_layouts=Shard(1)),
                    "proj": RowwiseParallel(output_layouts=Shard(1)), "ln2": SequenceParallel(),
                    "fc1": ColwiseParallel(input_layouts=Shard(1)), "fc2": RowwiseParallel(output_layouts=Shard(1))}
        else:
            plan = {"qkv": ColwiseParallel(), "proj": RowwiseParallel(), "fc1": ColwiseParallel(),
                    "fc2": RowwiseParallel()}
        parallelize_module(blk, mesh, plan)
    return blocks


# ---------------------------------------------------------------------------------------------------------
# cocoweave.nn
# ---------------------------------------------------------------------------------------------------------


def cocoweave_block_kwargs(schedule: str | None) -> dict[str, Any] | None:
    """TransformerBlock's keywords for `schedule` (None: as the layers are; NAME+sp: with sequence parallelism);
    None if the layers cannot take it."""
    from cocoweave.nn import TransformerBlock

    params = inspect.signature(TransformerBlock).parameters
    if schedule is None:
        return {}
    name, _, sp = schedule.partition("+")
    kw: dict[str, Any] = {}
    if "schedule" in params:
        kw["schedule"] = "as written" if name in ("as-written", "as written") else name
    elif name not in ("as-written", "as written"):
        return None
    if sp:
        if sp != "sp" or "sequence_parallel" not in params:
            return None
        kw["sequence_parallel"] = True
    return kw


class CocoweaveStack(nn.Module):
    """cocoweave.nn.TransformerBlocks; under sequence parallelism they take and give this rank's token slice."""

    def __init__(self, refs: list[nn.Module], p: float, group: Any, kwargs: dict[str, Any]) -> None:
        from cocoweave.nn import TransformerBlock

        super().__init__()
        d = refs[0].ln1.normalized_shape[0]
        self.blocks = nn.ModuleList(TransformerBlock(d, HEADS, dropout=p, group=group, **kwargs).load_reference(r)
                                    for r in refs)
        self.sequence_parallel = bool(kwargs.get("sequence_parallel"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kw = {"batch_shape": (BATCH, SEQ)} if self.sequence_parallel else {}
        for blk in self.blocks:
            x = blk(x, **kw)
        return x


# ---------------------------------------------------------------------------------------------------------
# Variants, steps, measurements
# ---------------------------------------------------------------------------------------------------------


def variant_names(schedules: list[str]) -> list[str]:
    """The variants this run times: the peers, cocoweave per schedule the layers accept, the floors."""
    names = list(PEERS)
    if not any(cocoweave_block_kwargs(s) is not None and s != "as-written" for s in schedules):
        names.append("cocoweave")  # the layers take no schedule= yet: run them as they are, once
    else:
        names += [f"cocoweave:{s}" for s in schedules if cocoweave_block_kwargs(s) is not None]
    return names + list(LIMITS)


def skipped_schedules(schedules: list[str]) -> list[str]:
    return [s for s in schedules if cocoweave_block_kwargs(s) is None]


def references(d: int, p: float) -> list[nn.Module]:
    from cocoweave.nn import ReferenceBlock

    torch.manual_seed(0)
    return [ReferenceBlock(d, HEADS, dropout=p, seed=i) for i in range(LAYERS)]


class Variant:
    """A model of one variant on this rank, its optimizers and how its input and loss are taken."""

    def __init__(self, name: str, d: int, p: float, mesh: Any) -> None:
        self.name = name
        self.tp, self.dp = mesh["tp"].get_group(), mesh["dp"].get_group() if "dp" in mesh.mesh_dim_names else None
        refs = references(d, p)
        kind, _, schedule = name.partition(":")
        self.sequence_parallel = name == "torch-tp-sp"
        if kind in ("megatron", *LIMITS):
            self.model = nn.Sequential(*[HandBlock(r, self.tp, p, communicate=kind == "megatron",
                                                   sync=kind == "floor-sync") for r in refs])
        elif kind.startswith("torch-tp"):
            self.model = torch_tp(refs, p, mesh["tp"], self.sequence_parallel)
        else:
            self.model = CocoweaveStack(refs, p, self.tp, cocoweave_block_kwargs(schedule or None) or {})
            self.sequence_parallel = self.model.sequence_parallel
        self.model.train()
        self.params = [q for q in self.model.parameters() if q.requires_grad]
        kinds: dict[bool, list[Any]] = {}
        for q in self.params:
            kinds.setdefault(hasattr(q, "to_local"), []).append(q)
        self.optimizers = [torch.optim.AdamW(qs, **ADAMW, fused=True) for qs in kinds.values()]
        self.sync_dp = self.dp is not None and dist.get_world_size(self.dp) > 1 and kind not in LIMITS

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's input: the whole batch, or its sequence slice (torch: along seq; cocoweave: token rows)."""
        if not self.sequence_parallel:
            return x
        if isinstance(self.model, CocoweaveStack):
            from cocoweave.nn.transformer import sequence_slice

            return sequence_slice(x, self.tp)
        from cocoweave.nn.functional import part

        return part(x, 1, dist.get_world_size(self.tp), dist.get_rank(self.tp)).contiguous()

    def step(self, x: torch.Tensor) -> torch.Tensor:
        """zero_grad + forward + backward (+ the data-parallel gradient average) + AdamW; returns the loss
        (this rank's part of it under sequence parallelism: the sum over the group is the loss)."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        out = self.model(self.inputs(x))
        loss = out.square().sum() / x.numel()
        loss.backward()
        if self.sync_dp:
            average_gradients(self.params, self.dp)
        for opt in self.optimizers:
            opt.step()
        return loss.detach()

    def held_bytes(self) -> int:
        """Bytes of parameters, gradients and optimizer state this rank holds."""
        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if hasattr(t, "to_local") else t

        total = sum(2 * local(q).numel() * local(q).element_size() for q in self.params)
        for opt in self.optimizers:
            for st in opt.state.values():
                total += sum(local(v).numel() * local(v).element_size() for v in st.values()
                             if isinstance(v, torch.Tensor) and v.dim())
        return total


def average_gradients(params: list[Any], group: Any) -> None:
    """Average the local gradients over the data-parallel `group` with one flat all-reduce."""
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in (q.grad for q in params) if g is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    i = 0
    for g in grads:
        g.copy_(flat[i:i + g.numel()].view_as(g))
        i += g.numel()


SHM_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "gather_in_place", "gather_common")


@contextlib.contextmanager
def shm_labels() -> Any:
    """cocoweave's shared-memory collectives (backends/torch/shm.py) labelled "shm:NAME" for the profiler while
    inside; the library's (Gloo) are labelled by torch itself ("gloo:NAME", on its collective thread)."""
    from cocoweave.backends.torch import shm

    saved = {n: getattr(shm, n) for n in SHM_COLLECTIVES if hasattr(shm, n)}

    def labelled(name: str, fn: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            with torch.profiler.record_function(f"shm:{name}"):
                return fn(*a, **k)
        return call

    try:
        for n, fn in saved.items():
            setattr(shm, n, labelled(n, fn))
        yield
    finally:
        for n, fn in saved.items():
            setattr(shm, n, fn)


def profile_step(v: Variant, x: torch.Tensor) -> dict[str, float]:
    """One profiled step: its wall ms, the ms of its collectives (Gloo's and cocoweave's shared-memory ones), the
    peak of its allocations above its start."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with shm_labels(), warnings.catch_warnings(), \
            profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        v.step(x)
        wall = (time.perf_counter() - t0) * 1e3
    comm, events = 0.0, []
    for e in prof.events():
        if e.name.startswith(("gloo:", "nccl:", "shm:")):
            comm += e.cpu_time_total / 1e3
        if e.self_cpu_memory_usage:  # net bytes an op allocated itself (children excluded), at its start
            events.append((e.time_range.start, e.self_cpu_memory_usage))
    running = peak = 0
    for _, b in sorted(events):
        running += b
        peak = max(peak, running)
    return {"wall_ms": wall, "comm_ms": comm, "peak_alloc": peak}


def timings(rank: int, world_size: int, d: int, p: float, dp: int, names: list[str], rounds: int, steps: int,
            warmup: int) -> dict[str, Any]:
    """Every variant's step times on this rank (ms), rounds interleaved; the same-work check; one profiled step."""
    from torch.distributed.device_mesh import init_device_mesh

    from cocoweave.backends.torch.worker import timed_steps

    tp = world_size // dp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_coordinate()[0]
    x = torch.randn(BATCH, SEQ, d, generator=torch.Generator().manual_seed(100 + dp_rank))

    # Same work: two steps at dropout 0 from the same weights; the losses of every variant but the floor agree.
    losses: dict[str, list[float]] = {}
    for v in names:
        check = Variant(v, d, 0.0, mesh)
        got = []
        for _ in range(2):
            loss = check.step(x)
            if check.sequence_parallel:
                dist.all_reduce(loss, group=check.tp)
            got.append(float(loss))
        losses[v] = got
        del check
    same = {v: max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses[v], losses["megatron"]))
            for v in names if v not in LIMITS}

    built = {v: Variant(v, d, p, mesh) for v in names}
    times: dict[str, list[float]] = {v: [] for v in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for v in order:
            times[v] += timed_steps(lambda v=v: built[v].step(x), world_size, torch.device("cpu"), steps,
                                    warmup if r == 0 else 1)
    profiled = {v: profile_step(built[v], x) for v in names}
    return {"times": times, "same_work": same, "profile": profiled,
            "held_bytes": {v: built[v].held_bytes() for v in names},
            "repr": {v: repr(built[v].model.blocks[0]) for v in names if v.startswith("cocoweave")}}


def layouts(spec: str) -> list[tuple[str, int, int]]:
    """'tp2,tp4,dp2xtp2' -> [(label, world size, dp)]."""
    out = []
    for item in spec.split(","):
        dp_s, _, tp_s = item.rpartition("x")
        dp = int(dp_s[2:]) if dp_s else 1
        if not tp_s.startswith("tp") or (dp_s and not dp_s.startswith("dp")):
            raise SystemExit(f"--layouts: {item!r} is not tpN or dpMxtpN")
        out.append((item, dp * int(tp_s[2:]), dp))
    return out


def summarise(label: str, ws: int, dp: int, d: int, p: float, names: list[str], per_rank: list[dict]) -> list[dict]:
    from cocoweave.backends.torch.worker import step_time_ms, step_times

    rows = []
    for v in names:
        t = [r["times"][v] for r in per_rank]
        prof = [r["profile"][v] for r in per_rank]
        rows.append({"layout": label, "world": ws, "dp": dp, "tp": ws // dp, "d_model": d, "dropout": p,
                     "variant": v, "kind": "floor" if v == "floor" else "limit" if v in LIMITS
                     else "cocoweave" if v.startswith("cocoweave") else "peer",
                     "median_ms": step_time_ms(t), "step_ms": step_times(t),
                     "comm_share": max(q["comm_ms"] / q["wall_ms"] for q in prof),
                     "peak_step_alloc_bytes": max(q["peak_alloc"] for q in prof),
                     "held_bytes": max(r["held_bytes"][v] for r in per_rank),
                     "same_work_rel_diff": None if v in LIMITS else max(r["same_work"][v] for r in per_rank),
                     "module": per_rank[0]["repr"].get(v)})
    fastest = min(r["median_ms"] for r in rows if r["kind"] == "peer")
    floor = next(r["median_ms"] for r in rows if r["kind"] == "floor")
    for r in rows:
        r["ratio_to_fastest_peer"] = r["median_ms"] / fastest
        r["ratio_to_floor"] = r["median_ms"] / floor
    return rows


def print_table(rows: list[dict], title: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover - rich is a dependency
        Console = None
    headers = ["variant", "median ms", "vs fastest peer", "vs floor", "comm share", "step peak MiB",
               "held MiB", "same work"]
    cells = [[r["variant"] + (" (limit)" if r["kind"] in ("floor", "limit") else ""), f"{r['median_ms']:.1f}",
              f"{r['ratio_to_fastest_peer']:.2f}", f"{r['ratio_to_floor']:.2f}", f"{100 * r['comm_share']:.0f}%",
              f"{r['peak_step_alloc_bytes'] / 2**20:.1f}", f"{r['held_bytes'] / 2**20:.1f}",
              "-" if r["same_work_rel_diff"] is None else f"{r['same_work_rel_diff']:.0e}"] for r in rows]
    if Console is None:
        print(title)
        for c in [headers, *cells]:
            print("  ".join(f"{x:>14}" for x in c))
        return
    table = Table(title=title)
    for h in headers:
        table.add_column(h, justify="left" if h == "variant" else "right")
    for c in cells:
        table.add_row(*c)
    Console(width=150).print(table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256,512", help="d_model values (the issue's set: 256,512,1024)")
    ap.add_argument("--dropouts", default="0.1,0")
    ap.add_argument("--layouts", default="tp2", help="tpN and dpMxtpN, comma-separated (e.g. tp2,tp4,dp2xtp2)")
    ap.add_argument("--schedules", default="as-written,auto",
                    help="cocoweave.nn schedules to time (schedule= of the layers; NAME+sp adds sequence_parallel)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps of each variant before the first round")
    ap.add_argument("--quick", action="store_true", help="smoke test: d 32, seq 16, batch 2, 1 round x 1 step")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    global SEQ, BATCH
    if args.quick:
        args.sizes, args.dropouts, args.rounds, args.steps, args.warmup = "32", "0.1", 1, 1, 1
        SEQ, BATCH = 16, 2
    from cocoweave.launch import LocalWorld

    schedules = [s for s in args.schedules.split(",") if s]
    names = variant_names(schedules)
    doc: dict[str, Any] = {"command": "benchmarks/tp_step.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                           "machine": machine(), "model": {"layers": LAYERS, "heads": HEADS, "batch": BATCH,
                                                           "seq": SEQ, "d_ff": "4 x d_model"},
                           "variants": names, "schedules_not_taken": skipped_schedules(schedules), "rows": []}
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    if doc["schedules_not_taken"]:
        print(f"cocoweave.nn's layers do not take schedule(s) {', '.join(doc['schedules_not_taken'])}: "
              "timed as they are")
    for label, ws, dp in layouts(args.layouts):
        over = f", oversubscribed: {ws} ranks on {os.cpu_count()} cores" if ws > (os.cpu_count() or 1) else ""
        with LocalWorld(ws, timeout_s=1800) as world:
            for d in (int(s) for s in args.sizes.split(",")):
                for p in (float(s) for s in args.dropouts.split(",")):
                    per_rank = world.run(timings, d, p, dp, names, args.rounds, args.steps, args.warmup)
                    rows = summarise(label, ws, dp, d, p, names, per_rank)
                    for r in rows:
                        r["oversubscribed"] = bool(over)
                    doc["rows"] += rows
                    print_table(rows, f"{label}{over}: d_model {d}, dropout {p}, {LAYERS} blocks, batch {BATCH} x "
                                      f"seq {SEQ}, {args.rounds} rounds x {args.steps} steps, median of the "
                                      "slowest rank")
    doc["machine"]["load_average_end"] = os.getloadavg()
    doc["spread_note"] = "step_ms: every timed step's slowest-rank time; median_ms is their median"
    args.out.mkdir(parents=True, exist_ok=True)
    options = {"sizes": args.sizes, "dropouts": args.dropouts, "layouts": args.layouts, "quick": args.quick}
    path = results_path(args.out, "tp_step", ap, options)
    path.write_text(json.dumps(doc, indent=1))
    print(f"\nJSON: {path}")
    bad = [f"{r['variant']} (d {r['d_model']}, {r['layout']}): {r['same_work_rel_diff']:.1e}" for r in doc["rows"]
           if r["same_work_rel_diff"] is not None and r["same_work_rel_diff"] > 1e-4]
    if bad:
        print("variants whose losses differ from the hand-written block's at dropout 0: " + "; ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
