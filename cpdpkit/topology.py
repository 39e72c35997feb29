"""The network model every part of cpdpkit shares: tiers, rank placement and α-β costs.

A topology names a few link *tiers* (``NVLINK``, ``IB``, ``WAN``, ...; each a ``latency_s`` and a
``bandwidth_bytes_per_s``) and places ranks on nodes and sites: ``ranks_per_node`` consecutive
ranks share a node, ``nodes_per_site`` consecutive nodes share a site, and there are
``num_sites`` sites. Three *levels* say which tier joins two ranks: the same node
(``intra_node_tier``), the same site (``inter_node_tier``) or different sites
(``inter_site_tier``). A group's tier is its slowest link (:meth:`Topology.tier_of`).

Two types, two states:

* :class:`TopologySpec` is what a user names: a preset (:func:`preset`, see :data:`PRESETS`) or a
  TOML file (:func:`load_topology`). At most one placement count may be left open (``None``; in
  TOML ``"auto"``, and an omitted ``ranks_per_node``); it knows no world size.
* :class:`Topology` is a spec bound to a world size: every count is a number, and it answers
  for ranks (:meth:`Topology.tier_of`, :meth:`Topology.group`). :meth:`TopologySpec.place` makes
  one: the open count becomes the world size divided by the other two (the *placement rule*).

The edges (the CLI's commands, :func:`cpdpkit.init_distributed`, a rank started by ``cpdpkit
launch``) resolve a name once (:func:`resolve_topology`) and pass the placed :class:`Topology`
inward; everything below them takes a :class:`Topology`.

Collective costs come from the one network model, :mod:`cpdpkit.network`:
:meth:`Topology.group` gives the :class:`~cpdpkit.network.NetworkGroup` of a set of ranks (its
tier, and per collective its algorithm, wire bytes and time). The planner, the two-stage
schedule, the emulator and ``cpdpkit topology show`` all ask it; nothing here needs torch or a
process group, so a plan for 1,024 ranks runs anywhere.

Presets (every one is registered here, in :data:`PRESETS`): ``lan`` and ``wan`` leave
``ranks_per_node`` open (so does ``wan-variable``, the ``wan`` link varying per collective);
``cluster`` picks ``ranks_per_node`` from the world size (8, 4 or 2, whichever leaves at least
two nodes; else one node of up to 8 ranks) and leaves the node count open. ``multisite`` has
three tiers (NVLINK in a node, IB between the nodes of a site, the ``wan`` WAN between its two
sites): two nodes per site and ``ranks_per_node`` open, or, with ``ranks_per_node`` given, the
number of nodes per site open. ``cluster-slow-ib`` (the sharding suite's) is ``cluster`` with
nodes of 2 ranks and an IB scaled down to CPU compute; ``cluster-slower-ib`` slows that IB further
(the suite's communication-dominated scenario).

TOML format (what :meth:`TopologySpec.to_toml` writes)::

    name = "two-sites"
    [placement]            # omitted ranks_per_node = "auto"; omitted other counts = 1
    ranks_per_node = "auto"
    nodes_per_site = 2
    num_sites = 2
    [levels]               # the tier joining two ranks on one node / one site / two sites
    intra_node = "NVLINK"
    inter_node = "IB"
    inter_site = "WAN"
    [tiers.WAN]            # one table per tier
    latency_s = 8.3e-3
    bandwidth_bytes_per_s = 125e6
    latency_jitter_frac = 0.3     # optional: the latency term varies ±30 % per collective
    bandwidth_jitter_frac = 0.5   # optional: the transfer term varies ±50 % per collective

The two jitter keys (each in [0, 1), default 0) are described in :mod:`cpdpkit.network`; the
emulator samples them per collective, the planner uses the unjittered mean. The old key
``jitter_frac = j`` is still read, as both keys set to ``j`` (:class:`~cpdpkit.network.Tier`).
A ``[faults]`` table (:class:`~cpdpkit.faults.FaultPlan`, :meth:`~cpdpkit.faults.FaultPlan.to_toml`) may follow.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, overload

from cpdpkit._text_file import read_text_file
from cpdpkit._values import is_int
from cpdpkit.errors import TopologyError
from cpdpkit.faults import FaultPlan
from cpdpkit.labels import format_ranks
from cpdpkit.network import COLLECTIVE_OPS, CollectiveCost, NetworkGroup, Tier

__all__ = [
    "Tier",
    "Topology",
    "TopologySpec",
    "CollectiveCost",
    "COLLECTIVE_OPS",
    "PRESETS",
    "preset",
    "load_topology",
    "parse_topology_toml",
    "resolve_topology",
    "format_ranks",
    "NetworkGroup",
]

_PLACEMENT_FIELDS = ("ranks_per_node", "nodes_per_site", "num_sites")
_LEVEL_FIELDS = ("intra_node_tier", "inter_node_tier", "inter_site_tier")
# The most ranks a topology places (each count, and their product). Work is proportional to the ranks:
# `topology show` lists them, the planner prices each rank's groups, the profiler's what-if each rank's
# timeline. At 2**20 ranks `cpdpkit plan` takes ~22 s and 1.3 GB and `topology show` ~4 s (measured on a
# loaded 2-core machine); the largest clusters today have ~10**5 GPUs. torch's own limit is 2**31 - 1.
MAX_RANKS = 2**20
_MAX_COUNT = MAX_RANKS
_MAX_TOML_BYTES = 1 << 20  # a topology is a few tiers: 1 MiB is thousands of them


def _check_count(path: str, value: Any, *, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if not is_int(value) or value < 1:
        hint = ' (or "auto" in a TOML [placement])' if allow_none else ""
        raise TopologyError(f"{path} = {_short_repr(value)} is invalid; set it to a whole number >= 1{hint}")
    if value > _MAX_COUNT:
        raise TopologyError(f"{path} = {_short_repr(value)} is too large; set it to a whole number <= {_MAX_COUNT:,} "
                            "(the most ranks cpdpkit plans or emulates: its work grows with the ranks)")


def _short_repr(value: Any) -> str:
    """``repr(value)``, cut in the middle past 60 characters (a fuzzed file may hold a 400-digit number)."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's 4,300-digit str() limit
        return f"<a {value.bit_length()}-bit integer>"
    return text if len(text) <= 60 else f"{text[:28]}...{text[-28:]} ({len(text)} characters)"


