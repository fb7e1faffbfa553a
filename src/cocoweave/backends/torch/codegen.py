"""Plan -> Python source: one module with one `step(ctx, I)` function per (plan, rank, world, sizes).

The code is meant to be read (`cocoweave show --code`): every stage is a commented block, shapes
and offsets of this rank are constants, computations are plain torch expressions, communication
goes through `ctx` (runtime.RankContext), which owns the preallocated buffers and the algorithms.
"""

from __future__ import annotations

import keyword
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ... import collectives, rng
from ...ir import registry as R
from ...ir.graph import Value
from ...ir.layout import slice_bounds
from ...ir.ops import wire_reduction
from ...ir.printer import operand
from ...ir.semantics import local_rank
from ...ir.types import bind_shape
from ...plan import P2P, Collective, Compute, FusedCollective, Memory, Overlap, Plan, RankView
from ...plan.memory import OVER_OPS
from ...schedule import rows
from ...schedule.stages import RowChunks
from .algorithms import method as runtime_method

RESERVED = {"ctx", "I", "torch", "rt", "math", "step", "OUT"}
# the in-place form of each op the Plan may compute over an operand: (operand, other) -> expression
INPLACE = {op: (lambda a, b, m=f"{op}_": f"{a}.{m}({b})") for op in OVER_OPS} | {
    "silu_grad": lambda a, b: f"rt.silu_grad({a}, {b}, out={a})"}


