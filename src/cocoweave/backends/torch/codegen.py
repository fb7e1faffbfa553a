"""Plan -> Python source: one module with one `step(ctx, I)` function per (plan, rank, world, sizes).

The code is meant to be read (`cocoweave show --code`): every stage is a commented block, shapes
and offsets of this rank are constants, computations are plain torch expressions, communication
goes through `ctx` (runtime.RankContext), which owns the preallocated buffers and the algorithms.
"""

from __future__ import annotations

import keyword
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...ir.graph import Value
from ...ir.layout import slice_bounds
from ...ir.printer import operand
from ...ir.types import bind_shape
from ...plan.plan import P2P, Chunked, Collective, FusedCollective, Kernel, MatMul, Plan, PlanStage
from ..inputs import local_shape

RESERVED = {"ctx", "I", "torch", "rt", "math", "step", "OUT"}
HALF = ("float16", "bfloat16")
INPLACE = {"add": "add_", "sub": "sub_", "mul": "mul_", "div": "div_"}  # ops whose results are fresh tensors
PY_BINARY = {"add": "+", "sub": "-", "mul": "*", "div": "/", "pow": "**",
             "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}


@dataclass
class RankView:
    """What codegen knows about one rank: its place in every group and the bound sizes."""

    rank: int
    world_size: int
    sizes: Mapping[str, int]

    def in_group(self, v: Value) -> bool:
        return v.group is None or self.rank in v.group.ranks(self.world_size)

    def group_rank(self, v: Value) -> tuple[int, int]:
        ranks = v.group.ranks(self.world_size)
        return ranks.index(self.rank), len(ranks)

    def local_shape(self, v: Value) -> tuple[int, ...]:
        gr, gs = self.group_rank(v)
        return local_shape(v, self.sizes, gr, gs)


@dataclass
class Emitter:
    """Builds the source text of one rank's step function."""

    plan: Plan
    view: RankView
    lines: list[str] = field(default_factory=list)
    names: dict[int, str] = field(default_factory=dict)
    chunk: tuple[int, int, str] | None = None  # (chain dim, chain ndim, python name of (start, length))
    chain_ids: set[int] = field(default_factory=set)  # values computed inside the chunked chain
    live_out: set[int] = field(default_factory=set)
    used: set[str] = field(default_factory=set)
    scratch: dict[int, int] = field(default_factory=dict)  # temporary of this stage -> its last reader (in place)
    algorithm: str = "library"  # the collective algorithm of the stage being emitted

    # -- naming -------------------------------------------------------------------------------
    def var(self, v: Value) -> str:
        if v.op == "update":
            return self.var(v.args[1])
        if id(v) not in self.names:
            base = v.name.replace("%", "v").replace(".", "_").replace("'", "_new")
            if keyword.iskeyword(base) or base in RESERVED or not base.isidentifier():
                base = f"{base}_"
            name, i = base, 1
            while name in self.used:  # an input may be called like an intermediate (`v10`)
                name, i = f"{base}_{i}", i + 1
            self.used.add(name)
            self.names[id(v)] = name
        return self.names[id(v)]

    def ref(self, a: Value) -> str:
        """An operand as an expression (constants inline)."""
        return repr(a.attrs["value"]) if a.op == "const" else self.var(a)

    def emit(self, line: str, indent: int = 1) -> None:
        self.lines.append("    " * indent + line)

    # -- values -------------------------------------------------------------------------------
    def host(self, v: Value) -> str:
        """A scalar-only operation, computed with Python numbers on the host."""
        a = [self.ref(x) for x in v.args]
        op = v.op
        if op in PY_BINARY:
            return f"{a[0]} {PY_BINARY[op]} {a[1]}"
        simple = {"neg": f"-{a[0]}" if a else "", "sqrt": f"math.sqrt({a[0]})" if a else "",
                  "rsqrt": f"1.0 / math.sqrt({a[0]})" if a else "", "exp": f"math.exp({a[0]})" if a else "",
                  "abs": f"abs({a[0]})" if a else ""}
        if op in simple:
            return simple[op]
        if op in ("maximum", "minimum"):
            return f"{op[:3]}({a[0]}, {a[1]})"
        if op == "where":
            return f"({a[1]} if {a[0]} else {a[2]})"
        if op == "cast":
            return {"bool": "bool", "int32": "int", "int64": "int"}.get(v.dtype, "float") + f"({a[0]})"
        raise NotImplementedError(f"host scalar operation {op}")

    def operand_expr(self, v: Value, a: Value, up: bool) -> str:
        """Operand a of elementwise v: sliced to this rank's part when v is Sliced and a is a whole
        Replicated tensor; upcast to float32 when v computes in half precision."""
        e = self.ref(a)
        if a.is_scalar:
            return e
        if v.op not in ("matmul", "slice") and v.layout.is_sliced and a.layout.is_replicated:
            j = v.layout.dim - (v.ndim - a.ndim)
            full = bind_shape(a.shape, self.view.sizes)
            if j >= 0 and full[j] != 1:
                gr, gs = self.view.group_rank(v)
                s, t = slice_bounds(full[j], gs, gr)
                e = f"{e}.narrow({j}, {s}, {t - s})"
        if not (v.op == "matmul" and a is v.args[1]):
            e = self.chunked(a, e)
        if up and a.dtype in HALF:
            e = f"{e}.float()"
        return e

    def chunked(self, a: Value, e: str | None = None) -> str:
        """Inside a chunked chain, a whole tensor from outside the chain is narrowed to the chunk."""
        e = e or self.var(a)
        if self.chunk is None or a.is_scalar or self._inside(a):
            return e
        dim, nd, se = self.chunk
        j = dim - (nd - a.ndim)
        if j >= 0 and bind_shape(a.shape, self.view.sizes)[j] != 1:
            return f"{e}.narrow({j}, *{se})"
        return e

    def _inside(self, a: Value) -> bool:
        return id(a) in self.chain_ids

    def in_place(self, v: Value) -> str | None:
        """`v` written over a temporary of its stage that nothing reads after it (`a.add_(b)`): saves a
        full-size allocation per operation on CPU, where each one costs page faults. Only float32/64
        arithmetic of equal shapes, on temporaries that are fresh tensors (never views or inputs)."""
        if v.op not in INPLACE or v.dtype not in ("float32", "float64") or self.chunk is not None:
            return None
        tensors = [a for a in v.args if not a.is_scalar]
        if any(a.dtype != v.dtype for a in tensors):
            return None
        for j, a in enumerate(v.args[:2] if v.op in ("add", "mul") else v.args[:1]):
            if self.scratch.get(id(a)) == id(v) and self.view.local_shape(a) == self.view.local_shape(v):
                other = self.operand_expr(v, v.args[1 - j], up=False)
                return f"{self.var(a)}.{INPLACE[v.op]}({other})"
        return None

    def compute(self, v: Value) -> str:
        """A tensor computation as a torch expression (half precision: float32 math, one rounding)."""
        if (e := self.in_place(v)) is not None:
            return e
        op, half = v.op, v.dtype in HALF or any(x.dtype in HALF for x in v.args if not x.is_scalar)
        a = [self.operand_expr(v, x, up=half and op not in ("cast", "slice", "matmul")) for x in v.args]
        to = f".to(torch.{v.dtype})"
        if op in PY_BINARY:
            e = f"({a[0]} {PY_BINARY[op]} {a[1]})"
        elif op in ("maximum", "minimum"):
            e = f"rt.{op}({a[0]}, {a[1]})"
        elif op == "neg":
            e = f"(-{a[0]})"
        elif op in ("sqrt", "rsqrt", "exp", "abs"):
            floating = v.args[0].dtype in ("float16", "bfloat16", "float32", "float64")
            x = a[0] if floating or op == "abs" else f"{a[0]}.float()"  # abs keeps integer dtypes
            e = f"torch.{op}({x})"
        elif op == "cast":
            return f"{a[0]}{to}"
        elif op == "where":
            e = f"torch.where({a[0]}, {a[1]}, {a[2]})"
        elif op == "dropout":
            seed = v.attrs["seed"] if v.attrs["seed"] is not None else f"int({a[1]})"
            rank = self.view.group_rank(v)[0] if v.args[0].layout.is_local else 0
            key, p = f"rt.dropout_key({seed}, {rank})", v.attrs["p"]
            # a constant seed gives the same mask every step: the executable hashes it once (ctx.keep)
            bits = f'ctx.keep("{v.name}", {p!r}, {key})' if v.attrs["seed"] is not None else f'ctx.index("{v.name}")'
            if self.chunk is not None:
                dim, nd, se = self.chunk
                bits = f"{bits}.narrow({dim - (nd - v.ndim)}, *{se})"
            if v.attrs["seed"] is not None:
                e = f"rt.apply_dropout({a[0]}, {bits}, {p!r})"
            else:
                e = f"rt.dropout({a[0]}, {bits}, {p!r}, {key})"
        elif op in ("sum", "max", "min", "norm"):
            e = f"rt.reduce({op!r}, {a[0]}, {tuple(v.attrs['dims'])!r}, {v.attrs['keepdim']})"
        elif op == "matmul":
            return f"torch.matmul({a[0]}, {a[1]})"
        elif op == "layer_norm":
            w = a[1] if v.attrs["has_weight"] else "None"
            b = a[1 + v.attrs["has_weight"]] if v.attrs["has_bias"] else "None"
            x = a[0] if half else a[0]
            e = f"torch.nn.functional.layer_norm({x}, ({self.view.local_shape(v)[-1]},), {w}, {b}, {v.attrs['eps']!r})"
        elif op == "slice":
            full = bind_shape(v.args[0].shape, self.view.sizes)
            gr, gs = self.view.group_rank(v)
            s, t = slice_bounds(full[v.attrs["dim"]], gs, gr)
            if self.chunk is not None and v.attrs["dim"] == self.chunk[0] - (self.chunk[1] - v.ndim):
                # a piece of this rank's part (fused ring): offset within the part, from the whole tensor
                se = self.chunk[2]
                return f"{self.ref(v.args[0])}.narrow({v.attrs['dim']}, {s} + {se}[0], {se}[1])"
            return f"{a[0]}.narrow({v.attrs['dim']}, {s}, {t - s})"
        else:
            raise NotImplementedError(f"no code generation for {op}")
        return f"{e}{to}" if half or op in ("sum", "max", "min", "norm") else e

    def communicate(self, v: Value, async_op: bool = False) -> str:
        """A collective or send through the runtime, into this value's preallocated buffer."""
        a, x = v.attrs, self.chunked(v.args[0])
        g = f'ctx.group("{v.args[0].group.name}")'
        key = f'("{v.name}", k)' if self.chunk is not None else f'"{v.name}"'  # a buffer per chunk in flight
        tail = f", out={key}" + (", async_op=True" if async_op else "")
        # the ring algorithm (ring.py: point-to-point, synchronous, never chunked) takes the library's arguments
        ring = "ring_" if self.algorithm == "ring" else ""
        if v.op == "all_reduce":
            return f"ctx.{ring}all_reduce({x}, {a['op']!r}, {g}{tail})"
        if v.op == "reduce_scatter":
            return f"ctx.{ring}reduce_scatter({x}, {a['op']!r}, {a['dim']}, {g}{tail})"
        if v.op == "all_gather":
            total = self.view.local_shape(v)[a["dim"]]
            return f"ctx.{ring}all_gather({x}, {a['dim']}, {total}, {g}{tail})"
        if v.op == "broadcast":
            return f"ctx.broadcast({x}, {a['root']}, {g}{tail})"
        if v.op == "reduce":
            return f"ctx.reduce({x}, {a['op']!r}, {a['root']}, {g}{tail})"
        if v.op == "send":
            src = v.args[0].group.ranks(self.view.world_size)
            dst = v.group.ranks(self.view.world_size)
            peer = dst[src.index(self.view.rank)] if self.view.rank in src else src[dst.index(self.view.rank)]
            # both ends hold group rank i's part: the sender's shape is the receiver's
            shape = str(self.view.local_shape(v.args[0] if self.view.rank in src else v))
            if self.chunk is not None:
                dim, nd, se = self.chunk
                shape = f"rt.with_dim({shape}, {dim - (nd - v.ndim)}, {se}[1])"
            sending = "True" if self.view.rank in src else "False"
            x = x if self.view.rank in src else "None"
            return (f"ctx.send_recv({x}, peer={peer}, sending={sending}, shape={shape}, "
                    f"dtype=torch.{v.dtype}{tail})")
        raise NotImplementedError(v.op)


def _participates(view: RankView, stage: PlanStage) -> bool:
    """A rank runs a stage if it holds any of its values or sends any of them."""
    return any(view.in_group(v) or (v.op == "send" and view.in_group(v.args[0])) for v in stage.values)


def generate(plan: Plan, rank: int, world_size: int, sizes: Mapping[str, int],
             fused: Mapping[int, Any] | None = None) -> str:
    """Python source of the step function that rank `rank` of `world_size` runs for `plan`.
    `fused` maps stage indices to generated Triton kernels (kernels.codegen.FusedKernel): those
    stages become one kernel call; the others are torch expressions."""
    view = RankView(rank, world_size, dict(sizes))
    em = Emitter(plan, view)
    fused = fused or {}
    program = plan.program
    em.live_out = _live_outs(plan)
    em.lines += [f'"""cocoweave plan `{plan.name}` ({plan.fingerprint}) for rank {rank} of {world_size}, '
                 f'sizes {dict(sizes)}.', "", "Generated code: read it, do not edit it.", '"""', "",
                 "import math", "", "import torch", "", "from cocoweave.backends.torch import runtime as rt", "", "",
                 "def step(ctx, I):"]
    for v in program.inputs.values():
        if v.group is None or view.in_group(v):
            em.emit(f'{em.var(v)} = I["{v.name}"]')
    # an output that is a state input is its value before the step: copied before anything writes it
    written = {id(program.inputs[n]) for n, v in plan.state.items() if view.in_group(v)}
    before = {n: v for n, v in plan.outputs if id(v) in written}
    if before:
        em.emit(f"OUT = {{{', '.join(f'{n!r}: {em.var(v)}.clone()' for n, v in before.items())}}}")
    if plan.host:
        em.emit("# host scalars")
        for v in plan.host:
            em.emit(f"{em.var(v)} = {em.host(v)}  # {v.name}")
    for i, stage in enumerate(plan.stages):
        if not _participates(view, stage):
            continue
        em.emit("")
        em.emit(f"# stage {i}: {stage.label}  [{', '.join(v.name for v in stage.values)}]")
        if isinstance(stage, Chunked):
            _emit_chunked(em, stage, i)
        elif isinstance(stage, FusedCollective) and stage.algorithm == "ring":
            _emit_fused_ring(em, stage, i)
        elif i in fused:
            k = fused[i]
            em.emit(f'with ctx.span("{stage.label}", {i}):')
            em.emit(f"# one generated Triton kernel, {getattr(k, 'name', 'kernel')} (ctx.fused({i}).source)", 2)
            if getattr(getattr(k, "spec", None), "in_place", None):
                em.emit("# it writes new state over the state tensors: their copies at the end are no-ops", 2)
            outs = ", ".join(em.var(v) for v in k.outputs) + ("," if len(k.outputs) == 1 else "")
            em.emit(f"{outs} = ctx.fused({i})({', '.join(em.ref(a) for a in k.inputs)})", 2)
        else:
            em.emit(f'with ctx.span("{stage.label}", {i}):')
            em.algorithm = getattr(stage, "algorithm", "library")
            em.scratch = _scratch(em, stage)
            for v in stage.values:
                _emit_value(em, v, indent=2)
            em.algorithm, em.scratch = "library", {}
    em.emit("")
    em.emit("# results: state is written in place, outputs are returned")
    for name, v in plan.state.items():
        if view.in_group(v):
            em.emit(f"{em.var(program.inputs[name])}.copy_({em.var(v)})")
    outs = ", ".join(f'"{n}": ' + (f"OUT[{n!r}]" if n in before else em.var(v))
                     for n, v in plan.outputs if view.in_group(v))
    em.emit(f"return {{{outs}}}")
    return "\n".join(em.lines) + "\n"


def _emit_value(em: Emitter, v: Value, indent: int, async_op: bool = False) -> bool:
    """Emit v if this rank takes part in it; True if it did."""
    if v.op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "send"):
        if not em.view.in_group(v) and not (v.op == "send" and em.view.in_group(v.args[0])):
            return False
        em.emit(f"{em.var(v)} = {em.communicate(v, async_op)}", indent)
        return True
    if em.view.in_group(v):
        em.emit(f"{em.var(v)} = {em.compute(v)}  # {v.name} = {v.op}"
                f"({', '.join(operand(a) for a in v.args)})", indent)
        return True
    return False


