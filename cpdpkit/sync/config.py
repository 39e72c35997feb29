"""Configuration of :class:`~cpdpkit.sync.PeriodicSyncOptimizer` and its step schedule.

The schedule is pure arithmetic on the step counter ``n`` (optimizer steps, counted from 1):

* ``ddp``: every step all-reduces gradients.
* other strategies: steps ``n <= warmup_steps`` all-reduce gradients (warm-up, as DDP);
  afterwards step ``n`` is a *reconciliation* when ``(n - warmup_steps) % period == 0`` and a
  *local step* (no communication across the slow group) otherwise.
* ``period="auto"``: the gaps between reconciliations are chosen at run time by the rule in
  :mod:`cpdpkit.sync.period_control` (from ``k_min``, within ``[k_min, k_max]``); the schedule
  then lives in the optimizer (``opt.next_step_kind()``), not here.

``overlap_steps`` (τ) does not change which steps reconcile, only when a reconciliation's result
is applied: τ steps after its launch, or at the next reconciliation if that comes first.

``cpdp``'s reconciliation, ``cpdp_order="average-then-step"`` (the default): the reconciliation
step ``n`` (``(n - W) % K == 0``) is a *synchronous step*. At the end of step ``n - 1`` the replicas
are averaged and SlowMo's outer update applied, so step ``n``'s forward and backward run at the
consensus point; its gradients are all-reduced (under backward, in buckets) and the inner step takes
the mean gradient. With plain SGD the replicas leave step ``n`` identical; with optimizer state
(momentum, Adam's moments) they differ only by what their states differ by. The all-reduce now
changes the parameters: ``cpdp`` is not ``slowmo``.

* warm-up: steps ``n <= W`` all-reduce gradients as DDP; the replicas are identical at the end of
  step ``W`` (or after the initial broadcast when ``W = 0``), which is the consensus of the first
  synchronous step if that is ``W + 1``: no average runs at the end of step ``W``. The first period
  therefore holds ``K - 1`` local steps, every later one ``K`` steps (one synchronous, ``K - 1``
  local) from one outer update to the next.
* ``K = 1``: every step is synchronous and is followed by an average and outer update (on
  identical replicas with plain SGD: SGD with SlowMo's outer momentum).
* ``overlap_steps`` τ >= 1: the average launched at the end of step ``n - 1`` is applied at the end
  of step ``a = min(n - 1 + τ, next launch)`` (``x ← x̃ + (x − x_launch)``), and the synchronous step
  is ``a + 1``: it follows the late average, not the schedule's ``n``.
* ``period="auto"``: the controller decides at each average (the numbers ride in it), and the gap
  to the next synchronous step is the K decided, as for the other order.

``cpdp_order="step-then-average"`` keeps the order before this option: the reconciliation step
all-reduces gradients, takes its inner step, then averages (with plain SGD it equals ``slowmo``).
"""

from __future__ import annotations

import dataclasses
import enum
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cpdpkit._values import is_int, refuse_nonfinite
from cpdpkit.errors import ConfigError
from cpdpkit.sync._codec import parse_compression

__all__ = [
    "STRATEGIES",
    "BUFFER_POLICIES",
    "STATE_POLICIES",
    "CPDP_ORDERS",
    "OUTER_OPTIMIZERS",
    "SLOWMO_BETAS",
    "is_torch_optimizer_name",
    "slowmo_beta_for",
    "StepKind",
    "SyncConfig",
]

STRATEGIES = ("ddp", "localsgd", "slowmo", "cpdp")
BUFFER_POLICIES = ("average", "broadcast", "local")
STATE_POLICIES = ("keep", "average", "reset")
CPDP_ORDERS = ("average-then-step", "step-then-average")
OUTER_OPTIMIZERS = ("slowmo", "diloco")  # named outer steps; any torch.optim class name too

# SlowMo's β when ``slowmo_momentum`` is None (the default), by the number of replicas averaged: one row
# (least replicas, β) per measured regime (docs/results.md, "Issue 23, 2026-12-03": β x K at 2, 4 and 8
# replicas on stdlib-text and MNIST-1D, K = 2, 4, 8, inner SGD momentum 0.9). β = 0 was the best or within a
# seed's noise of it at every point; 0.5 (SlowMo's paper, fairscale's 8-node value at K = 48) lost 0.7-3.5 pp
# or collapsed. 16+ replicas were not measured.
SLOWMO_BETAS: tuple[tuple[int, float], ...] = ((1, 0.0),)


