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

**Across sites, sharded inside each** (:mod:`cpdpkit.sync._sharded`): ``model`` may be an FSDP2
module sharded over one site (``fully_shard(..., mesh=mesh["shard"])``) or a
:class:`~cpdpkit.shard.TwoStageExecutor` (or ``PartialShardExecutor``) built on one site's
sub-mesh, with ``group`` the cross-site replicate group; every step synchronises inside the site
as FSDP2 (or the executor) does, and every K steps the reconciliation runs over ``group`` on this
rank's shard only. SlowMo's anchor and momentum are then shard-sized::

    mesh = init_device_mesh("cpu", (num_sites, ranks_per_site), mesh_dim_names=("replicate", "shard"))
    fully_shard(model, mesh=mesh["shard"])          # (and each block first)
    opt = PeriodicSyncOptimizer(torch.optim.AdamW(model.parameters()), model=model,
                                group=mesh["replicate"].get_group(), strategy="cpdp", period=4)

The wrapper is a complete ``torch.optim.Optimizer``: torch's ``__init__`` runs (step pre/post
hooks, global step hooks, state-dict hooks, LR schedulers' step tracking), and
``param_groups``, ``state`` and ``defaults`` are the inner optimizer's own objects. Its state
dict is torch's standard one (the inner optimizer's ``{"state", "param_groups"}``) plus one key,
``"cpdpkit"``, holding the wrapper's own state.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from cpdpkit.errors import ConfigError
from cpdpkit.labels import SYNC
from cpdpkit.sync._comm import Communicator
from cpdpkit.sync._flat import FlatParameters, SegmentedParameters
from cpdpkit.sync._fragments import fragments_of
from cpdpkit.sync._grad_buckets import GradientBuckets
from cpdpkit.sync._parts import Part, Parts, named_values
from cpdpkit.sync._reconcile import STATS_SLOTS, Reconciler
from cpdpkit.sync._replicas import check_replicas
from cpdpkit.sync._sharded import ShardedParameters, ShardGradientSync, as_param_layout, is_sharded
from cpdpkit.sync._state_policies import sync_buffers
from cpdpkit.sync._validate import (
    STATE_VERSION,
    check_clip_args,
    check_params_in_model,
    is_executor,
    resolve_config,
    split_checkpoint,
    validate_executor,
    validate_groups,
    validate_objects,
    validate_sharded,
)
from cpdpkit.sync.config import StepKind, SyncConfig
from cpdpkit.sync.stats import SyncStats
from cpdpkit.topology import Topology

__all__ = ["PeriodicSyncOptimizer"]


