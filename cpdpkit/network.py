"""The one network model: what a collective over a group of ranks costs on its link tier.

Every part of cpdpkit that needs a collective's algorithm, bytes or time asks a
:class:`NetworkGroup` (from :meth:`cpdpkit.topology.Topology.group`): the planner's cost model,
the two-stage schedule, the ``emu`` backend (its modeled delays and its byte counters) and the
CLI's ``topology show``. So a plan's "bytes sent" and an emulated run's counted bytes are the
same numbers for the same collectives, by construction.

The model is the textbook α-β model (α = ``latency_s``, β = 1 / ``bandwidth_bytes_per_s``,
``p`` ranks, ``n`` bytes), a flat algorithm over the group's slowest tier:

===============  =====================================  ==================================
op               time                                   wire bytes per rank (the β term)
===============  =====================================  ==================================
all_reduce       ring: 2(p-1)α + 2(p-1)/p·nβ            ring: 2(p-1)/p·n
                 tree: 2⌈log2 p⌉(α + nβ)  (if cheaper)  tree: 2⌈log2 p⌉·n
all_gather       (p-1)α + (p-1)/p·nβ                    (p-1)/p·n  (n = gathered output)
reduce_scatter   (p-1)α + (p-1)/p·nβ                    (p-1)/p·n  (n = unreduced input)
broadcast        tree: ⌈log2 p⌉(α + nβ)                 tree: ⌈log2 p⌉·n
                 scatter+all_gather (if cheaper):       2(p-1)/p·n
                 (⌈log2 p⌉ + p-1)α + 2(p-1)/p·nβ
all_to_all       (p-1)α + (p-1)/p·nβ                    (p-1)/p·n  (n = bytes one rank sends)
send_recv        α + nβ                                 n
barrier          ⌈log2 p⌉α                              0
===============  =====================================  ==================================

*Wire bytes per rank* are the bytes on the algorithm's critical path, the ones the β term
charges: ``time_s == steps·α + wire_bytes·β`` for every row. A single rank costs nothing.

Nothing here imports torch or needs a process group (the profiler and ``cpdpkit plan`` use it).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from cpdpkit.errors import TopologyError

__all__ = [
    "COLLECTIVE_OPS",
    "LOCAL_TIER",
    "CollectiveCost",
    "NetworkGroup",
    "Tier",
    "alpha_beta_cost",
]

COLLECTIVE_OPS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "barrier",
    "all_to_all",
    "send_recv",
)

LOCAL_TIER = "LOCAL"  # the tier name of a one-rank group: no link, no cost


def check_number(path: str, value: Any, *, minimum: float | None = None, positive: bool = False) -> None:
    """Raise :class:`TopologyError` naming ``path`` unless ``value`` is a finite number in range."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and positive:
        ok = value > 0
    if ok and minimum is not None:
        ok = value >= minimum
    if not ok:
        need = "a finite number > 0" if positive else f"a finite number >= {minimum:g}"
        raise TopologyError(f"{path} = {value!r} is invalid; set it to {need}")


