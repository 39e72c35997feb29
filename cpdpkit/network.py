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
charges: ``time_s == steps·α + wire_bytes·β`` for every row (a :class:`CollectiveCost` keeps the
two terms, ``latency_term_s`` and ``bandwidth_term_s``). A single rank costs nothing.

Network variability. A tier may vary per collective: ``latency_jitter_frac`` (``jl``) and
``bandwidth_jitter_frac`` (``jb``), both in [0, 1). One collective's *sampled* time, for two
uniform draws ``u_latency``, ``u_bandwidth`` in [-1, 1] (:func:`jitter_draws`), is

    sampled = steps·α·(1 + jl·u_latency) + wire_bytes·β·(1 + jb·u_bandwidth)

(:func:`sampled_time_s`): the latency term varies by ±jl and the transfer term by ±jb, i.e. the
collective sees a bandwidth between B/(1 + jb) and B/(1 - jb) whose harmonic mean is B. The
draws are centred, so the *mean* sampled time is exactly ``time_s``: the planner and the
schedule use ``time_s`` (the unjittered mean), the emulator a sampled time per collective, and
over many collectives the two agree. The range is [sampled(-1, -1), sampled(+1, +1)]
(:meth:`NetworkGroup.time_range_s`).

Groups spanning tiers (:meth:`NetworkGroup.of`). A group whose ranks sit on several nodes or
sites is split into *levels*, fastest first: ``f0`` ranks per node (intra-node tier), ``f1`` nodes
per site (inter-node tier), ``f2`` sites (inter-site tier); ``U_i = f0·…·f_{i-1}`` ranks of the
group share one level-``i`` uplink (a node's link to the next tier, a site's WAN link), ``U_0 = 1``.
Two algorithms are priced and the cheaper wins (ties keep the flat one, so one-tier numbers never
change):

* *flat*: the module table on the group's slowest tier, all ``p`` ranks (gloo's ring, and NCCL's
  ring: ranks of a node are consecutive, so each ring crosses each node's uplink once per step and
  no uplink carries two ring edges);
* *hierarchical* (NCCL's tree/CollNet and the two-level all-reduce of Horovod/torchtitan HSDP:
  reduce-scatter inside each unit, the level above on ``1/U_i`` of the data from all ``U_i`` ranks
  at once, all-gather back): per level ``i`` the ``f_i``-rank formula, with the ``U_i`` concurrent
  senders sharing the uplink, so the uplink carries the *unit's* bytes at the tier's bandwidth:

  =============== ==============================================================
  all_reduce      Σ_i 2(f_i-1)α_i + 2(f_i-1)/f_i · n / B_i
  all_gather,     Σ_i  (f_i-1)α_i +  (f_i-1)/f_i · n / B_i
  reduce_scatter
  broadcast       Σ_i  min(tree, scatter+all_gather) of f_i ranks (one sender per unit)
  barrier         Σ_i ⌈log2 f_i⌉α_i
  =============== ==============================================================

  i.e. the slow tier carries ``n·(f-1)/f`` per unit and direction (all_reduce: twice), shared by
  its ``U_i`` ranks; a rank's own wire bytes at level ``i`` are that divided by ``U_i``.
