"""The emulated backend on 2 and 4 spawned gloo ranks: timing, overlap, numerics, coverage.

Each rank count is one spawned job (tests/_emu_jobs.py) shared by all tests of this module;
the last tests need no process group (meter's error, the link helper thread's lifetime).
"""

from __future__ import annotations

import gc
import re
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest

import _emu_jobs as jobs
from cpdpkit.emulator import meter
from cpdpkit.emulator._counters import GroupCounters
from cpdpkit.emulator._link import Link
from cpdpkit.errors import DistributedSetupError
from cpdpkit.network import jitter_draws

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]

TIMED_OPS = ("all_reduce", "all_gather", "reduce_scatter")
# a profiler event closed by the link's thread may end after the waiter's call: its wake-up after
# the modeled end, and the profiler's clock read on another core (up to 1.1 ms seen on 2 cores)
LINK_THREAD_US = 5000.0
PATH_KINDS = {"all_reduce": 2, "all_gather": 2, "reduce_scatter": 2, "broadcast": 1, "barrier": 2,
              "all_to_all": 1, "send_recv": 1}


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return jobs.spawn_job("two_ranks", 2, tmp_path_factory.mktemp("emu2"))


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return jobs.spawn_job("four_ranks", 4, tmp_path_factory.mktemp("emu4"))


def _modeled_s(op: str, world: int, num_bytes: int) -> float:
    return jobs.TEST_TOPOLOGY.place(world).collective_time_s(op, num_bytes, range(world))


@pytest.mark.parametrize("op", TIMED_OPS)
def test_two_rank_time_matches_model(two: list[dict[str, Any]], op: str) -> None:
    modeled = _modeled_s(op, 2, jobs.TIMED_BYTES)
    assert modeled >= 0.02
    for rank in two:
        # No run ends before the model says (a rank completes at the last arrival + the modeled time),
        # and the emulator's best schedule, from the last rank's issue to the end it set, both stamped by
        # the issuing threads' own calls, is within 10 % of it: load moves neither stamp's difference.
        runs = rank["times"][op]
        assert modeled * 0.99 <= min(runs["wall_s"]) and min(runs["schedule_s"]) <= modeled * 1.10, (op, runs, modeled)


@pytest.mark.parametrize("op", TIMED_OPS)
def test_four_rank_time_matches_model(four: list[dict[str, Any]], op: str) -> None:
    modeled = _modeled_s(op, 4, jobs.FOUR_RANK_BYTES)  # 2 sites x 2 ranks: hierarchical since issue 15
    assert modeled >= 0.02
    for rank in four:
        # (issue 15) every rank completes at the *last* rank's arrival + modeled: the schedule runs from
        # that issue, so the ms by which 4 processes on 2 shared cores leave a barrier apart do not count.
        runs = rank["times"][op]  # as above
        assert modeled * 0.99 <= min(runs["wall_s"]) and min(runs["schedule_s"]) <= modeled * 1.10, (op, runs, modeled)


def test_async_all_reduce_overlaps_compute(two: list[dict[str, Any]]) -> None:
    comm, compute = _modeled_s("all_reduce", 2, jobs.TIMED_BYTES), jobs.OVERLAP_COMPUTE_S
    longer, total = max(compute, comm), compute + comm
    for rank in two:
        runs = rank["overlap"]["step_s"]
        # no run beats the longer of the two (the busy loop runs to a deadline; the all-reduce
        # completes no earlier than its model); the best run, which load only slows, hides the
        # shorter one: close to the longer, far from their sum
        assert 0.99 * longer <= min(runs) <= longer + 0.15 * min(compute, comm) + 0.005, (runs, comm, compute)
        assert min(runs) < 0.8 * total, (runs, comm, compute)


def test_ddp_and_plain_all_reduce_are_bit_identical(two: list[dict[str, Any]]) -> None:
    for rank in two:
        assert rank["ddp_identical"] and rank["allreduce_identical"]
        assert rank["ddp_counts"].get("all_reduce", 0) >= 3  # DDP's reducer went through emu
        assert rank["ddp_counts"].get("broadcast", 0) >= 1  # its initial state sync too


