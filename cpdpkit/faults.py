"""Injected faults as data: :class:`FaultPlan`, parsed from a topology TOML's ``[faults]`` table or
``CPDPKIT_FAULTS`` (:mod:`cpdpkit._env`) and applied by the emulator (:mod:`cpdpkit.emulator.faults`).

A plan is seeded: one ``seed`` replays the same faults on every rank. It is torch-free and sits
beside the network model (:mod:`cpdpkit.network`, what a collective costs) below the topology
(:mod:`cpdpkit.topology`, whose TOML may carry a ``[faults]`` table); it is parsed here and
nowhere else.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from cpdpkit.errors import TopologyError

__all__ = ["FaultPlan"]

_FAULT_KINDS = ("latency_spikes", "slow_rank", "link_down", "dead_peer")


def _fault_number(path: str, value: Any, *, minimum: float = 0.0, whole: bool = False) -> Any:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= minimum
    if ok and whole:
        ok = float(value).is_integer()
    if not ok:
        kind = "a whole number" if whole else "a finite number"
        raise TopologyError(f"faults.{path} = {value!r} is invalid; set it to {kind} >= {minimum:g}")
    return int(value) if whole else float(value)


@dataclass(frozen=True, kw_only=True)
class FaultPlan:
    """Faults the emulator injects, seeded (one ``seed`` replays the same faults on every rank).

    * ``latency_spikes = {probability, extra_s}``: each collective, with ``probability`` (its
      own draw of ``(seed, group, sequence number)``, the same on every rank), takes ``extra_s``
      longer.
    * ``slow_rank = {rank, factor = 1, extra_s = 0}``: that rank arrives ``extra_s`` late at each
      collective it issues (it sleeps before issuing: a straggler every other member waits for),
      and every collective of a group holding it takes ``factor`` times its modeled time.
    * ``link_down = {tier | pair, start_s, duration_s}``: collectives of the groups that cross
      ``tier`` (or hold both ranks of ``pair``) cannot use the link from ``start_s`` seconds after
      the emulated world started, for ``duration_s``: they wait until it is back, or fail on
      every rank of the group with one line when that is past the group's timeout.
    * ``dead_peer = {rank, at_collective | at_s, mode = "exit"}``: that rank ends at its
      ``at_collective``-th collective (or the first one ``at_s`` seconds after the start):
      ``exit`` exits (code 1), ``hang`` stops answering (sleeps) until past the timeout, then exits.
      The others end within their timeout with one line naming the op, the group and the ranks
      that did not arrive.
    """

    seed: int = 0
    latency_spikes: tuple[float, float] | None = None  # (probability, extra_s)
    slow_rank: tuple[int, float, float] | None = None  # (rank, factor, extra_s)
    # (tier, pair, start_s, duration_s)
    link_down: tuple[str | None, tuple[int, int] | None, float, float] | None = None
    dead_peer: tuple[int, int | None, float | None, str] | None = None  # (rank, at_collective, at_s, mode)

    def __post_init__(self) -> None:
        _fault_number("seed", self.seed, whole=True)

    @property
    def is_empty(self) -> bool:
        return not (self.latency_spikes or self.slow_rank or self.link_down or self.dead_peer)

    @classmethod
    def from_mapping(cls, data: Any, *, where: str = "[faults]") -> FaultPlan:
        """A plan from a ``[faults]`` table (TOML) or the same keys in a dict."""
        if not isinstance(data, dict):
            raise TopologyError(f"{where} must be a table, got {data!r}")
        for key in data:
            if key != "seed" and key not in _FAULT_KINDS:
                raise TopologyError(f"{where}: unknown key {key!r}; use seed or one of {', '.join(_FAULT_KINDS)}")
        out: dict[str, Any] = {"seed": _fault_number("seed", data.get("seed", 0), whole=True)}
        for kind in _FAULT_KINDS:
            if kind in data:
                spec = data[kind]
                if not isinstance(spec, dict):
                    raise TopologyError(f"{where}: {kind} must be a table such as {_FAULT_EXAMPLES[kind]}, "
                                        f"got {spec!r}")
                out[kind] = _FAULT_PARSERS[kind](spec)
        return cls(**out)

    def to_toml(self) -> str:
        """This plan as a ``[faults]`` table that :meth:`from_mapping` reads back unchanged."""
        lines = ["[faults]", f"seed = {self.seed}"]
        tables: dict[str, dict[str, Any]] = {}
        if self.latency_spikes is not None:
            tables["latency_spikes"] = dict(zip(("probability", "extra_s"), self.latency_spikes))
        if self.slow_rank is not None:
            tables["slow_rank"] = dict(zip(("rank", "factor", "extra_s"), self.slow_rank))
        if self.link_down is not None:
            tier, pair, start_s, duration_s = self.link_down
            where = {"tier": tier} if tier is not None else {"pair": list(pair or ())}
            tables["link_down"] = {**where, "start_s": start_s, "duration_s": duration_s}
        if self.dead_peer is not None:
            rank, at_collective, at_s, mode = self.dead_peer
            when = {"at_collective": at_collective} if at_collective is not None else {"at_s": at_s}
            tables["dead_peer"] = {"rank": rank, **when, "mode": mode}
        for kind, table in tables.items():  # JSON's numbers, strings and lists are TOML's
            lines.append(f"{kind} = {{{', '.join(f'{k} = {json.dumps(v)}' for k, v in table.items())}}}")
        return "\n".join(lines) + "\n"

    @classmethod
    def parse(cls, text: str, *, where: str = "CPDPKIT_FAULTS") -> FaultPlan:
        """The one-line form of ``CPDPKIT_FAULTS``: ``seed=3;slow_rank:rank=1,extra_s=0.02;...``
        (``kind:key=value,...`` parts; a pair as ``pair=0-1``)."""
        data: dict[str, Any] = {}
        for part in (p.strip() for p in text.split(";")):
            if not part:
                continue
            kind, sep, body = part.partition(":")
            if not sep:
                key, eq, value = part.partition("=")
                if key.strip() != "seed" or not eq:
                    raise TopologyError(f"{where}: {part!r} is not 'seed=N' nor 'kind:key=value,...'; "
                                        f"e.g. {_FAULT_EXAMPLE_LINE}")
                data["seed"] = _parse_value(value)
                continue
            spec: dict[str, Any] = {}
            for item in (i.strip() for i in body.split(",") if i.strip()):
                key, eq, value = item.partition("=")
                if not eq:
                    raise TopologyError(f"{where}: {item!r} in {kind.strip()!r} is not key=value; "
                                        f"e.g. {_FAULT_EXAMPLE_LINE}")
                spec[key.strip()] = _parse_value(value.strip())
            data[kind.strip()] = spec
        return cls.from_mapping(data, where=where)


_FAULT_EXAMPLE_LINE = "seed=1;latency_spikes:probability=0.1,extra_s=0.05;dead_peer:rank=1,at_collective=20"
_FAULT_EXAMPLES = {
    "latency_spikes": "{probability = 0.1, extra_s = 0.05}",
    "slow_rank": "{rank = 1, factor = 1.5, extra_s = 0.01}",
    "link_down": '{tier = "WAN", start_s = 2.0, duration_s = 1.0}',
    "dead_peer": '{rank = 1, at_collective = 20, mode = "exit"}',
}


def _parse_value(text: str) -> Any:
    text = text.strip()
    if "-" in text[1:] and all(p.strip().isdigit() for p in text.split("-")):
        return [int(p) for p in text.split("-")]  # a pair: 0-1
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip("'\"")


def _keys(kind: str, spec: dict[str, Any], allowed: set[str], required: set[str]) -> None:
    for key in spec:
        if key not in allowed:
            raise TopologyError(f"faults.{kind}: unknown key {key!r}; use {', '.join(sorted(allowed))}")
    for key in required - set(spec):
        raise TopologyError(f"faults.{kind}: {key} is missing; e.g. {kind} = {_FAULT_EXAMPLES[kind]}")


def _parse_spikes(spec: dict[str, Any]) -> tuple[float, float]:
    _keys("latency_spikes", spec, {"probability", "extra_s"}, {"probability", "extra_s"})
    probability = _fault_number("latency_spikes.probability", spec["probability"])
    if probability > 1:
        raise TopologyError(f"faults.latency_spikes.probability = {probability!r} is invalid; set it in [0, 1]")
    return probability, _fault_number("latency_spikes.extra_s", spec["extra_s"])


def _parse_slow_rank(spec: dict[str, Any]) -> tuple[int, float, float]:
    _keys("slow_rank", spec, {"rank", "factor", "extra_s"}, {"rank"})
    factor = _fault_number("slow_rank.factor", spec.get("factor", 1.0), minimum=1.0)
    return (_fault_number("slow_rank.rank", spec["rank"], whole=True), factor,
            _fault_number("slow_rank.extra_s", spec.get("extra_s", 0.0)))


def _parse_link_down(spec: dict[str, Any]) -> tuple[str | None, tuple[int, int] | None, float, float]:
    _keys("link_down", spec, {"tier", "pair", "start_s", "duration_s"}, {"start_s", "duration_s"})
    tier, pair = spec.get("tier"), spec.get("pair")
    if (tier is None) == (pair is None):
        raise TopologyError(f"faults.link_down needs exactly one of tier or pair; e.g. {_FAULT_EXAMPLES['link_down']}"
                            " or pair = [0, 1]")
    if tier is not None and not (isinstance(tier, str) and tier):
        raise TopologyError(f"faults.link_down.tier = {tier!r} is invalid; name a tier such as \"WAN\"")
    if pair is not None:
        if not (isinstance(pair, list | tuple) and len(pair) == 2):
            raise TopologyError(f"faults.link_down.pair = {pair!r} is invalid; give two ranks such as [0, 1]")
        pair = tuple(sorted(_fault_number("link_down.pair", r, whole=True) for r in pair))
    return (tier, pair, _fault_number("link_down.start_s", spec["start_s"]),
            _fault_number("link_down.duration_s", spec["duration_s"]))


def _parse_dead_peer(spec: dict[str, Any]) -> tuple[int, int | None, float | None, str]:
    _keys("dead_peer", spec, {"rank", "at_collective", "at_s", "mode"}, {"rank"})
    if ("at_collective" in spec) == ("at_s" in spec):
        raise TopologyError(f"faults.dead_peer needs exactly one of at_collective or at_s; "
                            f"e.g. {_FAULT_EXAMPLES['dead_peer']}")
    mode = spec.get("mode", "exit")
    if mode not in ("exit", "hang"):
        raise TopologyError(f"faults.dead_peer.mode = {mode!r} is invalid; use \"exit\" or \"hang\"")
    at_collective = spec.get("at_collective")
    at_s = spec.get("at_s")
    return (_fault_number("dead_peer.rank", spec["rank"], whole=True),
            None if at_collective is None else _fault_number("dead_peer.at_collective", at_collective, minimum=1,
                                                             whole=True),
            None if at_s is None else _fault_number("dead_peer.at_s", at_s), mode)


_FAULT_PARSERS = {"latency_spikes": _parse_spikes, "slow_rank": _parse_slow_rank, "link_down": _parse_link_down,
                  "dead_peer": _parse_dead_peer}