def _emit_chunked(em: Emitter, stage: Chunked, index: int) -> None:
    """A chunked chain: one function per part; ctx.pipeline runs part j on chunk k while the
    communication issued by earlier parts for later chunks is in flight."""
    nd, dim = stage.values[0].ndim, stage.dim
    size = bind_shape(stage.values[0].shape, em.view.sizes)[dim]
    bounds = [slice_bounds(size, stage.chunks, k) for k in range(stage.chunks)]
    em.emit(f"CHUNKS_{index} = {[(s, t - s) for s, t in bounds]}  # (start, length) along dim {dim}")
    em.chain_ids = {id(v) for v in stage.values}
    em.chunk = (dim, nd, f"CHUNKS_{index}[k]")
    parts = _flatten(stage.stages)
    for j, part in enumerate(parts):
        em.emit(f"def part{index}_{j}(k, env):  # {part.label}: {', '.join(v.name for v in part.values)}")
        mine = {id(v) for v in part.values}
        loaded: set[int] = set()
        for v in part.values:
            for a in v.args:
                if id(a) in em.chain_ids and id(a) not in mine and id(a) not in loaded and em.view.in_group(a):
                    em.emit(f'{em.var(a)} = env["{em.var(a)}"]', 2)
                    loaded.add(id(a))
        comm = isinstance(part, (Collective, P2P))
        body = len(em.lines)
        for v in part.values:
            if _emit_value(em, v, indent=2, async_op=comm):
                em.emit(f'env["{em.var(v)}"] = {em.var(v)}', 2)
        if len(em.lines) == body:
            em.emit("pass  # this rank takes no part", 2)
    names = ", ".join(f"part{index}_{j}" for j in range(len(parts)))
    comm = [isinstance(part, (Collective, P2P)) for part in parts]
    em.emit(f'with ctx.span("{stage.label}", {index}):')
    em.emit(f"envs = ctx.pipeline({stage.chunks}, [{names}], comm={comm}, labels={[p.label for p in parts]})", 2)
    for v in stage.values:
        if em.view.in_group(v) and id(v) in em.live_out:  # only what later stages or the results read
            j = dim - (nd - v.ndim)
            em.emit(f'{em.var(v)} = rt.concat([e["{em.var(v)}"] for e in envs], {j})', 2)
    em.chunk = None
    em.chain_ids = set()


