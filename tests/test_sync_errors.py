"""Bad input to PeriodicSyncOptimizer: one clear error, before any collective."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sync_scenarios as sc
from _ranks import RANKS_TIMEOUT_S, share_ranks
from cpdpkit.errors import ConfigError, DistributedSetupError
from cpdpkit.sync import PeriodicSyncOptimizer, SyncConfig

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"period": 0}, "period must be an integer >= 1 or 'auto', got 0: pass period=1 to "
                        "reconcile every step, a larger K, or 'auto'"),
        ({"period": "fast"}, "period must be an integer >= 1 or 'auto', got 'fast': pass period=1 "
                             "to reconcile every step, a larger K, or 'auto'"),
        ({"overlap_steps": -1}, "overlap_steps must be an integer >= 0, got -1: pass 0 to reconcile "
                                "blocking, or e.g. 2 to apply each average two steps after its launch"),
        ({"overlap_steps": 2, "optimizer_state": "average"},
         "overlap_steps=2 with optimizer_state='average': an averaged optimizer state cannot be "
         "applied late (it would erase the local steps' state, and Adam's second moments have no "
         "additive correction); use optimizer_state='keep' or overlap_steps=0"),
        ({"overlap_steps": 1, "strategy": "ddp"}, "overlap_steps=1 with strategy 'ddp': ddp never "
                                                  "reconciles; use strategy 'localsgd', 'slowmo' or "
                                                  "'cpdp', or overlap_steps=0"),
        ({"period": "auto", "k_min": 8, "k_max": 2}, "k_min=8 is above k_max=2: pass k_min <= k_max, "
                                                     "e.g. k_min=1, k_max=8"),
        ({"k_min": 0}, "k_min must be an integer >= 1, got 0: e.g. k_min=1"),
        ({"target_exposed_frac": 1.5}, "target_exposed_frac must be in (0, 1), got 1.5: e.g. 0.1 "
                                       "for at most 10 % of the step time exposed"),
        ({"max_divergence": 0}, "max_divergence must be > 0 or None, got 0: e.g. 0.01, or None to "
                                "let only the exposed-time target choose K"),
        ({"strategy": "fedavg"}, "unknown strategy 'fedavg': choose one of ddp, localsgd, "
                                 "slowmo, cpdp"),
        ({"cpdp_order": "average"}, "unknown cpdp_order 'average': choose one of average-then-step, "
                                    "step-then-average"),
        ({"warmup_steps": -1}, "warmup_steps must be an integer >= 0, got -1: pass 0 for no "
                               "warm-up"),
        ({"slowmo_momentum": 1.0}, "slowmo_momentum must be in [0, 1) or None, got 1.0: pass None for "
                                   "the measured default by replicas (slowmo_beta_for), or e.g. 0.2"),
        ({"slowmo_lr": 0}, "slowmo_lr must be > 0, got 0: pass 1.0 for SlowMo's default α"),
        ({"buffers": "sum"}, "unknown buffers 'sum': choose one of average, broadcast, local"),
        ({"optimizer_state": "drop"}, "unknown optimizer_state 'drop': choose one of keep, "
                                      "average, reset"),
        ({"bucket_cap_mb": 0}, "bucket_cap_mb must be > 0, got 0: DDP's default is 25"),
    ],
)
def test_config_errors_name_value_and_fix(kwargs, message):
    with pytest.raises(ConfigError) as info:
        SyncConfig(**kwargs)
    assert str(info.value) == message


def test_schedule_arithmetic():
    cfg = SyncConfig(strategy="cpdp", period=4, warmup_steps=2)
    kinds = [cfg.step_kind(n).value for n in range(1, 11)]
    assert kinds == ["warmup", "warmup", "local", "local", "local", "reconcile",
                     "local", "local", "local", "reconcile"]
    assert [cfg.syncs_gradients(n) for n in (1, 2, 3, 6)] == [True, True, False, True]
    lsgd = SyncConfig(strategy="localsgd", period=4, warmup_steps=2)
    assert not lsgd.syncs_gradients(6) and lsgd.averages_parameters(6)
    assert all(SyncConfig(strategy="ddp").syncs_gradients(n) for n in range(1, 5))
    # cpdp, average-then-step: averaged at the end of the step before each synchronous step
    assert [n for n in range(1, 11) if cfg.averages_parameters(n)] == [5, 9]
    old = SyncConfig(strategy="cpdp", period=4, warmup_steps=2, cpdp_order="step-then-average")
    assert [n for n in range(1, 11) if old.averages_parameters(n)] == [6, 10]
    # K = 1: no average at the end of warm-up (the replicas are identical there)
    k1 = SyncConfig(strategy="cpdp", period=1, warmup_steps=2)
    assert [n for n in range(1, 6) if k1.averages_parameters(n)] == [3, 4, 5]


def test_errors_without_process_group():
    model = nn.Linear(2, 2)
    with pytest.raises(DistributedSetupError, match="torch.distributed is not initialised"):
        PeriodicSyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer, got list"):
        PeriodicSyncOptimizer([], model=model)  # type: ignore[arg-type]

    class HookOnly:  # not a cpdpkit.contracts.SyncedExecutor: one of its methods is not the contract
        def attach_periodic_sync(self, outer: object) -> list:
            return []

    with pytest.raises(TypeError) as info:
        PeriodicSyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=HookOnly())
    assert str(info.value) == ("model must be an nn.Module or a TwoStageExecutor, got HookOnly: "
                               "pass model=<your module>")


def _foreign_and_fp16(rank: int, world: int) -> dict:
    out = {}
    model, other = nn.Linear(2, 2), nn.Linear(2, 2)
    try:
        PeriodicSyncOptimizer(torch.optim.SGD(other.parameters(), lr=0.1), model=model)
    except ConfigError as exc:
        out["foreign"] = str(exc)
    half = nn.Linear(2, 2).half()
    try:
        PeriodicSyncOptimizer(torch.optim.SGD(half.parameters(), lr=0.1), model=half,
                              strategy="slowmo")
    except ConfigError as exc:
        out["fp16"] = str(exc)
    ok = PeriodicSyncOptimizer(torch.optim.SGD(half.parameters(), lr=0.1), model=half,
                               strategy="slowmo", anchor_dtype=torch.float32)
    out["fp16_ok"] = ok.state_dict()["cpdpkit"]["anchor"][0].dtype
    return out


# on the session's one pair of spawned ranks (tests/conftest.py sync_ranks); bad_input after every other
# module's calls (its mismatched construction leaves the process group's collectives out of step)
share_ranks(__name__, {"foreign": (_foreign_and_fp16, {})}, timeout_s=30.0)
share_ranks(f"{__name__}:last", {"bad": (sc.bad_input, {})}, timeout_s=30.0, order=2)


@pytest.mark.slow
@pytest.mark.timeout(RANKS_TIMEOUT_S)  # the first test to ask for sync_ranks waits for all of it
def test_errors_that_need_a_process_group(sync_ranks):
    results, bad = sync_ranks[__name__]["foreign"], sync_ranks[f"{__name__}:last"]["bad"]
    r = results[0]
    assert r["foreign"] == ("parameter 0 of param group 0 (shape (2, 2)) is not a parameter of "
                            "model: build the optimizer from model.parameters()")
    assert r["fp16"] == ("parameters are torch.float16: SlowMo's anchor and slow momentum lose "
                         "updates in low precision; pass anchor_dtype=torch.float32")
    assert r["fp16_ok"] == torch.float32
    results = bad
    assert results[0]["group"] == "no error"
    assert results[1]["group"] == (
        "DistributedSetupError: this rank (1) is not a member of the group passed to "
        "PeriodicSyncOptimizer: pass a group created with this rank in its ranks")
    for res in results:
        assert res["mismatch"] == (
            "DistributedSetupError: ranks disagree on period (rank 0: 2, rank 1: 4): construct "
            "PeriodicSyncOptimizer with the same model and arguments on every rank")