class Code(str):
    """Source text that a generated call takes as is where a value's repr would go (a size known at run time)."""

    def __repr__(self) -> str:
        return str(self)


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
    algorithm: str = collectives.DEFAULT  # the collective algorithm of the stage being emitted
    defs: list[str] = field(default_factory=list)  # module-level functions (fused stages), before `step`
    in_function: bool = False  # emitting the body of a fused stage's function (no ctx there)
    extra: dict[str, str] = field(default_factory=dict)  # function parameter -> its argument at the call (host)
    memory: Memory | None = None  # the Plan's memory decisions for this rank (Memory.of(plan, view) when not given)

    def __post_init__(self) -> None:
        if self.memory is None:
            self.memory = Memory.of(self.plan, self.view)

    # -- naming -------------------------------------------------------------------------------
    def var(self, v: Value) -> str:
        if v.op == "update":
            return self.var(v.args[1])
        if id(v) not in self.names:
            base = v.name.replace("%", "v").replace(".", "_").replace("'", "_new")
            if keyword.iskeyword(base) or base in RESERVED or not base.isidentifier():
                base = f"{base}_"
            self.names[id(v)] = self.fresh(base)
        return self.names[id(v)]

    def fresh(self, base: str) -> str:
        """`base`, or `base_1`, `base_2`... if taken (an input may be called like an intermediate, `v10`, or like
        a derived name, `z_pad`): a name no other value of the step has."""
        name, i = base, 1
        while name in self.used:
            name, i = f"{base}_{i}", i + 1
        self.used.add(name)
        return name

    def ref(self, a: Value) -> str:
        """An operand as an expression (constants inline)."""
        return repr(a.attrs["value"]) if a.op == "const" else self.var(a)

    def emit(self, line: str, indent: int = 1) -> None:
        self.lines.append("    " * indent + line)

    # -- values -------------------------------------------------------------------------------
    def host(self, v: Value) -> str:
        """A scalar-only operation, computed with Python numbers on the host."""
        emit = HOST.get(v.op)
        if emit is None:
            raise NotImplementedError(f"host scalar operation {v.op}")
        return emit(v, [self.ref(x) for x in v.args])

    def bounds(self, v: Value) -> list[tuple[int, int]]:
        """[start, stop) per dimension of this rank's part of v in the logical tensor."""
        return self.view.bounds(v)

    def operand_expr(self, v: Value, a: Value, up: bool) -> str:
        """Operand a of elementwise v: cut to this rank's part of v where a is whole along an axis that slices v
        (a Replicated operand of a Sliced result); upcast to float32 when v computes in half precision."""
        e = self.ref(a)
        if a.is_scalar:
            return e
        if (R.opdef(v.op).elementwise or v.op == "layer_norm") and v.layout.is_sliced:
            full = bind_shape(a.shape, self.view.sizes)
            for j, (h, w) in enumerate(zip(self.bounds(a), self.bounds(v)[v.ndim - a.ndim:])):
                if full[j] != 1 and h != w:
                    e = f"{e}.narrow({j}, {w[0] - h[0]}, {w[1] - w[0]})"
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

    def over(self, v: Value) -> str | None:
        """`v` computed over the operand the Plan's memory decisions name (`a.add_(b)`), if any (Memory.over)."""
        j = self.memory.over.get(id(v))
        if j is None:
            return None
        return INPLACE[v.op](self.var(v.args[j]), self.operand_expr(v, v.args[1 - j], up=False))

    def compute(self, v: Value) -> str:
        """A tensor computation as a torch expression (half precision: float32 math, one rounding)."""
        if (e := self.over(v)) is not None:
            return e
        emit, raw = EXPR.get(v.op), v.op in RAW
        if emit is None:
            raise NotImplementedError(f"no code generation for {v.op}")
        half = v.dtype in HALF or any(x.dtype in HALF for x in v.args if not x.is_scalar)
        e = emit(self, v, [self.operand_expr(v, x, up=half and not raw) for x in v.args])
        return f"{e}.to(torch.{v.dtype})" if not raw and (half or v.op in REDUCTIONS) else e

    def dropout(self, v: Value, a: list[str]) -> str:
        """Counter-based dropout: a constant seed's mask is the same every step (the executable hashes it once,
        ctx.keep); a runtime seed hashes the precomputed logical indices each step."""
        seed = v.attrs["seed"] if v.attrs["seed"] is not None else f"int({a[1]})"
        rank = local_rank(v.args[0].layout, self.view.position(v))
        key, p = f"rt.dropout_key({seed}, {rank})", v.attrs["p"]
        if self.in_function:  # a fused loop: the logical index is arithmetic on the element's position
            if v.attrs["seed"] is not None:
                key = str(rng.dropout_key(v.attrs["seed"], rank))
            else:  # the key of a runtime seed is hashed on the host, before the call
                key = f"{self.var(v)}_key"
                self.extra[key] = f"rt.dropout_key(int({a[1]}), {rank})"
            shift = ""
            if v.attrs.get("offset"):  # an integer on the host, like the key
                shift = f" + {self.var(v)}_offset"
                self.extra[shift[3:]] = f"int({a[2]})"
            return f"rt.dropout({a[0]}, {self.logical_index(v.args[0], a[0])}{shift}, {p!r}, {key})"
        bits = f'ctx.keep("{v.name}", {p!r}, {key})' if v.attrs["seed"] is not None else f'ctx.index("{v.name}")'
        if v.attrs.get("offset"):
            bits = f"({bits} + int({a[2]}))"
        if self.chunk is not None:
            dim, nd, se = self.chunk
            bits = f"{bits}.narrow({dim - (nd - v.ndim)}, *{se})"
        if v.attrs["seed"] is not None:
            return f"rt.apply_dropout({a[0]}, {bits}, {p!r})"
        return f"rt.dropout({a[0]}, {bits}, {p!r}, {key})"

    def logical_index(self, x: Value, expr: str) -> str:
        """An expression of the logical indices of this rank's part of `x` (its slice of the whole tensor)."""
        full = bind_shape(x.shape, self.view.sizes)
        cuts = [(d, s) for d, (s, t) in enumerate(self.bounds(x)) if (s, t) != (0, full[d])]
        dim, start = (None, 0) if not cuts else cuts[0] if len(cuts) == 1 else tuple(zip(*cuts))
        return f"rt.logical_index({full}, {self.view.local_shape(x)}, {dim}, {start}, {expr}.device)"

    def slice(self, v: Value, a: list[str]) -> str:
        d = v.attrs["dim"]
        (s, t), s0 = self.bounds(v)[d], self.bounds(v.args[0])[d][0]
        s, t = s - s0, t - s0  # within this rank's part of the operand
        if self.chunk is not None and v.attrs["dim"] == self.chunk[0] - (self.chunk[1] - v.ndim):
            # a piece of this rank's part (fused ring): offset within the part, from the whole tensor
            se = self.chunk[2]
            return f"{self.ref(v.args[0])}.narrow({v.attrs['dim']}, {s} + {se}[0], {se}[1])"
        return f"{a[0]}.narrow({v.attrs['dim']}, {s}, {t - s})"

    def communicate(self, v: Value, async_op: bool = False) -> str:
        """A collective or send through the runtime, into this value's preallocated buffer."""
        x = ", ".join([self.chunked(v.args[0]), *(self.ref(a) for a in v.args[1:])])  # all_to_all_v's counts follow
        key = f'("{v.name}", k)' if self.chunk is not None else f'"{v.name}"'  # a buffer per chunk in flight
        tail = f", out={key}" + (", async_op=True" if async_op else "")
        if v.attrs.get("weights") is not None:  # a weighted average: scale by w_r / sum(w), then sum
            w = v.attrs["weights"]
            x = f"({x} * {w[self.view.line(v)[0]] / sum(w)!r})"
        shares = self.shares(v)
        tail = (f", shares={shares}" if shares is not None else "") + tail
        into = self.memory.into.get(id(v))
        if into is not None:  # gathered straight into the state it becomes
            tail += f", into={self.var(into.state)}" + (", deferrable=True" if into.deferrable else "")
        if v.op == "send":
            return self.send(v, x, tail)
        return self.collective(v, x, self.group(v), tail)

    def group(self, v: Value) -> str:
        """The process group communication value v runs over: its mesh axis' line through this rank, or its group."""
        axis = v.attrs.get("axis")
        return f'ctx.group("{axis if axis is not None else v.args[0].group.name}")'

    def shares(self, v: Value) -> tuple[int, ...] | None:
        """The shares of the parts a collective splits, as its kind says (None: equal parts, or not a collective)."""
        kind = collectives.kinds.find(v.op)
        return None if kind is None else kind.shares(v)

    def collective(self, v: Value, x: str, g: str, tail: str, shape: tuple[Any, ...] | None = None) -> str:
        """The runtime call of collective `v`: the operand, the arguments its kind gives (collectives/kinds.py), the
        group, then its keyword arguments. `shape` stands for v's local shape where a size is only known when the
        step runs (a `Code` expression: a row chunk's rows)."""
        before, after = collectives.kind(v.op).call(v, self.view.local_shape(v) if shape is None else shape)
        args = "".join(f", {a!r}" for a in before)
        more = "".join(f", {k}={a!r}" for k, a in after if a is not None)
        return f"ctx.{self.method(v)}({x}{args}, {g}{more}{tail})"

    def send(self, v: Value, x: str, tail: str) -> str:
        src = v.args[0].group.ranks(self.view.world_size)
        dst = v.group.ranks(self.view.world_size)
        sending = self.view.rank in src
        peer = dst[src.index(self.view.rank)] if sending else src[dst.index(self.view.rank)]
        # both ends hold group rank i's part: the sender's shape is the receiver's
        shape = str(self.view.local_shape(v.args[0] if sending else v))
        if self.chunk is not None:
            dim, nd, se = self.chunk
            shape = f"rt.with_dim({shape}, {dim - (nd - v.ndim)}, {se}[1])"
        return (f"ctx.{self.method(v)}({x if sending else 'None'}, peer={peer}, sending={sending}, "
                f"shape={shape}, dtype=torch.{v.dtype}{tail})")

    def method(self, v: Value) -> str:
        """The runtime method communication value v calls on the stage's algorithm: its registered implementation
        (backends/torch/algorithms.py); the others take the library's arguments (synchronous, never chunked)."""
        return runtime_method(self.algorithm, v.op)


