"""``check_replicas=True``: prove after each reconciliation that every replica holds the same parameters.

One collective: each rank computes an exact checksum per parameter (its bit pattern read as integers,
summed plainly and weighted by position in wrapping int64 arithmetic, so the order of summation does
not matter and any changed bit almost surely changes it), and one ``all_reduce(MAX)`` of
``[checksums, ~checksums]`` gives every rank the maximum and (through ``~``) the minimum of each.
Where they differ, the replicas differ; only then a second collective (an all-gather of that one
parameter's checksums) finds which ranks hold other values, and every rank raises the same line.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cpdpkit.errors import DistributedSetupError
from cpdpkit.labels import SYNC
from cpdpkit.sync._comm import Communicator, group_ranks

__all__ = ["check_replicas", "checksum"]

_WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}  # 8-byte elements: two int32 words
_MIX = 1_000_003


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """An int64 scalar that changes when any bit of ``tensor`` does (almost surely); equal bits, equal sums."""
    flat = tensor.detach().reshape(-1).contiguous()
    words = flat.view(_WORDS[flat.element_size()]).to(torch.int64)
    position = torch.arange(1, words.numel() + 1, dtype=torch.int64)
    return words.sum() * _MIX + (words * position).sum()  # wraps around in int64: still exact equality


def check_replicas(comm: Communicator, named: Sequence[tuple[str, torch.Tensor]], *, when: str) -> None:
    """Raise one line naming the first parameter whose value differs between ranks of ``comm``'s group."""
    if comm.size == 1 or not named:
        return
    sums = torch.stack([checksum(t) for _, t in named])
    both = torch.cat([sums, torch.bitwise_not(sums)])
    with comm.blocking(SYNC.REPLICA_CHECK):
        comm.wait(comm.all_reduce_max_async(both))
        high, low = both[: len(named)], torch.bitwise_not(both[len(named):])
        differ = torch.nonzero(high != low).reshape(-1)
        if differ.numel() == 0:
            return
        first = int(differ[0])
        gathered = torch.empty(comm.size, dtype=torch.int64)
        comm.wait(comm.all_gather_async(gathered, sums[first : first + 1]))
    name, tensor = named[first]
    ranks = group_ranks(comm.group)
    values = gathered.tolist()
    reference = values[0]  # the first rank's value; the ranks that disagree with it are named
    others = [r for r, v in zip(ranks, values) if v != reference]
    same = [r for r, v in zip(ranks, values) if v == reference]
    raise DistributedSetupError(
        f"replica check {when}: parameter {name!r} (shape {tuple(tensor.shape)}) differs across replicas: "
        f"rank(s) {_ranks(others)} hold other values than rank(s) {_ranks(same)} ({differ.numel()} of {len(named)} "
        "parameters differ); something changed parameters on some ranks only (code that writes them outside the "
        "optimizer, or faulty hardware): fix that, then resume from the last checkpoint"
    )


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
