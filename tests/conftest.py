"""Shared fixtures of the test suite: the session's spawned process groups.

Spawning a rank costs 2-4 s of importing torch (more with FSDP) on 2 CPU cores, more than most jobs
run. Test modules register their multi-process jobs at import (collection); the first test that asks
for a group runs every collected module's jobs in it, one after the other, and the rest read their
results. Each job of ``planner_spawn`` gets its own process group; the calls of ``sync_ranks`` share one
(each builds its own models, optimizers and sub-groups, and seeds its own data). Every test still
asserts everything it asserted when it spawned its own ranks."""

from __future__ import annotations

import pytest

import _planner_jobs as pj
import dist_utils


@pytest.fixture(scope="session")
def planner_spawn(request, tmp_path_factory):
    """The jobs that test modules registered with ``_planner_jobs.share_spawn`` (apply_plan, the two
    executors, the collective labels, the network model's agreement, the 4-rank sync numerics), run
    one after the other in ONE spawned group of 4 processes, each job with its own process group (a
    2-rank job on ranks 0-1) and DTensor's caches emptied before it: torch, FSDP and dynamo are
    imported once per session instead of once per job. Results by owner (the registering module's
    ``__name__``), then job. (The emulator's timing jobs keep their own spawns.)"""
    return pj.run_shared(tmp_path_factory.mktemp("planner_spawn"), _collected_modules(request))


@pytest.fixture(scope="session")
def sync_ranks(request):
    """The 2-rank calls that test modules registered with ``dist_utils.share_ranks`` (the sync
    scenarios), run one after the other on ONE pair of spawned gloo ranks: results by owner, then call."""
    return dist_utils.run_shared(_collected_modules(request))


def _collected_modules(request) -> set[str]:
    """The test modules pytest collected: only their registered jobs run."""
    return {item.module.__name__ for item in request.session.items if getattr(item, "module", None)}