HALF = ("float16", "bfloat16")
REDUCTIONS = R.names(R.REDUCTION)
RAW = ("cast", "matmul", "slice")  # operands as they are, no rounding: the op itself gives the dtype


def _infix(sym: str) -> Callable[[Emitter, Value, list[str]], str]:
    return lambda em, v, a: f"({a[0]} {sym} {a[1]})"


def _unary(fn: str) -> Callable[[Emitter, Value, list[str]], str]:
    def emit(em: Emitter, v: Value, a: list[str]) -> str:
        floating = v.args[0].dtype in ("float16", "bfloat16", "float32", "float64")
        return f"torch.{fn}({a[0] if floating or fn == 'abs' else a[0] + '.float()'})"  # abs keeps integer dtypes

    return emit


def _reduce(em: Emitter, v: Value, a: list[str]) -> str:
    return f"rt.reduce({v.op!r}, {a[0]}, {tuple(v.attrs['dims'])!r}, {v.attrs['keepdim']})"


def _layer_norm(em: Emitter, v: Value, a: list[str]) -> str:
    w = a[1] if v.attrs["has_weight"] else "None"
    b = a[1 + v.attrs["has_weight"]] if v.attrs["has_bias"] else "None"
    return f"torch.nn.functional.layer_norm({a[0]}, ({em.view.local_shape(v)[-1]},), {w}, {b}, {v.attrs['eps']!r})"