def slowmo_beta_for(replicas: int) -> float:
    """SlowMo's default β for ``replicas`` replicas (:data:`SLOWMO_BETAS`: the last row whose least count fits)."""
    return [beta for least, beta in SLOWMO_BETAS if is_int(replicas) and replicas >= least][-1]


def is_torch_optimizer_name(name: str) -> bool:
    """Whether ``name`` is a ``torch.optim.Optimizer`` subclass in ``torch.optim`` (imported only then:
    this module stays torch-free for the named ones)."""
    if not name.isidentifier() or name.startswith("_"):
        return False
    import torch.optim

    cls = getattr(torch.optim, name, None)
    return isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer


class StepKind(enum.StrEnum):
    """What one optimizer step does to communicate."""

    DDP = "ddp"  # gradient all-reduce every step (strategy "ddp")
    WARMUP = "warmup"  # n <= warmup_steps: gradient all-reduce, like DDP
    LOCAL = "local"  # no communication across the group
    RECONCILE = "reconcile"  # the communicating step of a period


def _choice(field: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(
            f"unknown {field} {value!r}: choose one of {', '.join(choices)}"
        )


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """Everything that decides when and how :class:`PeriodicSyncOptimizer` communicates.

    ``period`` is K (steps between reconciliations); ``warmup_steps`` is W;
    ``slowmo_momentum`` is β and ``slowmo_lr`` is α of SlowMo. β ``None`` (the default) is the measured
    default for the number of replicas averaged (:func:`slowmo_beta_for`: 0 at 2 to 8), resolved by
    ``PeriodicSyncOptimizer`` at construction (:meth:`resolved`), so ``opt.config`` and its checkpoints hold
    the number; an explicit β is used as given. ``bucket_cap_mb`` bounds one
    all-reduce's payload, as DDP's argument of the same name. ``timeout_s`` bounds every
    wait on a collective (``None``: the process group's own timeout).

    ``overlap_steps`` is τ: 0 reconciles blocking (the parameters are averaged inside the
    reconciliation's ``step()``); τ >= 1 launches the average asynchronously and applies it τ
    steps later, keeping the local progress made meanwhile (:mod:`cpdpkit.sync.optimizer`).
    ``period="auto"`` lets a controller choose K in ``[k_min, k_max]`` so that exposed sync
    time stays near ``target_exposed_frac`` of the step time, and, when ``max_divergence`` is
    set, the replicas' relative divergence ‖x_i − x̄‖/‖x̄‖ below it
    (:mod:`cpdpkit.sync.period_control`).

    ``cpdp_order`` is where ``cpdp``'s gradient all-reduce sits in its reconciliation (module
    docstring): ``"average-then-step"`` (average, then one synchronous step from the consensus) or
    ``"step-then-average"`` (the synchronous step, then the average; equal to ``slowmo`` with plain
    SGD). Other strategies ignore it.

    ``outer_optimizer`` is the outer step of ``slowmo`` and ``cpdp`` on the pseudo-gradient ``anchor −
    average`` (:mod:`cpdpkit.sync._outer`): ``"slowmo"`` (β = ``slowmo_momentum``, α = ``slowmo_lr``),
    ``"diloco"`` (Nesterov SGD, lr 0.7, momentum 0.9) or a ``torch.optim`` class name, with
    ``outer_lr`` and ``outer_momentum`` (None: the named one's, or lr 1.0 and the class's default).

    ``compression`` (``"none"``, ``"bf16"``, ``"int8"``, ``"topk:F"``) encodes each reconciliation's
    pseudo-gradient ``anchor − parameters`` with error feedback and exchanges the codes in one all-gather
    (:mod:`cpdpkit.sync._codec`), blocking or overlapped; a fixed period only, not ``ddp``.

    ``fragments`` (F) streams the reconciliation (:mod:`cpdpkit.sync._fragments`): the parameters in F
    fragments of about equal bytes, each reconciled every K steps with its own anchor, outer state and
    residuals, their reconciliations staggered by about K/F steps, so a step sends about 1/F of a
    reconciliation (with ``overlap_steps``, each fragment's exchange overlaps the following local steps);
    for ``cpdp`` the synchronous step after a fragment's average all-reduces that fragment's gradients only.

    ``check_replicas`` verifies with one checksum all-reduce that every replica holds identical
    parameters: after each reconciliation (with ``overlap_steps``: the reconciled value when it is
    applied, since the applied parameters keep each rank's local progress), and for ``ddp``, whose
    replicas must be identical after every step, after every step. A difference raises one line
    naming the first differing parameter and the ranks (:mod:`cpdpkit.sync._replicas`).

    These declarations are the only defaults: ``PeriodicSyncOptimizer`` takes either
    ``config=SyncConfig(...)`` or these fields as keyword options, never both.
    """

    strategy: str = "cpdp"
    period: int | str | None = None  # None: 1 for ddp (it has no period), else 4
    warmup_steps: int = 0
    slowmo_momentum: float | None = None  # None: slowmo_beta_for(replicas), at construction (resolved)
    slowmo_lr: float = 1.0
    buffers: str = "average"
    optimizer_state: str = "keep"
    bucket_cap_mb: float = 25.0
    timeout_s: float | None = None
    overlap_steps: int = 0
    target_exposed_frac: float = 0.05
    k_min: int = 1
    k_max: int = 8
    max_divergence: float | None = None
    check_replicas: bool = False
    cpdp_order: str = "average-then-step"
    outer_optimizer: str = "slowmo"
    outer_lr: float | None = None
    outer_momentum: float | None = None
    compression: str = "none"
    fragments: int = 1

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (list, tuple, set)):
                raise ConfigError(
                    f"{f.name} takes one value, got {value!r}: construct one optimizer per value (cpdpkit bench "
                    "sweeps --periods, --slowmo-momentum and --outer-lr)"
                )
        refuse_nonfinite(self, ConfigError)
        _choice("strategy", self.strategy, STRATEGIES)
        _choice("cpdp_order", self.cpdp_order, CPDP_ORDERS)
        if self.strategy == "ddp" and self.period not in (None, 1):
            raise ConfigError(f"period = {self.period!r} with strategy 'ddp': ddp all-reduces gradients every step "
                              "and has no period; leave period unset (or 1), or use strategy 'cpdp' for K steps")
        if self.period is None:
            object.__setattr__(self, "period", 1 if self.strategy == "ddp" else 4)
        _choice("buffers", self.buffers, BUFFER_POLICIES)
        _choice("optimizer_state", self.optimizer_state, STATE_POLICIES)
        if self.period != "auto" and (not is_int(self.period) or self.period < 1):
            raise ConfigError(
                f"period must be an integer >= 1 or 'auto', got {self.period!r}: "
                "pass period=1 to reconcile every step, a larger K, or 'auto'"
            )
        self._check_overlap_and_auto()
        self._check_outer()
        self._check_compression()
        self._check_fragments()
        if not is_int(self.warmup_steps) or self.warmup_steps < 0:
            raise ConfigError(
                f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}: "
                "pass 0 for no warm-up"
            )
        if self.slowmo_momentum is not None and (isinstance(self.slowmo_momentum, bool)
                                                 or not 0.0 <= float(self.slowmo_momentum) < 1.0):
            raise ConfigError(
                f"slowmo_momentum must be in [0, 1) or None, got {self.slowmo_momentum!r}: "
                "pass None for the measured default by replicas (slowmo_beta_for), or e.g. 0.2"
            )
        if not float(self.slowmo_lr) > 0.0:
            raise ConfigError(
                f"slowmo_lr must be > 0, got {self.slowmo_lr!r}: pass 1.0 for SlowMo's default α"
            )
        if not float(self.bucket_cap_mb) > 0.0:
            raise ConfigError(
                f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb!r}: DDP's default is 25"
            )
        if not isinstance(self.check_replicas, bool):
            raise ConfigError(
                f"check_replicas must be True or False, got {self.check_replicas!r}: pass check_replicas=True "
                "to verify identical replicas after each reconciliation"
            )
        if self.timeout_s is not None and not float(self.timeout_s) > 0.0:
            raise ConfigError(
                f"timeout_s must be > 0 or None, got {self.timeout_s!r}: "
                "pass None to use the process group's timeout"
            )

    def _check_outer(self) -> None:
        name = self.outer_optimizer
        if not isinstance(name, str) or (name not in OUTER_OPTIMIZERS and not is_torch_optimizer_name(name)):
            raise ConfigError(
                f"outer_optimizer {name!r} is not a torch optimizer: pass 'slowmo', 'diloco' or the name of a "
                "torch.optim.Optimizer class, e.g. 'SGD' or 'Adam'"
            )
        if name != "slowmo" and self.strategy not in ("slowmo", "cpdp"):
            raise ConfigError(
                f"outer_optimizer={name!r} with strategy {self.strategy!r}: only slowmo and cpdp take an outer "
                "step; use one of them, or leave outer_optimizer='slowmo'"
            )
        if name == "slowmo" and (self.outer_lr is not None or self.outer_momentum is not None):
            raise ConfigError(
                "outer_lr/outer_momentum with outer_optimizer='slowmo': SlowMo's are slowmo_lr and "
                "slowmo_momentum; pass those, or another outer_optimizer"
            )
        if self.outer_lr is not None and not (not isinstance(self.outer_lr, bool) and float(self.outer_lr) > 0.0):
            raise ConfigError(f"outer_lr must be > 0 or None, got {self.outer_lr!r}: DiLoCo's is 0.7")
        if self.outer_momentum is not None and not 0.0 <= float(self.outer_momentum) < 1.0:
            raise ConfigError(f"outer_momentum must be in [0, 1) or None, got {self.outer_momentum!r}: "
                              "DiLoCo's is 0.9")

    def _check_compression(self) -> None:
        parse_compression(self.compression)
        if self.compression == "none":
            return
        if self.strategy == "ddp":
            raise ConfigError(f"compression={self.compression!r} with strategy 'ddp': ddp all-reduces fp32 "
                              "gradients and has no reconciliation to compress; use strategy 'localsgd', "
                              "'slowmo' or 'cpdp', or compression='none'")
        if self.auto:
            raise ConfigError(f"compression={self.compression!r} with period='auto': the controller's numbers "
                              "ride in an uncompressed average; pass a fixed period or compression='none'")

    def _check_fragments(self) -> None:
        if not is_int(self.fragments) or self.fragments < 1:
            raise ConfigError(f"fragments must be an integer >= 1, got {self.fragments!r}: pass 1 to reconcile the "
                              "whole model at once, or e.g. 4 to stream it in 4 fragments")
        if self.fragments == 1:
            return
        for bad, why, fix in (
            (self.strategy == "ddp", "strategy 'ddp' never reconciles", "use strategy 'localsgd', 'slowmo' or 'cpdp'"),
            (self.auto, "period='auto' decides one K for the whole model", "pass a fixed period"),
            (self.strategy == "cpdp" and self.cpdp_order != "average-then-step",
             "cpdp_order='step-then-average' all-reduces every gradient at each reconciliation",
             "use cpdp_order='average-then-step'"),
            (self.optimizer_state != "keep", f"optimizer_state={self.optimizer_state!r} acts on the whole "
             "optimizer at each reconciliation", "use optimizer_state='keep'"),
        ):
            if bad:
                raise ConfigError(f"fragments={self.fragments} with {why}: {fix}, or fragments=1")

    def _check_overlap_and_auto(self) -> None:
        if not is_int(self.overlap_steps) or self.overlap_steps < 0:
            raise ConfigError(
                f"overlap_steps must be an integer >= 0, got {self.overlap_steps!r}: pass 0 to "
                "reconcile blocking, or e.g. 2 to apply each average two steps after its launch"
            )
        if self.overlap_steps and self.strategy == "ddp":
            raise ConfigError(
                f"overlap_steps={self.overlap_steps} with strategy 'ddp': ddp never reconciles; "
                "use strategy 'localsgd', 'slowmo' or 'cpdp', or overlap_steps=0"
            )
        if self.overlap_steps and self.optimizer_state == "average":
            raise ConfigError(
                f"overlap_steps={self.overlap_steps} with optimizer_state='average': an averaged "
                "optimizer state cannot be applied late (it would erase the local steps' state, "
                "and Adam's second moments have no additive correction); use "
                "optimizer_state='keep' or overlap_steps=0"
            )
        if not 0.0 < float(self.target_exposed_frac) < 1.0:
            raise ConfigError(
                f"target_exposed_frac must be in (0, 1), got {self.target_exposed_frac!r}: e.g. "
                "0.1 for at most 10 % of the step time exposed"
            )
        for name in ("k_min", "k_max"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}: e.g. {name}=1")
        if self.k_min > self.k_max:
            raise ConfigError(
                f"k_min={self.k_min} is above k_max={self.k_max}: pass k_min <= k_max, e.g. "
                "k_min=1, k_max=8"
            )
        if self.max_divergence is not None and not float(self.max_divergence) > 0.0:
            raise ConfigError(
                f"max_divergence must be > 0 or None, got {self.max_divergence!r}: e.g. 0.01, or "
                "None to let only the exposed-time target choose K"
            )

    def resolved(self, replicas: int) -> SyncConfig:
        """This config with β decided: :func:`slowmo_beta_for` ``replicas`` when ``slowmo_momentum`` is None."""
        if self.slowmo_momentum is not None:
            return self
        return dataclasses.replace(self, slowmo_momentum=slowmo_beta_for(replicas))

    # -- schedule ---------------------------------------------------------------------
    @property
    def auto(self) -> bool:
        """Whether K is chosen at run time (``period="auto"``)."""
        return self.period == "auto"

    def step_kind(self, n: int) -> StepKind:
        """The kind of step ``n`` (counted from 1) with a fixed period."""
        assert n >= 1, n
        if self.strategy == "ddp":
            return StepKind.DDP
        if n <= self.warmup_steps:
            return StepKind.WARMUP
        if self.auto:
            raise ConfigError(
                "period='auto' chooses its reconciliation steps at run time: ask the optimizer "
                "(opt.next_step_kind()), not its config"
            )
        if (n - self.warmup_steps) % self.period == 0:
            return StepKind.RECONCILE
        return StepKind.LOCAL

    def syncs_gradients(self, n: int) -> bool:
        """Whether step ``n`` all-reduces gradients across the whole group before its step."""
        return self.kind_syncs_gradients(self.step_kind(n))

    def kind_syncs_gradients(self, kind: StepKind) -> bool:
        """Whether a step of ``kind`` all-reduces gradients across the whole group."""
        if kind in (StepKind.DDP, StepKind.WARMUP):
            return True
        return kind is StepKind.RECONCILE and self.strategy == "cpdp"

    def averages_parameters(self, n: int) -> bool:
        """Whether step ``n`` averages parameters after its inner step (blocking, fixed period)."""
        if self.averages_first:
            return n > self.warmup_steps and self.step_kind(n + 1) is StepKind.RECONCILE
        return self.step_kind(n) is StepKind.RECONCILE

    @property
    def averages_first(self) -> bool:
        """``cpdp`` with ``cpdp_order="average-then-step"``: the average precedes the synchronous step."""
        return self.strategy == "cpdp" and self.cpdp_order == "average-then-step"

    @property
    def uses_slowmo(self) -> bool:
        return self.strategy in ("slowmo", "cpdp")

    @property
    def bucket_cap_bytes(self) -> int:
        return max(1, int(float(self.bucket_cap_mb) * 1024 * 1024))

    # -- (de)serialisation -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SyncConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(
                f"unknown SyncConfig field(s) {unknown}: known fields are {sorted(names)}"
            )
        return cls(**data)

    def fingerprint(self) -> list[tuple[str, int, Sequence[str] | Mapping[int, str] | None]]:
        """``(name, value, labels)`` that must agree on every rank, checked before training."""
        return [
            ("strategy", STRATEGIES.index(self.strategy), STRATEGIES),
            ("period", 0 if self.auto else self.period, {0: "auto"}),
            ("overlap_steps", self.overlap_steps, None),
            ("k_min", self.k_min, None),
            ("k_max", self.k_max, None),
            ("target_exposed_frac (x 1e6)", round(float(self.target_exposed_frac) * 1e6), None),
            ("max_divergence (x 1e9, 0: off)", round(float(self.max_divergence or 0.0) * 1e9), None),
            ("warmup_steps", self.warmup_steps, None),
            ("buffers", BUFFER_POLICIES.index(self.buffers), BUFFER_POLICIES),
            ("optimizer_state", STATE_POLICIES.index(self.optimizer_state), STATE_POLICIES),
            ("bucket_cap_bytes", self.bucket_cap_bytes, None),
            ("check_replicas", int(self.check_replicas), None),
            ("cpdp_order", CPDP_ORDERS.index(self.cpdp_order), CPDP_ORDERS),
            ("outer_optimizer (crc32)", zlib.crc32(self.outer_optimizer.encode()), None),
            ("outer_lr (x 1e9, 0: default)", round(float(self.outer_lr or 0.0) * 1e9), None),
            ("outer_momentum (x 1e9, -1: default)",
             -1 if self.outer_momentum is None else round(float(self.outer_momentum) * 1e9), None),
            ("compression (crc32)", zlib.crc32(self.compression.encode()), None),
            ("fragments", self.fragments, None),
        ]