def _intra_node_unset(name: str) -> TopologyError:
    return TopologyError(f"topology {name!r}: intra_node_tier is unset; name the tier that joins ranks of one node")


@dataclass(frozen=True, kw_only=True)
class _Links:
    """What a spec and a placed topology share: the name, the tiers and the tier of each level."""

    name: str
    tiers: tuple[Tier, ...]
    intra_node_tier: str
    inter_node_tier: str | None = None
    inter_site_tier: str | None = None
    description: str = ""
    faults: FaultPlan | None = None  # the TOML's [faults] table (the emulator injects them)

    def _check(self, *, open_counts_allowed: bool) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TopologyError(f"name = {_short_repr(self.name)} is invalid; give the topology a non-empty name")
        if not isinstance(self.description, str):
            raise TopologyError(f"topology {self.name!r}: description = {_short_repr(self.description)} is invalid; "
                                "make it a string")
        object.__setattr__(self, "tiers", tuple(self.tiers))
        if not self.tiers or not all(isinstance(t, Tier) for t in self.tiers):
            raise TopologyError(
                f"topology {self.name!r}: tiers = {self.tiers!r} is invalid; give at least one [tiers.NAME] table"
            )
        names = [t.name for t in self.tiers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise TopologyError(f"topology {self.name!r}: tier {dupes[0]!r} is defined twice; keep one")
        for path in _PLACEMENT_FIELDS:
            value = getattr(self, path)
            if value is None and not open_counts_allowed:
                raise TopologyError(f"topology {self.name!r}: {path} is unset, but a placed Topology has every "
                                    "placement count; leave it open in a TopologySpec and call place(world_size)")
            _check_count(path, value, allow_none=True)
        counts = [getattr(self, p) for p in _PLACEMENT_FIELDS if getattr(self, p) is not None]
        if math.prod(counts) > _MAX_COUNT:
            raise TopologyError(f"topology {self.name!r}: {' x '.join(map(str, counts))} = {math.prod(counts):,} ranks "
                                f"is too many; place at most {_MAX_COUNT:,} (the most ranks cpdpkit plans or emulates)")
        open_counts = [p for p in _PLACEMENT_FIELDS if getattr(self, p) is None]
        if len(open_counts) > 1:
            raise TopologyError(
                f"topology {self.name!r}: {' and '.join(open_counts)} are both unset; "
                "leave at most one placement count unset (it is derived from the world size)"
            )
        self._check_levels(names)

    def _check_levels(self, names: list[str]) -> None:
        for path in _LEVEL_FIELDS:
            value = getattr(self, path)
            if value is not None and not isinstance(value, str):
                raise TopologyError(f"topology {self.name!r}: {path} = {_short_repr(value)} is invalid; "
                                    f"name a tier, one of {', '.join(names)}")
            if value is not None and value not in names:
                raise TopologyError(
                    f"topology {self.name!r}: {path} = {value!r} is not a defined tier; "
                    f"use one of {', '.join(names)} or add [tiers.{value}]"
                )
        if self.intra_node_tier is None:  # a caller without type checks (the TOML parser names it first)
            raise _intra_node_unset(self.name)
        levels = (("inter_node_tier", "nodes_per_site", "nodes"), ("inter_site_tier", "num_sites", "sites"))
        for level, count, what in levels:
            if getattr(self, level) is None and getattr(self, count) != 1:
                raise TopologyError(
                    f"topology {self.name!r}: {level} is unset but {count} = {getattr(self, count)!r}; "
                    f"name the tier between {what} or set {count} = 1"
                )

    def _shape(self) -> str:
        def show(v: int | None) -> str:
            return "?" if v is None else str(v)

        counts = [show(getattr(self, p)) for p in reversed(_PLACEMENT_FIELDS)]
        return f"{counts[0]} site(s) x {counts[1]} node(s) x {counts[2]} rank(s)"

    # ---- tiers -----------------------------------------------------------------------------
    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise TopologyError(f"topology {self.name!r} has no tier {name!r}; use one of {self.tier_names}")

    @property
    def tier_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tiers)

    # ---- serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "description": self.description}
        out["tiers"] = [t.to_dict() for t in self.tiers]
        for f in (*_LEVEL_FIELDS, *_PLACEMENT_FIELDS):
            out[f] = getattr(self, f)
        counts = [getattr(self, p) for p in _PLACEMENT_FIELDS]
        out["world_size"] = None if None in counts else math.prod(counts)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Any:
        kwargs = {k: v for k, v in data.items() if k != "world_size"}
        kwargs["tiers"] = tuple(Tier(**t) for t in data.get("tiers", ()))
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise TopologyError(f"topology dict is invalid ({exc}); use Topology.to_dict()'s keys") from None

    def to_toml(self) -> str:
        """This topology as TOML that :func:`parse_topology_toml` reads back unchanged."""
        lines = [f"name = {_toml_str(self.name)}"]
        if self.description:
            lines.append(f"description = {_toml_str(self.description)}")
        lines += ["", "[placement]"]
        lines += [f"{p} = {_AUTO_TOML if getattr(self, p) is None else getattr(self, p)}" for p in _PLACEMENT_FIELDS]
        lines += ["", "[levels]"]
        lines += [f"{f.removesuffix('_tier')} = {_toml_str(getattr(self, f))}" for f in _LEVEL_FIELDS
                  if getattr(self, f) is not None]
        for t in self.tiers:
            lines += ["", f"[tiers.{t.name}]", f"latency_s = {t.latency_s!r}"]
            lines.append(f"bandwidth_bytes_per_s = {t.bandwidth_bytes_per_s!r}")
            if t.latency_jitter_frac:
                lines.append(f"latency_jitter_frac = {t.latency_jitter_frac!r}")
            if t.bandwidth_jitter_frac:
                lines.append(f"bandwidth_jitter_frac = {t.bandwidth_jitter_frac!r}")
            if t.collective_overhead_s:
                lines.append(f"collective_overhead_s = {t.collective_overhead_s!r}")
        if self.faults is not None:  # so a placed topology handed to launch reaches the ranks whole
            lines += ["", self.faults.to_toml().rstrip("\n")]
        return "\n".join(lines) + "\n"


