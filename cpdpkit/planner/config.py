"""The planner's configuration (:class:`PlannerConfig`), its error type, size parsing and
:class:`Record`, the ``to_dict``/``from_dict`` of the planner's flat JSON records.

Torch-free: dtypes are names mapped to byte sizes, so a plan for 1,024 ranks needs no torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar, cast

from cpdpkit._values import refuse_nonfinite
from cpdpkit.errors import ConfigError

__all__ = ["PlannerConfig", "PlannerError", "DTYPE_BYTES", "PARAM_SHARDINGS", "dtype_bytes", "parse_bytes",
           "format_bytes", "ceil_div"]

# A plan's parameter layout: FSDP2-style shards, or replicated (partially sharded data parallelism).
PARAM_SHARDINGS = ("sharded", "replicated")

# Canonical torch dtype names (and the usual short aliases) -> bytes per element.
DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1,
}
_DTYPE_ALIASES = {"fp64": "float64", "double": "float64", "fp32": "float32", "float": "float32",
                  "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp8": "float8_e4m3fn"}

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class PlannerError(ConfigError):
    """The planner cannot produce a plan for these inputs (names the limit and what would fit)."""


def _canonical_dtype(name: str) -> str:
    """The :data:`DTYPE_BYTES` key of ``name`` (``"bf16"``, ``"torch.float32"``...)."""
    key = str(name).removeprefix("torch.").lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise PlannerError(f"dtype {name!r} is unknown; use one of {', '.join(DTYPE_BYTES)}")
    return key


def dtype_bytes(name: str) -> int:
    """Bytes per element of dtype ``name`` (``"bfloat16"``, ``"bf16"``, ``"torch.float32"``...)."""
    return DTYPE_BYTES[_canonical_dtype(name)]


def parse_bytes(text: str | int) -> int:
    """``"80GiB"`` -> 85899345920; ``"1.5 TB"``, ``"512MiB"``, ``"1000"`` (bytes) also work."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise PlannerError(f"size {text!r} is not understood; write it like 80GiB, 40GB or 512MiB")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise PlannerError(f"size {text!r} must be positive; write it like 80GiB")
    return value


