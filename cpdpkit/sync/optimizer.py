"""``PeriodicSyncOptimizer``: DDP, LocalSGD, SlowMo and CPDP behind one optimizer wrapper.

Usage::

    opt = PeriodicSyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                model=model, strategy="cpdp", period=4)
    for x, y in loader:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

The schedule is in :mod:`cpdpkit.sync.config`. On a step that synchronises gradients, a
plain module's gradients are all-reduced in buckets launched from backward hooks (overlapping
backward, as DDP); a DDP-wrapped module's own reducer is switched on for exactly those steps.
A reconciliation averages the parameters (in place, in flat buffers) and, for ``slowmo`` and
``cpdp``, applies the SlowMo outer update.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from cpdpkit.errors import ConfigError, DistributedSetupError
from cpdpkit.sync._comm import Communicator, group_ranks
from cpdpkit.sync._flat import FlatParameters
from cpdpkit.sync._grad_buckets import GradientBuckets
from cpdpkit.sync._state_policies import sync_buffers, sync_optimizer_state
from cpdpkit.sync.config import StepKind, SyncConfig
from cpdpkit.sync.stats import SyncStats

__all__ = ["PeriodicSyncOptimizer"]

_STATE_VERSION = 1


def _check_group(group: Any, what: str) -> None:
    if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        raise DistributedSetupError(
            f"this rank ({dist.get_rank()}) is not a member of the {what} passed to "
            f"PeriodicSyncOptimizer: pass a group created with this rank in its ranks"
        )


class PeriodicSyncOptimizer(torch.optim.Optimizer):
    """Wraps any ``torch.optim`` optimizer to communicate every ``period`` steps.

    Args:
        optimizer: the inner optimizer (any ``torch.optim.Optimizer``; LR schedulers attach
            to it or to this wrapper).
        model: the module whose parameters the optimizer trains; a plain ``nn.Module`` or a
            ``DistributedDataParallel``.
        strategy: ``"ddp"`` | ``"localsgd"`` | ``"slowmo"`` | ``"cpdp"``.
        period: K, optimizer steps between reconciliations.
        warmup_steps: W, first steps that synchronise gradients like DDP.
        slowmo_momentum, slowmo_lr: SlowMo's β and α.
        buffers: ``"average"`` | ``"broadcast"`` | ``"local"`` (module buffers at each
            synchronising step).
        optimizer_state: ``"keep"`` | ``"average"`` | ``"reset"`` (inner state at each
            reconciliation).
        group: the process group to synchronise over (default: the world).
        fast_group: optional group of this rank's fast neighbours (e.g. its node); gradients
            are all-reduced in it on every step and reconciliation runs over ``slow_group``.
        slow_group: group for parameter averaging when ``fast_group`` is set (default
            ``group``; the ranks with this rank's index in other nodes is enough).
        anchor_dtype: dtype of SlowMo's anchor and momentum (required as ``torch.float32``
            when parameters are fp16/bf16).
        bucket_cap_mb: payload bound of one all-reduce, as DDP's argument.
        timeout_s: bound on every wait for a collective (default: the group's timeout).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        model: nn.Module,
        strategy: str = "cpdp",
        period: int = 4,
        warmup_steps: int = 0,
        slowmo_momentum: float = 0.5,
        slowmo_lr: float = 1.0,
        buffers: str = "average",
        optimizer_state: str = "keep",
        group: dist.ProcessGroup | None = None,
        fast_group: dist.ProcessGroup | None = None,
        slow_group: dist.ProcessGroup | None = None,
        anchor_dtype: torch.dtype | None = None,
        bucket_cap_mb: float = 25.0,
        timeout_s: float | None = None,
    ) -> None:
        # Validation happens before any collective: a user mistake must not hang a peer.
        self.config = SyncConfig(
            strategy=strategy, period=period, warmup_steps=warmup_steps,
            slowmo_momentum=slowmo_momentum, slowmo_lr=slowmo_lr, buffers=buffers,
            optimizer_state=optimizer_state, bucket_cap_mb=bucket_cap_mb, timeout_s=timeout_s,
        )
        self._validate_objects(optimizer, model, anchor_dtype)
        self._validate_groups(model, group, fast_group, slow_group)
        self.optim = optimizer
        self.model = model
        self._ddp = model if isinstance(model, DistributedDataParallel) else None
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self._check_params_in_model(model)
        self._flat = FlatParameters(optimizer.param_groups, anchor_dtype=anchor_dtype)
        if self._flat.low_precision_params() and self.config.uses_slowmo and anchor_dtype is None:
            raise ConfigError(
                f"parameters are {self._flat.low_precision_params()[0]}: SlowMo's anchor and "
                "slow momentum lose updates in low precision; pass anchor_dtype=torch.float32"
            )
        self._comm = Communicator(group, timeout_s=timeout_s)
        self._fast = Communicator(fast_group, timeout_s=timeout_s) if fast_group else None
        self._slow = Communicator(slow_group, timeout_s=timeout_s) if slow_group else self._comm
        self._step = 0
        self._counts = {"local_steps": 0, "reconciliations": 0, "gradient_syncs": 0}
        self._extra_bytes = 0
        self._no_sync = False
        self._buckets: GradientBuckets | None = None
        self._start()

    # -- construction ----------------------------------------------------------------------
    @staticmethod
    def _validate_objects(optimizer: Any, model: Any, anchor_dtype: Any) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}: "
                "wrap e.g. torch.optim.SGD(model.parameters(), lr=0.1)"
            )
        if isinstance(optimizer, PeriodicSyncOptimizer):
            raise ConfigError("optimizer is already a PeriodicSyncOptimizer: wrap the inner one once")
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"model must be an nn.Module, got {type(model).__name__}: pass model=<your module>"
            )
        if anchor_dtype is not None and not (
            isinstance(anchor_dtype, torch.dtype) and anchor_dtype.is_floating_point
        ):
            raise ConfigError(
                f"anchor_dtype must be a floating torch.dtype, got {anchor_dtype!r}: "
                "pass anchor_dtype=torch.float32"
            )
        if not dist.is_available() or not dist.is_initialized():
            raise DistributedSetupError(
                "torch.distributed is not initialised: call cpdpkit.init_distributed() or "
                "torch.distributed.init_process_group() before creating PeriodicSyncOptimizer"
            )

    def _validate_groups(self, model: nn.Module, group: Any, fast: Any, slow: Any) -> None:
        _check_group(group, "group")
        if fast is not None:
            _check_group(fast, "fast_group")
            if isinstance(model, DistributedDataParallel):
                raise ConfigError(
                    "fast_group with a DDP-wrapped model: DDP already all-reduces over its own "
                    "group; pass the plain module and let fast_group do the intra-node sync"
                )
        if slow is not None:
            if fast is None:
                raise ConfigError("slow_group is set without fast_group: pass both, or use group=")
            _check_group(slow, "slow_group")
        if isinstance(model, DistributedDataParallel):
            ddp_ranks = group_ranks(model.process_group)
            if ddp_ranks != group_ranks(group):
                raise ConfigError(
                    f"the DDP model's process group has ranks {ddp_ranks} but group has "
                    f"{group_ranks(group)}: pass group=<the DDP model's process group>"
                )

    def _check_params_in_model(self, model: nn.Module) -> None:
        in_model = {id(p) for p in model.parameters()}
        for gi, g in enumerate(self.optim.param_groups):
            for pi, p in enumerate(g["params"]):
                if id(p) not in in_model:
                    raise ConfigError(
                        f"parameter {pi} of param group {gi} (shape {tuple(p.shape)}) is not a "
                        "parameter of model: build the optimizer from model.parameters()"
                    )

    def _start(self) -> None:
        """Check that ranks agree, make parameters identical, then arm the hooks."""
        fields = [
            *self.config.fingerprint(),
            ("number of parameters", len(self._params), None),
            ("number of parameter elements", self._flat.numel, None),
            ("number of buffers", len(self._buffers()), None),
            ("fast_group presence", int(self._fast is not None), None),
        ]
        self._comm.check_agreement(fields)
        with self._comm.blocking("broadcast_init"):
            self._comm.broadcast_(self._flat.flats, self.config.bucket_cap_bytes)
            if self._buffers():
                sync_buffers(self._comm, self._buffers(), "broadcast", self.config.bucket_cap_bytes)
        if self.config.uses_slowmo:
            self._flat.capture_anchor()
        for comm in self._communicators():
            comm.reset_counters()  # stats count from the first step, not construction
        if self._ddp is None:
            trained = {id(q) for q in self._params}
            self._buckets = GradientBuckets(
                [p for p in self.model.parameters() if id(p) in trained],
                bucket_cap_bytes=self.config.bucket_cap_bytes,
                target=self._gradient_target,
            )
        self._arm_next_step()

    def _buffers(self) -> list[torch.Tensor]:
        # Listed anew each time: a module may re-assign a buffer rather than update it in place.
        return list(self.model.buffers())

    # -- the torch.optim.Optimizer surface ----------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optim.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optim.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ConfigError(
            "add_param_group on a PeriodicSyncOptimizer is not supported: add the group to the "
            "inner optimizer before wrapping it"
        )

    def __repr__(self) -> str:
        c = self.config
        return (
            f"PeriodicSyncOptimizer(strategy={c.strategy!r}, period={c.period}, "
            f"warmup_steps={c.warmup_steps}, step={self._step}, inner={self.optim!r})"
        )

    # -- schedule helpers ------------------------------------------------------------------
    @property
    def step_count(self) -> int:
        """Optimizer steps taken so far (n of the last step)."""
        return self._step

    def next_step_kind(self) -> StepKind:
        return self.config.step_kind(self._step + 1)

    def _gradient_target(self) -> Communicator | None:
        """The communicator the coming step's gradients are averaged over (hook time)."""
        n = self._step + 1
        if self.config.syncs_gradients(n):
            return self._comm
        return self._fast

    def _arm_next_step(self) -> None:
        """Tell the gradient path whether the coming backward communicates."""
        if self._ddp is not None:
            syncs = self.config.syncs_gradients(self._step + 1) and not self._no_sync
            self._ddp.require_backward_grad_sync = syncs
        if self._buckets is not None:
            self._buckets.enabled = not self._no_sync

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this block accumulate gradients without communicating.

        Use it for all but the last micro-batch of a gradient accumulation, as DDP's
        ``no_sync``; the last backward (outside the block) synchronises if the step does.
        """
        previous = self._no_sync
        self._no_sync = True
        self._arm_next_step()
        try:
            yield
        finally:
            self._no_sync = previous
            self._arm_next_step()

    # -- the step ----------------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        n = self._step + 1
        kind = self.config.step_kind(n)
        syncs = self.config.syncs_gradients(n)
        target = self._gradient_target()
        if self._buckets is not None and target is not None:
            self._buckets.finish(target)
        elif self._ddp is not None and syncs:  # DDP's reducer sent them; count its payload
            self._extra_bytes += self._flat.nbytes
        if syncs:
            self._counts["gradient_syncs"] += 1
        self.optim.step()
        if kind is StepKind.RECONCILE:
            self._reconcile()
        elif kind in (StepKind.DDP, StepKind.WARMUP):
            sync_buffers(self._comm, self._buffers(), self.config.buffers, self.config.bucket_cap_bytes)
        else:
            self._counts["local_steps"] += 1
        if self.config.uses_slowmo and n == self.config.warmup_steps:
            # The periodic phase starts here: SlowMo's anchor is the post-warm-up parameters.
            self._flat.capture_anchor()
        self._step = n
        self._arm_next_step()
        return loss

    @torch.no_grad()
    def _reconcile(self) -> None:
        cfg = self.config
        self._counts["reconciliations"] += 1
        self._flat.ensure_bound()
        with self._slow.blocking("param_average"):
            self._slow.average_(self._flat.flats, cfg.bucket_cap_bytes)
        if cfg.uses_slowmo:
            with self._slow.blocking("slowmo_update"):
                self._flat.slowmo_update(
                    self.optim.param_groups, beta=float(cfg.slowmo_momentum),
                    alpha=float(cfg.slowmo_lr),
                )
        sync_buffers(self._comm, self._buffers(), cfg.buffers, cfg.bucket_cap_bytes)
        sync_optimizer_state(
            self._slow, self.optim, self._params, cfg.optimizer_state, cfg.bucket_cap_bytes
        )

    @torch.no_grad()
    def average_parameters(self) -> None:
        """Average parameters and buffers across the group now (e.g. before evaluation or
        saving one model at the end of training); every rank must call it. No SlowMo update,
        no step counted."""
        self._flat.ensure_bound()
        with self._comm.blocking("param_average"):
            self._comm.average_(self._flat.flats, self.config.bucket_cap_bytes)
        sync_buffers(self._comm, self._buffers(), self.config.buffers, self.config.bucket_cap_bytes)

    # -- stats and checkpoints -----------------------------------------------------------------
    def _communicators(self) -> list[Communicator]:
        comms = [self._comm]
        for extra in (self._fast, self._slow):
            if extra is not None and all(extra is not c for c in comms):
                comms.append(extra)
        return comms

    @property
    def stats(self) -> SyncStats:
        comms = self._communicators()
        return SyncStats(
            steps=self._step,
            local_steps=self._counts["local_steps"],
            reconciliations=self._counts["reconciliations"],
            gradient_syncs=self._counts["gradient_syncs"],
            collectives=sum(c.collectives for c in comms),
            bytes_sent=sum(c.bytes_sent for c in comms) + self._extra_bytes,
            blocked_s=sum(c.blocked_s for c in comms),
        )

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Inner optimizer state plus the step counter, SlowMo's anchor and momentum."""
        return {
            "inner": self.optim.state_dict(),
            "cpdpkit": {
                "version": _STATE_VERSION,
                "config": self.config.to_dict(),
                "step": self._step,
                "counts": dict(self._counts),
                "layout": self._flat.layout(),
                **self._flat.slowmo_state(),
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore a :meth:`state_dict`. Load the model's own state (per rank) as well."""
        if "inner" not in state_dict or "cpdpkit" not in state_dict:
            raise ConfigError(
                "state_dict lacks 'inner'/'cpdpkit' keys: pass what PeriodicSyncOptimizer."
                "state_dict() returned (for the inner optimizer alone use opt.optim)"
            )
        own = state_dict["cpdpkit"]
        saved = SyncConfig.from_dict(own["config"])
        if saved.strategy != self.config.strategy:
            raise ConfigError(
                f"checkpoint was saved with strategy {saved.strategy!r}, this optimizer uses "
                f"{self.config.strategy!r}: construct it with strategy={saved.strategy!r}"
            )
        if own["layout"] != self._flat.layout():
            raise ConfigError(
                "checkpoint parameter layout differs from this optimizer's: load a checkpoint "
                "saved with the same model and param groups"
            )
        self.optim.load_state_dict(state_dict["inner"])
        self._flat.ensure_bound()
        self._flat.load_slowmo_state(own)
        if self.config.uses_slowmo and own.get("anchor") is None:
            self._flat.capture_anchor()
        self._step = int(own["step"])
        self._counts.update(own.get("counts", {}))
        self._arm_next_step()