@dataclass(frozen=True, kw_only=True)
class Tier:
    """One class of link: a one-way ``latency_s`` and a per-link ``bandwidth_bytes_per_s``.

    ``jitter_frac`` (0 ≤ j < 1) lets the emulator stretch or shrink each modeled time by a
    seeded uniform factor in [1 - j, 1 + j]; the cost model itself ignores it.
    """

    name: str
    latency_s: float
    bandwidth_bytes_per_s: float
    jitter_frac: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or not self.name.isidentifier():
            raise TopologyError(
                f"tier name {self.name!r} is invalid; use a short identifier such as 'IB' or 'WAN'"
            )
        if self.name == LOCAL_TIER:
            raise TopologyError(f"tier name {LOCAL_TIER!r} is reserved for one-rank groups; rename the tier")
        check_number(f"tiers.{self.name}.latency_s", self.latency_s, minimum=0.0)
        check_number(f"tiers.{self.name}.bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, positive=True)
        check_number(f"tiers.{self.name}.jitter_frac", self.jitter_frac, minimum=0.0)
        if self.jitter_frac >= 1.0:
            raise TopologyError(
                f"tiers.{self.name}.jitter_frac = {self.jitter_frac!r} must be below 1 "
                "(a fraction such as 0.05 for ±5 %)"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class CollectiveCost:
    """The modeled cost of one collective: its algorithm, seconds and wire bytes per rank."""

    op: str
    num_bytes: int
    num_ranks: int
    tier: str
    algorithm: str
    time_s: float
    wire_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_op(op: str) -> None:
    if op not in COLLECTIVE_OPS:
        raise TopologyError(f"op = {op!r} is not a modeled collective; use one of {', '.join(COLLECTIVE_OPS)}")


def alpha_beta_cost(op: str, num_bytes: int, p: int, latency_s: float,
                    bandwidth_bytes_per_s: float) -> tuple[str, float, float]:
    """``(algorithm, seconds, wire bytes per rank)`` of ``op`` over ``p`` ranks of one tier.

    The formulas of the module table; the cheaper algorithm wins where there are two.
    """
    _check_op(op)
    if p < 2:
        return "local", 0.0, 0.0
    a, beta = latency_s, 1.0 / bandwidth_bytes_per_s
    log_p = math.ceil(math.log2(p))
    frac = (p - 1) / p
    if op == "all_reduce":
        choices = [("ring", 2 * (p - 1), 2 * frac * num_bytes), ("tree", 2 * log_p, 2 * log_p * num_bytes)]
    elif op == "broadcast":
        choices = [("tree", log_p, log_p * num_bytes), ("scatter_allgather", log_p + p - 1, 2 * frac * num_bytes)]
    elif op == "all_to_all":
        choices = [("pairwise", p - 1, frac * num_bytes)]
    elif op in ("all_gather", "reduce_scatter"):
        choices = [("ring", p - 1, frac * num_bytes)]
    elif op == "send_recv":
        choices = [("p2p", 1, float(num_bytes))]
    else:  # barrier
        choices = [("dissemination", log_p, 0.0)]
    # the first of equal-time algorithms wins (ring before tree), as a stable sort keeps it first
    algorithm, steps, wire = min(choices, key=lambda c: c[1] * a + c[2] * beta)
    return algorithm, steps * a + wire * beta, wire


class NetworkGroup:
    """The network model of one group of global ranks: its tier and each collective's cost.

    Obtain one from :meth:`cpdpkit.topology.Topology.group`. The tier is the group's slowest
    link (``None`` for a single rank, whose :attr:`tier_name` is ``"LOCAL"``). Costs are
    memoised per ``(op, num_bytes)``: a group is asked the same sizes every step.
    """

    __slots__ = ("ranks", "tier", "_costs")

    def __init__(self, ranks: tuple[int, ...], tier: Tier | None) -> None:
        self.ranks = ranks
        self.tier = tier
        self._costs: dict[tuple[str, int], CollectiveCost] = {}

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def tier_name(self) -> str:
        return self.tier.name if self.tier is not None else LOCAL_TIER

    def cost(self, op: str, num_bytes: int) -> CollectiveCost:
        """The modeled cost of ``op`` moving ``num_bytes`` in this group (see the module table)."""
        key = (op, num_bytes)
        cost = self._costs.get(key)
        if cost is None:
            if not isinstance(num_bytes, int) or isinstance(num_bytes, bool) or num_bytes < 0:
                raise TopologyError(f"num_bytes = {num_bytes!r} is invalid; pass a whole number of bytes >= 0")
            p = len(self.ranks)
            if self.tier is None:
                _check_op(op)
                algorithm, time_s, wire = "local", 0.0, 0.0
            else:
                algorithm, time_s, wire = alpha_beta_cost(op, num_bytes, p, self.tier.latency_s,
                                                          self.tier.bandwidth_bytes_per_s)
            cost = CollectiveCost(op=op, num_bytes=num_bytes, num_ranks=p, tier=self.tier_name,
                                  algorithm=algorithm, time_s=time_s, wire_bytes=int(round(wire)))
            self._costs[key] = cost
        return cost

    def time_s(self, op: str, num_bytes: int) -> float:
        return self.cost(op, num_bytes).time_s

    def wire_bytes(self, op: str, num_bytes: int) -> int:
        return self.cost(op, num_bytes).wire_bytes

    def __repr__(self) -> str:
        return f"NetworkGroup(ranks={len(self.ranks)}, tier={self.tier_name})"
