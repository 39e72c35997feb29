"""torch's ZeRO-1 peers of ``cpdpkit bench sharding``: ``ZeroRedundancyOptimizer`` over DDP.

* ``zero1``: :class:`torch.distributed.optim.ZeroRedundancyOptimizer` (``optimizer_class`` = the
  suite's optimizer, same hyperparameters, ``parameters_as_bucket_view=True`` so each rank's
  updated parameters go out in one broadcast instead of one per tensor) over a
  ``DistributedDataParallel`` model on the world group: DDP all-reduces full gradients during
  backward, each rank updates the parameters it owns, ``step()`` broadcasts them.
* ``zero1-overlap``: the same with ``overlap_with_ddp=True`` and DDP's communication hook
  ``hook_with_zero_step(allreduce_hook, ddp, zero, shard_buckets=True)``: the local updates and
  their broadcasts run inside the hook of the last gradient bucket, overlapping the bucket
  all-reduces still in flight (``shard_buckets=True`` splits every DDP bucket over the ranks, so
  optimizer state is spread as evenly as ``zero1``'s; with whole buckets per rank this small
  model's few buckets would leave some ranks all the state and others none). ZeRO learns DDP's
  buckets during DDP's bucket rebuild and skips the optimizer step of the first two iterations
  (``static_graph=False``), so :func:`build_zero_peer` runs :data:`OVERLAP_PRIMING_STEPS`
  forward/backward passes before training (no update happens in them: the model stays at its
  initial values and the optimizer state empty) and the run's steps then match the other
  strategies' step for step.

DDP's bucket cap is one transformer block's parameter bytes: torch's default (25 MiB) would put
this few-MB model into one or two buckets and leave nothing to overlap, while at the scale the
topology emulates (a link ~170x slower than IB) 25 MiB buckets are a small part of a model; one
block per bucket is also FSDP2's and the planner's unit.

**Gloo.** ``hook_with_zero_step`` refuses a group whose backend is ``gloo`` ("Gloo backend using
Overlapping DDP with ZeRO may meet hangs", pytorch/pytorch#62300). The suite's ranks run on the
``emu`` backend (which moves the data with gloo), and torch's check looks at the backend's name
only, so ``zero1-overlap`` runs. On a plain gloo group the worker reports the run
``unsupported`` with torch's error text (:class:`ZeroPeerUnsupported`).

**Clipping.** ``zero1`` clips DDP's full (already all-reduced) gradients with
``clip_grad_norm_`` before ``zero.step()``. ``zero1-overlap`` cannot clip: its optimizer step
runs inside the communication hook before backward returns, when no global gradient norm
exists; the suite marks that run ``unsupported`` (:data:`OVERLAP_CLIP_REASON`) and runs the rest.

**Exposed communication.** DDP's reducer waits for its all-reduce futures in C++ (not through the
emulated backend's ``Work.wait``, which the suite's meter counts), so this module clocks those
waits itself (:class:`WaitClock`): the wait of ``backward()`` after the last bucket's hook
returned (DDP's ``finalize_backward``), and, for ``zero1-overlap``, the hook's own waits on the
all-reduce futures. ZeRO's broadcasts are waited through ``Work.wait`` and counted by the meter;
the two never overlap in time, so their sum is the training thread's blocked time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cpdpkit.bench._gpt_rank import ddp_over_blocks, local_bytes

__all__ = ["ZERO_STRATEGIES", "OVERLAP_PRIMING_STEPS", "OVERLAP_CLIP_REASON", "ZeroPeer", "ZeroPeerUnsupported",
           "WaitClock", "build_zero_peer"]

ZERO_STRATEGIES = ("zero1", "zero1-overlap")
OVERLAP_PRIMING_STEPS = 2  # DDP rebuilds its buckets after iteration 1; ZeRO initialises in iteration 2
OVERLAP_CLIP_REASON = ("--max-grad-norm cannot apply to zero1-overlap: its optimizer step runs inside DDP's "
                       "communication hook (hook_with_zero_step) before backward returns, so there is no point "
                       "where the global gradient norm is known")


class ZeroPeerUnsupported(RuntimeError):
    """This peer cannot run here; ``str()`` is the reason (torch's own error text where it refused)."""


@dataclass(frozen=True)
class ZeroPeer:
    """One rank's training step for a ZeRO peer, its optimizer-state bytes and its clocked DDP waits."""

    step: Callable[[torch.Tensor, torch.Tensor], float]
    state_bytes: Callable[[], int]
    ddp_wait_s: Callable[[], float]  # seconds blocked on DDP's all-reduce futures so far (monotonic)


class _TimedFuture(torch.futures.Future):
    """A future completed with another's value whose Python ``wait()`` is clocked."""

    def __init__(self, clock: WaitClock) -> None:
        super().__init__()
        self.clock = clock

    def wait(self) -> Any:
        start = time.perf_counter()
        try:
            return super().wait()
        finally:
            self.clock.waited_s += time.perf_counter() - start


class WaitClock:
    """Seconds the training thread waits for DDP's all-reduce futures outside ``Work.wait``."""

    def __init__(self) -> None:
        self.waited_s = 0.0
        self._last_hook_end: float | None = None

    def timed(self, hook: Callable[..., torch.futures.Future]) -> Callable[..., torch.futures.Future]:
        """``hook`` that notes when it returned (the last call of a backward ends its compute)."""

        def timed_hook(state, bucket):  # noqa: ANN001, ANN202 (DDP refuses string annotations)
            fut = hook(state, bucket)
            self._last_hook_end = time.perf_counter()
            return fut

        return timed_hook

    def clocked_futures(self, hook: Callable[..., torch.futures.Future]) -> Callable[..., torch.futures.Future]:
        """``hook`` whose futures clock the Python waits on them (ZeRO's hook waits inside backward)."""

        def clocked_hook(state, bucket):  # noqa: ANN001, ANN202
            inner, out = hook(state, bucket), _TimedFuture(self)

            def forward(f: torch.futures.Future) -> None:
                try:
                    out.set_result(f.value())
                except Exception as exc:  # noqa: BLE001 (handed to the waiter)
                    out.set_exception(exc)

            inner.add_done_callback(forward)
            return out

        return clocked_hook

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, adding the wait in DDP's ``finalize_backward`` after the last hook."""
        self._last_hook_end = None
        loss.backward()
        if self._last_hook_end is not None:
            self.waited_s += time.perf_counter() - self._last_hook_end


def _state_bytes(optimizer: Any) -> int:
    # The count of cpdpkit.shard.executor.optimizer_state_bytes (not imported: it loads FSDP2,
    # ~1 s per rank); ZeRO's local state holds plain tensors only.
    return local_bytes(v for state in getattr(optimizer, "state", {}).values() for v in state.values())


def build_zero_peer(strategy: str, model: nn.Module, *, optimizer_class: type[torch.optim.Optimizer],
                    optimizer_kwargs: dict[str, Any], max_grad_norm: float | None,
                    priming_batch: tuple[torch.Tensor, torch.Tensor]) -> ZeroPeer:
    """Wrap ``model`` (with a ``loss(x, y)`` method) for ``strategy`` on the world group.

    ``zero1-overlap`` runs its :data:`OVERLAP_PRIMING_STEPS` here on ``priming_batch`` (collective:
    every rank calls this at the same point). Raises :class:`ZeroPeerUnsupported` when torch
    refuses the peer on this backend or with clipping.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if strategy not in ZERO_STRATEGIES:
        raise ValueError(f"strategy {strategy!r} is not a ZeRO peer: use one of {', '.join(ZERO_STRATEGIES)}")
    overlap = strategy == "zero1-overlap"
    if overlap and max_grad_norm is not None:
        raise ZeroPeerUnsupported(OVERLAP_CLIP_REASON)
    clock = WaitClock()
    ddp = ddp_over_blocks(model)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=optimizer_class, overlap_with_ddp=overlap,
                                   parameters_as_bucket_view=not overlap, **optimizer_kwargs)
    if overlap:
        from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        try:
            hook = hook_with_zero_step(clock.clocked_futures(allreduce_hook), ddp, zero, shard_buckets=True)
        except RuntimeError as exc:  # torch refuses gloo by name
            raise ZeroPeerUnsupported(f"torch's hook_with_zero_step on backend {dist.get_backend()!r}: {exc}") from exc
    else:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook as hook
    ddp.register_comm_hook(None, clock.timed(hook))

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = ddp(x)  # through DDP's forward (it prepares the reducer); the module's own loss
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    if overlap:
        for _ in range(OVERLAP_PRIMING_STEPS):
            clock.backward(loss_of(*priming_batch))
            ddp.zero_grad(set_to_none=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        ddp.zero_grad(set_to_none=True)
        loss = loss_of(x, y)
        clock.backward(loss)
        if not overlap:
            if max_grad_norm is not None:  # DDP's gradients are full here: a local norm is the global one
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_grad_norm)
            zero.step()
        return float(loss.detach())

    return ZeroPeer(step=step, state_bytes=lambda: _state_bytes(getattr(zero, "optim", None)),
                    ddp_wait_s=lambda: clock.waited_s)
