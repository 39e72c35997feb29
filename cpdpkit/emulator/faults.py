"""Injected faults on emulated groups, and the one-line errors a group ends with.

A :class:`~cpdpkit.faults.FaultPlan` (a topology TOML's ``[faults]`` table, or
``CPDPKIT_FAULTS``; parsed in :mod:`cpdpkit.faults`, read by :mod:`cpdpkit._env`) becomes one
:class:`FaultInjector` per emulator session. The backend asks it at three points of every
collective: before issuing it (:meth:`FaultInjector.before_issue`: a dead peer ends here, a slow
rank sleeps here, so it arrives late), when pricing it (:meth:`FaultInjector.modeled_s`: latency
spikes, a slow rank's slower link) and when resolving its start on the link
(:meth:`FaultInjector.link_down`: a link that is down). Every decision is a function of the plan's
seed, the group's name and the collective's sequence number, or of the start time every member
of the group agrees on, so all members take the same one.

What a surviving rank sees is one line, raised by ``Work.wait()`` as :class:`PeerLostError` or
:class:`LinkDownError` (both :class:`~cpdpkit.errors.DistributedSetupError`, a ``RuntimeError``)::

    emu all_reduce on group world (ranks 0-1): ranks [1] did not arrive within 5 s; a rank died or
    hung: check its log, or raise the timeout (init_distributed(timeout=timedelta(seconds=...))) if it is only slow
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from collections.abc import Callable

from cpdpkit.errors import DistributedSetupError
from cpdpkit.faults import FaultPlan
from cpdpkit.network import NetworkGroup
from cpdpkit.topology import Topology

__all__ = ["FaultInjector", "LinkDownError", "PeerLostError"]

# How long a rank injected with dead_peer mode "hang" stays silent past its group's timeout
# before it exits: long enough that every peer has timed out and reported first.
_HANG_PAST_TIMEOUT_S = 4.0
_TIMEOUT_FIX = "raise the timeout (init_distributed(timeout=timedelta(seconds=...)))"


class PeerLostError(DistributedSetupError):
    """Members of an emulated group did not arrive at a collective (died, hung, or too slow)."""


class LinkDownError(DistributedSetupError):
    """An injected link-down fault kept a collective off its link past the group's timeout."""


class FaultInjector:
    """The faults of one emulator session as seen by one rank (see the module docstring)."""

    def __init__(self, plan: FaultPlan, *, rank: int, topology: Topology) -> None:
        world = topology.world_size
        for kind, spec in (("slow_rank", plan.slow_rank), ("dead_peer", plan.dead_peer)):
            if spec is not None and not 0 <= spec[0] < world:
                raise DistributedSetupError(
                    f"faults.{kind}.rank = {spec[0]} is outside the world (size {world}); use 0..{world - 1}")
        if plan.link_down is not None:
            tier, pair = plan.link_down[0], plan.link_down[1]
            if tier is not None and tier not in topology.tier_names:
                raise DistributedSetupError(
                    f"faults.link_down.tier = {tier!r} is not a tier of topology "
                    f"{topology.name!r}; use one of {', '.join(topology.tier_names)}")
            if pair is not None and not all(0 <= r < world for r in pair):
                raise DistributedSetupError(f"faults.link_down.pair = {list(pair)} is outside the world "
                                            f"(size {world}); use ranks 0..{world - 1}")
        self.plan = plan
        self.rank = rank
        self.start_s = time.monotonic()  # replaced by the start every rank agrees on (the world group's)
        self._lock = threading.Lock()
        self._issued = 0

    # ---- before issuing: dead peer, slow rank ---------------------------------------------------
    def before_issue(self, timeout_s: float) -> None:
        """Called on the issuing thread before each collective (and send/recv) of this rank."""
        with self._lock:
            self._issued += 1
            issued = self._issued
        dead = self.plan.dead_peer
        if dead is not None and dead[0] == self.rank:
            at_collective, at_s, mode = dead[1], dead[2], dead[3]
            if (at_collective is not None and issued >= at_collective) or (
                    at_s is not None and time.monotonic() - self.start_s >= at_s):
                _die(self.rank, issued, mode, timeout_s)
        slow = self.plan.slow_rank
        if slow is not None and slow[0] == self.rank and slow[2] > 0:
            time.sleep(slow[2])

    # ---- pricing: spikes, a slow rank's link ---------------------------------------------------
    def modeled_s(self, network: NetworkGroup, key: str, modeled_s: float) -> float:
        """``modeled_s`` of the collective keyed ``key`` (``<group>:<seq>``) with the faults applied."""
        slow = self.plan.slow_rank
        if slow is not None and slow[0] in network.ranks:
            modeled_s *= slow[1]
        spikes = self.plan.latency_spikes
        if spikes is not None and len(network.ranks) > 1:
            if random.Random(f"{self.plan.seed}:spike:{key}").random() < spikes[0]:
                modeled_s += spikes[1]
        return modeled_s

    # ---- resolving: a link that is down --------------------------------------------------------
    def link_down(self, network: NetworkGroup, timeout_s: float,
                  describe: Callable[[], str]) -> Callable[[float, float], tuple[float, float]] | None:
        """The schedule step that holds this group's collectives while its link is down, or
        ``None`` when the fault does not touch the group."""
        fault = self.plan.link_down
        if fault is None or len(network.ranks) < 2:
            return None
        tier, pair, start_s, duration_s = fault
        crossed = {network.tier_name, *(t.name for t, _ in network.levels)}
        if (tier is not None and tier not in crossed) or (pair is not None and not set(pair) <= set(network.ranks)):
            return None
        what = f"the {tier} link" if tier is not None else f"the link between ranks {pair[0]} and {pair[1]}"

        def hold(start: float, modeled: float) -> tuple[float, float]:
            down_s, up_s = self.start_s + start_s, self.start_s + start_s + duration_s
            end = start + modeled
            if start >= up_s or end <= down_s:
                return start, end
            blocked_from = max(start, down_s)
            if up_s - blocked_from > timeout_s:
                _sleep_until(blocked_from + timeout_s)
                raise LinkDownError(
                    f"{describe()}: {what} is down (injected fault link_down at {start_s:g} s for {duration_s:g} s) "
                    f"and stayed down past the group's {timeout_s:g} s timeout; shorten the fault or {_TIMEOUT_FIX}")
            if start >= down_s:
                return up_s, up_s + modeled
            return start, end + (up_s - down_s)  # paused while the link was down

        return hold


def _die(rank: int, issued: int, mode: str, timeout_s: float) -> None:
    """End this rank as the dead_peer fault says: exit now, or stop answering and exit later."""
    what = f"cpdpkit emulator: rank {rank} (injected fault dead_peer, mode {mode}) at its collective {issued}"
    if mode == "hang":
        wait_s = timeout_s + _HANG_PAST_TIMEOUT_S
        sys.stderr.write(f"{what} stops answering; it exits in {wait_s:g} s\n")
        sys.stderr.flush()
        time.sleep(wait_s)
    sys.stderr.write(f"{what} exits with code 1\n")
    sys.stderr.flush()
    os._exit(1)


def _sleep_until(deadline_s: float) -> None:
    while (left_s := deadline_s - time.monotonic()) > 0:
        time.sleep(left_s)
