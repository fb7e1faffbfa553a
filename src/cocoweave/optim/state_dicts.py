"""torch-style state dicts: the state of every bucket gathered whole (a collective when ranks keep it sliced, met
through the store first so that a rank alone is told so, never hung), `opt.state[p]` as torch users read it, and a
saved state dict (any world size, or torch's optimizer's) checked and loaded, all or nothing."""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import OptimizerError
from ..group_facts import group_timeout, world
from ..workloads.optimizer_contract import PARAMS, STARTED, STEPS, WEIGHTS, model_weights
from .buckets import Bucket
from .placements import like, local

# torch.optim's implementation switches and flags its param_groups carry (a state dict may lack them)
TORCH_SWITCHES = ("amsgrad", "maximize", "foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay")


class StateDicts:
    """DistributedOptimizer's state dicts and `opt.state[p]` (a mixin of it)."""

    def _gather_whole(self, b: Bucket) -> dict[str, torch.Tensor]:
        """Every state tensor of bucket b, whole (a collective when the executable keeps some sliced)."""
        return {**b.state, **{n: b.exe.gather_state(n) for n in b.exe.sliced_state if n not in b.state}}

    def _publish_steps(self) -> None:
        """`opt.state[p]["step"]` as torch users read it (so that torch's checkpoint helpers see an initialised
        optimizer): one 0-d tensor per bucket, shared by its parameters; the state views are set when a bucket's
        state is (`_publish_views`)."""
        if not self.has_step:
            return
        for b in self._buckets:
            if b.step_count is None:  # one tensor per bucket, made once: no per-parameter work per step
                b.step_count = torch.zeros(())
                for p in b.params:
                    self.state[p]["step"] = b.step_count
            b.step_count.fill_(float(b.step))

    def _publish_views(self, b: Bucket) -> None:
        """`opt.state[p]`'s exp_avg / exp_avg_sq / momentum_buffer: views of the bucket's state where this rank holds
        it whole (valid while the bucket's state tensors are: they are updated in place); where ranks keep it sliced,
        gathered when first read after a step (a collective, as state_dict(): every rank reads it)."""
        self._gathered.discard(id(b))
        for i, p in enumerate(b.params):
            entry = self.state[p]
            if not isinstance(entry, _ParamState):
                entry = self.state[p] = _ParamState(entry)
            entry.gather = None
            for n, key in self._view_keys(b):
                if n in b.state:
                    dict.__setitem__(entry, key, self._view_part(b, n, b.state[n], i))
                elif n in b.exe.sliced_state:
                    dict.__setitem__(entry, key, _SLICED)
                    entry.gather = lambda b=b: self._gather_views(b)

    def _kept(self, b: Bucket) -> dict[str, str]:
        """The `state_keys` bucket b's program keeps (a factored optimizer's keeps some, by its parameters' shape)."""
        inputs = b.exe.tensor_inputs()
        return {n: key for n, key in self.state_keys.items() if n in inputs}

    def _view_keys(self, b: Bucket) -> list[tuple[str, str]]:
        """(state tensor, torch's key) of what `opt.state[p]` shows: the moments, and the fp32 master weights as
        'master_param' where the parameters are half (as state_dict() names them)."""
        keys = list(self.state_keys.items())
        if model_weights(b.exe.tensor_inputs()) == PARAMS:
            keys.append((WEIGHTS, "master_param"))
        return keys

    def _view_part(self, b: Bucket, n: str, whole: torch.Tensor, i: int) -> torch.Tensor:
        return b.part(whole, i) if n == WEIGHTS else self.state_part(b, n, whole, i)

    def _gather_views(self, b: Bucket) -> None:
        """Gather bucket b's sliced state into its parameters' `opt.state[p]` (until the next step)."""
        if self._sliced():
            self._meet("state[p] (reading exp_avg, exp_avg_sq or momentum_buffer)")
        whole = self._gather_whole(b)
        self._gathered.add(id(b))
        for i, p in enumerate(b.params):
            entry = self.state[p]
            for n, key in self._view_keys(b):
                if n in b.exe.sliced_state:
                    dict.__setitem__(entry, key, self._view_part(b, n, whole[n], i))
            entry.gather = None

    def _meet(self, what: str) -> None:
        """Wait until every rank of the group has called `what` (a collective: it gathers state kept sliced), as long
        as the process group's timeout; a rank that waited in vain withdraws its arrival, so that the next call of
        every rank meets again (no hang, no rank left one call ahead), and says so."""
        rank, size = world(self.process_group)
        store = dist.distributed_c10d._get_default_store()
        self._sd_calls += 1
        key = f"{self._store_prefix()}/collective/{self._sd_calls}"
        arrived = store.add(key, 1)
        limit = group_timeout(self.process_group)
        deadline = time.monotonic() + limit
        while arrived < size:
            if time.monotonic() >= deadline:
                if store.compare_set(key, str(arrived), str(arrived - 1)) == str(arrived - 1).encode():
                    self._sd_calls -= 1  # withdrawn: this rank's next call meets the others' at the same key
                    raise OptimizerError(
                        f"rank {rank}: {type(self).__name__}.{what} gathers optimizer state that ranks keep sliced "
                        f"({self._buckets[0].schedule.name}), so every rank must call it; only {arrived} of {size} "
                        f"did within the process group's timeout ({limit:g} s). Call it on every rank (and save on "
                        "one), or use schedule='AR-C' to keep whole state on each rank.")
                # a rank arrived meanwhile: look again
            time.sleep(0.005)
            arrived = store.add(key, 0)

    def _sliced(self) -> bool:
        return world(self.process_group)[1] > 1 and any(b.exe.sliced_state for b in self._buckets)

    def state_dict(self) -> dict[str, Any]:
        """A torch-style state dict with whole (gathered) state per parameter, loadable at any world size (and by
        the torch optimizer of the same name); with fp32 master weights, also 'master_param'. torch's state-dict
        hooks run around it, the post-hooks on the whole state. Every rank must call it when state is kept sliced
        (gathering is a collective); a rank alone is told so within the process group's timeout."""
        self.wait()
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        buckets = self._ensure_buckets()
        if self._sliced():
            self._meet("state_dict()")
        saved = self.state, self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks
        self.state, self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = \
            type(saved[0])(), OrderedDict(), OrderedDict()
        try:
            out = super().state_dict()  # torch's packing of the groups
        finally:
            self.state, self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = saved
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        for b in buckets:  # every parameter, a fresh optimizer's at step 0 (a template DCP can fill)
            whole = self._gather_whole(b)
            kept, masters = self._kept(b), WEIGHTS in whole and model_weights(b.exe.tensor_inputs()) == PARAMS
            for i, p in enumerate(b.params):
                steps = b.part(whole[STEPS], i) if STEPS in whole else None
                step = int(steps.reshape(-1)[0]) if steps is not None and steps.numel() else b.step
                entry = {key: like(p, self.state_part(b, n, whole[n], i).detach().clone())
                         for n, key in kept.items() if self.has_state(b, whole, i)}
                if self.has_step:
                    entry = {"step": torch.tensor(float(step))} | entry
                if masters:
                    entry["master_param"] = like(p, b.part(whole[WEIGHTS], i).detach().clone())
                out["state"][index[id(p)]] = entry
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, out)
            if result is not None:
                out = result
        return out

    def _loaded_groups(self, saved_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Our parameter groups with the saved hyperparameters, as torch's load_state_dict makes them, checked as
        add_param_group checks a group; raises OptimizerError (changing nothing) for a state dict that does not
        fit: another number of groups or parameters, a hyperparameter missing (another optimizer's state dict) or
        one this optimizer cannot run (maximize=True, amsgrad=True)."""
        name = type(self).__name__
        if len(saved_groups) != len(self.param_groups):
            raise OptimizerError(f"{name}.load_state_dict: the state dict has {len(saved_groups)} parameter groups, "
                                 f"this optimizer {len(self.param_groups)}")
        groups = []
        for gi, (group, saved) in enumerate(zip(self.param_groups, copy.deepcopy(saved_groups), strict=True)):
            if len(saved["params"]) != len(group["params"]):
                raise OptimizerError(f"{name}.load_state_dict: group {gi} of the state dict has "
                                     f"{len(saved['params'])} parameters, this optimizer's {len(group['params'])}")
            missing = [k for k in self.defaults if k not in saved and k not in TORCH_SWITCHES]
            if missing:
                raise OptimizerError(f"{name}.load_state_dict: group {gi} of the state dict has no "
                                     f"{', '.join(map(repr, missing))}: it was saved by another optimizer (its "
                                     f"hyperparameters: {', '.join(sorted(k for k in saved if k != 'params'))})")
            new = {**{k: v for k, v in group.items() if k in TORCH_SWITCHES}, **saved, "params": group["params"]}
            if "param_names" in group and "param_names" not in saved:
                new["param_names"] = group["param_names"]
            try:
                self._check_hyperparameters(new)
            except OptimizerError as exc:
                raise OptimizerError(f"{name}.load_state_dict: group {gi} of the state dict: "
                                     f"{str(exc).removeprefix(name + ': ')}") from None
            groups.append(new)
        return groups

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved at any world size (or by the torch optimizer of the same name): the
        hyperparameters of every group, and the state, resliced for this world size. As torch: the load pre-hooks
        may edit or replace the state dict first, the post-hooks run once it is in place. All or nothing: a state
        dict that does not fit raises OptimizerError and changes nothing."""
        self.wait()
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        groups = self._loaded_groups(state_dict["param_groups"])
        saved = state_dict.get("state", {})
        # as torch: the saved groups list their parameters' keys (indices, or names from torch's DCP helpers) in the
        # order of ours
        keys = [k for g in state_dict["param_groups"] for k in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        entry_of = {id(p): _local_entry(saved.get(k, saved.get(str(k)))) for p, k in zip(params, keys, strict=True)}
        plans = [self._loaded_state(b, [entry_of[id(p)] for p in b.params]) for b in self._ensure_buckets()]
        # nothing failed: from here on the optimizer changes
        self.param_groups[:] = groups
        rebuilt = False
        for b, (step, masked, state, master, started) in zip(self._buckets, plans, strict=True):
            if masked and not b.masked:
                self._rebuild(b, masked=True)
                rebuilt = True
            b.step, b.started = step, started
            self._reset_state(b, state, master)
        if rebuilt:  # (collective, as the rebuild itself) parameters moved into new buckets
            self._settle()
        self._publish_steps()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _loaded_state(self, b: Bucket, entries: list[dict[str, Any] | None]) -> tuple:
        """Bucket b's state from the saved entries of its parameters, checked and built before anything changes:
        (step, whether it needs the masked program, whole state tensors, fp32 masters or None, momentum started)."""
        if all(e is None for e in entries):
            return 0, b.masked, {}, None, False
        steps = {int(e["step"]) for e in entries if e is not None and "step" in e} or {1}
        kept = self._kept(b)
        has = [e is not None and all(key in e for key in kept.values()) for e in entries]
        masked = b.masked or len(steps) > 1 or any(e is None for e in entries) or (
            not self.has_step and any(has) and not all(has))
        shape = (*b.shape[:-1], b.shape[-1])
        try:
            zeros = dict(size=shape, dtype=torch.float32, device=b.device)
            state = {n: self._state_from(b, n, [e[key] if h else None for e, h in zip(entries, has)])
                     for n, key in kept.items()}
            if masked:
                state[STEPS] = b.fill(torch.zeros(**zeros), [float(e["step"]) if e is not None and "step" in e else
                                                           0.0 for e in entries])
                state[STARTED] = b.fill(torch.zeros(**zeros), [1.0 if h else 0.0 for h in has])
            master = None
            if b.dtype != torch.float32 and self.master_weights:
                master = b.fill(b.data.float().clone(), [e.get("master_param") if e is not None else None
                                                         for e in entries])
        except (KeyError, RuntimeError, TypeError) as exc:
            raise OptimizerError(f"{type(self).__name__}.load_state_dict: the state of group {b.group} does not "
                                 f"match its parameters ({exc})") from None
        return max(steps), masked, state, master, any(has)


def _local_entry(entry: Any) -> Any:
    """A saved parameter's state with DTensors (a DCP checkpoint's, resharded to this rank) as their local tensors."""
    return {k: local(v) if isinstance(v, torch.Tensor) else v for k, v in entry.items()} \
        if isinstance(entry, dict) else entry


_SLICED = object()  # opt.state[p]'s value of state the ranks keep sliced, until read


class _ParamState(dict):
    """`opt.state[p]`, a dict with torch's keys, whose state kept sliced is gathered (once per step, on every rank)
    when first read."""

    gather: Callable[[], None] | None = None

    def _value(self, key: Any, value: Any) -> Any:
        if value is _SLICED and self.gather is not None:
            self.gather()
            value = dict.__getitem__(self, key)
        return value

    def __getitem__(self, key: Any) -> Any:
        return self._value(key, dict.__getitem__(self, key))

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self else default

    def values(self) -> Any:
        return [self[k] for k in self]

    def items(self) -> Any:
        return [(k, self[k]) for k in self]
