"""Bucketed gradient all-reduce started from backward hooks, as DDP's reducer does.

Parameters are assigned to buckets in reverse registration order (the order in which
backward usually produces their gradients), at most ``bucket_cap_bytes`` each and one dtype
per bucket. A post-accumulate-grad hook marks a parameter ready; when a bucket's last
parameter is ready its gradients are copied into the bucket, divided by the group size and
all-reduced asynchronously, so communication overlaps the rest of backward. ``finish()``
(called from ``step()``) launches what backward did not reach, waits, and writes the
averaged gradients back.

Compressed (``compression`` other than ``"none"``, on the steps ``compressed()`` names: ``cpdp``'s
synchronous steps): a full bucket is not all-reduced; its gradients plus the bucket's error-feedback
residual are encoded (:mod:`cpdpkit.sync._codec`), every rank's code is all-gathered as bytes, and
``finish()`` decodes all of them in rank order into the bucket: the mean of the decoded gradients, the
same bit for bit on every rank. The residuals (one per bucket, the bucket's size) keep what each code
lost, so over many steps the sum of what was sent plus the residual is the sum of the gradients.

``ranges`` (one ``(start, stop)`` per parameter, in its flattened elements) makes the buckets hold only
those pieces of the gradients: a streaming fragment's share (:mod:`cpdpkit.sync._fragments`), which may
cut a parameter in two; the rest of that gradient is left as it is.

Without hooks (``hooks=False``) the caller marks each gradient ready itself
(:meth:`GradientBuckets.mark_ready`): the two-stage executor does, for its slice gradients, once
they are reduced inside its mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.profiler import record_function

from cpdpkit.errors import DistributedSetupError
from cpdpkit.labels import SYNC
from cpdpkit.sync._codec import ErrorFeedback
from cpdpkit.sync._comm import Communicator

__all__ = ["GradientBuckets"]


@dataclass
class _Bucket:
    params: list[torch.Tensor]
    offsets: list[int]
    ranges: list[tuple[int, int]]  # each parameter's piece, in its flattened elements
    buffer: torch.Tensor
    index: int = 0
    gathered: torch.Tensor | None = None  # compressed: every rank's code, decoded into buffer in finish()
    ready: int = 0
    comm: Communicator | None = None
    work: dist.Work | None = None
    launched: bool = False
    ready_ids: set[int] = field(default_factory=set)


class GradientBuckets:
    """Gradient buckets with backward hooks (see module docstring).

    ``target`` is called at hook time and returns the :class:`Communicator` this backward's
    gradients are averaged over, or ``None`` when the coming step does not synchronise them;
    ``compressed`` (with a ``compression``) whether this backward's exchange is compressed.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        *,
        bucket_cap_bytes: int,
        target: Callable[[], Communicator | None],
        hooks: bool = True,
        compression: str = "none",
        compressed: Callable[[], bool] | None = None,
        ranges: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        self._target, self._compressed = target, compressed
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        self._handles = []
        pieces = list(zip(params, ranges if ranges is not None else [(0, p.numel()) for p in params], strict=True))
        self._build(list(reversed(pieces)), bucket_cap_bytes)
        self.feedback = (ErrorFeedback(compression, [b.buffer.numel() for b in self._buckets])
                         if compression != "none" else None)
        self.enabled = True  # False inside PeriodicSyncOptimizer.no_sync()
        for p in params if hooks else ():
            self._handles.append(p.register_post_accumulate_grad_hook(self.mark_ready))

    def _build(self, ordered: list[tuple[torch.Tensor, tuple[int, int]]], cap: int) -> None:
        current: list[tuple[torch.Tensor, tuple[int, int]]] = []
        size = 0
        for p, (start, stop) in ordered:
            nbytes = (stop - start) * p.element_size()
            first = current[0][0] if current else p
            same_kind = (first.dtype, first.device) == (p.dtype, p.device)
            if current and (size + nbytes > cap or not same_kind):
                self._add_bucket(current)
                current, size = [], 0
            current.append((p, (start, stop)))
            size += nbytes
        if current:
            self._add_bucket(current)

    def _add_bucket(self, pieces: list[tuple[torch.Tensor, tuple[int, int]]]) -> None:
        params = [p for p, _ in pieces]
        offsets, total = [], 0
        for _, (start, stop) in pieces:
            offsets.append(total)
            total += stop - start
        buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        bucket = _Bucket(params, offsets, [r for _, r in pieces], buffer, index=len(self._buckets))
        self._buckets.append(bucket)
        for p in params:
            self._bucket_of[id(p)] = bucket

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- during backward ---------------------------------------------------------------
    def mark_ready(self, param: torch.Tensor) -> None:
        """``param.grad`` is final for this backward: launch its bucket's all-reduce once the bucket is full."""
        if not self.enabled:
            return
        comm = self._target()
        if comm is None:
            return
        bucket = self._bucket_of[id(param)]
        if bucket.launched:
            raise DistributedSetupError(
                "a gradient was produced twice before step() on a step that synchronises "
                "gradients: wrap the earlier backward passes of a gradient accumulation in "
                "`with opt.no_sync():`"
            )
        if id(param) not in bucket.ready_ids:
            bucket.ready_ids.add(id(param))
            bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket, comm)

    @torch.no_grad()
    def _launch(self, bucket: _Bucket, comm: Communicator) -> None:
        for p, off, (start, stop) in zip(bucket.params, bucket.offsets, bucket.ranges):
            view = bucket.buffer[off : off + stop - start]
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1)[start:stop])
        if self.feedback is not None and self._compressed is not None and self._compressed():
            code = self.feedback.encode_one(bucket.index, bucket.buffer)
            bucket.gathered = torch.empty(comm.size * code.numel(), dtype=torch.uint8)
            with record_function(SYNC.GRAD_ALLREDUCE.label):  # the launch only: encoding is local work
                bucket.work = comm.all_gather_async(bucket.gathered, code)
        else:
            bucket.buffer.div_(comm.size)
            with record_function(SYNC.GRAD_ALLREDUCE.label):  # the launch only: the copies are local work
                bucket.work = comm.all_reduce_sum_async(bucket.buffer)
        bucket.comm = comm
        bucket.launched = True

    # -- in step() -----------------------------------------------------------------------
    @torch.no_grad()
    def finish(self, comm: Communicator) -> None:
        """Launch buckets backward did not complete, wait for all, write gradients back.

        A parameter without a gradient on this rank contributes zeros (its averaged
        gradient is then set, as on the ranks that used it).
        """
        for bucket in self._buckets:
            if not bucket.launched:
                self._launch(bucket, comm)
        with comm.blocking(SYNC.GRAD_WAIT):
            for bucket in self._buckets:
                assert bucket.work is not None and bucket.comm is not None
                bucket.comm.wait(bucket.work)
        for bucket in self._buckets:
            if bucket.gathered is not None:  # compressed: the mean of every rank's decoded code
                assert self.feedback is not None and bucket.comm is not None
                bucket.buffer.copy_(self.feedback.mean_one(bucket.index, bucket.gathered, bucket.comm.size))
                bucket.gathered = None
            for p, off, (start, stop) in zip(bucket.params, bucket.offsets, bucket.ranges):
                view = bucket.buffer[off : off + stop - start]
                if stop - start == p.numel():
                    if p.grad is None:
                        p.grad = view.view_as(p).clone()
                    else:
                        p.grad.copy_(view.view_as(p))
                    continue
                if p.grad is None:  # a piece of it (a fragment's): the rest stays zero until its own piece lands
                    p.grad = torch.zeros_like(p)
                p.grad.view(-1)[start:stop].copy_(view)
            bucket.ready, bucket.launched, bucket.work, bucket.comm = 0, False, None, None
            bucket.ready_ids.clear()