* all_to_all has no hierarchical form; its pairwise exchange sends ``(U_{i+1}-U_i)/p·n`` of each
  rank's bytes over level ``i``, and the ``U_i`` ranks behind one uplink send at once:
  ``Σ_i (U_{i+1}-U_i)α_i + U_i(U_{i+1}-U_i)/p · n / B_i`` (one tier: the table's row).

Sources: the per-level α-β terms are Thakur, Rabenseifner & Gropp, "Optimization of Collective
Communication Operations in MPICH" (2005); the two-level all-reduce is Horovod's hierarchical
all-reduce (Sergeev & Del Balso, 2018) and NCCL's tree/CollNet; "the uplink carries n(f-1)/f per
node" is NCCL's bus-bandwidth accounting (nccl-tests, PERFORMANCE.md) applied per level.

A group whose nodes hold different numbers of its ranks (or sites different numbers of nodes) is
priced flat. On a multi-tier group ``time_s = latency_term_s + bandwidth_term_s`` still holds
(``Σ steps_i·α_i`` and ``Σ bytes_i/B_i``), ``wire_bytes`` is the rank's bytes over all tiers and
``tier_bytes`` splits them; jitter applies the slowest tier's fractions to both terms.

Contention between groups. :attr:`NetworkGroup.uplinks` names the shared uplinks a group's
collectives cross (``node<i>`` when nodes hold several ranks, ``site<j>`` when sites hold several
nodes). Collectives of different groups that cross one uplink at the same time share it:
:func:`concurrent_time_s` is the model (they finish, together, after the sum of their times, as two
TCP flows on one link do: measured 2.05-2.12x for two concurrent all-reduces over one shaped link),
and the emulator books each uplink as a first-come-first-served timeline, which gives the same
makespan. ``NetworkGroup.cost(op, n, concurrent=k)`` prices one of ``k`` identical groups running
at once over the same uplinks (HSDP's replicate groups: one per local rank).

Nothing here imports torch or needs a process group (the profiler and ``cpdpkit plan`` use it).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import InitVar, asdict, dataclass
from typing import Any

from cpdpkit.errors import TopologyError
from cpdpkit.labels import KINDS

__all__ = [
    "COLLECTIVE_OPS",
    "LOCAL_TIER",
    "CollectiveCost",
    "NetworkGroup",
    "Tier",
    "alpha_beta_cost",
    "concurrent_time_s",
    "jitter_draws",
    "sampled_time_s",
]

COLLECTIVE_OPS = tuple(k for k in KINDS if k != "other")  # the kinds the model prices

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


def check_fraction(path: str, value: Any, example: str) -> None:
    """Raise :class:`TopologyError` naming ``path`` unless ``value`` is a number in [0, 1)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not (ok and 0 <= value < 1):
        raise TopologyError(f"{path} = {value!r} is invalid; set it to a fraction in [0, 1), such as {example}")


@dataclass(frozen=True, kw_only=True)
class Tier:
    """One class of link: a one-way ``latency_s`` and a per-link ``bandwidth_bytes_per_s``.

    ``latency_jitter_frac`` and ``bandwidth_jitter_frac`` (each in [0, 1)) make the link vary per
    collective: the latency term of a collective's time by ±``latency_jitter_frac``, its transfer
    term by ±``bandwidth_jitter_frac`` (see :func:`sampled_time_s`; the mean stays the unjittered
    time, which is all the planner uses). The emulator draws them, seeded, per collective.

    ``collective_overhead_s`` (>= 0, default 0): the fixed cost of launching one collective on this
    tier (launch + the host's CPU time of a small collective; gloo on CPU: milliseconds when ranks
    share cores). The planner adds it once per collective (:meth:`NetworkGroup.planned_s`); the
    emulator never delays by it, since the real collective under the emulated one pays it already.

    ``jitter_frac`` is the old single knob (the whole time scaled by one factor in [1 - j, 1 + j]),
    still accepted as an alias: ``jitter_frac=j`` sets both fractions to ``j``, which keeps its
    range and its mean (the two terms now draw independently). It is not a field, and cannot be
    combined with the new ones.
    """

    name: str
    latency_s: float
    bandwidth_bytes_per_s: float
    latency_jitter_frac: float = 0.0
    bandwidth_jitter_frac: float = 0.0
    collective_overhead_s: float = 0.0
    jitter_frac: InitVar[float | None] = None

    def __post_init__(self, jitter_frac: float | None) -> None:
        if not isinstance(self.name, str) or not self.name or not self.name.isidentifier():
            raise TopologyError(
                f"tier name {self.name!r} is invalid; use a short identifier such as 'IB' or 'WAN'"
            )
        if self.name == LOCAL_TIER:
            raise TopologyError(f"tier name {LOCAL_TIER!r} is reserved for one-rank groups; rename the tier")
        check_number(f"tiers.{self.name}.latency_s", self.latency_s, minimum=0.0)
        check_number(f"tiers.{self.name}.bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, positive=True)
        check_number(f"tiers.{self.name}.collective_overhead_s", self.collective_overhead_s, minimum=0.0)
        if jitter_frac is not None:
            if self.latency_jitter_frac or self.bandwidth_jitter_frac:
                raise TopologyError(
                    f"tiers.{self.name}: jitter_frac = {jitter_frac!r} is the old name of latency_jitter_frac "
                    "and bandwidth_jitter_frac; remove it and keep the new keys"
                )
            check_fraction(f"tiers.{self.name}.jitter_frac", jitter_frac, "0.05 for ±5 %")
            object.__setattr__(self, "latency_jitter_frac", jitter_frac)
            object.__setattr__(self, "bandwidth_jitter_frac", jitter_frac)
        check_fraction(f"tiers.{self.name}.latency_jitter_frac", self.latency_jitter_frac, "0.3 for ±30 %")
        check_fraction(f"tiers.{self.name}.bandwidth_jitter_frac", self.bandwidth_jitter_frac, "0.5 for ±50 %")

    @property
    def is_variable(self) -> bool:
        """Whether collectives on this tier vary (either jitter fraction is set)."""
        return bool(self.latency_jitter_frac or self.bandwidth_jitter_frac)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class CollectiveCost:
    """The modeled cost of one collective: its algorithm, seconds and wire bytes per rank.

    ``time_s`` (the unjittered mean) is ``latency_term_s + bandwidth_term_s``: steps·α and
    wire_bytes·β, the two terms that :func:`sampled_time_s` varies.
    """

    op: str
    num_bytes: int
    num_ranks: int
    tier: str
    algorithm: str
    time_s: float
    wire_bytes: int
    latency_term_s: float = 0.0
    bandwidth_term_s: float = 0.0
    # (tier, wire bytes per rank) for each tier the collective uses; one entry on a one-tier group
    tier_bytes: tuple[tuple[str, int], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def concurrent_time_s(costs: Iterable[CollectiveCost]) -> float:
    """Seconds until the last of ``costs`` ends when they start together over one shared uplink.

    The uplink's bandwidth is shared: together they take the sum of their times (fair sharing
    ends them all then; first-come-first-served, the emulator's booking, ends the first earlier
    and the last then). The latency terms are summed too, which over-counts them by at most the
    largest one: negligible wherever contention matters.
    """
    return sum(c.time_s for c in costs)


def _check_op(op: str) -> None:
    if op not in COLLECTIVE_OPS:
        raise TopologyError(f"op = {op!r} is not a modeled collective; use one of {', '.join(COLLECTIVE_OPS)}")


def alpha_beta_cost(op: str, num_bytes: int, p: int, latency_s: float,
                    bandwidth_bytes_per_s: float) -> tuple[str, float, float]:
    """``(algorithm, seconds, wire bytes per rank)`` of ``op`` over ``p`` ranks of one tier.

    The formulas of the module table; the cheaper algorithm wins where there are two.
    """
    algorithm, latency_term_s, wire = _alpha_beta_terms(op, num_bytes, p, latency_s, bandwidth_bytes_per_s)
    return algorithm, latency_term_s + wire * (1.0 / bandwidth_bytes_per_s), wire


def _alpha_beta_terms(op: str, num_bytes: int, p: int, latency_s: float,
                      bandwidth_bytes_per_s: float) -> tuple[str, float, float]:
    """``(algorithm, steps·α, wire bytes per rank)``: :func:`alpha_beta_cost` before summing."""
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
    return algorithm, steps * a, wire


def jitter_draws(seed: int, key: str) -> tuple[float, float]:
    """Two uniform draws in [-1, 1], ``(u_latency, u_bandwidth)``, fixed by ``(seed, key)``.

    The same ``(seed, key)`` gives the same draws in every process: the emulator keys a
    collective by its group's name and sequence number, so every rank of the group samples the
    same time (a group's ranks finish together, as on one shared link).
    """
    rng = random.Random(f"{seed}:{key}")
    return 2.0 * rng.random() - 1.0, 2.0 * rng.random() - 1.0


def sampled_time_s(cost: CollectiveCost, tier: Tier | None, u_latency: float, u_bandwidth: float) -> float:
    """The time of one collective of ``cost`` on ``tier`` for the draws ``u_latency``, ``u_bandwidth``.

    ``latency_term_s·(1 + jl·u_latency) + bandwidth_term_s·(1 + jb·u_bandwidth)`` with ``jl``,
    ``jb`` the tier's jitter fractions (module docstring). Draws must lie in [-1, 1]; a tier
    without jitter (or ``None``, one rank) gives ``cost.time_s`` whatever the draws.
    """
    if not (-1.0 <= u_latency <= 1.0 and -1.0 <= u_bandwidth <= 1.0):
        raise ValueError(f"draws ({u_latency!r}, {u_bandwidth!r}) must lie in [-1, 1]; use jitter_draws()")
    if tier is None or not tier.is_variable:
        return cost.time_s
    return (cost.latency_term_s * (1.0 + tier.latency_jitter_frac * u_latency)
            + cost.bandwidth_term_s * (1.0 + tier.bandwidth_jitter_frac * u_bandwidth))


Level = tuple[Tier, int]  # (the tier of a level, f: how many units of the level below it joins)


def _hierarchical_terms(op: str, num_bytes: int, levels: Sequence[Level]) -> tuple[float, float, list[float]]:
    """``(Σ steps·α, Σ bytes/B, [wire bytes per rank at each level])`` of ``op`` run level by level
    (the module docstring's table): each uplink carries its unit's bytes, shared by ``U_i`` ranks."""
    latency_s = bandwidth_s = 0.0
    per_rank: list[float] = []
    sharing = 1  # U_i: ranks of the group behind one uplink of this level
    for tier, f in levels:
        if op == "all_reduce":
            steps, unit_bytes = 2 * (f - 1), 2 * (f - 1) / f * num_bytes
        elif op in ("all_gather", "reduce_scatter"):
            steps, unit_bytes = f - 1, (f - 1) / f * num_bytes
        else:  # broadcast, barrier: the f-rank algorithm, one sender per unit
            _, level_latency_s, unit_bytes = _alpha_beta_terms(op, num_bytes, f, tier.latency_s,
                                                               tier.bandwidth_bytes_per_s)
            steps = 0
            latency_s += level_latency_s
        latency_s += steps * tier.latency_s
        bandwidth_s += unit_bytes / tier.bandwidth_bytes_per_s
        per_rank.append(unit_bytes / sharing)
        sharing *= f
    return latency_s, bandwidth_s, per_rank


def _all_to_all_terms(num_bytes: int, levels: Sequence[Level]) -> tuple[float, float, list[float]]:
    """Pairwise all_to_all over levels: ``U_i`` ranks behind one uplink send their share at once."""
    p = math.prod(f for _, f in levels)
    latency_s = bandwidth_s = 0.0
    per_rank: list[float] = []
    below = 1
    for tier, f in levels:
        peers = below * f - below  # ranks reached over this level
        latency_s += peers * tier.latency_s
        per_rank.append(peers / p * num_bytes)
        bandwidth_s += below * per_rank[-1] / tier.bandwidth_bytes_per_s
        below *= f
    return latency_s, bandwidth_s, per_rank


class NetworkGroup:
    """The network model of one group of global ranks: its tier and each collective's cost.

    Obtain one from :meth:`cpdpkit.topology.Topology.group` (built by :meth:`of`). The tier is
    the group's slowest link (``None`` for a single rank, whose :attr:`tier_name` is
    ``"LOCAL"``); :attr:`levels` its tiers with their fan-outs, fastest first, when the group
    spans tiers evenly (module docstring); :attr:`uplinks` the shared uplinks its collectives
    cross. Costs are memoised per ``(op, num_bytes, concurrent)``: a group is asked the same
    sizes every step.
    """

    __slots__ = ("ranks", "tier", "levels", "uplinks", "_costs")

    def __init__(self, ranks: tuple[int, ...], tier: Tier | None, *, levels: Sequence[Level] = (),
                 uplinks: Sequence[str] = ()) -> None:
        self.ranks = ranks
        self.tier = tier
        self.levels: tuple[Level, ...] = tuple(levels)
        self.uplinks: tuple[str, ...] = tuple(uplinks)
        self._costs: dict[tuple[str, int, int], CollectiveCost] = {}

    @classmethod
    def of(cls, topology: Any, members: tuple[int, ...]) -> NetworkGroup:
        """The group of ``members`` (sorted, distinct) on a placed ``topology``: its slowest tier,
        its levels when each node holds as many of its ranks and each site as many of its nodes,
        and the uplinks shared with other groups (a node's when nodes hold several ranks, a
        site's when sites hold several nodes)."""
        tier = topology.tier_of(members)
        if len(members) < 2:
            return cls(members, tier)
        rpn, nps = topology.ranks_per_node, topology.nodes_per_site
        per_node = Counter(r // rpn for r in members)
        nodes_per_site = Counter(node // nps for node in per_node)
        uplinks = [f"node{n}" for n in sorted(per_node)] if len(per_node) > 1 and rpn > 1 else []
        if len(nodes_per_site) > 1 and nps > 1:
            uplinks += [f"site{s}" for s in sorted(nodes_per_site)]
        levels: list[Level] = []
        if len(set(per_node.values())) == 1 and len(set(nodes_per_site.values())) == 1:
            fan_outs = (next(iter(per_node.values())), next(iter(nodes_per_site.values())), len(nodes_per_site))
            names = (topology.intra_node_tier, topology.inter_node_tier, topology.inter_site_tier)
            levels = [(topology.tier(name), f) for name, f in zip(names, fan_outs) if f > 1]
        return cls(members, tier, levels=levels if len(levels) > 1 else (), uplinks=uplinks)

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def tier_name(self) -> str:
        return self.tier.name if self.tier is not None else LOCAL_TIER

    def cost(self, op: str, num_bytes: int, *, concurrent: int = 1) -> CollectiveCost:
        """The modeled cost of ``op`` moving ``num_bytes`` in this group (see the module doc).

        ``concurrent`` identical groups running it at once over the same uplinks share them: the
        time of one is then :func:`concurrent_time_s` of all (``concurrent`` times its own).
        """
        key = (op, num_bytes, concurrent)
        cost = self._costs.get(key)
        if cost is None:
            if not isinstance(num_bytes, int) or isinstance(num_bytes, bool) or num_bytes < 0:
                raise TopologyError(f"num_bytes = {num_bytes!r} is invalid; pass a whole number of bytes >= 0")
            if not isinstance(concurrent, int) or isinstance(concurrent, bool) or concurrent < 1:
                raise TopologyError(f"concurrent = {concurrent!r} is invalid; pass a whole number of groups >= 1")
            cost = self._cost(op, num_bytes)
            if concurrent > 1:
                cost = CollectiveCost(**{**cost.to_dict(), "tier_bytes": cost.tier_bytes,
                                         "time_s": concurrent_time_s([cost] * concurrent),
                                         "latency_term_s": cost.latency_term_s * concurrent,
                                         "bandwidth_term_s": cost.bandwidth_term_s * concurrent})
            self._costs[key] = cost
        return cost

    def _cost(self, op: str, num_bytes: int) -> CollectiveCost:
        p = len(self.ranks)
        if self.tier is None:
            _check_op(op)
            return CollectiveCost(op=op, num_bytes=num_bytes, num_ranks=p, tier=self.tier_name, algorithm="local",
                                  time_s=0.0, wire_bytes=0)
        algorithm, latency_term_s, wire = _alpha_beta_terms(op, num_bytes, p, self.tier.latency_s,
                                                            self.tier.bandwidth_bytes_per_s)
        bandwidth_term_s = wire * (1.0 / self.tier.bandwidth_bytes_per_s)  # as alpha_beta_cost, bit for bit
        tier_bytes: tuple[tuple[str, int], ...] = ((self.tier_name, int(round(wire))),) if wire else ()
        if self.levels and op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier",
                                  "all_to_all"):
            terms = (_all_to_all_terms(num_bytes, self.levels) if op == "all_to_all"
                     else _hierarchical_terms(op, num_bytes, self.levels))
            if op == "all_to_all" or sum(terms[:2]) < latency_term_s + bandwidth_term_s:
                algorithm = "pairwise" if op == "all_to_all" else "hierarchical"
                latency_term_s, bandwidth_term_s, per_level = terms
                wire = sum(per_level)
                tier_bytes = tuple((t.name, int(round(b))) for (t, _), b in zip(self.levels, per_level) if b)
        return CollectiveCost(op=op, num_bytes=num_bytes, num_ranks=p, tier=self.tier_name,
                              algorithm=algorithm, time_s=latency_term_s + bandwidth_term_s,
                              wire_bytes=int(round(wire)), latency_term_s=latency_term_s,
                              bandwidth_term_s=bandwidth_term_s, tier_bytes=tier_bytes)

    def sampled_time_s(self, cost: CollectiveCost, u_latency: float, u_bandwidth: float) -> float:
        """``cost`` (one of this group's) for one pair of draws: :func:`sampled_time_s` on this tier."""
        return sampled_time_s(cost, self.tier, u_latency, u_bandwidth)

    def time_range_s(self, op: str, num_bytes: int) -> tuple[float, float]:
        """The shortest and longest time ``op`` of ``num_bytes`` can sample on this tier
        (both ``time_s`` on a tier without jitter)."""
        cost = self.cost(op, num_bytes)
        return self.sampled_time_s(cost, -1.0, -1.0), self.sampled_time_s(cost, 1.0, 1.0)

    def time_s(self, op: str, num_bytes: int) -> float:
        return self.cost(op, num_bytes).time_s

    @property
    def overhead_s(self) -> float:
        """The fixed cost of one collective over this group: its tier's ``collective_overhead_s``
        (the group's slowest tier: one collective call; 0 for a single rank)."""
        return self.tier.collective_overhead_s if self.tier is not None and len(self.ranks) > 1 else 0.0

    def planned_s(self, op: str, num_bytes: int) -> float:
        """What the planner charges for one ``op``: the α-β :meth:`time_s` plus :attr:`overhead_s`."""
        return self.time_s(op, num_bytes) + self.overhead_s

    def wire_bytes(self, op: str, num_bytes: int) -> int:
        return self.cost(op, num_bytes).wire_bytes

    def __repr__(self) -> str:
        return f"NetworkGroup(ranks={len(self.ranks)}, tier={self.tier_name})"