def _emit_fused_ring(em: Emitter, stage: FusedCollective, index: int) -> None:
    """CoCoNet's fused ring: a function computes one reduced piece of this rank's part (at `piece` =
    (offset, length) inside the part); ctx.fused_ring calls it as each piece finishes its ring
    reduce-scatter and all-gathers its results. Values read after the stage are kept whole (this
    rank's part), assembled from the pieces."""
    rs, ags = stage.reduce_scatter, stage.all_gathers
    inside = [rs] + (stage.kernel.values if stage.kernel is not None else [])
    kept = [v for v in inside if id(v) in em.live_out]
    x, g = em.ref(rs.args[0]), f'ctx.group("{rs.args[0].group.name}")'
    em.chain_ids = {id(v) for v in inside}
    em.chunk = (rs.attrs["dim"], rs.ndim, "piece")
    em.emit(f'with ctx.span("{stage.label}", {index}):')
    em.emit(f"def ring{index}({em.var(rs)}, piece):  # piece: (offset, length) inside this rank's part", 2)
    for v in inside[1:]:
        _emit_value(em, v, indent=3)
    em.emit(f"return [{', '.join(em.var(a.args[0]) for a in ags)}], [{', '.join(em.var(v) for v in kept)}]", 3)
    em.chunk, em.chain_ids = None, set()

    def spec(v: Value) -> str:
        return f'("{v.name}", {em.view.local_shape(v)}, torch.{v.dtype})'

    em.emit(f"[{', '.join(em.var(a) for a in ags)}], [{', '.join(em.var(v) for v in kept)}] = ctx.fused_ring(", 2)
    em.emit(f"{x}, {rs.attrs['dim']}, {rs.attrs['op']!r}, {g}, ring{index},", 3)
    em.emit(f"gathered=[{', '.join(spec(a) for a in ags)}], kept=[{', '.join(spec(v) for v in kept)}])", 3)