# computation -> (emitter, value, operand expressions) -> torch expression
EXPR: dict[str, Callable[[Emitter, Value, list[str]], str]] = {
    "add": _infix("+"), "sub": _infix("-"), "mul": _infix("*"), "div": _infix("/"), "pow": _infix("**"),
    "lt": _infix("<"), "le": _infix("<="), "gt": _infix(">"), "ge": _infix(">="), "eq": _infix("=="),
    "ne": _infix("!="),
    "maximum": lambda em, v, a: f"rt.maximum({a[0]}, {a[1]})",
    "minimum": lambda em, v, a: f"rt.minimum({a[0]}, {a[1]})",
    "neg": lambda em, v, a: f"(-{a[0]})",
    "sqrt": _unary("sqrt"), "rsqrt": _unary("rsqrt"), "exp": _unary("exp"), "abs": _unary("abs"),
    "sigmoid": _unary("sigmoid"), "silu": _unary("nn.functional.silu"),
    "silu_grad": lambda em, v, a: f"rt.silu_grad({a[0]}, {a[1]})",
    "cast": lambda em, v, a: f"{a[0]}.to(torch.{v.dtype})",
    "where": lambda em, v, a: f"torch.where({a[0]}, {a[1]}, {a[2]})",
    "dropout": lambda em, v, a: em.dropout(v, a),
    "sum": _reduce, "max": _reduce, "min": _reduce, "norm": _reduce,
    "matmul": lambda em, v, a: f"torch.matmul({a[0]}, {a[1]})",
    "grouped_matmul": lambda em, v, a: f"rt.grouped_matmul({a[0]}, {a[1]}, {a[2]}, {v.name!r})",
    "grouped_matmul_wgrad": lambda em, v, a: f"rt.grouped_matmul_wgrad({a[0]}, {a[1]}, {a[2]}, {v.name!r})",
    "layer_norm": _layer_norm,
    "slice": lambda em, v, a: em.slice(v, a),
}

def _host_infix(sym: str) -> Callable[[Value, list[str]], str]:
    return lambda v, a: f"{a[0]} {sym} {a[1]}"


_PY = {"add": "+", "sub": "-", "mul": "*", "div": "/", "pow": "**", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
       "eq": "==", "ne": "!="}
# scalar-only operation -> (value, operand expressions) -> Python expression on the host
HOST: dict[str, Callable[[Value, list[str]], str]] = {
    **{op: _host_infix(sym) for op, sym in _PY.items()},
    "neg": lambda v, a: f"-{a[0]}",
    "sqrt": lambda v, a: f"math.sqrt({a[0]})",
    "rsqrt": lambda v, a: f"1.0 / math.sqrt({a[0]})",
    "exp": lambda v, a: f"math.exp({a[0]})",
    # torch's float64 kernels on the host: the reference's bits (its FMA in silu_grad; inf, not math.exp's
    # OverflowError, where exp(-x) overflows)
    "sigmoid": lambda v, a: f"float(torch.sigmoid(torch.as_tensor({a[0]}, dtype=torch.float64)))",
    "silu": lambda v, a: f"float(torch.nn.functional.silu(torch.as_tensor({a[0]}, dtype=torch.float64)))",
    "silu_grad": lambda v, a: f"float(rt.silu_grad({a[0]}, {a[1]}))",
    "abs": lambda v, a: f"abs({a[0]})",
    "maximum": lambda v, a: f"max({a[0]}, {a[1]})",
    "minimum": lambda v, a: f"min({a[0]}, {a[1]})",
    "where": lambda v, a: f"({a[1]} if {a[0]} else {a[2]})",
    "cast": lambda v, a: {"bool": "bool", "int32": "int", "int64": "int"}.get(v.dtype, "float") + f"({a[0]})",
}

