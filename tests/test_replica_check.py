"""``check_replicas=True``: one checksum all-reduce per reconciliation (ddp: per step), and one line naming
the first differing parameter and the ranks when one rank's replica was corrupted (2 real gloo ranks)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from _ranks import SPAWN_TIMEOUT_S, share_fn
from cpdpkit.errors import ConfigError, DistributedSetupError
from cpdpkit.sync import PeriodicSyncOptimizer, SyncConfig
from cpdpkit.sync._replicas import checksum

FIX = ("something changed parameters on some ranks only (code that writes them outside the optimizer, or faulty "
       "hardware): fix that, then resume from the last checkpoint")


def _setup(**options: Any) -> tuple[nn.Module, PeriodicSyncOptimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    period = None if options.get("strategy") == "ddp" else 2  # ddp has no period
    opt = PeriodicSyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model=model,
                                period=period, **options)
    return model, opt


def _step(model: nn.Module, opt: PeriodicSyncOptimizer, rank: int, n: int) -> None:
    g = torch.Generator().manual_seed(10 * n + rank)  # each rank its own data: replicas diverge between reconciliations
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _collectives_of_checks(rank: int) -> dict[str, int]:
    """Extra collectives with the check on, per strategy, over 8 clean steps (no error raised)."""
    out = {}
    for options in ({"strategy": "ddp"}, {"strategy": "localsgd"}, {"strategy": "cpdp"},
                    {"strategy": "slowmo", "overlap_steps": 1}):
        counts = []
        for check in (False, True):
            model, opt = _setup(check_replicas=check, **options)
            for n in range(1, 9):
                _step(model, opt, rank, n)
            opt.flush()
            counts.append(opt.stats.collectives)
        out[str(options)] = counts[1] - counts[0]
    return out


def _corrupted(rank: int, options: dict[str, Any], corrupt: Any, steps: int) -> str:
    model, opt = _setup(check_replicas=True, **options)
    try:
        for n in range(1, steps + 1):
            _step(model, opt, rank, n)
            if rank == 1:
                corrupt(n, model, opt)
        opt.flush()
    except DistributedSetupError as exc:
        return str(exc)
    return "no error"


def _bump_param(n: int, model: nn.Module, opt: PeriodicSyncOptimizer) -> None:
    if n == 2:
        with torch.no_grad():
            model[2].weight[1, 3] += 1e-6


def _bump_slow_momentum(n: int, model: nn.Module, opt: PeriodicSyncOptimizer) -> None:
    if n == 2:  # SlowMo's momentum u of parameter '0.bias' (elements 32..39 of the flat layout): x0 <- x̄ - γβu
        opt._flat.segments[0].slow_momentum[33] += 1e-3


def _faulty_average(n: int, model: nn.Module, opt: PeriodicSyncOptimizer) -> None:
    if n == 1:  # from now on this rank's parameter average returns a wrong element of '0.weight'
        real = opt._slow.average_

        def average_(flats: Any, cap: int) -> None:
            real(flats, cap)
            flats[0][5] += 1e-6

        opt._slow.average_ = average_


def _job(rank: int, world: int) -> dict[str, Any]:
    return {
        "counts": _collectives_of_checks(rank),
        "ddp": _corrupted(rank, {"strategy": "ddp"}, _bump_param, 4),
        # a corrupted SlowMo momentum u changes the parameters only with β > 0 (the default β is 0: not here)
        "cpdp": _corrupted(rank, {"strategy": "cpdp", "slowmo_momentum": 0.5}, _bump_slow_momentum, 6),
        "slowmo-overlap": _corrupted(rank, {"strategy": "slowmo", "overlap_steps": 1, "slowmo_momentum": 0.5},
                                     _bump_slow_momentum, 6),
        "localsgd": _corrupted(rank, {"strategy": "localsgd"}, _faulty_average, 6),
        "localsgd-local-change": _corrupted(rank, {"strategy": "localsgd"}, _bump_param, 4),
    }


# on 2 ranks of the session's one spawned group (tests/conftest.py planner_spawn)
share_fn(__name__, "checks", _job, 2, timeout_s=60.0)


@pytest.mark.slow
@pytest.mark.timeout(SPAWN_TIMEOUT_S)  # the first test to ask for planner_spawn waits for all of it
def test_replica_check_names_the_first_differing_parameter_and_the_ranks(planner_spawn) -> None:
    results = planner_spawn[__name__]["checks"]
    for rank, res in enumerate(results):
        # one collective per reconciliation (steps 2, 4, 6, 8), ddp one per step
        assert res["counts"] == {"{'strategy': 'ddp'}": 8, "{'strategy': 'localsgd'}": 4,
                                 "{'strategy': 'cpdp'}": 4, "{'strategy': 'slowmo', 'overlap_steps': 1}": 4}, rank
        differs = "differs across replicas: rank(s) 1 hold other values than rank(s) 0 (1 of 4 parameters differ); "
        assert res["ddp"] == f"replica check after step 3: parameter '2.weight' (shape (2, 8)) {differs}{FIX}"
        # cpdp (average-then-step): the average of reconciliation 4 runs at the end of step 3
        assert res["cpdp"] == (f"replica check after the reconciliation of step 3: parameter '0.bias' (shape (8,)) "
                               f"{differs}{FIX}")
        # overlapped: launched at step 2, applied at step 3 with u corrupted after step 2
        assert res["slowmo-overlap"] == (f"replica check after the reconciliation of step 2: parameter '0.bias' "
                                         f"(shape (8,)) {differs}{FIX}")
        assert res["localsgd"] == (f"replica check after the reconciliation of step 2: parameter '0.weight' "
                                   f"(shape (8, 4)) {differs}{FIX}")
        # a change between reconciliations is averaged away at the next one: nothing to report
        assert res["localsgd-local-change"] == "no error"


def test_check_replicas_must_be_a_bool() -> None:
    with pytest.raises(ConfigError) as info:
        SyncConfig(check_replicas="yes")
    assert str(info.value) == ("check_replicas must be True or False, got 'yes': pass check_replicas=True to verify "
                               "identical replicas after each reconciliation")


def test_checksum_sees_one_bit_and_ignores_nothing() -> None:
    x = torch.randn(1000)
    y = x.clone()
    y.view(torch.int32)[500] ^= 1  # the lowest mantissa bit of one element
    assert int(checksum(x)) == int(checksum(x.clone())) and int(checksum(x)) != int(checksum(y))
    swapped = x.clone()
    swapped[[3, 7]] = x[[7, 3]]  # same values, other places
    assert int(checksum(swapped)) != int(checksum(x))
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        assert int(checksum(x.to(dtype))) != int(checksum(y.to(torch.float64).to(dtype) + 1))
