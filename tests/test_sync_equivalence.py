"""When CPDP's gradient all-reduce matters: ``cpdp`` against ``slowmo`` on 2 real gloo ranks.

A reconciliation of ``cpdp`` all-reduces gradients, steps, then averages; ``slowmo`` steps on
local gradients, then averages. With an update linear in the gradient and no optimizer state
(plain SGD, no momentum, no weight decay) both give mean(x_r) - lr * mean(g_r): the same
parameters to rounding. With state (momentum buffers, Adam's moments) the all-reduced gradient
enters the state and the runs part. Benchmarks must use the second kind (docs/api.md).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _ranks import RANKS_TIMEOUT_S, share_ranks
from cpdpkit.sync import PeriodicSyncOptimizer
from sync_reference import batch, make_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(RANKS_TIMEOUT_S)]  # sync_ranks: all of it

PERIOD, PERIODS = 3, 4  # 12 steps: 4 reconciliations, each after 2 local steps
SAME_TOL = 1e-6  # measured: 1.5e-7 (float32 rounding)
DIFFERENT_BY = 1e-4  # 100x the tolerance; measured: 1.7e-3 (momentum 0.9), 4.5e-2 (Adam)

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


def _train(rank: int, world: int, strategy: str, optimizer: str) -> list[torch.Tensor]:
    model = make_model(0)
    opt = PeriodicSyncOptimizer(OPTIMIZERS[optimizer](model.parameters()), model=model, strategy=strategy,
                                period=PERIOD, slowmo_momentum=0.5, timeout_s=60)
    for n in range(1, PERIOD * PERIODS + 1):
        opt.zero_grad()
        x, y = batch(rank, n)  # different data on every rank: local steps diverge
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert opt.stats.reconciliations == PERIODS
    return [p.detach().clone() for p in model.parameters()]


def _cpdp_and_slowmo(rank: int, world: int) -> dict[str, dict[str, list[torch.Tensor]]]:
    return {name: {s: _train(rank, world, s, name) for s in ("cpdp", "slowmo")} for name in OPTIMIZERS}


# on the session's one pair of spawned ranks (tests/conftest.py sync_ranks)
share_ranks(__name__, {"runs": (_cpdp_and_slowmo, {})}, timeout_s=80.0)


@pytest.fixture(scope="module")
def runs(sync_ranks):
    return sync_ranks[__name__]["runs"]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def _moved(rank_runs: dict, name: str) -> float:
    start = list(make_model(0).parameters())
    return _max_diff(rank_runs[name]["slowmo"], [p.detach() for p in start])


def test_plain_sgd_cpdp_equals_slowmo(runs):
    for rank, res in enumerate(runs):
        assert _moved(res, "sgd") > 0.05, "training must move the parameters (measured 0.08), or equality says nothing"
        diff = _max_diff(res["sgd"]["cpdp"], res["sgd"]["slowmo"])
        assert diff <= SAME_TOL, f"rank {rank}: plain SGD, max |cpdp - slowmo| = {diff:.3g}"


@pytest.mark.parametrize("name", ["sgd-momentum", "adam"])
def test_with_optimizer_state_cpdp_differs_from_slowmo(runs, name):
    for rank, res in enumerate(runs):
        diff = _max_diff(res[name]["cpdp"], res[name]["slowmo"])
        assert diff > DIFFERENT_BY, f"rank {rank}: {name}, max |cpdp - slowmo| = {diff:.3g}"


def test_ranks_agree_after_the_last_reconciliation(runs):
    # 12 steps end on a reconciliation: both ranks hold the same parameters, so the comparison above
    # is between two models, not four
    for name in OPTIMIZERS:
        for strategy in ("cpdp", "slowmo"):
            assert _max_diff(runs[0][name][strategy], runs[1][name][strategy]) == 0.0, (name, strategy)