@dataclass(frozen=True, kw_only=True)
class TopologySpec(_Links):
    """A frozen, unplaced network description: tiers, the tier of each level, placement counts.

    At most one count may be ``None``; :meth:`place` binds the spec to a world size.
    """

    ranks_per_node: int | None = None
    nodes_per_site: int | None = 1
    num_sites: int | None = 1

    def __post_init__(self) -> None:
        self._check(open_counts_allowed=True)

    @property
    def fixed_world_size(self) -> int | None:
        """The world size every count fixes (ranks_per_node × nodes_per_site × num_sites), or ``None`` with one open."""
        counts = [getattr(self, p) for p in _PLACEMENT_FIELDS]
        return None if None in counts else math.prod(counts)

    def place(self, world_size: int) -> Topology:
        """This spec placed on ``world_size`` ranks (the placement rule).

        A spec with every count given must match ``world_size`` exactly. Otherwise the one unset
        count becomes ``world_size`` divided by the product of the other two, which must divide it.
        """
        _check_count("world_size", world_size, allow_none=False)
        fixed = self.fixed_world_size
        if fixed is not None:
            if fixed != world_size:
                raise TopologyError(
                    f"topology {self.name!r} places {fixed} ranks ({self._shape()}) but "
                    f"the world size is {world_size}; change its placement or run {fixed} ranks"
                )
            return Topology(**_fields_of(self))
        (open_field,) = [p for p in _PLACEMENT_FIELDS if getattr(self, p) is None]
        per = math.prod(getattr(self, p) for p in _PLACEMENT_FIELDS if p != open_field)
        if world_size % per:
            raise TopologyError(
                f"topology {self.name!r} needs a world size divisible by {per} ({self._shape()}); "
                f"got {world_size}; run a multiple of {per} ranks or use a TOML file"
            )
        return Topology(**{**_fields_of(self), open_field: world_size // per})


@dataclass(frozen=True, kw_only=True)
class Topology(_Links):
    """A frozen network description placed on a world size: every placement count is a number.

    Made by :meth:`TopologySpec.place` (or :func:`resolve_topology` / :func:`preset` with a
    ``world_size``); the methods that take ranks check them against the world size.
    """

    ranks_per_node: int
    nodes_per_site: int = 1
    num_sites: int = 1
    # NetworkGroup per sorted rank tuple; not part of the topology's identity
    _groups: dict[tuple[int, ...], NetworkGroup] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        self._check(open_counts_allowed=False)

    @property
    def world_size(self) -> int:
        """ranks_per_node × nodes_per_site × num_sites."""
        return self.ranks_per_node * self.nodes_per_site * self.num_sites

    @property
    def num_nodes(self) -> int:
        """nodes_per_site × num_sites (the replicas of a node-sharded mesh)."""
        return self.nodes_per_site * self.num_sites

    @property
    def ranks_per_site(self) -> int:
        """ranks_per_node × nodes_per_site."""
        return self.ranks_per_node * self.nodes_per_site

    def place(self, world_size: int) -> Topology:
        """This topology, after checking it places exactly ``world_size`` ranks."""
        _check_count("world_size", world_size, allow_none=False)
        if self.world_size != world_size:
            raise TopologyError(
                f"topology {self.name!r} places {self.world_size} ranks ({self._shape()}) but "
                f"the world size is {world_size}; change its placement or run {self.world_size} ranks"
            )
        return self

    def spec(self) -> TopologySpec:
        """The same description as a :class:`TopologySpec` (every count fixed)."""
        return TopologySpec(**_fields_of(self))

    def _check_ranks(self, ranks: Iterable[int]) -> None:
        world = self.world_size
        for rank in ranks:
            if not is_int(rank) or not 0 <= rank < world:
                raise TopologyError(
                    f"rank {rank!r} is outside topology {self.name!r} (world size {world}); use 0..{world - 1}"
                )

    def node_of(self, rank: int) -> int:
        self._check_ranks((rank,))
        return rank // self.ranks_per_node

    def site_of(self, rank: int) -> int:
        self._check_ranks((rank,))
        return rank // (self.ranks_per_node * self.nodes_per_site)

    def _level(self, name: str | None) -> Tier:
        assert name is not None, "checked in __post_init__: a level that ranks cross names its tier"
        return self.tier(name)

    def tier_between(self, a: int, b: int) -> Tier | None:
        """The tier of the link between ranks ``a`` and ``b`` (``None`` when a == b)."""
        self._check_ranks((a, b))
        rpn, site = self.ranks_per_node, self.ranks_per_node * self.nodes_per_site
        if a == b:
            return None
        if a // site != b // site:
            return self._level(self.inter_site_tier)
        if a // rpn != b // rpn:
            return self._level(self.inter_node_tier)
        return self.tier(self.intra_node_tier)

    def tier_of(self, ranks: Iterable[int]) -> Tier | None:
        """The slowest tier among the links of ``ranks`` (``None`` for a single rank).

        Slowest means the lowest bandwidth, then the highest latency.
        """
        members = sorted(set(ranks))
        self._check_ranks(members)
        if len(members) < 2:
            return None
        rpn, site = self.ranks_per_node, self.ranks_per_node * self.nodes_per_site
        nodes = {r // rpn for r in members}
        sites = {r // site for r in members}
        crossed: list[Tier] = []
        if len(sites) > 1:
            crossed.append(self._level(self.inter_site_tier))
        if len(nodes) > len(sites):
            crossed.append(self._level(self.inter_node_tier))
        if len(members) > len(nodes):
            crossed.append(self.tier(self.intra_node_tier))
        return min(crossed, key=lambda t: (t.bandwidth_bytes_per_s, -t.latency_s))

    # ---- the network model -----------------------------------------------------------------
    def group(self, ranks: Iterable[int]) -> NetworkGroup:
        """The :class:`~cpdpkit.network.NetworkGroup` of ``ranks``: their tier and collective costs.

        Groups are cached per topology (a group's tier never changes), so asking again is cheap.
        """
        members = tuple(sorted(set(ranks)))
        found = self._groups.get(members)
        if found is None:
            if not members:
                raise TopologyError("a group needs at least one rank; pass the group's global ranks")
            found = self._groups.setdefault(members, NetworkGroup.of(self, members))
        return found

    def collective_cost(self, op: str, num_bytes: int, ranks: Iterable[int]) -> CollectiveCost:
        """The modeled cost of ``op`` moving ``num_bytes`` among ``ranks`` (``group(ranks).cost``)."""
        return self.group(ranks).cost(op, num_bytes)

    def collective_time_s(self, op: str, num_bytes: int, ranks: Iterable[int]) -> float:
        """Modeled seconds of ``op`` moving ``num_bytes`` among ``ranks``."""
        return self.group(ranks).cost(op, num_bytes).time_s


def _fields_of(topo: _Links) -> dict[str, Any]:
    return {f.name: getattr(topo, f.name) for f in fields(topo) if f.init}


def _toml_str(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


# ---- presets: every one is registered here ------------------------------------------------------
_LAN = Tier(name="LAN", latency_s=50e-6, bandwidth_bytes_per_s=1.25e9)  # 10 GbE through one switch
_WAN = Tier(name="WAN", latency_s=8.3e-3, bandwidth_bytes_per_s=125e6)  # 16.6 ms RTT, 1 Gbit/s
_NVLINK = Tier(name="NVLINK", latency_s=3e-6, bandwidth_bytes_per_s=300e9)  # A100 NVLink3, one direction
_IB = Tier(name="IB", latency_s=5e-6, bandwidth_bytes_per_s=25e9)  # one HDR 200 Gbit/s NIC
# the WAN varying per collective: see PRESETS["wan-variable"] for the two fractions
_WAN_VARIABLE = replace(_WAN, latency_jitter_frac=0.3, bandwidth_jitter_frac=0.5)
# A real HDR link is 5 us / 25 GB/s, but a GPU computes about 1,000x faster than the two CPU cores the
# sharding suite runs on; scaling the link down by ~170x keeps communication a comparable share of a step
_SLOW_IB = Tier(name="IB", latency_s=1e-3, bandwidth_bytes_per_s=150e6)
# communication-dominated: the same link a further 3x slower in bandwidth and 2x in latency (sharding suite)
_SLOWER_IB = Tier(name="IB", latency_s=2e-3, bandwidth_bytes_per_s=50e6)
# No preset sets collective_overhead_s: with this machine's measured 0.5 ms per gloo collective
# (benchmarks/collective_overhead.py) the planner merges gpt-tiny's blocks so that no exchange is left
# for stage 1 and drops state sharding (docs/results.md, issue 28); benchmarks/cluster-slow-ib-gloo.toml
# is cluster-slow-ib with it


@dataclass(frozen=True)
class _Preset:
    description: str
    # (name, world_size, ranks_per_node) -> the spec; world_size only picks counts a preset derives from it
    build: Callable[[str, int | None, int | None], TopologySpec]


def _two_sites(tiers: tuple[Tier, ...]) -> Callable[[str, int | None, int | None], TopologySpec]:
    return lambda name, _world, rpn: TopologySpec(
        name=name, tiers=tiers, intra_node_tier="LAN", inter_site_tier="WAN", ranks_per_node=rpn, nodes_per_site=1,
        num_sites=2, description=PRESETS[name])


def _lan(name: str, _world: int | None, rpn: int | None) -> TopologySpec:
    return TopologySpec(name=name, tiers=(_LAN,), intra_node_tier="LAN", ranks_per_node=rpn, description=PRESETS[name])


def _cluster_ranks_per_node(world_size: int) -> int:
    for rpn in (8, 4, 2):
        if world_size % rpn == 0 and world_size // rpn >= 2:
            return rpn
    if world_size <= 8:
        return world_size
    raise TopologyError(
        f"preset 'cluster' cannot choose ranks_per_node for world size {world_size}; "
        "pass ranks_per_node (--ranks-per-node) or use a TOML file"
    )


def _cluster(name: str, world: int | None, rpn: int | None) -> TopologySpec:
    if rpn is None and world is not None:
        _check_count("world_size", world, allow_none=False)
        rpn = _cluster_ranks_per_node(world)
    return TopologySpec(name=name, tiers=(_NVLINK, _IB), intra_node_tier="NVLINK", inter_node_tier="IB",
                        ranks_per_node=rpn if rpn is not None else 8, nodes_per_site=None, num_sites=1,
                        description=PRESETS[name])


def _cluster_slow_ib(name: str, _world: int | None, rpn: int | None) -> TopologySpec:
    ib = _SLOWER_IB if name == "cluster-slower-ib" else _SLOW_IB
    return TopologySpec(name=name, tiers=(_NVLINK, ib), intra_node_tier="NVLINK", inter_node_tier="IB",
                        ranks_per_node=rpn if rpn is not None else 2, nodes_per_site=None, num_sites=1,
                        description=PRESETS[name])


def _multisite(name: str, world: int | None, rpn: int | None) -> TopologySpec:
    """Two sites of two nodes (ranks_per_node = world/4), or of world/(2·ranks_per_node) nodes when it is given."""
    if rpn is None and world is not None:
        _check_count("world_size", world, allow_none=False)
        if world % 4:
            raise TopologyError(
                f"preset 'multisite' places world_size/4 ranks on each of 2 nodes x 2 sites, but world_size = "
                f"{world} is not divisible by 4; run a multiple of 4 ranks or pass ranks_per_node "
                "(--ranks-per-node R gives world_size/(2R) nodes per site)")
    return TopologySpec(name=name, tiers=(_NVLINK, _IB, _WAN), intra_node_tier="NVLINK", inter_node_tier="IB",
                        inter_site_tier="WAN", ranks_per_node=rpn, nodes_per_site=2 if rpn is None else None,
                        num_sites=2, description=PRESETS[name])


_REGISTRY: dict[str, _Preset] = {
    "lan": _Preset("one node: every rank on one 10 GbE LAN (LAN: 50 us, 1.25 GB/s); any world size", _lan),
    "wan": _Preset(
        "two sites joined by a WAN of 16.6 ms RTT (8.3 ms one way) and 1 Gbit/s, like the CPDP "
        "paper's Nancy-Sophia Grid'5000 link; each site one node of world_size/2 ranks on LAN; "
        "even world sizes", _two_sites((_LAN, _WAN))),
    "wan-variable": _Preset(
        "wan with a variable WAN, drawn per collective (seeded): latency term ±30 % (RTT 11.6-21.6 ms, "
        "queueing on a shared path), transfer term ±50 % (one flow gets 0.67-2 Gbit/s, harmonic mean "
        "1 Gbit/s, as cross-site traffic comes and goes); the mean time of each collective is wan's. "
        "Assumed values: the CPDP paper names network variability but gives no figures",
        _two_sites((_LAN, _WAN_VARIABLE))),
    "cluster": _Preset(
        "GPU nodes with NVLINK inside (3 us, 300 GB/s) and InfiniBand HDR between (5 us, 25 GB/s); "
        "ranks_per_node defaults to the largest of 8, 4, 2 that leaves >= 2 nodes, else one node "
        "(<= 8 ranks)", _cluster),
    "multisite": _Preset(
        "two sites joined by the wan preset's WAN (16.6 ms RTT, 1 Gbit/s), each site 2 nodes joined by InfiniBand "
        "HDR (5 us, 25 GB/s) with NVLINK inside a node (3 us, 300 GB/s); world_size/4 ranks per node (world sizes "
        "divisible by 4), or with --ranks-per-node R, world_size/(2R) nodes per site", _multisite),
    "cluster-slow-ib": _Preset(
        "nodes of 2 ranks: NVLINK inside (3 us, 300 GB/s), IB between scaled to CPU compute "
        "(1 ms, 150 MB/s); the sharding suite's default (even world sizes)", _cluster_slow_ib),
    "cluster-slower-ib": _Preset(
        "cluster-slow-ib with the IB a further 2x slower in latency and 3x in bandwidth (2 ms, 50 MB/s): the "
        "sharding suite's communication-dominated scenario (even world sizes)", _cluster_slow_ib),
}
PRESETS: dict[str, str] = {name: p.description for name, p in _REGISTRY.items()}  # name -> description


@overload
def preset(name: str, *, world_size: int, ranks_per_node: int | None = None) -> Topology: ...
@overload
def preset(name: str, *, world_size: None = None, ranks_per_node: int | None = None) -> TopologySpec: ...
def preset(name: str, *, world_size: int | None = None, ranks_per_node: int | None = None) -> Topology | TopologySpec:
    """The preset ``name`` (see :data:`PRESETS`): a :class:`TopologySpec`, or placed when ``world_size`` is given."""
    found = _REGISTRY.get(name)
    if found is None:
        raise TopologyError(
            f"unknown topology preset {name!r}; use one of {', '.join(PRESETS)} or a path to a .toml file"
        )
    spec = found.build(name, world_size, ranks_per_node)
    return spec if world_size is None else spec.place(world_size)


# ---- TOML --------------------------------------------------------------------------------------
_AUTO_TOML = '"auto"'  # a placement count derived from the world size by place()
_TOP_KEYS = {"name", "description", "placement", "levels", "tiers", "faults"}
_TIER_KEYS = {"latency_s", "bandwidth_bytes_per_s", "latency_jitter_frac", "bandwidth_jitter_frac",
              "collective_overhead_s"}
_OLD_TIER_KEYS = {"jitter_frac"}  # still read (network.Tier maps it), never written nor suggested
_LEVEL_KEYS = {"intra_node", "inter_node", "inter_site"}


def _reject_unknown(where: str, keys: Iterable[str], allowed: set[str], old: Iterable[str] = ()) -> None:
    for key in keys:
        if key not in allowed and key not in old:
            raise TopologyError(f"{where}: unknown key {key!r}; use one of {', '.join(sorted(allowed))}")


def _table(where: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TopologyError(f"{where} must be a table ([{where}]), got {_short_repr(value)}")
    return value


def _check_float_range(where: str, spec: Mapping[str, Any]) -> None:
    """An integer too large for a float (``latency_s = 1e400`` written out in digits) named before Tier sees it."""
    for key, value in spec.items():
        if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 1000:
            raise TopologyError(f"{where}: {key} = {_short_repr(value)} is too large; set it to a finite number "
                                "such as 8.3e-3 (latency_s) or 125e6 (bandwidth_bytes_per_s)")


def _parse_tiers(source: str, data: dict[str, Any]) -> tuple[Tier, ...]:
    tiers = []
    for tier_name, spec in _table("tiers", data.get("tiers", {})).items():
        spec = _table(f"tiers.{tier_name}", spec)
        _reject_unknown(f"{source} [tiers.{tier_name}]", spec, _TIER_KEYS, _OLD_TIER_KEYS)
        for key in ("latency_s", "bandwidth_bytes_per_s"):
            if key not in spec:
                raise TopologyError(f"{source} [tiers.{tier_name}]: {key} is missing; add {key} = <number>")
        _check_float_range(f"{source} [tiers.{tier_name}]", spec)
        tiers.append(Tier(name=tier_name, **spec))
    return tuple(tiers)


def parse_topology_toml(text: str, *, source: str = "<string>") -> TopologySpec:
    """A :class:`TopologySpec` from TOML text (the format :meth:`TopologySpec.to_toml` writes)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TopologyError(f"{source}: not valid TOML ({exc}); fix the syntax") from None
    except RecursionError:  # tomllib recurses once per nested array or inline table
        raise TopologyError(f"{source}: not valid TOML (arrays or tables nested too deeply); fix the syntax") from None
    except ValueError as exc:  # an integer past Python's 4,300-digit limit
        raise TopologyError(f"{source}: not valid TOML ({exc}); fix the value") from None
    _reject_unknown(source, data, _TOP_KEYS)
    placement = _table("placement", data.get("placement", {}))
    _reject_unknown(f"{source} [placement]", placement, set(_PLACEMENT_FIELDS))
    levels = _table("levels", data.get("levels", {}))
    _reject_unknown(f"{source} [levels]", levels, _LEVEL_KEYS)
    tiers = _parse_tiers(source, data)
    counts = {p: (None if placement.get(p, 1) == "auto" else placement.get(p, 1)) for p in _PLACEMENT_FIELDS}
    if "ranks_per_node" not in placement:
        counts["ranks_per_node"] = None
    name = data.get("name", Path(source).stem)
    intra = levels.get("intra_node")
    if intra is None:
        raise _intra_node_unset(name)
    return TopologySpec(
        name=name, description=data.get("description", ""), tiers=tiers, intra_node_tier=intra,
        inter_node_tier=levels.get("inter_node"), inter_site_tier=levels.get("inter_site"),
        faults=FaultPlan.from_mapping(data["faults"], where=f"{source} [faults]") if "faults" in data else None,
        **counts,
    )


def load_topology(path: str | Path) -> TopologySpec:
    """A :class:`TopologySpec` from a TOML file (at most 1 MiB)."""
    p = Path(path)
    text = read_text_file(p, what="topology file", max_bytes=_MAX_TOML_BYTES, error=TopologyError,
                          fix="save it as UTF-8")
    try:
        return parse_topology_toml(text, source=str(p))
    except TopologyError as exc:  # every message names the file, not only the parser's own
        if str(p) in str(exc):
            raise
        raise TopologyError(f"{p}: {exc}") from None


@overload
def resolve_topology(spec: str, *, world_size: int, ranks_per_node: int | None = None) -> Topology: ...
@overload
def resolve_topology(spec: str, *, world_size: None = None, ranks_per_node: int | None = None) -> TopologySpec: ...
@overload
def resolve_topology(spec: str, *, world_size: int | None,
                     ranks_per_node: int | None = None) -> Topology | TopologySpec: ...
def resolve_topology(spec: str, *, world_size: int | None = None,
                     ranks_per_node: int | None = None) -> Topology | TopologySpec:
    """A preset name or a TOML path (anything ending in .toml or naming a file): the spec, or placed on
    ``world_size`` when it is given. The edges call it once and pass the placed :class:`Topology` on."""
    if spec.endswith(".toml") or ("/" in spec) or Path(spec).is_file() and spec not in PRESETS:
        loaded = load_topology(spec)
        if ranks_per_node is not None:
            loaded = replace(loaded, ranks_per_node=ranks_per_node)
        return loaded if world_size is None else loaded.place(world_size)
    return preset(spec, world_size=world_size, ranks_per_node=ranks_per_node)