def _scratch(em: Emitter, stage: PlanStage) -> dict[int, int]:
    """Temporaries of a computation stage that may be overwritten by their last reader: fresh results of
    arithmetic (INPLACE ops or sqrt/exp/neg/rsqrt in float32/64), read by nothing after it, not live out."""
    if not isinstance(stage, Kernel):
        return {}
    fresh = {id(v) for v in stage.values if (v.op in INPLACE or v.op in ("neg", "sqrt", "rsqrt", "exp"))
             and v.dtype in ("float32", "float64") and id(v) not in em.live_out and em.view.in_group(v)}
    last: dict[int, int] = {}
    for v in stage.values:
        for a in v.args:
            if id(a) in fresh:
                last[id(a)] = id(v)
    return last


def _live_outs(plan: Plan) -> set[int]:
    """Values read across a stage boundary or kept as results (chunked stages concatenate only these)."""
    out = {id(v.args[1] if v.op == "update" else v) for _, v in plan.outputs}
    out |= {id(v) for v in plan.state.values()}
    for stage in plan.stages:
        for a in stage.reads():
            out.add(id(a.args[1] if a.op == "update" else a))
    return out


def _flatten(stages: list[PlanStage]) -> list[PlanStage]:
    """Fused collectives inside a chunked chain run as their parts (RS, C, AG) so that each
    collective can be in flight while another chunk computes."""
    out: list[PlanStage] = []
    for s in stages:
        if isinstance(s, FusedCollective):
            out.append(Collective([s.reduce_scatter]))
            if s.kernel is not None:
                out.append(Kernel(s.kernel.values, fused=True))
            out += [Collective([ag]) for ag in s.all_gathers]
        else:
            out.append(s)
    return out


__all__ = ["generate", "Kernel", "MatMul"]
