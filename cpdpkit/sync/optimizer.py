"""``PeriodicSyncOptimizer``: DDP, LocalSGD, SlowMo and CPDP behind one optimizer wrapper.

Usage::

    opt = PeriodicSyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                model=model, strategy="cpdp", period=4)
    # or, the same: PeriodicSyncOptimizer(inner, model=model, config=SyncConfig(period=4))
    for x, y in loader:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

The schedule is in :mod:`cpdpkit.sync.config`. On a step that synchronises gradients, a
plain module's gradients are all-reduced in buckets launched from backward hooks (overlapping
backward, as DDP); a DDP-wrapped module's own reducer is switched on for exactly those steps.
A reconciliation averages the parameters (in place, in flat buffers) and, for ``slowmo`` and
``cpdp``, applies the SlowMo outer update; with ``overlap_steps=τ`` the average is launched
asynchronously and applied τ steps later, keeping the local progress made meanwhile:
``x ← x̃ + (x − x_launch)`` with ``x̃`` the average after SlowMo's update against that
reconciliation's anchor (:mod:`cpdpkit.sync._reconcile` has the whole formula). With
``period="auto"`` a controller chooses K at run time (:mod:`cpdpkit.sync.period_control`).

The wrapper is a complete ``torch.optim.Optimizer``: torch's ``__init__`` runs (step pre/post
hooks, global step hooks, state-dict hooks, LR schedulers' step tracking), and
``param_groups``, ``state`` and ``defaults`` are the inner optimizer's own objects. Its state
dict is torch's standard one (the inner optimizer's ``{"state", "param_groups"}``) plus one key,
``"cpdpkit"``, holding the wrapper's own state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from cpdpkit.errors import ConfigError, DistributedSetupError
from cpdpkit.labels import SYNC
from cpdpkit.sync._comm import Communicator, group_ranks
from cpdpkit.sync._flat import FlatParameters
from cpdpkit.sync._grad_buckets import GradientBuckets
from cpdpkit.sync._reconcile import STATS_SLOTS, Reconciler
from cpdpkit.sync._replicas import check_replicas
from cpdpkit.sync._state_policies import sync_buffers
from cpdpkit.sync.config import StepKind, SyncConfig
from cpdpkit.sync.stats import SyncStats

__all__ = ["PeriodicSyncOptimizer"]

# 1: {"inner": <inner state dict>, "cpdpkit": ...}; 2: torch's standard dict plus "cpdpkit";
# 3: "cpdpkit" also holds the schedule, the controller's decisions and a reconciliation in flight.
_STATE_VERSION = 3
_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(SyncConfig))


def _resolve_config(config: SyncConfig | None, options: dict[str, Any]) -> SyncConfig:
    """``config=`` or keyword options named like SyncConfig's fields, never both: the defaults
    live only in SyncConfig, and refusing the mix leaves no doubt about which value wins."""
    unknown = [name for name in options if name not in _CONFIG_FIELDS]
    if unknown:
        raise ConfigError(
            f"unknown keyword {', '.join(map(repr, unknown))} for PeriodicSyncOptimizer: "
            f"known SyncConfig fields are {', '.join(_CONFIG_FIELDS)}"
        )
    if config is None:
        return SyncConfig(**options)
    if not isinstance(config, SyncConfig):
        raise TypeError(
            f"config must be a SyncConfig, got {type(config).__name__}: "
            "pass config=cpdpkit.sync.SyncConfig(...)"
        )
    if options:
        given = ", ".join(f"{name}=..." for name in options)
        raise ConfigError(
            f"config= given together with {', '.join(options)}: pass "
            f"config=dataclasses.replace(config, {given}), or the keywords without config="
        )
    return config


def _check_group(group: Any, what: str) -> None:
    if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        raise DistributedSetupError(
            f"this rank ({dist.get_rank()}) is not a member of the {what} passed to "
            f"PeriodicSyncOptimizer: pass a group created with this rank in its ranks"
        )


class PeriodicSyncOptimizer(torch.optim.Optimizer):
    """Wraps any ``torch.optim`` optimizer to communicate every ``period`` steps.

    Args:
        optimizer: the inner optimizer (any ``torch.optim.Optimizer`` with all its param
            groups added; LR schedulers attach to it or to this wrapper).
        model: the module whose parameters the optimizer trains; a plain ``nn.Module`` or a
            ``DistributedDataParallel``.
        config: a :class:`~cpdpkit.sync.SyncConfig` (strategy, period or ``"auto"``, warm-up,
            SlowMo's β and α, buffer and optimizer-state policies, bucket size, timeout,
            ``overlap_steps``, the controller's ``target_exposed_frac``, ``k_min``, ``k_max``,
            ``max_divergence``).
        **options: instead of ``config``, SyncConfig's fields as keywords (``strategy``,
            ``period``, ``warmup_steps``, ``overlap_steps``, ...); unset ones take
            SyncConfig's defaults. Passing both ``config`` and options is refused (a
            ``ConfigError`` naming ``dataclasses.replace(config, ...)``), as is an unknown one.
        group: the process group to synchronise over (default: the world).
        fast_group: optional group of this rank's fast neighbours (e.g. its node); gradients
            are all-reduced in it on every step and reconciliation runs over ``slow_group``.
        slow_group: group for parameter averaging when ``fast_group`` is set (default
            ``group``; the ranks with this rank's index in other nodes is enough).
        anchor_dtype: dtype of SlowMo's anchor and momentum (required as ``torch.float32``
            when parameters are fp16/bf16).

    ``param_groups``, ``state`` and ``defaults`` are the inner optimizer's objects;
    :meth:`state_dict` is the inner's standard dict plus a ``"cpdpkit"`` entry.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        model: nn.Module,
        config: SyncConfig | None = None,
        group: dist.ProcessGroup | None = None,
        fast_group: dist.ProcessGroup | None = None,
        slow_group: dist.ProcessGroup | None = None,
        anchor_dtype: torch.dtype | None = None,
        **options: Any,
    ) -> None:
        # Validation happens before any collective: a user mistake must not hang a peer.
        self.config = _resolve_config(config, options)
        self._validate_objects(optimizer, model, anchor_dtype)
        self._validate_groups(model, group, fast_group, slow_group)
        self._init_torch_optimizer(optimizer)
        self.model = model
        self._ddp = model if isinstance(model, DistributedDataParallel) else None
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self._check_params_in_model(model)
        self._flat = FlatParameters(optimizer.param_groups, anchor_dtype=anchor_dtype,
                                    stats_slots=STATS_SLOTS if self.config.auto else 0)
        if self._flat.low_precision_params() and self.config.uses_slowmo and anchor_dtype is None:
            raise ConfigError(
                f"parameters are {self._flat.low_precision_params()[0]}: SlowMo's anchor and "
                "slow momentum lose updates in low precision; pass anchor_dtype=torch.float32"
            )
        timeout_s = self.config.timeout_s
        self._comm = Communicator(group, timeout_s=timeout_s)
        self._fast = Communicator(fast_group, timeout_s=timeout_s) if fast_group else None
        self._slow = Communicator(slow_group, timeout_s=timeout_s) if slow_group else self._comm
        self._step = 0
        self._counts = {"local_steps": 0, "reconciliations": 0, "gradient_syncs": 0}
        self._extra_bytes = 0
        self._no_sync = False
        self._buckets: GradientBuckets | None = None
        self._reconciler = Reconciler(
            self.config, self._flat, slow=self._slow, world=self._comm, optimizer=self.optim,
            params=self._params, buffers=self._buffers,
            blocked_s=lambda: sum(c.blocked_s for c in self._communicators()),
            on_reconciled=self._check_reconciled if self.config.check_replicas else None,
        )
        names = {id(p): name for name, p in model.named_parameters()}
        self._param_names = [names.get(id(p), f"#{i}") for i, p in enumerate(self._flat_params())]
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
        if fast is not None and self.config.auto:
            raise ConfigError(
                "period='auto' with fast_group: each slow group would choose its own K while "
                "reconciliation steps all-reduce gradients over the whole group; pass a fixed "
                "period, or group= without fast_group"
            )
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

    def _init_torch_optimizer(self, inner: torch.optim.Optimizer) -> None:
        """Run torch's ``Optimizer.__init__``, then take the inner optimizer's objects."""
        # torch's __init__ creates the hook registries and wraps ``step`` (step hooks, global
        # hooks, LR schedulers' step tracking). It insists on one param group: it gets an
        # empty placeholder, which add_param_group accepts only until __init__ has returned.
        self._torch_init_done = False
        super().__init__([{"params": []}], inner.defaults)
        self._torch_init_done = True
        self.optim = inner
        self._alias_inner()
        # The inner's load_state_dict replaces its state and param_groups objects; re-alias
        # so a scheduler on the wrapper keeps driving the inner's lr even after
        # opt.optim.load_state_dict(...). A weak reference: the inner must not keep us alive.
        wrapper = weakref.ref(self)

        def realias(_inner: torch.optim.Optimizer) -> None:
            alive = wrapper()
            if alive is not None and alive.optim is _inner:
                alive._alias_inner()

        inner.register_load_state_dict_post_hook(realias, prepend=True)

    def _alias_inner(self) -> None:
        # Plain attributes bound to the inner's very objects, so an lr written through either
        # is seen by both. Not properties: torch's __init__ assigns these names, and a setter
        # forwarding to the inner would overwrite the inner's with torch's placeholders.
        self.param_groups = self.optim.param_groups
        self.state = self.optim.state
        self.defaults = self.optim.defaults

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
        with self._comm.blocking(SYNC.BROADCAST_INIT):
            self._comm.broadcast_(self._flat.flats, self.config.bucket_cap_bytes)
            if self._buffers():
                sync_buffers(self._comm, self._buffers(), "broadcast", self.config.bucket_cap_bytes)
        if self._keeps_anchor:
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
        self._reconciler.mark(0)

    @property
    def _keeps_anchor(self) -> bool:
        # SlowMo's anchor; for localsgd with period="auto" the controller's reference
        return self.config.uses_slowmo or self.config.auto

    def _buffers(self) -> list[torch.Tensor]:
        # Listed anew each time: a module may re-assign a buffer rather than update it in place.
        return list(self.model.buffers())

    # -- the torch.optim.Optimizer surface ----------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not self._torch_init_done:  # torch's __init__ adding its placeholder group
            return
        raise ConfigError(
            "add_param_group on a PeriodicSyncOptimizer is not supported: add the group to the "
            "inner optimizer before wrapping it"
        )

    def __repr__(self) -> str:
        c = self.config
        return (
            f"PeriodicSyncOptimizer(strategy={c.strategy!r}, period={c.period!r}, "
            f"warmup_steps={c.warmup_steps}, overlap_steps={c.overlap_steps}, "
            f"step={self._step}, inner={self.optim!r})"
        )

    # -- schedule helpers ------------------------------------------------------------------
    @property
    def step_count(self) -> int:
        """Optimizer steps taken so far (n of the last step)."""
        return self._step

    @property
    def period(self) -> int:
        """The current K (with ``period="auto"``, the one decided last)."""
        return self._reconciler.schedule.period

    def next_step_kind(self) -> StepKind:
        return self._reconciler.schedule.kind(self._step + 1)

    def _syncs_gradients(self, n: int) -> bool:
        return self.config.kind_syncs_gradients(self._reconciler.schedule.kind(n))

    def _gradient_target(self) -> Communicator | None:
        """The communicator the coming step's gradients are averaged over (hook time)."""
        if self._syncs_gradients(self._step + 1):
            return self._comm
        return self._fast

    def _arm_next_step(self) -> None:
        """Tell the gradient path whether the coming backward communicates."""
        if self._ddp is not None:
            syncs = self._syncs_gradients(self._step + 1) and not self._no_sync
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
        kind = self._reconciler.schedule.kind(n)
        syncs = self.config.kind_syncs_gradients(kind)
        target = self._gradient_target()
        if self._buckets is not None and target is not None:
            self._buckets.finish(target)
        elif self._ddp is not None and syncs:  # DDP's reducer sent them; count its payload
            self._extra_bytes += self._flat.nbytes
        if syncs:
            self._counts["gradient_syncs"] += 1
        self.optim.step()
        if kind is StepKind.RECONCILE:
            self._counts["reconciliations"] += 1
            if self.config.overlap_steps:
                self._reconciler.launch(n)
            else:
                self._reconciler.reconcile_blocking(n)
        elif kind in (StepKind.DDP, StepKind.WARMUP):
            sync_buffers(self._comm, self._buffers(), self.config.buffers, self.config.bucket_cap_bytes)
            if kind is StepKind.DDP and self.config.check_replicas:  # ddp's replicas are identical after every step
                check_replicas(self._comm, self._named_values(self._flat.flats), when=f"after step {n}")
        else:
            self._counts["local_steps"] += 1
            self._reconciler.apply(n, force=False)  # an overlapped average due at this step
        if self._keeps_anchor and n == self.config.warmup_steps:
            # The periodic phase starts here: SlowMo's anchor is the post-warm-up parameters.
            self._flat.capture_anchor()
            self._reconciler.mark(n)
        self._step = n
        self._arm_next_step()
        return loss

    def flush(self) -> None:
        """Apply a reconciliation still in flight (``overlap_steps >= 1``) now, e.g. at the end
        of training; every rank must call it. Nothing happens when none is in flight."""
        self._reconciler.apply(self._step)

    @torch.no_grad()
    def average_parameters(self) -> None:
        """Average parameters and buffers across the group now (e.g. before evaluation or
        saving one model at the end of training); every rank must call it. No SlowMo update,
        no step counted. A reconciliation in flight is applied first (:meth:`flush`)."""
        self.flush()
        self._flat.ensure_bound()
        with self._comm.blocking(SYNC.PARAM_AVERAGE):
            self._comm.average_(self._flat.flats, self.config.bucket_cap_bytes)
        sync_buffers(self._comm, self._buffers(), self.config.buffers, self.config.bucket_cap_bytes)

    # -- the replica check (check_replicas=True) --------------------------------------------------
    def _flat_params(self) -> list[torch.Tensor]:
        return [p for seg in self._flat.segments for p in seg.params]

    def _named_values(self, values: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """``(name, its slice of values)`` per parameter; ``values`` laid out as the flat segments."""
        out, i = [], 0
        for seg, flat in zip(self._flat.segments, values):
            for p, off in zip(seg.params, seg.offsets):
                out.append((self._param_names[i], flat[off : off + p.numel()].view_as(p)))
                i += 1
        return out

    def _check_reconciled(self, step: int, values: list[torch.Tensor]) -> None:
        check_replicas(self._comm, self._named_values(values), when=f"after the reconciliation of step {step}")

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
            period=self.period,
            in_flight=self._reconciler.in_flight is not None,
            period_decisions=tuple(self._reconciler.decisions),
        )

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The inner optimizer's standard state dict plus key ``"cpdpkit"``.

        ``{"state": ..., "param_groups": ..., "cpdpkit": {"version", "config", "step",
        "counts", "layout", "anchor", "slow_momentum", "schedule", "decisions",
        "in_flight"}}``. A reconciliation in flight is waited for (not applied: it still applies
        at its step) and saved, so a resumed run continues bit-identically. The wrapper's
        state-dict pre-hooks run first and its post-hooks see (and may replace) the whole
        dict, as torch's.

        ``torch.distributed.checkpoint``'s ``get_optimizer_state_dict`` reads the standard
        part (it drops ``"cpdpkit"``); on an optimizer with no state yet it first calls
        ``step()`` with lr 0, which this wrapper counts as a step: call it after training starts.
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        # The inner's own state_dict (not torch's generic one on our aliases): its overrides
        # and its own hooks must shape the standard part.
        state_dict = self.optim.state_dict()
        state_dict["cpdpkit"] = {
            "version": _STATE_VERSION,
            "config": self.config.to_dict(),
            "step": self._step,
            "counts": dict(self._counts),
            "layout": self._flat.layout(),
            **self._flat.slowmo_state(),
            **self._reconciler.state_dict(),
        }
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore a :meth:`state_dict`. Load the model's own state (per rank) as well.

        Load-state-dict pre-hooks get a shallow copy and may return a replacement; post-hooks
        run after both the inner optimizer and the wrapper are restored, as torch's.
        """
        state_dict = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        own, inner_state = self._split_checkpoint(state_dict)
        self.optim.load_state_dict(inner_state)
        self._alias_inner()
        self._flat.ensure_bound()
        self._flat.load_slowmo_state(own)
        if self._keeps_anchor and own.get("anchor") is None:
            self._flat.capture_anchor()
        self._step = int(own["step"])
        self._counts.update(own.get("counts", {}))
        self._reconciler.load_state_dict(own, self._step)
        self._arm_next_step()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _split_checkpoint(self, state_dict: dict[str, Any]) -> tuple[dict, dict]:
        """(the wrapper's own state, the inner's standard dict), after checking they fit."""
        if "cpdpkit" not in state_dict:
            raise ConfigError(
                "state_dict has no 'cpdpkit' key: pass what PeriodicSyncOptimizer.state_dict() "
                "returned (to load the inner optimizer alone, use opt.optim.load_state_dict)"
            )
        own = state_dict["cpdpkit"]
        version = own.get("version")
        if version == 1:  # written before the wrapper used torch's standard layout
            inner_state = state_dict["inner"]
        elif version in (2, _STATE_VERSION):
            inner_state = {k: v for k, v in state_dict.items() if k != "cpdpkit"}
        else:
            raise ConfigError(
                f"checkpoint has cpdpkit state version {version!r}, this cpdpkit reads 1 to "
                f"{_STATE_VERSION}: load it with the cpdpkit version that saved it"
            )
        saved = SyncConfig.from_dict(own["config"])
        if saved.strategy != self.config.strategy:
            raise ConfigError(
                f"checkpoint was saved with strategy {saved.strategy!r}, this optimizer uses "
                f"{self.config.strategy!r}: construct it with strategy={saved.strategy!r}"
            )
        if own.get("in_flight") is not None and not self.config.overlap_steps:
            raise ConfigError(
                f"checkpoint holds a reconciliation in flight (saved with overlap_steps="
                f"{saved.overlap_steps}), this optimizer reconciles blocking: construct it with "
                f"overlap_steps={saved.overlap_steps}"
            )
        if own["layout"] != self._flat.layout():
            raise ConfigError(
                "checkpoint parameter layout differs from this optimizer's: load a checkpoint "
                "saved with the same model and param groups"
            )
        return own, inner_state