def generate(plan: Plan, rank: int, world_size: int, sizes: Mapping[str, int],
             fused: Mapping[int, Any] | None = None, memory: Memory | None = None) -> str:
    """Python source of the step function that rank `rank` of `world_size` runs for `plan`.
    `fused` maps stage indices to generated Triton kernels (kernels.codegen.FusedKernel): those
    stages become one kernel call; the others are torch expressions. `memory`: the Plan's memory decisions for
    this rank, when the caller already has them."""
    view = plan.view(rank, world_size, sizes)
    em = Emitter(plan, view, memory=memory)
    fused = fused or {}
    program = plan.program
    em.live_out = plan.live_outs()
    em.lines += [f'"""cocoweave plan `{plan.name}` ({plan.fingerprint}) for rank {rank} of {world_size}, '
                 f'sizes {dict(sizes)}.', "", "Generated code: read it, do not edit it.", '"""', "",
                 "import math", "", "import torch", "", "from cocoweave.backends.torch import runtime as rt",
                 *(["from cocoweave.schedule import rows as rc"] if any(isinstance(s, RowChunks) for s in plan.stages)
                   else []), "", "",
                 "def step(ctx, I):",
                 '    """One step, a generator that pauses before each stage (yielding its index and what it reads):',
                 '    Executable.run runs it through; Executable.steps lets a caller work between stages."""']
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
        if not view.takes_part(stage):
            continue
        em.emit("")
        reads = ", ".join(f'"{a.name}": {em.ref(a)}' for a in stage.reads() if view.in_group(a))
        em.emit(f"yield {i}, {{{reads}}}")
        em.emit(f"# stage {i}: {stage.label}  [{', '.join(stage.names)}]")
        if isinstance(stage, RowChunks):
            _emit_row_chunks(em, stage, i)
        elif isinstance(stage, Overlap):
            _emit_chunked(em, stage, i)
        elif isinstance(stage, FusedCollective) and collectives.get(stage.algorithm).fuses:
            _emit_fused_ring(em, stage, i)
        elif i in fused:
            k = fused[i]
            em.emit(f'with ctx.span("{stage.label}", {i}):')
            em.emit(f"# one generated Triton kernel, {getattr(k, 'name', 'kernel')} (ctx.fused({i}).source)", 2)
            if getattr(getattr(k, "spec", None), "in_place", None):
                em.emit("# it writes new state over the state tensors: their copies at the end are no-ops", 2)
            outs = ", ".join(em.var(v) for v in k.outputs) + ("," if len(k.outputs) == 1 else "")
            em.emit(f"{outs} = ctx.fused({i})({', '.join(em.ref(a) for a in k.inputs)})", 2)
        elif isinstance(stage, Compute) and stage.fused:
            em.emit(f'with ctx.span("{stage.label}", {i}):')
            _emit_fused_call(em, stage, i, indent=2)
        else:
            em.emit(f'with ctx.span("{stage.label}", {i}):')
            em.algorithm = getattr(stage, "algorithm", collectives.DEFAULT)
            for part in stage.parts if isinstance(stage, FusedCollective) else (stage,):
                if isinstance(part, Compute) and part.fused:
                    _emit_fused_call(em, part, i, indent=2)
                    continue
                for v in part.values:
                    _emit_value(em, v, indent=2)
            em.algorithm = collectives.DEFAULT
    em.emit("")
    em.emit("# results: state is written in place, outputs are returned")
    for name, v in plan.state.items():
        if view.in_group(v) and id(v) not in em.memory.into:
            em.emit(f"{em.var(program.inputs[name])}.copy_({em.var(v)})")
    outs = ", ".join(f'"{n}": ' + (f"OUT[{n!r}]" if n in before else em.var(v))
                     for n, v in plan.outputs if view.in_group(v))
    em.emit(f"return {{{outs}}}")
    head, body = em.lines[:em.lines.index("def step(ctx, I):")], em.lines[em.lines.index("def step(ctx, I):"):]
    return "\n".join(head + em.defs + (["", ""] if em.defs else []) + body + _launch(em)) + "\n"


