"""Labelled, timed, coalesced collectives for the sync package.

Every collective the optimizer issues goes through :class:`Communicator`, which

* labels it with ``torch.profiler.record_function`` (a :data:`cpdpkit.labels.SYNC` phase),
* counts collectives and payload bytes,
* measures the seconds the caller is blocked (the optimizer's exposed sync time),
* waits with a timeout, so a mismatched peer ends in an error rather than a hang.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.profiler import record_function

from cpdpkit.errors import DistributedSetupError
from cpdpkit.labels import SYNC, Phase

__all__ = ["Communicator", "chunks", "group_ranks"]


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of ``group`` (``None``: the default group)."""
    return dist.get_process_group_ranks(group or dist.group.WORLD)


def chunks(flat: torch.Tensor, cap_bytes: int) -> list[torch.Tensor]:
    """Contiguous views of ``flat`` holding at most ``cap_bytes`` each."""
    per = max(1, cap_bytes // flat.element_size())
    return [flat[i : i + per] for i in range(0, flat.numel(), per)]


def _shown(labels: Sequence[str] | Mapping[int, str] | None, value: int) -> object:
    if labels is None:
        return value
    if isinstance(labels, Mapping):
        return labels.get(value, value)
    return labels[value]


class Communicator:
    """Collectives over one process group, with accounting (see module docstring)."""

    def __init__(self, group: dist.ProcessGroup | None, *, timeout_s: float | None) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.src = dist.get_global_rank(group, 0) if group is not None else 0
        self._timeout = None if timeout_s is None else timedelta(seconds=float(timeout_s))
        self.collectives = 0
        self.bytes_sent = 0
        self.blocked_s = 0.0

    # -- accounting ----------------------------------------------------------------
    def reset_counters(self) -> None:
        self.collectives, self.bytes_sent, self.blocked_s = 0, 0, 0.0

    def _count(self, tensor: torch.Tensor) -> None:
        self.collectives += 1
        self.bytes_sent += tensor.numel() * tensor.element_size()

    @contextmanager
    def blocking(self, phase: Phase) -> Iterator[None]:
        """Label a communication phase and count its wall time as blocked (exposed) time."""
        assert phase.is_communication, phase  # local work is neither labelled nor counted as communication
        start = time.perf_counter()
        with record_function(phase.label):
            yield
        self.blocked_s += time.perf_counter() - start

    def wait(self, work: dist.Work) -> None:
        try:
            if self._timeout is None:
                work.wait()
            else:
                work.wait(self._timeout)
        except RuntimeError as exc:  # gloo reports timeouts and peer failures this way
            raise DistributedSetupError(
                f"a collective on ranks {group_ranks(self.group)} failed or timed out ({exc}); "
                "check that every rank runs the same steps with the same configuration"
            ) from exc

    # -- collectives (callers label the phase) ----------------------------------------
    def all_reduce_sum_async(self, tensor: torch.Tensor) -> dist.Work:
        self._count(tensor)
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def all_reduce_avg_async(self, tensor: torch.Tensor) -> dist.Work:
        """The mean in place with ``ReduceOp.AVG`` (what FSDP2's HSDP all-reduce uses, for equal numbers)."""
        self._count(tensor)
        return dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=self.group, async_op=True)

    def all_reduce_max_async(self, tensor: torch.Tensor) -> dist.Work:
        self._count(tensor)
        return dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def all_gather_async(self, out: torch.Tensor, tensor: torch.Tensor) -> dist.Work:
        """``out`` (``size`` times ``tensor``'s numel) receives every rank's ``tensor``, in rank order."""
        self._count(tensor)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return gather(out, tensor, group=self.group, async_op=True)

    def all_to_all_async(self, out: torch.Tensor, tensor: torch.Tensor) -> dist.Work:
        """Piece r of ``tensor`` (``size`` equal pieces) goes to rank r; piece j of ``out`` comes from rank j."""
        self._count(tensor)
        return dist.all_to_all_single(out, tensor, group=self.group, async_op=True)

    def average_(self, flats: Sequence[torch.Tensor], cap_bytes: int) -> None:
        """Average flat tensors in place across the group, in buckets of ``cap_bytes``.

        Divides before summing, as torch's DDP and ``PeriodicModelAverager`` do, so results
        match them bit for bit where the reduction order agrees.
        """
        for work in self.average_async(flats, cap_bytes):
            self.wait(work)

    def average_async(self, flats: Sequence[torch.Tensor], cap_bytes: int) -> list[dist.Work]:
        """Launch :meth:`average_`'s collectives; the flats hold the means once all are waited."""
        works = []
        for flat in flats:
            flat.div_(self.size)
            for piece in chunks(flat, cap_bytes):
                works.append(self.all_reduce_sum_async(piece))
        return works

    def broadcast_(self, flats: Sequence[torch.Tensor], cap_bytes: int) -> None:
        """Broadcast flat tensors in place from the group's first rank."""
        for work in self.broadcast_async(flats, cap_bytes):
            self.wait(work)

    def broadcast_async(self, flats: Sequence[torch.Tensor], cap_bytes: int) -> list[dist.Work]:
        """Launch :meth:`broadcast_`'s collectives."""
        works = []
        for flat in flats:
            for piece in chunks(flat, cap_bytes):
                self._count(piece)
                works.append(dist.broadcast(piece, src=self.src, group=self.group, async_op=True))
        return works

    def check_agreement(
        self, fields: Sequence[tuple[str, int, Sequence[str] | Mapping[int, str] | None]]
    ) -> None:
        """Raise if ranks disagree on any ``(name, value, labels)`` (one small all-gather).

        ``labels`` turns an index back into its name for the message (e.g. strategies); a
        mapping names only some values (e.g. ``{0: "auto"}``).
        """
        mine = torch.tensor([value for _, value, _ in fields], dtype=torch.int64)
        gathered = torch.empty(self.size * mine.numel(), dtype=torch.int64)
        self._count(mine)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        with self.blocking(SYNC.CONFIG_CHECK):
            self.wait(gather(gathered, mine, group=self.group, async_op=True))
        table = gathered.view(self.size, -1)
        ranks = group_ranks(self.group)
        for col, (name, _, labels) in enumerate(fields):
            column = table[:, col].tolist()
            if len(set(column)) > 1:
                shown = [_shown(labels, v) for v in column]
                per_rank = ", ".join(f"rank {r}: {v}" for r, v in zip(ranks, shown))
                raise DistributedSetupError(
                    f"ranks disagree on {name} ({per_rank}): construct "
                    "PeriodicSyncOptimizer with the same model and arguments on every rank"
                )