def format_bytes(num_bytes: float) -> str:
    """Bytes for humans, binary units: 1536 -> ``"1.50 KiB"``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


_R = TypeVar("_R", bound="Record")


class Record:
    """``to_dict`` / ``from_dict`` of a flat frozen dataclass of the planner's JSON.

    ``to_dict``: every field as it is, tuples as lists. ``from_dict``: the fields back as keyword
    arguments (each class's ``__post_init__`` turns lists back into tuples).
    """

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in fields(cast(Any, self)):  # every Record is a dataclass (a mixin cannot say so)
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls: type[_R], data: Mapping[str, Any]) -> _R:
        return cls(**data)


@dataclass(frozen=True, kw_only=True)
class PlannerConfig(Record):
    """What the planner optimises for.

    * ``param_dtype`` / ``grad_dtype``: dtypes of the sharded parameters and gradients (also the
      dtypes on the wire: all-gathers move ``param_dtype``, reductions move ``grad_dtype``).
    * ``optim_state_bytes_per_param``: optimizer state per parameter; Adam with an fp32 master
      copy is 12 (two fp32 moments + fp32 master), plain SGD 0, SGD with momentum 4.
    * ``memory_budget_bytes``: model states plus communication buffers per rank (activations
      are not modeled; leave room for them); ``None`` means no limit.
    * ``min_unit_bytes``: neighbouring blocks smaller than this merge into one ``fully_shard``
      unit; ``None`` picks the size where a collective's latency equals its bandwidth term.
    * ``allow_state_sharding``: allow partitioning optimizer state across the replicate axis
      (``False`` gives a plan FSDP2 executes completely).
    * ``shard_size``: fix the shard axis to this many consecutive ranks (a divisor of the world
      size); ``None`` lets the planner choose a node, a site or the world.
    * ``reshard_after_forward``: fix FSDP2's policy for every non-root unit (``True``,
      ``False`` or a number of consecutive ranks inside one node); ``None`` lets the planner choose.
    * ``param_sharding``: ``"sharded"`` keeps to FSDP2-style plans (parameters sharded on the
      shard axis); ``"replicated"`` plans only *partially sharded* data parallelism (``strategy
      "partial"``: parameters replicated on every rank, gradients and optimizer state sharded
      across the world, node first); ``None`` considers both.
    * ``reconcile_period``: CPDP's period K across sites. On a topology of several sites the
      shard axis is then the site, and the replicate axis (across sites, over the WAN) carries
      only a reconciliation every K steps (gradient all-reduce + parameter average of each
      rank's shard), priced per step as its cost / K; SlowMo's anchor and slow momentum
      (float32, 2 × the rank's parameter shard) join each rank's memory. ``None`` (the
      default): the replicate axis all-reduces every step, as plain FSDP2/HSDP does.
    * ``tokens_per_rank`` / ``flops_per_s``: the compute model behind the two-stage schedule and
      the unit sizes (:func:`cpdpkit.planner.schedule.estimate_unit_timings`: 6·params·tokens
      FLOPs per unit at ``flops_per_s``); ``None``: 4,096 tokens at an A100's 125 TFLOP/s.
      With ``min_unit_bytes`` left ``None``, a plan that exchanges updated parameters across
      replicas gets the block grouping whose predicted exposed communication (that schedule,
      overlap with backward and forward included) is least.
    """

    param_dtype: str = "bfloat16"
    grad_dtype: str = "bfloat16"
    optim_state_bytes_per_param: int = 12
    memory_budget_bytes: int | None = None
    min_unit_bytes: int | None = None
    allow_state_sharding: bool = True
    shard_size: int | None = None
    reshard_after_forward: bool | int | None = None
    param_sharding: str | None = None
    reconcile_period: int | None = None
    tokens_per_rank: int | None = None
    flops_per_s: float | None = None

    def __post_init__(self) -> None:
        refuse_nonfinite(self, PlannerError)
        object.__setattr__(self, "param_dtype", _canonical_dtype(self.param_dtype))
        object.__setattr__(self, "grad_dtype", _canonical_dtype(self.grad_dtype))
        v = self.optim_state_bytes_per_param
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise PlannerError(
                f"optim_state_bytes_per_param = {v!r} is invalid; use a whole number >= 0 (Adam + fp32 master: 12)"
            )
        for name in ("memory_budget_bytes", "min_unit_bytes", "shard_size"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                what = "ranks" if name == "shard_size" else "bytes"
                raise PlannerError(f"{name} = {v!r} is invalid; use a whole number of {what} > 0 or None")
        raf = self.reshard_after_forward
        if raf is not None and not isinstance(raf, bool) and (not isinstance(raf, int) or raf < 2):
            raise PlannerError(f"reshard_after_forward = {raf!r} is invalid; use True, False, None or a "
                               "number of ranks >= 2 (for example the node size)")
        t = self.tokens_per_rank
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t < 1):
            raise PlannerError(f"tokens_per_rank = {t!r} is invalid; use a whole number >= 1 (e.g. 4096) or None")
        f = self.flops_per_s
        if f is not None and (not isinstance(f, (int, float)) or isinstance(f, bool) or not f > 0):
            raise PlannerError(f"flops_per_s = {f!r} is invalid; use a positive rate such as 125e12 or None")
        if not isinstance(self.allow_state_sharding, bool):
            raise PlannerError(f"allow_state_sharding = {self.allow_state_sharding!r} must be True or False")
        self._check_param_sharding()
        self._check_reconcile_period()

    def _check_reconcile_period(self) -> None:
        k = self.reconcile_period
        if k is None:
            return
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise PlannerError(f"reconcile_period = {k!r} is invalid; use a whole number of steps >= 1 (CPDP's K, "
                               "such as 4) or None (all-reduce across sites every step)")
        if self.param_sharding == "replicated":
            raise PlannerError(f"param_sharding = 'replicated' exchanges gradients and parameters across the world "
                               f"every step, which reconcile_period = {k} forbids (the WAN carries only the "
                               "reconciliation); use 'sharded' or None, or leave reconcile_period None")

    def _check_param_sharding(self) -> None:
        ps = self.param_sharding
        if ps is not None and ps not in PARAM_SHARDINGS:
            raise PlannerError(f"param_sharding = {ps!r} is invalid; use 'sharded', 'replicated' or None "
                               "(consider both)")
        if ps != "replicated":
            return
        if not self.allow_state_sharding:
            raise PlannerError("param_sharding = 'replicated' shards optimizer state across the world, which "
                               "allow_state_sharding = False forbids; allow state sharding or use 'sharded'")
        if self.reshard_after_forward not in (None, False):
            raise PlannerError(f"param_sharding = 'replicated' keeps parameters unsharded, so reshard_after_forward "
                               f"= {self.reshard_after_forward!r} cannot hold; leave it None or use 'sharded'")

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        for name in ("reconcile_period", "tokens_per_rank", "flops_per_s"):
            if getattr(self, name) is None:  # written only when set: a plan without them stays format 2, byte for byte
                del out[name]
        return out

    @property
    def param_bytes(self) -> int:
        return dtype_bytes(self.param_dtype)

    @property
    def grad_bytes(self) -> int:
        return dtype_bytes(self.grad_dtype)

    @property
    def state_bytes_per_param(self) -> int:
        """Parameter + gradient + optimizer bytes of one parameter."""
        return self.param_bytes + self.grad_bytes + self.optim_state_bytes_per_param


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)

