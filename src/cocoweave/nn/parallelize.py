"""Tensor parallelism of an existing torch model in one call, with torch's own plan vocabulary.

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = {"layers.*.attention.wq": ColwiseParallel(), ..., "layers.*.attention.wo": RowwiseParallel()}
    parallelize_module(model, mesh["tp"], plan)        # torch's DTensor TP
    cocoweave.nn.parallelize(model, mesh, plan)        # the same plan on cocoweave's compiled layers

Each planned nn.Linear is replaced in place by a ColumnParallelLinear / RowParallelLinear holding this rank's part of
its weights (the module's names, and so the state-dict keys, stay as they were); every other parameter of the model
becomes a Replicate() DTensor on the same mesh, and the modules that own one run on its local tensor. All parameters
are then DTensors: `model.state_dict()` saves and reshards through torch.distributed.checkpoint, `clip_grad_norm_`
returns the whole model's norm, and an optimizer over another mesh dim (DistributedAdamW over "dp") composes.

What a plan may say (anything else is refused with a sentence naming the module):
- ColwiseParallel() on an nn.Linear: output features split (the output is this rank's slice on the last dim);
  `output_layouts=Replicate()` gathers the output.
- RowwiseParallel() on an nn.Linear: input features split (the input is the slice a ColwiseParallel produced), the
  partial products summed.
- RowwiseParallel() on an nn.Embedding: the vocabulary split (a VocabParallelEmbedding), where cocoweave has one.
- Sequence parallelism as torchtitan plans it (nn/sequence.py): SequenceParallel() on the norms (they run on this
  rank's slice of the sequence, their gradients summed), PrepareModuleInput from Shard(1) to Replicate() on the
  modules that need the whole sequence (attention, feed-forward: one all-gather, whose backward reduce-scatters the
  partial input gradients of every column-parallel projection inside), RowwiseParallel(output_layouts=Shard(1))
  (the partial sums reduce-scattered into the next slice), RowwiseParallel(input_layouts=Replicate(),
  output_layouts=Shard(1)) on the embedding and ColwiseParallel(input_layouts=Shard(1)) on the output projection.
  A module whose input the plan gathers must read it only through its planned column-parallel projections (as
  torchtitan's attention and feed-forward do); sequences must split evenly over the group.
- PrepareModuleInput / PrepareModuleOutput whose layouts are already what the module gets: no-ops.
Attention heads are checked up front: a module with `n_heads` / `n_kv_heads` (torchtitan) or `num_heads` /
`num_key_value_heads` (Hugging Face) whose projections are planned must have head counts the group size divides.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from torch import nn

from ..errors import ParallelConfigError
from ..sharding import is_dtensor, local, replicate_parameters, tp_mesh
from .functional import group_size
from .layers import ColumnParallelLinear, RowParallelLinear, _ParallelLinear, resolve_group
from .sequence import SequenceColumnLinear, SequenceRowLinear, gather_inputs, on_sequence_slices, scatter_output


def parallelize(model: nn.Module, mesh: Any, plan: Mapping[str, Any], *, schedule: str | None = "auto"
                ) -> nn.Module:
    """Split `model`'s planned modules over `mesh`'s "tp" dim (a DeviceMesh, or a ProcessGroup) in place and make
    every other parameter a replicated DTensor; returns `model`. `plan` maps module names (with `*` for one name
    part, as torch's parallelize_module) to torch's ParallelStyles. `schedule` is the layers' program schedule
    ("auto": measured per layer and cached; None: the hand-written path)."""
    if not isinstance(plan, Mapping):
        raise ParallelConfigError(f"parallelize takes a plan of module names to ParallelStyles, got "
                                  f"{type(plan).__name__}")
    group = resolve_group(mesh)
    tp = group_size(group)
    modules = dict(model.named_modules())
    chosen: dict[str, Any] = {}
    for pattern, style in plan.items():
        hits = [name for name in modules if name and _matches(pattern, name)]
        if not hits:
            raise ParallelConfigError(f"parallelize: the plan names {pattern!r}, which matches no module of "
                                      f"{type(model).__name__}")
        for name in hits:
            chosen[name] = style
    _check_heads(modules, chosen, tp)
    gathered = _gathered(chosen, modules)
    for name, style in chosen.items():
        new = _replacement(name, modules[name], style, mesh, schedule, gathered)
        if new is not None:
            _set(model, name, new)
    _replicate_the_rest(model, tp_mesh(mesh))
    return model


def _matches(pattern: str, name: str) -> bool:
    """torch's rule: the name and the pattern have as many dotted parts, each matched by fnmatch."""
    want, have = pattern.split("."), name.split(".")
    return len(want) == len(have) and all(fnmatch.fnmatchcase(h, w) for w, h in zip(want, have, strict=True))


def _layouts(style: Any, attr: str) -> tuple[Any, ...]:
    value = getattr(style, attr, None)
    return tuple(value) if isinstance(value, tuple | list) else (value,)


def _is(layouts: tuple[Any, ...], kind: type, dim: int | None = None) -> bool:
    return len(layouts) == 1 and isinstance(layouts[0], kind) and (dim is None or layouts[0].dim in (dim, -1))


def _replacement(name: str, module: nn.Module, style: Any, mesh: Any, schedule: str | None,
                 gathered: Mapping[str, tuple[tuple[int, ...], tuple[str, ...]]]) -> nn.Module | None:
    """The cocoweave module that does what `style` asks of `module` (None: nothing to replace; a module that only
    changes what its forward does is changed in place). `gathered`: the modules whose inputs the plan gathers from
    sequence slices, with those inputs (their column-parallel projections leave the input gradient to the
    gather)."""
    from torch.distributed.tensor import Replicate, Shard  # imported here: DTensor costs 0.4 s to import
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    what = _describe(name, module, style)
    group = resolve_group(mesh)
    if isinstance(module, _ParallelLinear):
        raise ParallelConfigError(f"{what}: the module is already tensor-parallel")
    if isinstance(style, ColwiseParallel):
        if not isinstance(module, nn.Linear):
            raise ParallelConfigError(f"{what}: cocoweave splits only nn.Linear output features")
        inp, out = _layouts(style, "input_layouts"), _layouts(style, "output_layouts")
        if not (_is(inp, Replicate) or _is(inp, Shard, 1)):
            raise ParallelConfigError(f"{what}: input layouts {list(inp)} are not supported (Replicate() or, for "
                                      "sequence parallelism, Shard(1))")
        if not (_is(out, Shard, -1) or _is(out, Replicate)):
            raise ParallelConfigError(f"{what}: output layouts {list(out)} are not supported (Shard(-1) or "
                                      "Replicate())")
        under = _inside(name, gathered)
        if _is(inp, Shard, 1) or under:
            return _linear(SequenceColumnLinear, module, mesh, None, gather_output=_is(out, Replicate),
                           gather_input=_is(inp, Shard, 1) and not under)
        return _linear(ColumnParallelLinear, module, mesh, schedule, gather_output=_is(out, Replicate))
    if isinstance(style, RowwiseParallel):
        out = _layouts(style, "output_layouts")
        if not (_is(out, Replicate) or _is(out, Shard, 1)):
            raise ParallelConfigError(f"{what}: output layouts {list(out)} are not supported (Replicate() or, for "
                                      "sequence parallelism, Shard(1))")
        if isinstance(module, nn.Embedding):
            embedding = _vocab_embedding(what, module, mesh)
            if _is(out, Shard, 1):
                scatter_output(embedding, group)
            return embedding
        if not isinstance(module, nn.Linear):
            raise ParallelConfigError(f"{what}: cocoweave splits only nn.Linear input features or nn.Embedding "
                                      "vocabularies")
        inp = _layouts(style, "input_layouts")
        if not (_is(inp, Shard, -1) or _is(inp, Replicate)):
            raise ParallelConfigError(f"{what}: input layouts {list(inp)} are not supported (Shard(-1) or "
                                      "Replicate())")
        if _is(out, Shard, 1):
            return _linear(SequenceRowLinear, module, mesh, None, input_is_parallel=_is(inp, Shard, -1))
        return _linear(RowParallelLinear, module, mesh, schedule, input_is_parallel=_is(inp, Shard, -1))
    if isinstance(style, PrepareModuleInput):
        if name in gathered:
            gather_inputs(module, *gathered[name], group)
        return None
    if isinstance(style, PrepareModuleOutput):
        if all(a is None or b is None or a == b for a, b in zip(_layouts(style, "output_layouts"),
                                                                 _layouts(style, "desired_output_layouts"))):
            return None
        raise ParallelConfigError(f"{what}: converting outputs {list(_layouts(style, 'output_layouts'))} to "
                                  f"{list(_layouts(style, 'desired_output_layouts'))} is not supported")
    if isinstance(style, SequenceParallel):
        if _layouts(style, "sequence_sharding") not in ((Shard(1),), (None,)):
            raise ParallelConfigError(f"{what}: only the sequence dimension 1 can be sharded")
        on_sequence_slices(module, tp_mesh(mesh), group)
        return None
    raise ParallelConfigError(f"{what}: not a style cocoweave knows (ColwiseParallel, RowwiseParallel, "
                              "SequenceParallel, PrepareModuleInput/Output)")


def _sequence_gathers(what: str, style: Any) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The positional and keyword inputs a PrepareModuleInput gathers from sequence slices (Shard(1) ->
    Replicate()); any other change of layout is refused."""
    from torch.distributed.tensor import Replicate, Shard

    def gathers(given: Any, wanted: Any, where: str) -> bool:
        if given is None or wanted is None or given == wanted:
            return False
        if given == Shard(1) and wanted == Replicate():
            return True
        raise ParallelConfigError(f"{what}: converting {where} from {given} to {wanted} is not supported (only "
                                  "Shard(1) -> Replicate(), sequence parallelism's gather)")

    given, wanted = _layouts(style, "input_layouts"), _layouts(style, "desired_input_layouts")
    positions = tuple(i for i, (a, b) in enumerate(zip(given, wanted)) if gathers(a, b, f"input {i}"))
    kw_given = getattr(style, "input_kwarg_layouts", None) or {}
    kw_wanted = getattr(style, "desired_input_kwarg_layouts", None) or {}
    names = tuple(k for k in kw_given if gathers(kw_given[k], kw_wanted.get(k), f"input {k!r}"))
    return positions, names


def _describe(name: str, module: nn.Module, style: Any) -> str:
    """Where a refusal happened: 'parallelize: NAME (Module) with Style'."""
    return f"parallelize: {name} ({type(module).__name__}) with {type(style).__name__}"


def _inside(name: str, parents: Iterable[str]) -> bool:
    return any(name.startswith(p + ".") for p in parents)


def _gathered(chosen: dict[str, Any], modules: dict[str, nn.Module]
              ) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """The modules whose inputs `chosen` gathers from sequence slices (PrepareModuleInput Shard(1) -> Replicate()),
    with the positions and names of those inputs; any other change of an input's layout is refused here."""
    from torch.distributed.tensor.parallel import PrepareModuleInput

    out = {}
    for name, style in chosen.items():
        if isinstance(style, PrepareModuleInput):
            positions, names = _sequence_gathers(_describe(name, modules[name], style), style)
            if positions or names:
                out[name] = (positions, names)
    return out


def _linear(cls: type[_ParallelLinear], module: nn.Linear, mesh: Any, schedule: str | None, **kwargs: Any
            ) -> _ParallelLinear:
    """`cls` holding this rank's part of `module`'s weights."""
    weight = local(module.weight)
    layer = cls(module.in_features, module.out_features, module.bias is not None, group=mesh, device=weight.device,
                dtype=weight.dtype, schedule=schedule, **kwargs)
    layer.load_full(weight.detach(), None if module.bias is None else local(module.bias).detach())
    return layer


def _vocab_embedding(what: str, module: nn.Embedding, mesh: Any) -> nn.Module:
    try:
        from .vocab import VocabParallelEmbedding
    except ImportError:
        raise ParallelConfigError(f"{what}: this cocoweave has no vocab-parallel embedding; leave the embedding out "
                                  "of the plan (it is replicated)") from None
    return VocabParallelEmbedding.from_embedding(module, group=mesh)


def _set(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


_HEADS = (("n_heads", "n_kv_heads"), ("num_heads", "num_key_value_heads"),
          ("num_attention_heads", "num_key_value_heads"))


def _check_heads(modules: dict[str, nn.Module], chosen: dict[str, Any], tp: int) -> None:
    """Refuse, before any module changes, attention whose heads (or KV heads) the group does not divide."""
    for name, module in modules.items():
        if not any(other.startswith(name + ".") for other in chosen) or not name:
            continue
        config = getattr(module, "config", None)
        for heads_attr, kv_attr in _HEADS:
            heads = getattr(module, heads_attr, None) or getattr(config, heads_attr, None)
            kv = getattr(module, kv_attr, None) or getattr(config, kv_attr, None) or heads
            if not isinstance(heads, int):
                continue
            for what, count in (("attention heads", heads), ("KV heads", kv)):
                if isinstance(count, int) and count % tp:
                    raise ParallelConfigError(
                        f"parallelize: {name} has {count} {what}, which {tp} tensor-parallel ranks do not divide; "
                        f"use a tensor-parallel size that divides {count}")


def _replicate_the_rest(model: nn.Module, mesh: Any) -> None:
    """Every parameter not already a DTensor becomes a Replicate() DTensor; the modules owning one run their
    forward on the local tensors (a module's own forward sees plain tensors, as it did before)."""
    if mesh is None:
        return
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if not is_dtensor(p)]
        if own and not isinstance(module, _ParallelLinear):
            replicate_parameters(module, mesh)
            _run_on_local_parameters(module)


def _run_on_local_parameters(module: nn.Module) -> None:
    """Make `module.forward` see its DTensor parameters' local tensors (differentiable, so the gradients land in
    the DTensor parameters)."""
    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        with _local_parameters(module):
            return inner(*args, **kwargs)

    module.forward = forward  # an instance attribute: the class's forward is unchanged for other instances


@contextlib.contextmanager
def _local_parameters(module: nn.Module) -> Iterator[None]:
    """Within the block, `module`'s own DTensor parameters read as their local tensors."""
    saved = {name: p for name, p in module._parameters.items() if is_dtensor(p)}
    try:
        for name, p in saved.items():
            module._parameters[name] = p.to_local()  # read through nn.Module.__getattr__
        yield
    finally:
        module._parameters.update(saved)


def tp_plan_names(model: nn.Module) -> dict[str, str]:
    """Module name -> 'column' / 'row' of every tensor-parallel linear layer of `model` (for printing a plan)."""
    return {name: "column" if isinstance(m, ColumnParallelLinear) else "row"
            for name, m in model.named_modules() if isinstance(m, _ParallelLinear)}


__all__ = ["parallelize", "tp_plan_names"]

