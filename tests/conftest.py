"""Shared fixtures of the test suite: the session's spawned process groups, and a one-rank world.

Spawning a rank costs 2-4 s of importing torch (more with FSDP) on 2 CPU cores, more than most jobs
run. Test modules register their multi-process jobs at import (collection); the first test that asks
for a group runs every collected module's jobs in it, one after the other, and the rest read their
results. Each job of ``planner_spawn`` gets its own process group; the calls of ``sync_ranks`` share one
(each builds its own models, optimizers and sub-groups, and seeds its own data). Every test still
asserts everything it asserted when it spawned its own ranks. All of it starts ranks through
tests/_ranks.py, the one module that does."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

import _ranks


@pytest.fixture(scope="session")
def planner_spawn(request, tmp_path_factory):
    """The jobs that test modules registered with ``_ranks.share_spawn`` (apply_plan, the two
    executors, the collective labels, the network model's agreement, the 4-rank sync numerics, the
    jobs of the sharding and hybrid suites' CLI runs: tests/_suite_jobs.py), run
    one after the other in ONE spawned group of 4 processes, each job with its own process group (a
    2-rank job on ranks 0-1) and DTensor's caches emptied before it: torch, FSDP and dynamo are
    imported once per session instead of once per job. Results by owner (the registering module's
    ``__name__``), then job. (The emulator's timing jobs keep their own spawns.)"""
    return _ranks.run_shared_spawn(tmp_path_factory.mktemp("planner_spawn"), _collected_modules(request))


@pytest.fixture(scope="session")
def sync_ranks(request):
    """The 2-rank calls that test modules registered with ``_ranks.share_ranks`` (the sync
    scenarios), run one after the other on ONE pair of spawned gloo ranks: results by owner, then call."""
    return _ranks.run_shared_calls(_collected_modules(request))


@pytest.fixture
def world1():
    """A one-rank gloo world in the test process (its TCPStore on port 0), destroyed after the test."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))
    yield
    dist.destroy_process_group()


# pytest-xdist (`make test TEST_WORKERS=3`: -n 3 --dist loadgroup): the tests of one
# xdist_group run on one worker, one after the other, so a session fixture that runs every collected
# module's jobs runs once per run, not once per worker. Each test that asks for one of these fixtures
# joins its group here (the bench suites' CLI runs too: their jobs are in planner_spawn).
# Without -n the groups mean nothing.
RANKS4 = "ranks4"
FIXTURE_GROUPS = {"planner_spawn": RANKS4, "sync_ranks": "sync_ranks"}


def pytest_configure(config):
    # xdist registers its mark only when it runs workers (-n); without -n an unknown mark would warn
    config.addinivalue_line("markers", "xdist_group(name): the tests of one group run on one pytest-xdist worker")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        names = getattr(item, "fixturenames", ())
        for fixture, group in FIXTURE_GROUPS.items():
            if fixture in names:
                item.add_marker(pytest.mark.xdist_group(group))


def _collected_modules(request) -> set[str]:
    """The test modules pytest collected: only their registered jobs run."""
    return {item.module.__name__ for item in request.session.items if getattr(item, "module", None)}