def test_hsdp_is_bit_identical_and_sub_groups_get_their_tier(four: list[dict[str, Any]]) -> None:
    for rank in four:
        assert rank["hsdp_identical"]
        assert rank["hsdp_tiers"] == {"replicate": "WAN", "shard": "LAN"}
        counts = rank["hsdp_counts"]
        assert counts["all_gather"] > 0 and counts["reduce_scatter"] > 0 and counts["all_reduce"] > 0


@pytest.mark.parametrize("world", [2, 4])
def test_every_collective_path_is_emulated(two: list[dict[str, Any]], four: list[dict[str, Any]], world: int) -> None:
    for rank in two if world == 2 else four:
        assert rank["path_counts"] == PATH_KINDS
        # every c10d call (each reaches gloo through the dispatcher) has its emu event
        assert rank["num_emu_events"] == rank["num_c10d_events"] == sum(PATH_KINDS.values())


LABEL = re.compile(
    r"^cpdpkit::emu::all_reduce\[bytes=1048576,tier=WAN,ranks=0-1,modeled_us=(?P<us>\d+\.\d)\]$"
)


def test_profiler_event_follows_the_contract(two: list[dict[str, Any]]) -> None:
    modeled_us = _modeled_s("all_reduce", 2, jobs.TIMED_BYTES) * 1e6
    for rank in two:
        for mode in ("all_threads", "default"):
            (event,) = rank["profiler"][mode]
            match = LABEL.match(event["name"])
            assert match, event["name"]
            assert float(match["us"]) == pytest.approx(modeled_us, abs=0.1)
            assert event["cat"] == "user_annotation"
            # The event ends at the modeled end, as the issuing thread's call does (which also holds a
            # peer's late barrier exit; both timed by the profiler), but closed by the link's thread
            # after its own wake-up and read on another core: hence LINK_THREAD_US.
            # test_two_rank_time_matches_model judges the time against the model. With all
            # threads profiled the event opens when the link's thread takes the booking up, which
            # on 2 loaded cores has been 7 ms after the issue: hence the lower bound's margin.
            low = 0.8 if mode == "all_threads" else 0.9
            assert modeled_us * low <= event["dur_us"] <= event["call_us"] + LINK_THREAD_US, (mode, event, modeled_us)
        assert not rank["profiler"]["all_threads"][0]["on_issuing_thread"]  # on the link's thread
        assert rank["profiler"]["default"][0]["on_issuing_thread"]


def test_counters_see_one_all_reduce(two: list[dict[str, Any]]) -> None:
    modeled = _modeled_s("all_reduce", 2, jobs.TIMED_BYTES)
    for rank in two:
        assert rank["tier_bytes"] == {"WAN": jobs.TIMED_BYTES}  # ring all-reduce: 2(p-1)/p·n = n on 2 ranks
        assert rank["modeled_s"] == {"WAN": pytest.approx(modeled, rel=1e-12)}  # a steady tier: the mean
        # the wait is part of the call, which also holds the barrier's exit skew
        assert modeled * 0.9 <= rank["blocked_s"] <= rank["call_s"], (rank["blocked_s"], rank["call_s"], modeled)


def test_meter_nests_counts_new_groups_and_times_only_its_thread(two: list[dict[str, Any]]) -> None:
    n = jobs.METER_BYTES
    all_reduce_s, broadcast_s = _modeled_s("all_reduce", 2, n), _modeled_s("broadcast", 2, n)
    for rank in two:
        assert rank["meter_outer_ops"] == {"all_reduce": 2, "barrier": 1, "broadcast": 1}
        assert rank["meter_inner_ops"] == {"all_reduce": 1, "broadcast": 1}
        wan = jobs.TEST_TOPOLOGY.place(2).group((0, 1))
        assert rank["meter_inner_bytes"] == {"WAN": wan.wire_bytes("all_reduce", n) + wan.wire_bytes("broadcast", n)}
        # the broadcast was waited on by another thread: only the all-reduce blocked this one. Its
        # wait (with any wait for the peer) lies inside its call; the broadcast's would add
        # >= broadcast_s, far more than the call spends outside its wait
        blocked_s, call_s = rank["meter_inner_blocked_s"], rank["meter_all_reduce_call_s"]
        assert all_reduce_s * 0.9 <= blocked_s <= call_s, (blocked_s, call_s, all_reduce_s, broadcast_s)


