"""What a reconciliation does to module buffers and to the inner optimizer's state.

* buffers: ``average`` (floating buffers averaged, others such as BatchNorm's
  ``num_batches_tracked`` broadcast from the group's first rank), ``broadcast`` (all from the
  first rank, what DDP does before each forward), ``local`` (left alone).
* optimizer state: ``keep`` (left alone), ``average`` (floating state tensors averaged; step
  counters are equal on every rank and left alone), ``reset`` (state dropped, as if the inner
  optimizer started afresh from the reconciled parameters).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cpdpkit.labels import SYNC
from cpdpkit.sync._comm import Communicator

__all__ = ["flatten_by_dtype", "sync_buffers", "sync_optimizer_state", "write_back"]


def flatten_by_dtype(tensors: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    return [(torch.cat([t.reshape(-1) for t in ts]), ts) for ts in by_dtype.values()]


@torch.no_grad()
def write_back(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


@torch.no_grad()
def _coalesced(comm: Communicator, tensors: Sequence[torch.Tensor], cap_bytes: int,
               op: str) -> None:
    """Average (``op="average"``) or broadcast tensors in a few flat per-dtype buffers."""
    groups = flatten_by_dtype(tensors)
    flats = [flat for flat, _ in groups]
    if op == "average":
        comm.average_(flats, cap_bytes)
    else:
        comm.broadcast_(flats, cap_bytes)
    for flat, ts in groups:
        write_back(flat, ts)


def sync_buffers(
    comm: Communicator, buffers: Sequence[torch.Tensor], policy: str, cap_bytes: int
) -> None:
    """Apply the buffer policy (see module docstring) across ``comm``'s group."""
    if policy == "local" or not buffers:
        return
    with comm.blocking(SYNC.BUFFER_SYNC):
        if policy == "broadcast":
            _coalesced(comm, buffers, cap_bytes, "broadcast")
            return
        floating = [b for b in buffers if b.is_floating_point()]
        other = [b for b in buffers if not b.is_floating_point()]
        if floating:
            _coalesced(comm, floating, cap_bytes, "average")
        if other:
            _coalesced(comm, other, cap_bytes, "broadcast")


def _floating_state(
    state: dict, params: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    out = []
    for p in params:
        for key, value in sorted(state.get(p, {}).items(), key=lambda kv: str(kv[0])):
            if key == "step":
                continue
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() > 0:
                # a DTensor's state (FSDP2): its local shard itself, averaged with the other replicas' same shard
                out.append(value.to_local() if hasattr(value, "to_local") else value)
    return out


@torch.no_grad()
def sync_optimizer_state(
    comm: Communicator,
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    policy: str,
    cap_bytes: int,
) -> None:
    """Apply the optimizer-state policy (see module docstring) to ``optimizer.state``."""
    if policy == "keep":
        return
    if policy == "reset":
        optimizer.state.clear()
        return
    tensors = _floating_state(optimizer.state, params)
    if tensors:
        with comm.blocking(SYNC.STATE_SYNC):
            _coalesced(comm, tensors, cap_bytes, "average")
