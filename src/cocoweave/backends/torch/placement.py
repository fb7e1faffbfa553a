"""Which device a collective's tensors go on. NCCL takes only CUDA tensors, Gloo CPU and CUDA ones; a process
group made with `init_process_group("cpu:gloo,cuda:nccl")` sends each tensor to its device's backend.

Data (gradients, weights) stays where it is. Small metadata of a step (the ranks' used-parameter flags, a
gradient norm, gradient statistics) goes on the CPU when the group has a CPU backend, so reading it back costs no
device synchronisation, and on the data's device otherwise; or through `cpu_group`, a Gloo group beside a group
that takes no CPU tensor. cocoweave's launchers make NCCL worlds with Gloo beside it for CPU tensors
(`group_backend`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

CPU = torch.device("cpu")
NCCL_WITH_GLOO = "cpu:gloo,cuda:nccl"


def backend_devices(config: str) -> set[str]:
    """Device types whose tensors a backend config takes: "gloo" -> {cpu, cuda}, "nccl" -> {cuda},
    "cpu:gloo,cuda:nccl" -> {cpu, cuda} (torch's `get_backend_config` spells every group this way)."""
    config = config.strip().lower()
    if ":" in config:
        return {part.split(":", 1)[0].strip() for part in config.split(",") if ":" in part}
    return set(dist.Backend.backend_capability.get(config, ["cpu"]))


def metadata_device(group: Any, device: torch.device | str) -> torch.device:
    """Where a small metadata tensor of a collective over `group` (None: the default group) goes, for data on
    `device`: the CPU when the group takes CPU tensors (or there is no group), else `device`."""
    if not (dist.is_available() and dist.is_initialized()):
        return CPU
    return CPU if "cpu" in backend_devices(str(dist.get_backend_config(group))) else torch.device(device)


_CPU_SIDE: dict[Any, Any] = {}  # process group -> a Gloo group over the same ranks (groups that take no CPU tensor)


def cpu_group(group: Any) -> Any:
    """A process group over `group`'s ranks (None: the default group) that takes CPU tensors: the group itself when it
    does, else a Gloo group beside it, made once by the group's members (a world made with plain
    `init_process_group("nccl")`): the step's metadata then never goes through the GPU and back."""
    if "cpu" in backend_devices(str(dist.get_backend_config(group))):
        return group
    group = group if group is not None else dist.group.WORLD  # a new world is a new key
    side = _CPU_SIDE.get(group)
    if side is None:
        side = _CPU_SIDE[group] = dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                                                 use_local_synchronization=True)
    return side


def compute_device() -> torch.device:
    """This process's current GPU, or the CPU without one (where a tensor with no data to follow goes)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else CPU


def group_backend(backend: str) -> str:
    """The backend string to initialise a world with: NCCL with Gloo beside it for CPU tensors (metadata, and
    user code that all-reduces a CPU scalar), any other backend as it is."""
    return NCCL_WITH_GLOO if backend == "nccl" else backend
