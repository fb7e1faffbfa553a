"""`load`: rank 0 checks the files against the manifest, then every rank reads what its template asks for,
only the saved parts that overlap its own (resharding), without running code from the checkpoint unless trusted."""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from ..errors import CheckpointError
from ..ir.layout import share_bounds
from ..sharding import is_dtensor
from .common import _describe, _from_rank0, _is_dist, _rank
from .files import FORMAT, SKELETON, info, verify
from .safe_dcp import SafePlanner, SafeReader, UnsafeCheckpoint, first_failure
from .saving import _merge
from .shard import Shard, as_shard

log = logging.getLogger(__name__)


def load(path: str | os.PathLike[str], state: Mapping[str, Any], *, group: Any = None,
         trusted: bool = False) -> dict[str, Any]:
    """Read the entries of `state`'s top-level keys from the checkpoint at `path` (every rank of `group`
    calls it); returns them as a nested dict.

    Every file is checked against the checkpoint's manifest before anything is read. Tensors and Shards in
    `state` are filled in place (a Shard may be for another group size than the saved parts); everything
    else comes back as saved (new tensors, on the CPU), so that a template like an optimizer's state dict
    before its first step loads whatever state was saved. A tensor or Shard of `state` the checkpoint lacks,
    or sliced state it has that `state` lacks, is refused. `trusted=True` (only for checkpoints you trust:
    code in them can run) also loads pickled objects and checkpoints without a manifest."""
    p = Path(path)
    _verify_once(p, trusted, group)
    log.info("loading checkpoint %s (rank %d)", p, _rank(group))
    reader = dcp.FileSystemReader if trusted else SafeReader
    try:
        saved = reader(str(p)).read_metadata().state_dict_metadata
    except UnsafeCheckpoint as exc:
        raise CheckpointError(f"checkpoint {p} is refused: {exc}; load it with trusted=True only if you trust "
                              "where it came from") from None
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {p} has unreadable DCP metadata: {type(exc).__name__}: {exc}") from None
    # First read the small records: every rank's skeleton and the saved split of every sliced tensor.
    records = {k: "" for k in saved if k.startswith(SKELETON + "/") or k.endswith(".layout")}
    _dcp_load(p, records, group, reader, trusted)
    skeleton: dict[str, Any] = {"d": []}
    for key, text in records.items():
        if key.startswith(SKELETON + "/"):
            skeleton = _merge(skeleton, json.loads(text))
    top = {k: v for k, v in skeleton["d"]}
    missing = [k for k in state if k not in top]
    if missing:
        raise CheckpointError(f"checkpoint {p} has no entry `{missing[0]}`; it has: {', '.join(map(str, top))}")
    request: dict[str, Any] = {}
    shards: list[tuple[str, Shard]] = []
    plan = _Planner(p, saved, request, shards, trusted, records)
    tree = {k: plan.node(top[k], state[k], str(k)) for k in state}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, shard in shards:  # read only the saved parts that overlap this rank's part
        copies += _plan_shard(p, name, shard, json.loads(records[f"{name}.layout"]), saved, request)
    _dcp_load(p, request, group, reader, trusted)
    for dst, src in copies:
        dst.copy_(src)
    return _resolve(tree, request)


def _verify_once(p: Path, trusted: bool, group: Any) -> None:
    """Rank 0 of `group` checks the checkpoint's files against its manifest (hashing each once, however many ranks
    load it) and every rank gets its verdict: the same CheckpointError on all, or none."""
    error = None
    if _rank(group) == 0:
        try:
            if not (trusted and info(p)["format"] < FORMAT):
                verify(p)
        except CheckpointError as exc:
            error = str(exc)
        except OSError as exc:
            error = f"checkpoint {p} cannot be read: {exc.strerror or exc}"
    error = _from_rank0(error, group)
    if error is not None:
        raise CheckpointError(error)


_MISSING = object()


@dataclass
class _Ref:
    key: str


def _holds_state(template: Any) -> bool:
    """Whether a template value is, or contains, a tensor or a Shard (state that must be loaded)."""
    if isinstance(template, torch.Tensor | Shard):
        return True
    if isinstance(template, Mapping):
        return any(_holds_state(v) for v in template.values())
    if isinstance(template, list | tuple):
        return any(_holds_state(v) for v in template)
    return False


_KINDS = {"d": "a dict", "l": "a list", "u": "a tuple", "v": "a plain value", "o": "an object"}


