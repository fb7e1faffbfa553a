"""The boundary between two pipeline stages that are tensor-parallel inside: the activation leaving a stage
is replicated over that stage's group, so each rank sends only its 1/t slice to its peer (the rank with
the same index in the other stage), and the receiving stage all-gathers the slices over its group.
The gradient goes back the same way. This is CoCoNet's third workload (and Megatron's scatter-gather).

    # stage s (sends)                          # stage s + 1 (receives)
    y = stage_model(x)                          h = boundary.recv_forward(shape, dtype)
    boundary.send_forward(y)                    loss = next_model(h).sum(); loss.backward()
    boundary.recv_backward(y)  # y.backward     boundary.send_backward(h)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ParallelConfigError
from .functional import Group, all_gather_cat, group_rank, group_size, part


class PipelineBoundary(nn.Module):
    """Point-to-point transfer of a stage-replicated activation (forward) and its gradient (backward) between
    this rank and `peer` (a global rank). With `scatter_gather` (the default) only a 1/t slice crosses
    between stages and the receiving side all-gathers it over `group` (this stage's tensor-parallel group);
    tensors whose size t does not divide go whole."""

    def __init__(self, peer: int, group: Group = None, scatter_gather: bool = True) -> None:
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise ParallelConfigError("PipelineBoundary needs an initialised torch.distributed process group")
        if not 0 <= peer < dist.get_world_size() or peer == dist.get_rank():
            raise ParallelConfigError(f"PipelineBoundary: peer {peer} must be another rank of the world of "
                                      f"{dist.get_world_size()}")
        self.peer, self.group, self.scatter_gather = peer, group, scatter_gather

    def _sliced(self, numel: int) -> bool:
        t = group_size(self.group)
        return self.scatter_gather and t > 1 and numel % t == 0

    def _send(self, t: torch.Tensor) -> None:
        flat = t.detach().contiguous().view(-1)
        if self._sliced(flat.numel()):
            flat = part(flat, 0, group_size(self.group), group_rank(self.group))
        dist.send(flat.contiguous(), self.peer)

    def _recv(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: Any) -> torch.Tensor:
        numel = torch.Size(shape).numel()
        sliced = self._sliced(numel)
        buf = torch.empty(numel // group_size(self.group) if sliced else numel, dtype=dtype, device=device)
        dist.recv(buf, self.peer)
        return (all_gather_cat(buf, 0, self.group) if sliced else buf).view(shape)

    def send_forward(self, activation: torch.Tensor) -> None:
        """Send this stage's output (replicated over `group`) to the next stage."""
        self._send(activation)

    def recv_forward(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32,
                     device: Any = "cpu") -> torch.Tensor:
        """Receive the previous stage's output: a leaf tensor that requires grad (call `send_backward` on it)."""
        return self._recv(shape, dtype, device).requires_grad_(True)

    def send_backward(self, received: torch.Tensor) -> None:
        """Send the gradient of a tensor returned by `recv_forward` back to the previous stage."""
        if received.grad is None:
            raise ParallelConfigError("PipelineBoundary.send_backward: the received activation has no gradient; "
                                      "run backward through it first")
        self._send(received.grad)

    def recv_backward(self, activation: torch.Tensor) -> None:
        """Receive the gradient of the activation given to `send_forward` and backpropagate it."""
        activation.backward(self._recv(activation.shape, activation.dtype, activation.device))