class PeriodicSyncOptimizer(torch.optim.Optimizer):
    """Wraps any ``torch.optim`` optimizer to communicate every ``period`` steps.

    Args:
        optimizer: the inner optimizer (any ``torch.optim.Optimizer`` with all its param
            groups added; LR schedulers attach to it or to this wrapper).
        model: the module whose parameters the optimizer trains: a plain ``nn.Module``, a
            ``DistributedDataParallel``, an FSDP2 module sharded inside one replica (a site), or a
            ``TwoStageExecutor`` or ``PartialShardExecutor`` on one site's sub-mesh (then ``optimizer``
            is ``executor.optimizer`` and the loop calls this wrapper's ``zero_grad``/``step``, not the executor's).
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
        topology: optional :class:`~cpdpkit.topology.Topology` (placed): with a sharded model or an
            executor, a shard group spanning sites or a replicate group holding two ranks of one site
            is refused before the first collective.

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
        topology: Topology | None = None,
        **options: Any,
    ) -> None:
        # Validation happens before any collective: a user mistake must not hang a peer.
        self.config = resolve_config(config, options)
        self._executor = model if is_executor(model) else None
        if isinstance(optimizer, torch.optim.Optimizer) and not any(g["params"] for g in optimizer.param_groups):
            raise ConfigError(f"the {type(optimizer).__name__} optimizer holds no parameters: there is nothing to "
                              f"synchronise; pass one built from the model, e.g. {type(optimizer).__name__}"
                              "(model.parameters(), ...)")
        validate_objects(optimizer, model, anchor_dtype, wrapper=PeriodicSyncOptimizer)
        validate_groups(self.config, model, group, fast_group, slow_group)
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self._sharded = is_sharded(self._params)
        if self._sharded:
            validate_sharded(self.config, model, self._params, group, fast_group, topology)
        if self._executor is not None:
            validate_executor(self.config, self._executor, optimizer, group, fast_group, topology)
        else:  # an executor's own optimizer (checked) holds exactly its slices
            check_params_in_model(optimizer, model)
        self._init_torch_optimizer(optimizer)
        self.model = model
        self._module: nn.Module = model.model if self._executor is not None else model
        self._ddp = model if isinstance(model, DistributedDataParallel) else None
        layout = ShardedParameters if self._sharded else FlatParameters
        self._flat = layout(optimizer.param_groups, anchor_dtype=anchor_dtype,
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
        self.config = self.config.resolved(self._slow.size)  # β None: the measured default for these replicas
        self._step = 0
        self._counts = {"local_steps": 0, "reconciliations": 0, "gradient_syncs": 0}
        self._extra_bytes = 0
        self._no_sync = False
        self._grads_finished = False  # finish_gradients() ran for the coming step: step() does not finish again
        self._shard_grads: ShardGradientSync | None = None
        # the whole layout, or its fragments (a plain module's only: refused here, before any collective)
        wrapped = ("a DDP-wrapped" if self._ddp is not None else "an FSDP2" if self._sharded
                   else "an executor's" if self._executor is not None else None)
        self._parts = Parts.build(
            self.config, fragments_of(self._flat, self.config.fragments, wrapped=wrapped), buffers=self._buffers,
            check=self._check_reconciled if self.config.check_replicas else None, slow=self._slow, world=self._comm,
            optimizer=self.optim, params=self._params,
            blocked_s=lambda: sum(c.blocked_s for c in self._communicators()))
        names = {id(p): name for name, p in self._module.named_parameters()}
        self._param_names = {id(p): names.get(id(p), f"#{i}") for i, p in enumerate(self._flat_params())}
        self._after_ran = False
        if self._executor is not None:  # last: its refusals come before any change to the executor
            self._executor.attach_periodic_sync(self)
        self._start()

    # -- construction ----------------------------------------------------------------------
    @property
    def _reconciler(self) -> Reconciler:
        """Fragment 0's (the whole model's without fragments): the schedule the step kinds follow."""
        return self._parts[0].reconciler

    @property
    def _buckets(self) -> GradientBuckets | None:
        return self._parts[0].buckets

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
            values = self._flat.pack()
            self._comm.broadcast_(values, self.config.bucket_cap_bytes)
            self._flat.unpack(values)
            if self._buffers():
                sync_buffers(self._comm, self._buffers(), "broadcast", self.config.bucket_cap_bytes)
        if self._keeps_anchor:
            for part in self._parts:
                part.flat.capture_anchor(momentum=self._slow_momentum)
        for comm in self._communicators():
            comm.reset_counters()  # stats count from the first step, not construction
        if self._executor is not None:
            self._executor.publish_slices()  # the broadcast slices into every rank's model
            # its slice gradients, handed over by the executor (reduce_gradient), in DDP-style buckets
            self._parts[0].buckets = self._gradient_buckets(self._parts[0], self._params, hooks=False)
        elif self._sharded:
            self._shard_grads = ShardGradientSync(self.model, target=self._gradient_target,
                                                  compression=self._grad_compression,
                                                  compressed=lambda: self._compresses_gradients(self._parts[0]),
                                                  replicas=self._comm.size)
            if self._grad_compression != "none":
                self._parts[0].grad_feedback = self._shard_grads
        elif self._ddp is None:
            for part in self._parts:  # per fragment: a synchronous step all-reduces its fragment's gradients
                pieces = part.gradient_pieces()
                if pieces is not None:
                    part.buckets = self._gradient_buckets(part, pieces[0], ranges=pieces[1])
                    continue
                trained = {id(q) for q in self._params}
                part.buckets = self._gradient_buckets(part, [p for p in self.model.parameters() if id(p) in trained])
        for part in self._parts:
            if part.buckets is not None:
                part.grad_feedback = part.buckets.feedback
        if self.config.warmup_steps == 0:
            self._parts.begin_periodic_phase()
        self._arm_next_step()
        for part in self._parts:
            part.reconciler.mark(0)

    def _gradient_buckets(self, part: Part, params: list[torch.Tensor], *, hooks: bool = True,
                          ranges: list[tuple[int, int]] | None = None) -> GradientBuckets:
        return GradientBuckets(params, bucket_cap_bytes=self.config.bucket_cap_bytes, hooks=hooks, ranges=ranges,
                               target=lambda: self._gradient_target(part), compression=self._grad_compression,
                               compressed=lambda: self._compresses_gradients(part))

    @property
    def _keeps_anchor(self) -> bool:
        # SlowMo's anchor; for localsgd with period="auto" the controller's reference
        return self.config.uses_slowmo or self.config.auto or self.config.compression != "none"

    @property
    def _slow_momentum(self) -> bool:
        # SlowMo's momentum buffer: only for SlowMo's own outer step (another outer optimizer keeps its own state)
        return self.config.uses_slowmo and self.config.outer_optimizer == "slowmo"

    def _buffers(self) -> list[torch.Tensor]:
        # Listed anew each time: a module may re-assign a buffer rather than update it in place.
        return list(self._module.buffers())

    # -- the torch.optim.Optimizer surface ----------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._executor is not None:  # the model's gradients and any reduced slices too
            self._executor.zero_grad()
            return
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

    def _gradient_target(self, part: Part | None = None) -> Communicator | None:
        """The communicator the coming step's (``part``'s) gradients are averaged over (hook time)."""
        if self._parts.syncs_gradients(self._step + 1, part):
            return self._comm
        return self._fast

    @property
    def _grad_compression(self) -> str:
        # only cpdp's periodic phase all-reduces gradients across the slow group
        return self.config.compression if self.config.strategy == "cpdp" else "none"

    def _compresses_gradients(self, part: Part) -> bool:
        return self._parts.compresses_gradients(self._step + 1, part)

    def _arm_next_step(self) -> None:
        """Tell the gradient path whether the coming backward communicates."""
        if self._ddp is not None:
            syncs = self._parts.syncs_gradients(self._step + 1) and not self._no_sync
            self._ddp.require_backward_grad_sync = syncs
        for part in self._parts:
            if part.buckets is not None:
                part.buckets.enabled = not self._no_sync
        if self._sharded:  # FSDP2's switch: no reduce-scatter (and so no hook) inside no_sync()
            self.model.set_requires_gradient_sync(not self._no_sync)
        if self._executor is not None:
            self._executor.set_requires_gradient_sync(not self._no_sync)

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
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        n = self._step + 1
        kind = self._reconciler.schedule.kind(n)
        syncs = any(self._parts.syncs_gradients(n, part) for part in self._parts)
        self._finish_gradients()  # nothing when finish_gradients() (or clip_grad_norm_) already did
        self._grads_finished = False
        if self._ddp is not None and syncs:  # DDP's reducer sent them; count its payload
            self._extra_bytes += self._flat.nbytes
        if syncs:
            self._counts["gradient_syncs"] += 1
        if self._executor is not None:
            self._after_ran = False
            self._executor.step()  # calls after_updates() itself when defers_exchange() said so
            if not self._after_ran:
                self._after_inner_step(n, kind)
        else:
            self.optim.step()
            self._after_inner_step(n, kind)
        self._step = n
        self._arm_next_step()
        return loss

    def _finish_gradients(self) -> None:
        """Wait for the coming step's gradient exchange and write the means into ``.grad`` (once per step)."""
        if self._grads_finished:
            return
        if self._buckets is not None:
            for part in self._parts:
                target = self._gradient_target(part)
                if target is not None:  # an executor's: the means land in its own gradient tensors
                    part.buckets.finish(target)  # type: ignore[union-attr]
        elif self._shard_grads is not None:
            self._shard_grads.finish()
        self._grads_finished = True

    def finish_gradients(self) -> None:
        """Make ``.grad`` what the coming ``step()`` uses, now: on a step that averages gradients, wait for the
        exchange launched under backward and write the means (what DDP's backward leaves); on a local step
        nothing happens. ``step()`` then does not wait or average again. Call it after the last backward of
        the step, on every rank when the step averages gradients (it is the wait of that collective)."""
        self._refuse_outside_step("finish_gradients")
        self._finish_gradients()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` on the gradients the coming ``step()`` uses, as DDP + clipping.

        First :meth:`finish_gradients` (so on a gradient-sync step the norm is that of the averaged gradients,
        the same on every rank; on a local step, of this rank's), then torch's clipping of the optimizer's
        parameters. Returns the total norm, as torch does; over FSDP2 (DTensor shards) the norm spans the
        shard group and is returned as a plain tensor, as FSDP1's ``clip_grad_norm_``. Call it between the
        last backward and ``step()``, on every rank (over FSDP2 the norm is a collective on every step).
        Calling torch's ``clip_grad_norm_`` directly there instead clips the *local* gradients on a step
        that averages them: the exchange is still in flight until ``step()``."""
        check_clip_args(max_norm, norm_type)
        self._refuse_outside_step("clip_grad_norm_")
        self._finish_gradients()
        norm = torch.nn.utils.clip_grad_norm_(self._params, max_norm, norm_type=norm_type)
        full = getattr(norm, "full_tensor", None)  # a DTensor over FSDP2: the replicated norm as a plain tensor
        return full() if full is not None else norm

    def _refuse_outside_step(self, what: str) -> None:
        if self._executor is not None:
            raise ConfigError(f"{what}() over a {type(self._executor).__name__} is not supported: its slice "
                              "gradients are averaged inside its step(); clip with the plain path or FSDP2")
        if self._no_sync:
            raise ConfigError(f"{what}() inside opt.no_sync(): call it after the last backward of the step, "
                              "outside the no_sync() block")

    def _after_inner_step(self, n: int, kind: StepKind) -> None:
        """What step ``n`` does after the inner update: reconcile, apply an average in flight, buffers."""
        if kind in (StepKind.DDP, StepKind.WARMUP):
            sync_buffers(self._comm, self._buffers(), self.config.buffers, self.config.bucket_cap_bytes)
            if kind is StepKind.DDP and self.config.check_replicas:  # ddp's replicas are identical after every step
                check_replicas(self._comm, self._named_values(self._flat.pack()), when=f"after step {n}")
        else:
            if all(part.reconciler.schedule.kind(n) is StepKind.LOCAL for part in self._parts):
                self._counts["local_steps"] += 1
            for part in self._parts:  # with fragments, one reconciliation each (staggered)
                if self._parts.averages_after(n, part):
                    self._counts["reconciliations"] += 1
                    if self.config.overlap_steps:
                        part.reconciler.launch(n)
                    else:
                        part.reconciler.reconcile_blocking(n)
                else:
                    part.reconciler.apply(n, force=False)  # an overlapped average due at this step
        if self._keeps_anchor and n == self.config.warmup_steps:
            # The periodic phase starts here: SlowMo's anchor is the post-warm-up parameters.
            for part in self._parts:
                part.flat.capture_anchor(momentum=self._slow_momentum)
                part.reconciler.mark(n)
        if n == self.config.warmup_steps > 0:
            self._parts.begin_periodic_phase()

    # -- over a slice executor (TwoStageExecutor): the hooks it calls ----------------------------------
    def defers_exchange(self) -> bool:
        """Whether the coming step averages the executor's slice gradients across replicas or changes its
        slices after their update (a reconciliation, or an overlapped average due): then the executor
        updates in :meth:`step`, after the gradients arrived, and exchanges only after :meth:`after_updates`."""
        n = self._step + 1
        if self._parts.averages_after(n) or self.gradient_sync_due():
            return True
        flight = self._reconciler.in_flight
        return flight is not None and n >= flight.apply_step

    def after_updates(self) -> None:
        """The executor's slices are updated and not yet exchanged: run this step's periodic work."""
        n = self._step + 1
        self._after_inner_step(n, self._reconciler.schedule.kind(n))
        self._after_ran = True

    def gradient_sync_due(self) -> bool:
        """Whether the coming backward's gradients are averaged across replicas."""
        return self._gradient_target() is not None and not self._no_sync

    def reduce_gradient(self, slice_param: torch.Tensor, grad: torch.Tensor) -> None:
        """An executor's slice gradient, reduced inside its mesh: on a gradient-sync step it joins its bucket
        (launched across replicas once full, the rest in :meth:`step`) and is averaged there in place."""
        if self.gradient_sync_due():
            slice_param.grad = grad  # the bucket writes the mean back into this very tensor
            self._buckets.mark_ready(slice_param)

    def flush(self) -> None:
        """Apply a reconciliation still in flight (``overlap_steps >= 1``) now, e.g. at the end
        of training; every rank must call it. Nothing happens when none is in flight."""
        applied = self._parts.in_flight
        for part in self._parts:
            part.reconciler.apply(self._step)
        if applied and self._executor is not None:
            self._executor.publish_slices()

    @torch.no_grad()
    def average_parameters(self) -> None:
        """Average parameters and buffers across the group now (e.g. before evaluation or
        saving one model at the end of training); every rank must call it. No SlowMo update,
        no step counted. A reconciliation in flight is applied first (:meth:`flush`)."""
        self.flush()
        self._flat.ensure_bound()
        with self._comm.blocking(SYNC.PARAM_AVERAGE):
            values = self._flat.pack()
            self._comm.average_(values, self.config.bucket_cap_bytes)
            self._flat.unpack(values)
        if self._executor is not None:
            self._executor.publish_slices()
        sync_buffers(self._comm, self._buffers(), self.config.buffers, self.config.bucket_cap_bytes)

    # -- the replica check (check_replicas=True) --------------------------------------------------
    def _flat_params(self) -> list[torch.Tensor]:
        return [p for seg in self._flat.segments for p in seg.params]

    def _named_values(self, values: list[torch.Tensor],
                      flat: SegmentedParameters | None = None) -> list[tuple[str, torch.Tensor]]:
        """``(name, its slice of values)`` per parameter; ``values`` laid out as ``flat``'s segments (default: all)."""
        return named_values(flat or self._flat, values, self._param_names)

    def _check_reconciled(self, flat: SegmentedParameters, step: int, values: list[torch.Tensor]) -> None:
        check_replicas(self._comm, self._named_values(values, flat), when=f"after the reconciliation of step {step}")

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
            in_flight=self._parts.in_flight,
            period_decisions=tuple(self._reconciler.decisions),
        )

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's standard state dict plus key ``"cpdpkit"``.

        ``{"state": ..., "param_groups": ..., "cpdpkit": {"version", "config", "step",
        "counts", "layout", "anchor", "slow_momentum", "schedule", "decisions",
        "in_flight", "residuals", "grad_residuals", "fragments"}}`` (with ``fragments`` > 1, each fragment's
        anchor ... grad_residuals in ``"fragments"``). A reconciliation in flight is waited for (not applied: it
        still applies at its step) and saved, so a resumed run continues bit-identically. The wrapper's
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
        if self._executor is not None:
            state_dict = self._executor.state_dict(include_model=False)
        else:
            state_dict = self.optim.state_dict()
        state_dict["cpdpkit"] = {
            "version": STATE_VERSION,
            "config": self.config.to_dict(),
            "step": self._step,
            "counts": dict(self._counts),
            "layout": self._flat.layout(),
            # without fragments the one reconciler's state at the top level; with them, each fragment's
            **self._parts.state_dict(self._flat),
        }
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`. Load the model's own state (per rank) as well.

        Load-state-dict pre-hooks get a shallow copy and may return a replacement; post-hooks
        run after both the inner optimizer and the wrapper are restored, as torch's.
        """
        state_dict = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        own, inner_state = split_checkpoint(state_dict, self.config, self._flat.layout())
        if self._sharded:  # state saved as local shards (cpdpkit's Checkpointer) back to DTensors
            inner_state = as_param_layout(inner_state, self._params)
        if self._executor is not None:  # its optimizer state, then its slices from the (restored) model
            self._executor.load_state_dict(inner_state)
        else:
            self.optim.load_state_dict(inner_state)
        self._alias_inner()
        self._flat.ensure_bound()
        self._step = int(own["step"])
        self._counts.update(own.get("counts", {}))
        anchor = self._slow_momentum if self._keeps_anchor else None  # None: no anchor to capture
        self._parts.load_state_dict(own, self._step, self._flat, capture=anchor)
        self._arm_next_step()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
