"""Fused computation stages as generated Triton kernels: the torch backend's code generation on CUDA.

`build_fused_kernels` turns every top-level fused `Compute` stage whose operations are all elementwise
(arithmetic with broadcasting, neg, pow, sqrt, rsqrt, exp, sigmoid, silu, silu_grad, abs, maximum/minimum,
comparisons, where, cast, dropout, slice) into ONE Triton kernel. The kernel is readable Python source, written to
the plan cache and imported from there (Triton reads a kernel's source from its file); `FusedKernel.source` shows it.

The kernel runs over the flat index space of the stage's iteration shape (this rank's local shapes of
the stage's values, broadcast); each program handles BLOCK consecutive elements, unmasked on full blocks
so that accesses can be 16 bytes wide. A module is specialised to one plan, rank, world size and sizes,
so shapes and strides are constants of the source: an operand's offset is an affine function of the
element's multi-index, with stride 0 on broadcast dimensions and a base offset that narrows a whole
Replicated operand of a sliced stage to this rank's part. Half types compute in float32 and round once
per operation to the value's dtype, like the torch path and the reference backend; division, square root and
rsqrt (1 / sqrt) are correctly rounded (div_rn, sqrt_rn), exp and pow (and the exp in sigmoid and silu) are
libdevice's (kernels/precise.py), and launches disable FMA contraction, as torch computes.
Dropout hashes each element's logical index with `cocoweave.kernels.rng`, so masks are bit-identical to
`cocoweave.rng`. New state is stored over the state tensor it replaces where that is safe (see
`_Gen.over_state`), so an Adam step moves 28 bytes per parameter like benchmarks/baselines/adam.py.

No kernel (the stage stays torch ops): reductions (sum, max, min, norm), layer_norm, matmul; float64
values; a live-out Replicated value that a sliced stage would compute only on this rank's slice; and
computation nested in Overlap or FusedCollective stages, which runs chunk by chunk as torch ops.
"""

from __future__ import annotations

import hashlib
import keyword
import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import triton

from .. import rng
from ..errors import BackendError
from ..ir import registry as R
from ..ir.graph import Value
from ..ir.layout import slice_bounds
from ..ir.loader import import_module_file
from ..ir.printer import operand
from ..ir.types import DTYPES, bind_shape, promote
from ..plan import Compute, Memory, Plan, RankView
from ..storage.codecache import source_file
from .precise import interpreted

log = logging.getLogger("cocoweave.kernels")
OPS = frozenset(R.names(*R.ELEMENTWISE_GROUPS, R.LAYOUT))
HALF = ("float16", "bfloat16")
TL = {"float16": "tl.float16", "bfloat16": "tl.bfloat16", "float32": "tl.float32", "int32": "tl.int32",
      "int64": "tl.int64", "bool": "tl.int1"}
