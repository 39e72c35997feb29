"""Where CPDP's gradient all-reduce sits, on 2 real gloo ranks against a reference written here.

``cpdp``'s default order, ``average-then-step``: the replicas are averaged (and SlowMo's outer update
applied) at the end of step n - 1, and step n runs forward and backward at that consensus and steps
on the all-reduced gradient. With plain SGD the replicas leave step n identical, and the result is
not ``slowmo``'s. The old order (``step-then-average``: the synchronous step, then the average)
gives, for plain SGD, mean_r(x_r - lr·ḡ) = mean_r(x_r - lr·g_r): exactly ``slowmo``; that is why it
is no longer the default (the all-reduce changed nothing the parameters see).

The reference (:func:`_reference`) is a plain single-process simulation of two workers written
from those definitions with per-parameter tensors: it shares no code with the implementation
(only the model builder and the data of tests/sync_reference.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _ranks import RANKS_TIMEOUT_S, share_ranks
from cpdpkit.sync import PeriodicSyncOptimizer
from sync_reference import batch, make_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(RANKS_TIMEOUT_S)]  # sync_ranks: all of it

PERIOD, PERIODS, BETA = 3, 4, 0.5  # 12 steps: 4 reconciliations
STEPS = PERIOD * PERIODS
SAME_TOL = 1e-6  # measured: <= 1.5e-7 (float32 rounding)
DIFFERENT_BY = 1e-4  # 100x the tolerance

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.01),
}
# (strategy, cpdp_order)
RUNS = [("ddp", None), ("localsgd", None), ("slowmo", None), ("cpdp", None), ("cpdp", "step-then-average")]


def _key(strategy: str, order: str | None) -> str:
    return strategy if order is None else f"{strategy}:{order}"


def _train(rank: int, strategy: str, order: str | None, optimizer: str) -> list[torch.Tensor]:
    model = make_model(0)
    options = {} if order is None else {"cpdp_order": order}
    opt = PeriodicSyncOptimizer(OPTIMIZERS[optimizer](model.parameters()), model=model, strategy=strategy,
                                period=None if strategy == "ddp" else PERIOD, slowmo_momentum=BETA, timeout_s=60,
                                **options)
    for n in range(1, STEPS + 1):
        opt.zero_grad()
        x, y = batch(rank, n)  # different data on every rank: local steps diverge
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert opt.stats.reconciliations == (0 if strategy == "ddp" else PERIODS)
    return [p.detach().clone() for p in model.parameters()]


def _all_runs(rank: int, world: int) -> dict[str, dict[str, list[torch.Tensor]]]:
    return {name: {_key(s, o): _train(rank, s, o, name) for s, o in RUNS} for name in OPTIMIZERS}


# on the session's one pair of spawned ranks (tests/conftest.py sync_ranks)
share_ranks(__name__, {"runs": (_all_runs, {})}, timeout_s=120.0)


def _reference(strategy: str, order: str | None, optimizer: str, world: int = 2) -> list[list[torch.Tensor]]:
    """Every worker's final parameters, from the definitions (module docstring), blocking, no warm-up."""
    models = [make_model(0) for _ in range(world)]
    opts = [OPTIMIZERS[optimizer](m.parameters()) for m in models]
    params = [list(m.parameters()) for m in models]
    lr = opts[0].param_groups[0]["lr"]
    anchor = [p.detach().clone() for p in params[0]]
    slow_u = [torch.zeros_like(p) for p in anchor]
    average_first = strategy == "cpdp" and order is None

    def average() -> None:
        for i in range(len(anchor)):
            xbar = torch.stack([params[r][i].detach() for r in range(world)]).mean(dim=0)
            if strategy in ("slowmo", "cpdp"):  # SlowMo: u <- βu + (x0 - x̄)/γ; x0 <- x0 - γu
                slow_u[i] = BETA * slow_u[i] + (anchor[i] - xbar) / lr
                anchor[i] = anchor[i] - lr * slow_u[i]
                xbar = anchor[i]
            for r in range(world):
                params[r][i].data.copy_(xbar)

    for n in range(1, STEPS + 1):
        for r in range(world):
            opts[r].zero_grad()
            x, y = batch(r, n)
            nn.functional.mse_loss(models[r](x), y).backward()
        if strategy == "ddp" or (strategy == "cpdp" and n % PERIOD == 0):
            for i in range(len(anchor)):
                g = torch.stack([params[r][i].grad for r in range(world)]).mean(dim=0)
                for r in range(world):
                    params[r][i].grad = g.clone()
        for o in opts:
            o.step()
        if strategy != "ddp" and (n + 1 if average_first else n) % PERIOD == 0:
            average()
    return [[p.detach().clone() for p in ps] for ps in params]


@pytest.fixture(scope="module")
def runs(sync_ranks):
    return sync_ranks[__name__]["runs"]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize(("strategy", "order"), RUNS)
def test_every_strategy_equals_the_reference(runs, strategy, order, optimizer):
    ref = _reference(strategy, order, optimizer)
    start = [p.detach() for p in make_model(0).parameters()]
    assert _max_diff(ref[0], start) > 0.05, "training must move the parameters, or equality says nothing"
    for rank, res in enumerate(runs):
        diff = _max_diff(res[optimizer][_key(strategy, order)], ref[rank])
        what = f"{_key(strategy, order)} {optimizer}"
        assert diff <= SAME_TOL, f"rank {rank}: {what}: max |ours - reference| = {diff:.3g}"


def test_plain_sgd_cpdp_differs_from_slowmo_and_the_old_order_does_not(runs):
    for rank, res in enumerate(runs):
        sgd = res["sgd"]
        diff = _max_diff(sgd["cpdp"], sgd["slowmo"])
        assert diff > DIFFERENT_BY, f"rank {rank}: plain SGD, max |cpdp - slowmo| = {diff:.3g}"
        old = _max_diff(sgd["cpdp:step-then-average"], sgd["slowmo"])
        assert old <= SAME_TOL, f"rank {rank}: plain SGD, max |cpdp step-then-average - slowmo| = {old:.3g}"


def test_plain_sgd_replicas_leave_the_synchronous_step_identical(runs):
    # step 12 is synchronous (averaged after step 11, all-reduced gradients): with plain SGD both ranks
    # take the same update from the same point; with momentum their buffers still differ
    assert _max_diff(runs[0]["sgd"]["cpdp"], runs[1]["sgd"]["cpdp"]) == 0.0
    assert _max_diff(runs[0]["sgd-momentum"]["cpdp"], runs[1]["sgd-momentum"]["cpdp"]) > DIFFERENT_BY
    for name in OPTIMIZERS:  # the old order and slowmo end on an average: identical whatever the state
        for key in ("slowmo", "cpdp:step-then-average", "ddp"):
            assert _max_diff(runs[0][name][key], runs[1][name][key]) == 0.0, (name, key)