@dataclass
class _Planner:
    """What to read for each saved skeleton node into the template; builds the result tree with _Refs."""

    p: Path
    saved: Mapping[str, Any]
    request: dict[str, Any]
    shards: list[tuple[str, Shard]]
    trusted: bool
    layouts: Mapping[str, str]  # the saved split of every sliced tensor (JSON)

    def node(self, node: Any, template: Any, where: str) -> Any:
        if is_dtensor(template):  # filled in place through its local tensor; the result holds the DTensor
            plain = as_shard(template)
            result = self.node(node, plain, where)
            return template if result is plain else result
        if "s" in node:
            if template is _MISSING:
                raise CheckpointError(f"checkpoint {self.p} holds sliced state `{where}` that the state to load into "
                                      "lacks (was it saved with a schedule that keeps other state sliced?)")
            dim = json.loads(self.layouts[f"{node['s']}.layout"])["dim"]
            if isinstance(template, torch.Tensor) and template.dim() > dim:  # a whole tensor: the one part of one
                self.shards.append((node["s"], Shard(template.detach(), dim, template.shape[dim], 0, 1)))
                return template
            if not isinstance(template, Shard):
                raise CheckpointError(f"checkpoint {self.p}: `{where}` is sliced there; load it into a "
                                      "checkpoint.Shard of this rank's part")
            self.shards.append((node["s"], template))
            return template
        if "t" in node:
            return self.tensor(node["t"], template)
        if isinstance(template, torch.Tensor | Shard):
            kind = next(_KINDS[k] for k in _KINDS if k in node)
            raise CheckpointError(f"checkpoint {self.p}: `{where}` is {kind} there, the state to load into has a "
                                  f"{'sliced ' if isinstance(template, Shard) else ''}tensor")
        if "v" in node:
            return node["v"]
        if "o" in node:
            if not self.trusted:
                raise CheckpointError(f"checkpoint {self.p} holds a pickled object at `{where}`; load it with "
                                      "trusted=True only if you trust where it came from")
            self.request[node["o"]] = None if template is _MISSING else template
            return _Ref(node["o"])
        if "d" in node:
            sub = template if isinstance(template, Mapping) else {}
            keys = {json.dumps(k) for k, _ in node["d"]}
            lost = [k for k, v in sub.items() if json.dumps(k) not in keys and _holds_state(v)]
            if lost:
                raise CheckpointError(f"checkpoint {self.p} has no entry `{where}/{lost[0]}`, which the state to "
                                      "load into has (it would be left as it is)")
            return {k: self.node(v, sub.get(k, _MISSING), f"{where}/{k}") for k, v in node["d"]}
        items = node.get("l", node.get("u"))
        fits = isinstance(template, list | tuple) and len(template) == len(items)
        if not fits and _holds_state(template):
            raise CheckpointError(f"checkpoint {self.p}: `{where}` has {len(items)} items there, the state to load "
                                  f"into has {len(template)}")
        subs = template if fits else [_MISSING] * len(items)
        out = [self.node(v, t, f"{where}/{i}") for i, (v, t) in enumerate(zip(items, subs))]
        return out if "l" in node else tuple(out)

    def tensor(self, key: str, template: Any) -> Any:
        md = self.saved.get(key)
        if md is None or not hasattr(md, "size"):
            raise CheckpointError(f"checkpoint {self.p} lacks the data of tensor `{key}`")
        if isinstance(template, torch.Tensor):
            if tuple(md.size) != tuple(template.shape):
                raise CheckpointError(f"checkpoint {self.p}: tensor `{key}` has shape {list(md.size)} there, "
                                      f"the state to load into has {list(template.shape)}")
            self.request[key] = template.detach()
            return template
        if isinstance(template, Shard):
            raise CheckpointError(f"checkpoint {self.p}: `{key}` is a whole tensor there, not a sliced one")
        self.request[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        return _Ref(key)


def _resolve(tree: Any, request: Mapping[str, Any]) -> Any:
    if isinstance(tree, _Ref):
        return request[tree.key]
    if isinstance(tree, dict):
        return {k: _resolve(v, request) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_resolve(v, request) for v in tree)
    return tree


def _dcp_load(p: Path, request: dict[str, Any], group: Any, reader: Any, trusted: bool) -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(request, storage_reader=reader(str(p)), planner=None if trusted else SafePlanner(),
                     process_group=group, no_dist=not _is_dist(group))
    except (Exception, dcp.api.CheckpointException) as exc:  # noqa: BLE001 - DCP's is a BaseException
        cause = first_failure(exc)
        if isinstance(cause, UnsafeCheckpoint):
            raise CheckpointError(f"checkpoint {p} is refused: {cause}; load it with trusted=True only if you "
                                  "trust where it came from") from None
        raise CheckpointError(f"loading checkpoint {p} failed: {_describe(cause)}") from None


def _plan_shard(p: Path, name: str, shard: Shard, layout: Any, saved: Mapping[str, Any],
                request: dict[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Add the saved parts overlapping this rank's new part to `request`; returns (dst, src) copies."""
    if not isinstance(layout, dict) or layout.get("dim") != shard.dim or layout.get("total") != shard.total:
        raise CheckpointError(f"checkpoint {p}: sliced `{name}` was saved split along dim {layout.get('dim')} "
                              f"of size {layout.get('total')}, not dim {shard.dim} of size {shard.total}")
    start, stop = shard.bounds(shard.index)
    saved_split = tuple(layout["shares"]) if layout.get("shares") else layout["count"]
    copies = []
    for i in range(layout["count"]):
        s, e = share_bounds(shard.total, saved_split, i)
        lo, hi = max(s, start), min(e, stop)
        if lo >= hi:
            continue
        key = f"{name}.part-{i}-of-{layout['count']}"
        if key not in saved:
            raise CheckpointError(f"checkpoint {p} lacks part {i} of {layout['count']} of sliced `{name}`")
        shape = list(shard.part.shape)
        shape[shard.dim] = e - s
        if list(saved[key].size) != shape:
            raise CheckpointError(f"checkpoint {p}: part {i} of sliced `{name}` has shape {list(saved[key].size)}, "
                                  f"expected {shape}")
        buf = torch.empty(shape, dtype=shard.part.dtype, device=shard.part.device)
        request[key] = buf
        copies.append((shard.part.narrow(shard.dim, lo - start, hi - lo), buf.narrow(shard.dim, lo - s, hi - lo)))
    return copies