INFIX = {"add": "+", "sub": "-", "mul": "*", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
# correctly rounded or libdevice's (kernels/precise.py): tl.rsqrt, tl.exp and an exp2-based pow are approximate
# sigmoid and silu as torch's CUDA kernels write them (1 / (1 + expf(-x)), x / (1 + expf(-x)), one rounding for halves)
UNARY = {"abs": "tl.abs({x})", "sqrt": "tl.sqrt_rn({x})", "rsqrt": "tl.div_rn(1.0, tl.sqrt_rn({x}))",
         "exp": "precise_exp({x})", "sigmoid": "tl.div_rn(1.0, 1.0 + precise_exp(-({x})))",
         "silu": "tl.div_rn({x}, 1.0 + precise_exp(-({x})))"}
# torch.pow's special cases for constant exponents (pow_tensor_scalar_optimized_kernel)
POW = {1: "{x}", 2: "{x} * {x}", 3: "{x} * {x} * {x}", 0.5: "tl.sqrt_rn({x})",
       -0.5: UNARY["rsqrt"], -1: "tl.div_rn(1.0, {x})", -2: "tl.div_rn(1.0, {x} * {x})"}
# At most 8 elements per thread (BLOCK / (32 x num_warps)): at 16, Adam's fused stage (two pows, six streams) used 168
# registers and spilled under Triton 3.6 for sm_90 (tests/kernels/test_sm90_compile.py, seen on an H200).
MAX_BLOCK = 2048
RESERVED = {"i", "mask", "tl", "triton", "BLOCK", "keep_mask", "precise_exp", "precise_pow", "math", "float"}
INT32_LIMIT = 2**31 - 1


class NoKernel(Exception):  # noqa: N818 - a reason, not a failure: the stage stays torch ops
    """Why a fused stage gets no Triton kernel (it runs as torch ops instead)."""


@dataclass
class KernelSpec:
    """A generated kernel's source and what its launcher needs: inputs in call order with their kinds
    ("tensor", "float", "int", or "host": a dropout seed used on the host only), outputs and shapes."""

    stage: int
    name: str
    source: str
    inputs: list[Value]
    kinds: list[str]
    numels: list[int]  # expected elements of each tensor input (0 for scalars)
    outputs: list[Value]
    out_shapes: list[tuple[int, ...]]
    dropouts: list[tuple[int | None, int | None, int, int]]  # (seed, seed input slot, key rank, threshold)
    in_place: dict[int, int]  # output index -> input slot: new state written over the state tensor it replaces
    numel: int
    block: int
    num_warps: int


@dataclass
class _Tensor:
    """Where a tensor's elements sit for the kernel: per iteration dim a stride (0: broadcast) and a base."""

    strides: list[int]
    base: int


@dataclass
class _Gen:
    """Writes the kernel of one fused stage for one rank: `analyse` finds the iteration shape, inputs and
    live-out values (or raises NoKernel), `generate` emits the source."""

    plan: Plan
    index: int
    stage: Compute
    view: RankView
    live: set[int]
    names: dict[int, str] = field(default_factory=dict)
    used: set[str] = field(default_factory=lambda: set(RESERVED))
    dtypes: dict[str, str] = field(default_factory=dict)  # variable -> ir dtype
    lines: list[str] = field(default_factory=list)

    # -- analysis -----------------------------------------------------------------------------
    def analyse(self) -> None:
        vals = self.stage.values
        for v in vals:
            if v.op not in OPS:
                raise NoKernel(f"`{v.name}` is a {v.op}, not an elementwise operation")
            for t in (v, *map(_arg, v.args)):
                if t.dtype not in TL:
                    raise NoKernel(f"`{t.name}` is {t.dtype}, which generated kernels do not handle")
        self.inside = {id(v) for v in vals}
        tensors = {id(t): t for v in vals for t in (v, *map(_arg, v.args)) if not t.is_scalar}
        self.nd = max(t.ndim for t in tensors.values())
        if any(t.layout.kind == "mesh" or getattr(t.layout, "shares", None) for t in tensors.values()):
            raise NoKernel("values laid out on a mesh of several axes or in uneven shares run as torch ops")
        dims = {t.layout.dim + self.nd - t.ndim for t in tensors.values() if t.layout.is_sliced}
        if len(dims) > 1:
            raise NoKernel(f"values are sliced along several dimensions {sorted(dims)}")
        self.sliced = dims.pop() if dims else None
        self.gr, self.gs = self.view.group_rank(vals[-1])
        shape = [1] * self.nd
        for t in tensors.values():
            for d, n in enumerate(self.effective(t)):
                if n != shape[d] and shape[d] != 1 and n != 1:
                    raise NoKernel(f"`{t.name}` does not broadcast with the stage's other values")
                shape[d] = n if shape[d] == 1 else shape[d]
        self.shape = tuple(shape)
        self.numel = math.prod(self.shape)
        self.outputs = [v for v in vals if id(v) in self.live]
        if not self.outputs:
            raise NoKernel("no value of the stage is used outside it")
        for v in self.outputs:
            if self.effective(v) != self.aligned(v):
                raise NoKernel(f"live-out Replicated `{v.name}` would be computed on this rank's slice only")
            if self.numel == 0 and math.prod(self.aligned(v)):
                raise NoKernel("this rank's part of the stage is empty")
        seen: dict[int, Value] = {}
        for v in vals:
            for a in map(_arg, v.args):
                if id(a) not in self.inside and a.op != "const":
                    seen.setdefault(id(a), a)
        self.inputs = list(seen.values())
        sizes = [self.numel] + [math.prod(bind_shape(t.shape, self.view.sizes)) for t in tensors.values()]
        self.wide = max(sizes) + MAX_BLOCK > INT32_LIMIT  # start + BLOCK must not overflow int32 either

    def aligned(self, t: Value) -> tuple[int, ...]:
        """This rank's local shape of t, right-aligned to the iteration dims."""
        return (1,) * (self.nd - t.ndim) + self.view.local_shape(t)

    def narrowed(self, t: Value) -> tuple[int, int] | None:
        """(iteration dim, start) where a whole Replicated t is narrowed to this rank's slice."""
        if self.sliced is None or not t.layout.is_replicated:
            return None
        j = self.sliced - (self.nd - t.ndim)
        full = bind_shape(t.shape, self.view.sizes)
        if j < 0 or full[j] == 1:
            return None
        return self.sliced, slice_bounds(full[j], self.gs, self.gr)[0]

    def effective(self, t: Value) -> tuple[int, ...]:
        """The part of t that the kernel's elements cover (narrowed along the stage's sliced dim)."""
        shape = list(self.aligned(t))
        cut = self.narrowed(t)
        if cut is not None:
            d, start = cut
            shape[d] = slice_bounds(shape[d], self.gs, self.gr)[1] - start
        return tuple(shape)

    def layout_of(self, full: tuple[int, ...], start: int | None) -> _Tensor:
        """Contiguous storage of shape `full` (right-aligned) read at the iteration's elements, starting
        at `start` along the sliced dim when given."""
        full = (1,) * (self.nd - len(full)) + tuple(full)
        strides, step = [0] * self.nd, 1
        for d in range(self.nd - 1, -1, -1):
            strides[d] = step if full[d] != 1 else 0
            step *= full[d]
        base = start * strides[self.sliced] if start else 0
        return _Tensor(strides, base)

    def storage(self, t: Value) -> _Tensor:
        cut = self.narrowed(t)
        return self.layout_of(self.view.local_shape(t), cut[1] if cut else None)

    # -- naming -------------------------------------------------------------------------------
    def var(self, v: Value) -> str:
        v = _arg(v)
        if id(v) not in self.names:
            base = re.sub(r"\W", "_", v.name.replace("%", "v").replace("'", "_new"))
            if not base[0].isalpha():
                base = "v" + base
            if keyword.iskeyword(base) or base.endswith("_ptr") or re.fullmatch(r"(index|key|threshold)\d+", base):
                base += "_"
            name = self.fresh(base)
            self.names[id(v)] = name
            self.dtypes[name] = v.dtype
        return self.names[id(v)]

    def fresh(self, base: str) -> str:
        """A kernel-local name starting with `base` that no value or temporary of this kernel has."""
        name, k = base, 1
        while name in self.used:
            name, k = f"{base}_{k}", k + 1
        self.used.add(name)
        return name

    def emit(self, line: str) -> None:
        self.lines.append("    " + line)

    # -- expressions --------------------------------------------------------------------------
    def affine(self, layout: _Tensor, block: bool) -> str:
        """Offset of each element as an expression of the flat index `i`, dims merged where contiguous."""
        dims: list[list[int]] = []  # [size, stride] of merged iteration dims, outermost first
        for n, s in zip(self.shape, layout.strides):
            if n == 1:
                continue
            if dims and dims[-1][1] == s * n:
                dims[-1] = [dims[-1][0] * n, s]
            else:
                dims.append([n, s])
        terms, inner = [], 1
        for n, s in reversed(dims):
            if s:
                e = "i" if inner == 1 else f"i // {inner}"
                if inner * n != self.numel:
                    e = f"{e} % {n}"
                terms.append(e if s == 1 else (f"({e}) * {s}" if " " in e else f"{e} * {s}"))
            inner *= n
        terms.reverse()
        if layout.base:
            terms.append(str(layout.base))
        if not terms or not any("i" in t for t in terms):
            return f"i * 0 + {layout.base}" if block else str(layout.base)
        return " + ".join(terms)

    def broadcast_mask(self, layout: _Tensor) -> str:
        """Elements of a smaller output are written once: where every broadcast index is 0 ("" if none is)."""
        conds, inner = [], 1
        for n, s in reversed(list(zip(self.shape, layout.strides))):
            if n != 1 and s == 0:
                conds.append(f"(i // {inner} % {n} == 0)" if inner > 1 else f"(i % {n} == 0)")
            inner *= n
        return " & ".join(reversed(conds))

    def operand(self, a: Value, compute: str | None) -> str:
        """An operand converted to the compute dtype (constants inline, bool scalars compared to 0)."""
        a = _arg(a)
        if a.op == "const":
            x = a.attrs["value"]
            if isinstance(x, float):
                return repr(x) if math.isfinite(x) else f'float("{x}")'
            return repr(int(x)) if not isinstance(x, bool) else repr(x)
        name = self.var(a)
        if a.is_scalar:
            return f"({name} != 0)" if a.dtype == "bool" else name
        if compute is not None and self.dtypes[name] != compute:
            return f"{name}.to({TL[compute]})"
        return name

    def compute(self, v: Value) -> str:
        """v as a Triton expression: float32 math for halves, one rounding to v's dtype."""
        op = v.op
        if op == "slice":
            return self.var(v.args[0])
        if op == "cast":
            x = self.operand(v.args[0], None)
            return f"{x} != 0" if v.dtype == "bool" else f"{x}.to({TL[v.dtype]})"
        if R.group(op) == R.COMPARISON:
            c = _compute_dtype(_promoted(v.args))
            a = [self.operand(x, c) for x in v.args]
            return f"{a[0]} {INFIX[op]} {a[1]}"
        c = _compute_dtype(v.dtype)
        if c == "bool" and op != "where":
            raise NoKernel(f"`{v.name}` is a {op} of bool values")
        if op == "where":
            a = [self.operand(v.args[0], None)] + [self.operand(x, c) for x in v.args[1:]]
            e = f"tl.where({a[0]}, {a[1]}, {a[2]})"
        elif op == "dropout":
            e = self.dropout(v, self.operand(v.args[0], c))
        elif op == "pow":
            e = self.power(v, c)
        else:
            a = [self.operand(x, c) for x in v.args]
            if op in INFIX:
                e = f"{a[0]} {INFIX[op]} {a[1]}"
            elif op == "div":
                e = f"tl.div_rn({a[0]}, {a[1]})"
            elif op == "silu_grad":  # torch's CUDA silu_backward: dy * s * (1 + x * (1 - s)), s = sigmoid(x)
                s = self.fresh(f"{self.var(v)}_sigmoid")
                self.emit(f"{s} = {UNARY['sigmoid'].format(x=a[1])}")
                e = f"{a[0]} * {s} * (1.0 + {a[1]} * (1.0 - {s}))"
            elif op in ("maximum", "minimum"):
                nan = ", propagate_nan=tl.PropagateNan.ALL" if c == "float32" else ""
                e = f"tl.{op}({a[0]}, {a[1]}{nan})"
            elif op == "neg":
                e = f"-{a[0]}"
            elif op in UNARY:
                e = UNARY[op].format(x=a[0])
            else:  # pragma: no cover - OPS lists exactly the cases above
                raise NoKernel(f"no Triton code for {op}")
        return f"({e}).to({TL[v.dtype]})" if v.dtype != c else e

    def power(self, v: Value, c: str) -> str:
        base, exp = v.args
        x = self.operand(base, c)
        if exp.op == "const" and exp.attrs["value"] in POW and not isinstance(exp.attrs["value"], bool):
            if c != "float32" and exp.attrs["value"] not in (1, 2, 3):
                raise NoKernel(f"`{v.name}` is an integer power with a negative or fractional exponent")
            return POW[exp.attrs["value"]].format(x=x if " " not in x and "(" not in x else f"({x})")
        if c != "float32":
            raise NoKernel(f"`{v.name}` is an integer power with a non-constant exponent")
        return f"precise_pow({x}, {self.operand(exp, c)})"

    def dropout(self, v: Value, x: str) -> str:
        p = v.attrs["p"]
        if p == 0.0:
            return x
        if v.attrs.get("offset"):
            raise NoKernel(f"`{v.name}` draws its mask at an index offset known only at run time")
        src = v.args[0]
        k = len(self.dropouts)
        full = bind_shape(src.shape, self.view.sizes)
        cut = self.narrowed(src)
        start = cut[1] if cut else None
        if src.layout.is_sliced:
            start = slice_bounds(full[src.layout.dim], self.gs, self.gr)[0]
        index = self.affine(self.layout_of(full, start), block=True)
        self.emit(f"index{k} = ({index}).to(tl.uint32)  # logical index of `{src.name}`'s elements")
        seed, slot = v.attrs["seed"], None
        if seed is None:
            slot = next(j for j, a in enumerate(self.inputs) if a is _arg(v.args[1]))
        rank = self.gr if src.layout.is_local else rng.NO_RANK
        self.dropouts.append((seed, slot, rank, rng.keep_threshold(p)))
        return f"tl.where(keep_mask(index{k}, key{k}, threshold{k}), {x} * {1.0 / (1.0 - p)!r}, 0.0)"

    def over_state(self) -> dict[int, int]:
        """Output index -> input slot, for the state the Plan writes over in this stage (Memory.state_writes) where
        the kernel reads the state tensor at exactly the elements it writes. Like the hand-written optimizer kernels,
        an Adam step then moves 28 bytes per parameter instead of 28 plus a copy of each state tensor at the end."""
        writes = {id(new): t for t, new in Memory.of(self.plan, self.view).state_writes(self.stage)}
        out = {}
        for j, v in enumerate(self.outputs):
            t = writes.get(id(v))
            if t is None or all(a is not t for a in self.inputs):
                continue
            if self.storage(t) == self.layout_of(self.view.local_shape(v), None):
                out[j] = next(k for k, a in enumerate(self.inputs) if a is t)
        return out

    # -- the module ---------------------------------------------------------------------------
    def generate(self) -> KernelSpec:
        self.analyse()
        self.dropouts: list[tuple[int | None, int | None, int, int]] = []
        name = f"stage{self.index}_kernel"
        seeds = {id(_arg(v.args[1])) for v in self.stage.values if v.op == "dropout" and v.attrs["seed"] is None}
        used_as_value = {id(_arg(a)) for v in self.stage.values for j, a in enumerate(v.args)
                         if not (v.op == "dropout" and j == 1)}
        kinds, params, numels = [], [], []
        for a in self.inputs:
            if a.is_scalar and id(a) in seeds and id(a) not in used_as_value:
                kinds.append("host")
                numels.append(0)
                continue
            if a.is_scalar:
                kinds.append("float" if a.dtype in ("float32", *HALF) else "int")
                params.append(self.var(a))
                numels.append(0)
            else:
                kinds.append("tensor")
                params.append(f"{self.var(a)}_ptr")
                numels.append(math.prod(self.view.local_shape(a)))
        for a in self.inputs:
            if not a.is_scalar:
                off = self.affine(self.storage(a), block=False)
                scalar = "i" not in off
                load = f"tl.load({self.var(a)}_ptr + {off})" if scalar and off != "0" else (
                    f"tl.load({self.var(a)}_ptr)" if scalar else f"tl.load({self.var(a)}_ptr + {off}, mask=mask)")
                self.emit(f"{self.var(a)} = {load}  # {a.name}: {a.type_str()}")
        for v in self.stage.values:
            e = self.compute(v)
            self.emit(f"{self.var(v)} = {e}  # {v.name} = {v.op}({', '.join(operand(a) for a in v.args)})")
        outs, in_place = [], self.over_state()
        for j, v in enumerate(self.outputs):
            layout = self.layout_of(self.view.local_shape(v), None)
            ptr = f"out_{self.var(v)}_ptr"
            outs.append(ptr)
            note = f"  # over `{self.inputs[in_place[j]].name}`, in place" if j in in_place else ""
            once = self.broadcast_mask(layout)
            store_mask = f"({once}) if mask is None else mask & ({once})" if once else "mask"
            self.emit(f"tl.store({ptr} + {self.affine(layout, block=True)}, {self.var(v)}, mask={store_mask}){note}")
        keys = [f"{w}{k}" for k in range(len(self.dropouts)) for w in ("key", "threshold")]
        block = min(MAX_BLOCK, max(16, triton.next_power_of_2(max(self.numel, 1))))
        num_warps = max(1, min(8, block // 256))
        ints = [p for p, kd in zip(params, [k for k in kinds if k != "host"]) if kd == "int"] + keys
        deco = f"@triton.jit(do_not_specialize={ints!r})" if ints else "@triton.jit"
        args = ", ".join(params + keys + outs)
        start = "tl.program_id(0).to(tl.int64) * BLOCK" if self.wide else "tl.program_id(0) * BLOCK"
        grid = triton.cdiv(self.numel, block)
        sizes = dict(self.view.sizes)
        head = [
            f'"""cocoweave plan `{self.plan.name}` ({self.plan.fingerprint}), stage {self.index} '
            f"({self.stage.label}) for rank {self.view.rank} of {self.view.world_size}, sizes {sizes}.",
            "",
            f"One Triton kernel over {list(self.shape)} ({self.numel} elements): grid ({grid},), "
            f"BLOCK={block}, num_warps={num_warps}.",
            "Reads " + (", ".join(f"`{a.name}`" for a in self.inputs) or "nothing")
            + "; writes " + ", ".join(f"`{v.name}`" for v in self.outputs) + ".",
            "Generated code: read it, do not edit it.",
            '"""',
            "",
            "import triton",
            "import triton.language as tl",
        ]
        precise = sorted(f for f in ("precise_exp", "precise_pow") if f + "(" in "\n".join(self.lines))
        if precise or self.dropouts:
            head.append("")
        if precise:
            head.append(f"from cocoweave.kernels.precise import {', '.join(precise)}")
        if self.dropouts:
            head.append("from cocoweave.kernels.rng import keep_mask")
        body = name.replace("_kernel", "_body")
        head += ["", "", "@triton.jit", f"def {body}({args}, i, mask):",
                 '    """BLOCK elements at flat indices i (mask: None for a full block)."""']
        tail = ["", "", deco, f"def {name}({args}, BLOCK: tl.constexpr):",
                f"    start = {start}",
                f"    i = start + tl.arange(0, BLOCK)  # flat index over {list(self.shape)}",
                f"    if start + BLOCK <= {self.numel}:  # a full block: no mask, so accesses can be 16 bytes wide",
                f"        {body}({args}, i, None)",
                "    else:",
                f"        {body}({args}, i, i < {self.numel})"]
        source = "\n".join(head + self.lines + tail) + "\n"
        return KernelSpec(self.index, name, source, self.inputs, kinds, numels, self.outputs,
                          [self.view.local_shape(v) for v in self.outputs], self.dropouts, in_place, self.numel, block,
                          num_warps)


def _arg(a: Value) -> Value:
    """An operand as the value it reads (an `update` reads its new contents)."""
    return a.args[1] if a.op == "update" else a


def _promoted(args: tuple[Value, ...]) -> str:
    """The dtype two operands are compared in (torch promotion, scalars weak)."""
    args = tuple(map(_arg, args))
    tensors = [a.dtype for a in args if not a.is_scalar]
    dtype = tensors[0]
    for d in tensors[1:]:
        dtype = promote(dtype, d)
    if dtype in ("bool", "int32", "int64") and any(a.is_scalar and a.dtype not in ("bool", "int32", "int64")
                                                   for a in args):
        dtype = "float32"
    return dtype


def _compute_dtype(dtype: str) -> str:
    return "float32" if dtype in HALF else dtype


def kernel_spec(plan: Plan, index: int, rank: int, world_size: int, sizes: Mapping[str, int]) -> KernelSpec:
    """The generated kernel of stage `index` for `rank`; NoKernel says why a stage gets none."""
    stage = plan.stages[index]
    if not isinstance(stage, Compute) or not stage.fused:
        raise NoKernel(f"stage {index} is a {stage.label} stage, not a fused computation")
    view = plan.view(rank, world_size, sizes)
    if not view.in_group(stage.values[-1]):
        raise NoKernel(f"rank {rank} takes no part in stage {index}")
    return _Gen(plan, index, stage, view, plan.live_outs()).generate()


class FusedKernel:
    """One fused computation stage as one generated Triton kernel. Call it with the stage's inputs
    (`inputs` order: tensors and scalars); it returns its live-out values (`outputs` order) in
    buffers it owns, reused by every call (valid until the next one)."""

    def __init__(self, spec: KernelSpec, device: torch.device, key: str):
        self.spec = spec
        self.inputs, self.outputs, self.source = spec.inputs, spec.outputs, spec.source
        self.stage, self.name, self.device = spec.stage, spec.name, torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda": the rank's GPU, as tensors name it
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.path = source_file(spec.source, key)
        self._fn = getattr(_load_module(self.path, spec.source), spec.name)
        self._grid = (triton.cdiv(spec.numel, spec.block),)
        self._outs = [torch.empty(0 if j in spec.in_place else s, dtype=DTYPES[v.dtype], device=device)
                      for j, (v, s) in enumerate(zip(spec.outputs, spec.out_shapes))]
        self._keys = [None if seed is None else [rng.dropout_key(seed, r), thr]
                      for seed, _, r, thr in spec.dropouts]

    def __call__(self, *args: Any) -> tuple[torch.Tensor, ...]:
        spec = self.spec
        if len(args) != len(spec.inputs):
            raise BackendError(f"fused stage {spec.stage}: expected {len(spec.inputs)} inputs, got {len(args)}")
        given: list[Any] = []  # each input as the kernel takes it (None: used on the host only)
        for v, kind, n, a in zip(spec.inputs, spec.kinds, spec.numels, args):
            if kind == "tensor":
                if a.numel() != n:
                    raise BackendError(f"fused stage {spec.stage}: input `{v.name}` has {a.numel()} elements, "
                                       f"expected {n}")
                if a.device != self.device:
                    raise BackendError(f"fused stage {spec.stage}: input `{v.name}` is on {a.device}, and the "
                                       f"stage's kernel runs on {self.device}")
                given.append(a if a.is_contiguous() else a.contiguous())
            else:
                given.append(float(a) if kind == "float" else int(a) if kind == "int" else None)
        call = [a for a, kind in zip(given, spec.kinds) if kind != "host"]
        for keys, (_, slot, r, thr) in zip(self._keys, spec.dropouts):
            call += keys if keys is not None else [rng.dropout_key(int(args[slot]), r), thr]
        outs = list(self._outs)
        for j, slot in spec.in_place.items():
            outs[j] = given[slot]  # a copy when the state tensor was not contiguous: the step copies it back
        if self._grid[0]:
            self._fn[self._grid](*call, *outs, BLOCK=spec.block, num_warps=spec.num_warps, enable_fp_fusion=False)
        return tuple(outs)

    def precompile(self) -> None:
        """Compile the kernel now for the launch `__call__` makes (dtypes stand in for tensors: Triton's
        JITFunction.warmup), so that a step's first launch does not compile inside a collective's timeout. A
        launch that specialises differently (an unaligned input) compiles then, as without this."""
        spec = self.spec
        warmup = getattr(self._fn, "warmup", None)
        if warmup is None or interpreted() or not self._grid[0]:  # interpreted: nothing to compile
            return
        args: list[Any] = [DTYPES[v.dtype] if kind == "tensor" else 0.5 if kind == "float" else 3
                           for v, kind in zip(spec.inputs, spec.kinds) if kind != "host"]
        for keys in self._keys:
            args += keys if keys is not None else [2**31, 2**31]  # a seed given at run time: a 64-bit key
        args += [DTYPES[v.dtype] for v in spec.outputs]
        try:
            warmup(*args, grid=self._grid, BLOCK=spec.block, num_warps=spec.num_warps, enable_fp_fusion=False)
        except Exception as exc:  # noqa: BLE001 - the first launch compiles instead, and reports any real error
            log.debug("precompiling %s failed (%s); it compiles at its first launch", self.name, exc)

    def __repr__(self) -> str:
        return f"<FusedKernel {self.name} ({self.path})>"


def _load_module(path: Any, source: str) -> Any:
    """Import a generated kernel module from its file (once per process and content)."""
    return import_module_file("cocoweave_kernel_" + hashlib.sha256(source.encode()).hexdigest()[:16], str(path))


def build_fused_kernels(plan: Plan, rank: int, world_size: int, sizes: Mapping[str, int],
                        device: str | torch.device) -> dict[int, FusedKernel]:
    """Generated Triton kernels of the top-level fused elementwise stages rank `rank` runs, by stage
    index; other stages (see the module docstring) are left to torch ops. Generating needs no GPU;
    launching on a CPU needs TRITON_INTERPRET=1 (the Executable checks). On CUDA each kernel is compiled here
    (`FusedKernel.precompile`), not at its first launch inside a step."""
    device = torch.device(device)
    out: dict[int, FusedKernel] = {}
    for i, stage in enumerate(plan.stages):
        if not isinstance(stage, Compute) or not stage.fused:
            continue
        try:
            spec = kernel_spec(plan, i, rank, world_size, sizes)
        except NoKernel:
            continue
        digest = hashlib.sha256(spec.source.encode()).hexdigest()[:12]
        out[i] = FusedKernel(spec, device, f"{plan.fingerprint}-r{rank}-w{world_size}-s{i}-triton-{digest}")
        if device.type == "cuda":  # compile at build time, before the step's first collective
            out[i].precompile()
    return out