def _launch(em: Emitter) -> list[str]:
    """`launch(ctx, I)`: issue the step's first communication asynchronously, ahead of the step (e.g. a gradient
    reduction from a backward hook); the step then takes its result from ctx. Only for a library reduce-scatter or
    all-reduce of a tensor input that opens the step (alone or as the head of a fused RS-C-AG)."""
    first = next((i for i, s in enumerate(em.plan.stages) if em.view.takes_part(s)), None)
    stage = em.plan.stages[first] if first is not None else None
    head = stage.values[0] if isinstance(stage, Collective | FusedCollective) else None
    if head is None or not collectives.get(stage.algorithm).overlaps or \
            head.op not in ("all_reduce", "reduce_scatter") or head.args[0].op != "input" or not em.view.in_group(head):
        return ["", "", "launch = None  # the step does not open with a collective that can be issued early"]
    x = head.args[0]
    em.lines = []
    em.emit(f"{em.var(x)} = I[\"{x.name}\"]")
    em.emit(f'with ctx.span("{stage.label}", {first}):')
    em.emit(f'ctx.early("{head.name}", lambda: {em.communicate(head, async_op=True)})', 2)
    doc = f'    """Issue stage {first} ({stage.label}) asynchronously, ahead of the step."""'
    return ["", "", "def launch(ctx, I):", doc, *em.lines]


def _emit_value(em: Emitter, v: Value, indent: int, async_op: bool = False) -> bool:
    """Emit v if this rank takes part in it; True if it did."""
    if R.is_communication(v.op):
        if not em.view.in_group(v) and not (v.op == "send" and em.view.in_group(v.args[0])):
            return False
        em.emit(f"{em.var(v)} = {em.communicate(v, async_op)}", indent)
        return True
    if em.view.in_group(v):
        em.emit(f"{em.var(v)} = {em.compute(v)}  # {v.name} = {v.op}"
                f"({', '.join(operand(a) for a in v.args)})", indent)
        return True
    return False


def _emit_fused_call(em: Emitter, stage: Compute, index: int, indent: int) -> None:
    """A fused computation becomes a module-level function of its inputs that returns its live-outs, and one call:
    `ctx.stage(i, fn)` runs it as one loop (torch.compile, Inductor's C++ on CPU) or op by op, as the executable's
    route says. New state is written over the state tensor inside the function where nothing later reads the old
    contents (the copy at the end of the step is then a no-op)."""
    view, plan = em.view, em.plan
    facts = em.memory.fused[id(stage)]
    vals = [v for v in stage.values if view.in_group(v)]
    outs, params = facts.outputs, facts.inputs
    if not outs:
        return
    name = f"stage{index}" + ("" if stage is plan.stages[index] else f"_{vals[0].id}")
    body = Emitter(plan, view, names=em.names, used=em.used, live_out=em.live_out, in_function=True, memory=em.memory)
    for v in vals:
        _emit_value(body, v, indent=1)
    written = {id(v): em.var(t) for t, v in facts.state_writes}
    for t, v in facts.state_writes:
        body.emit(f"{em.var(t)}.copy_({em.var(v)})  # new `{t.name}` over the old: nothing later reads it")
    # an shm all-gather then finds this rank's part in place
    for own in facts.own_parts.values():
        part = f"{em.var(own.state)}.narrow({own.dim}, {own.start}, {own.length})"
        body.emit(f"{part}.copy_({em.var(own.value)})  # this rank's part of the state its all-gather fills")
        written[id(own.value)] = part
    ret = [written.get(id(v), em.var(v)) for v in outs]
    body.emit(f"return {', '.join(ret)}{',' if len(ret) == 1 else ''}")
    params_ = [em.ref(a) for a in params] + list(body.extra)
    args = [em.ref(a) for a in params] + list(body.extra.values())
    doc = f'"""stage {index}: {stage.label} [{", ".join(stage.names)}], one function of its inputs."""'
    em.defs += ([] if not em.defs else ["", ""]) + [f"def {name}({', '.join(params_)}):", f"    {doc}", *body.lines]
    em.emit(f"{', '.join(em.var(v) for v in outs)}{',' if len(outs) == 1 else ''} = ctx.stage({index}, {name})"
            f"({', '.join(args)})", indent)