def test_every_rank_of_a_group_samples_the_same_jittered_time(two: list[dict[str, Any]]) -> None:
    """On a tier that varies, each collective takes the time of its own (seed, group, sequence)
    draw: the same on both ranks, different per call, and what the emulator then takes."""
    network = jobs.JITTER_TOPOLOGY.place(2).group([0, 1])
    cost = network.cost("all_reduce", jobs.TIMED_BYTES)
    name = two[0]["jitter_group_name"]
    assert two[1]["jitter_group_name"] == name
    expected = [network.sampled_time_s(cost, *jitter_draws(jobs.JITTER_SEED, f"{name}:{seq}"))
                for seq in range(1, jobs.NUM_JITTER_CALLS + 1)]
    low, high = network.time_range_s("all_reduce", jobs.TIMED_BYTES)
    assert all(low <= e <= high for e in expected) and len(set(expected)) == len(expected)
    for rank in two:
        draws = [call["modeled_s"]["WAN"] for call in rank["jitter_calls"]]
        assert draws == pytest.approx(expected, rel=1e-12)
        # each call timed from the later rank's issue (one host clock): no load moves that start
        ratios = [call["measured_s"] / call["modeled_s"]["WAN"] for call in rank["jitter_calls"]]
        assert min(ratios) >= 0.99 and sorted(ratios)[len(ratios) // 2] <= 1.10, ratios
    # a send and its recv draw from "<group>:p2p:<src>-><dst>:<n>": one time for both sides
    p2p = network.sampled_time_s(network.cost("send_recv", jobs.TIMED_BYTES), *jitter_draws(
        jobs.JITTER_SEED, f"{name}:p2p:0->1:1"))
    assert p2p != network.cost("send_recv", jobs.TIMED_BYTES).time_s
    assert [rank["jitter_p2p_modeled_s"] for rank in two] == [{"WAN": pytest.approx(p2p, rel=1e-12)}] * 2


def test_collective_times_out_instead_of_hanging(two: list[dict[str, Any]]) -> None:
    rank0 = two[0]
    # since issue 15 the emulator's arrival exchange notices first and names the missing rank in one line
    assert rank0["timeout_error"], rank0
    assert rank0["timeout_error"].startswith(
        "emu all_reduce on group world (ranks 0-1): ranks [1] did not arrive within 2 s; a rank died or hung"), rank0
    assert 1.5 <= rank0["timeout_after_s"] <= 10


# ---- no process group --------------------------------------------------------------------------
def test_meter_without_an_emulated_group_names_the_fix() -> None:
    with pytest.raises(DistributedSetupError, match=r"no default process group.*init_distributed\(topology="):
        meter()


class _DoneWork:
    """Stands in for the wrapped backend's Work."""

    def wait(self, timeout: Any = None) -> bool:
        return True


def test_a_collected_link_joins_its_helper_thread() -> None:
    counters = GroupCounters()
    link = Link("collect-test", counters)
    issued_s = time.monotonic()
    work = link.book(label="cpdpkit::emu::barrier[bytes=0]", modeled_s=0.05, inner=_DoneWork(), outputs=[],
                     timeout_s=5.0, issued_s=issued_s)
    waited_from_s = time.monotonic()  # after the helper thread's start, which may take a while
    work.wait()
    (helper,) = [t for t in threading.enumerate() if t.name == "cpdpkit-emu-collect-test"]
    # the wait counted on the group: from its start to the modeled end at least
    assert counters.read().blocked_s[threading.get_ident()] >= issued_s + 0.05 - waited_from_s - 1e-4
    del link
    gc.collect()
    assert not helper.is_alive()


def test_a_link_still_busy_at_exit_is_completed_and_joined() -> None:
    script = textwrap.dedent("""
        from cpdpkit.emulator._counters import GroupCounters
        from cpdpkit.emulator._link import Link

        class Inner:
            def wait(self, timeout=None):
                print("completed", flush=True)
                return True

        link = Link("exit-test", GroupCounters())
        link.book(label="cpdpkit::emu::barrier[bytes=0]", modeled_s=0.3, inner=Inner(), outputs=[], timeout_s=5.0)
        print("exiting", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["exiting", "completed"]