def _emit_chunked(em: Emitter, stage: Overlap, index: int) -> None:
    """A chunked chain: one function per part; ctx.pipeline runs part j on chunk k while the
    communication issued by earlier parts for later chunks is in flight."""
    nd, dim = stage.values[0].ndim, stage.chunk_dim
    size = bind_shape(stage.values[0].shape, em.view.sizes)[dim]
    bounds = [slice_bounds(size, stage.chunks, k) for k in range(stage.chunks)]
    em.emit(f"CHUNKS_{index} = {[(s, t - s) for s, t in bounds]}  # (start, length) along dim {dim}")
    em.chain_ids = {id(v) for v in stage.values}
    em.chunk = (dim, nd, f"CHUNKS_{index}[k]")
    parts = stage.parts
    for j, part in enumerate(parts):
        em.emit(f"def part{index}_{j}(k, env):  # {part.label}: {', '.join(part.names)}")
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


def _emit_row_chunks(em: Emitter, stage: RowChunks, index: int) -> None:
    """A chain through all_to_all_v in row-set chunks (schedule/rows.py): `RC{i}` holds this rank's counts on the
    host; part j of chunk k reads its operands' chunk-k rows (index_select), its counts' chunk-k counts and runs the
    exchanges asynchronously, so ctx.pipeline computes chunk k while chunk k+1's exchange is in flight; the chunks'
    results go back to their rows of the whole tensors (a grouped_matmul_wgrad's partial sums added)."""
    facts = rows.of_stage(stage)
    rc = f"RC{index}"
    spaces = ", ".join(f'"{c.name}": {em.var(c)}' for c in facts.spaces)
    segs = ", ".join(f'"{c.name}": ({em.var(c)}, "{facts.segments[id(c)].name}")' for c in facts.counts
                     if id(c) in facts.segments)
    em.emit(f'{rc} = rc.Chunks({stage.chunks}, {{{spaces}}}, {{{segs}}}, "rank {em.view.rank}: {stage.label}")')
    inside = {id(v) for v in stage.values}
    counts = {id(c) for c in facts.counts}
    overlaps = collectives.get(stage.algorithm).overlaps  # shm: one exchange of a group at a time, so each waits
    for j, part in enumerate(stage.parts):
        em.algorithm = getattr(part, "algorithm", collectives.DEFAULT)
        em.emit(f"def part{index}_{j}(k, env):  # {part.label}: {', '.join(part.names)}")
        mine, seen, swapped = {id(v) for v in part.values}, set(), {}
        for a in (a for v in part.values for a in v.args if not a.is_scalar and a.op != "const"):
            if id(a) in seen:
                continue
            seen.add(id(a))
            name = em.var(a)
            if id(a) in inside and id(a) not in mine:
                em.emit(f'{name} = env["{name}"]', 2)
                continue
            if id(a) in counts:  # chunk k's counts in place of the whole ones
                how = f"{'segments' if id(a) in facts.segments else 'counts'}(\"{a.name}\", k)"
            elif id(a) not in inside and id(a) in facts.space:  # chunk k's rows of a whole tensor
                how = f'take({name}, "{facts.space[id(a)].name}", k)'
            else:
                continue
            swapped[id(a)] = name
            em.names[id(a)] = chunk = em.fresh(f"{name}_k")
            em.emit(f"{chunk} = {rc}.{how}", 2)
        for v in part.values:
            if rows.exchanges_rows(v.op):  # chunk k's rows received: a size known when the step runs
                shape = (Code(f'{rc}.rows("{v.args[2].name}", k)'), *em.view.local_shape(v)[1:])
                call = em.collective(v, ", ".join(em.ref(a) for a in v.args), em.group(v),
                                     f', out=("{v.name}", k), async_op={overlaps}', shape)
                em.emit(f"{em.var(v)} = {call}", 2)
            else:
                em.emit(f"{em.var(v)} = {em.compute(v)}  # {v.name} = {v.op}({', '.join(operand(a) for a in v.args)})",
                        2)
            em.emit(f'env["{em.var(v)}"] = {em.var(v)}', 2)
        em.names.update(swapped)  # the whole tensors' names again after the part
    em.algorithm = collectives.DEFAULT
    names = ", ".join(f"part{index}_{j}" for j in range(len(stage.parts)))
    comm = [isinstance(part, Collective) for part in stage.parts]
    em.emit(f'with ctx.span("{stage.label}", {index}):')
    em.emit(f"envs = ctx.pipeline({stage.chunks}, [{names}], comm={comm}, labels={[p.label for p in stage.parts]})", 2)
    pads = _emit_row_padding(em, stage, facts, rc)
    for v in stage.values:
        if id(v) in em.live_out:  # only what later stages or the results read
            pieces = f'[e["{em.var(v)}"] for e in envs]'
            space = facts.space[id(v)]
            pad = f", {pads[id(v)]}" if id(v) in pads else ""
            em.emit(f"{em.var(v)} = " + (f"rc.accumulate({pieces})" if space is rows.ACCUMULATED else
                                         f'{rc}.assemble({pieces}, "{space.name}", '
                                         f"{em.view.local_shape(v)[0]}{pad})"), 2)


def _emit_row_padding(em: Emitter, stage: RowChunks, facts: rows.RowFacts, rc: str) -> dict[int, str]:
    """The rows no chunk holds (the padding past the counts') of the elementwise values read after a row-chunked
    chain (facts.tail), computed once after the chunks from their operands' padding rows: zero for an exchange's or
    a grouped GEMM's, the rows past the counts' of a whole tensor from outside. Returns their names by value id."""
    inside, tail = {id(v) for v in stage.values}, {id(v) for v in facts.tail}
    saved, padded = dict(em.names), set()
    for v in facts.tail:
        for a in v.args:
            if a.is_scalar or a.op == "const" or id(a) in tail or id(a) in padded:
                continue
            if id(a) in inside:
                how = f'zeros(envs[0]["{em.var(a)}"], "{facts.space[id(a)].name}", {em.view.local_shape(a)[0]})'
            elif id(a) in facts.space:
                how = f'padding({em.var(a)}, "{facts.space[id(a)].name}")'
            else:
                continue
            padded.add(id(a))
            em.names[id(a)] = pad = em.fresh(f"{em.var(a)}_pad")
            em.emit(f"{pad} = {rc}.{how}", 2)
        line = em.compute(v)
        em.names[id(v)] = pad = em.fresh(f"{em.var(v)}_pad")
        em.emit(f"{pad} = {line}  # {v.name}'s rows past the chunks'", 2)
    pads = {id(v): em.var(v) for v in facts.tail}
    em.names = saved
    return pads


def _emit_fused_ring(em: Emitter, stage: FusedCollective, index: int) -> None:
    """CoCoNet's fused ring: a function computes one reduced piece of this rank's part (at `piece` =
    (offset, length) inside the part); ctx.fused_ring calls it as each piece finishes its ring
    reduce-scatter and all-gathers its results. Values read after the stage are kept whole (this
    rank's part), assembled from the pieces."""
    rs, ags = stage.reduce_scatter, stage.all_gathers
    inside = [rs] + (list(stage.kernel.values) if stage.kernel is not None else [])
    kept = [v for v in inside if id(v) in em.live_out]
    x, g = em.ref(rs.args[0]), em.group(rs)
    if rs.attrs.get("weights") is not None:
        w = rs.attrs["weights"]
        x = f"({x} * {w[em.view.line(rs)[0]] / sum(w)!r})"
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

    outs = f"[{', '.join(em.var(a) for a in ags)}], [{', '.join(em.var(v) for v in kept)}]"
    em.emit(f"{outs} = ctx.{runtime_method(stage.algorithm, collectives.FUSED)}(", 2)
    em.emit(f"{x}, {rs.attrs['dim']}, {wire_reduction(rs)!r}, {g}, ring{index},", 3)
    shares = f", shares={rs.attrs['shares']}" if rs.attrs.get("shares") is not None else ""
    em.emit(f"gathered=[{', '.join(spec(a) for a in ags)}], kept=[{', '.join(spec(v) for v in kept)}]{shares})", 3)
