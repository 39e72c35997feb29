"""The outer step as an optimizer (``outer_optimizer=``), on 2 real gloo ranks.

SlowMo is one instance: with a constant inner lr γ its update equals ``torch.optim.SGD(lr=α,
momentum=β)`` on the pseudo-gradient ``anchor − average``. DiLoCo's Nesterov SGD is checked against a
reference simulated here with hand-written Nesterov arithmetic (no torch optimizer, no cpdpkit
helper). A checkpoint taken mid-period resumes bit-identically with the outer state (DiLoCo's
momentum, Adam's moments and step count).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _ranks import RANKS_TIMEOUT_S, share_ranks
from _resume import params, straight_and_resumed, train
from cpdpkit.errors import ConfigError
from cpdpkit.sync import PeriodicSyncOptimizer, SyncConfig
from sync_reference import batch, make_model

PERIOD, STEPS, LR = 3, 12, 0.05
TOL = 1e-6


def _inner(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def _run(rank: int, **options) -> list[torch.Tensor]:
    model = make_model(0)
    opt = PeriodicSyncOptimizer(_inner(model), model=model, period=PERIOD, timeout_s=60, **options)
    train(opt, model, rank, range(1, STEPS + 1))
    return params(model)


def _resume(rank: int, stop: int, **options) -> dict:
    def build():
        model = make_model(0)
        return model, PeriodicSyncOptimizer(_inner(model), model=model, period=PERIOD, timeout_s=60, **options)

    run = straight_and_resumed(build, rank, stop=stop, steps=STEPS)
    saved = run.saved["opt"]["cpdpkit"]
    return {"straight": run.straight, "resumed": run.resumed, "saved_outer": saved["outer"],
            "saved_slow_momentum": saved["slow_momentum"], "anchor_numel": sum(a.numel() for a in saved["anchor"]),
            "slowmo_bytes": run.opt._flat.slowmo_bytes()}


def _job(rank: int, world: int) -> dict:
    out = {}
    for strategy in ("slowmo", "cpdp"):
        out[f"{strategy}-slowmo"] = _run(rank, strategy=strategy, slowmo_momentum=0.5, slowmo_lr=1.0)
        out[f"{strategy}-sgd"] = _run(rank, strategy=strategy, outer_optimizer="SGD", outer_lr=1.0,
                                      outer_momentum=0.5)
        out[f"{strategy}-diloco"] = _run(rank, strategy=strategy, outer_optimizer="diloco")
    out["resume-diloco"] = _resume(rank, 7, strategy="cpdp", outer_optimizer="diloco")
    out["resume-adam"] = _resume(rank, 7, strategy="slowmo", outer_optimizer="Adam", outer_lr=0.5)
    out["resume-slowmo"] = _resume(rank, 7, strategy="cpdp", slowmo_momentum=0.5)
    return out


share_ranks(__name__, {"all": (_job, {})}, timeout_s=120.0)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(RANKS_TIMEOUT_S)]


@pytest.fixture(scope="module")
def results(sync_ranks):
    return sync_ranks[__name__]["all"]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def _diloco_reference(strategy: str, world: int = 2, lr: float = 0.7, mu: float = 0.9) -> list[list[torch.Tensor]]:
    """Every worker's parameters: inner SGD (momentum 0.9), the outer Nesterov step by hand."""
    models = [make_model(0) for _ in range(world)]
    opts = [_inner(m) for m in models]
    params = [list(m.parameters()) for m in models]
    anchor = [p.detach().clone() for p in params[0]]
    buf = [torch.zeros_like(a) for a in anchor]
    first = True
    average_first = strategy == "cpdp"
    for n in range(1, STEPS + 1):
        for r in range(world):
            opts[r].zero_grad()
            x, y = batch(r, n)
            nn.functional.mse_loss(models[r](x), y).backward()
        if strategy == "cpdp" and n % PERIOD == 0:  # the synchronous step: mean gradients
            for i in range(len(anchor)):
                g = torch.stack([params[r][i].grad for r in range(world)]).mean(dim=0)
                for r in range(world):
                    params[r][i].grad = g.clone()
        for o in opts:
            o.step()
        if (n + 1 if average_first else n) % PERIOD:
            continue
        for i in range(len(anchor)):
            delta = anchor[i] - torch.stack([params[r][i].detach() for r in range(world)]).mean(dim=0)
            buf[i] = delta.clone() if first else mu * buf[i] + delta  # torch's SGD: the first buffer is g
            anchor[i] = anchor[i] - lr * (delta + mu * buf[i])  # Nesterov
            for r in range(world):
                params[r][i].data.copy_(anchor[i])
        first = False
    return [[p.detach().clone() for p in ps] for ps in params]


@pytest.mark.parametrize("strategy", ["slowmo", "cpdp"])
def test_slowmo_is_sgd_with_momentum_on_the_pseudo_gradient(results, strategy):
    for rank, res in enumerate(results):
        diff = _max_diff(res[f"{strategy}-slowmo"], res[f"{strategy}-sgd"])
        assert diff <= TOL, f"rank {rank}: {strategy}: max |slowmo - SGD(lr=1, momentum=0.5)| = {diff:.3g}"
        moved = _max_diff(res[f"{strategy}-slowmo"], [p.detach() for p in make_model(0).parameters()])
        assert moved > 0.05, "training must move the parameters, or equality says nothing"


@pytest.mark.parametrize("strategy", ["slowmo", "cpdp"])
def test_diloco_equals_a_hand_written_nesterov_reference(results, strategy):
    ref = _diloco_reference(strategy)
    for rank, res in enumerate(results):
        diff = _max_diff(res[f"{strategy}-diloco"], ref[rank])
        assert diff <= TOL, f"rank {rank}: {strategy} diloco: max |ours - reference| = {diff:.3g}"
        assert _max_diff(res[f"{strategy}-diloco"], res[f"{strategy}-slowmo"]) > 1e-3  # a different outer step


@pytest.mark.parametrize("name", ["resume-diloco", "resume-adam"])
def test_outer_state_resumes_bit_identically(results, name):
    for res in results:
        assert all(torch.equal(a, b) for a, b in zip(res[name]["straight"], res[name]["resumed"], strict=True))
        saved = res[name]["saved_outer"]
        assert saved is not None and len(saved["state"]) == 1  # one flat fp32 segment
        assert saved["state"][0], "the outer optimizer's state (momentum / moments) was saved"


@pytest.mark.parametrize("name", ["resume-diloco", "resume-adam", "resume-slowmo"])
def test_slow_momentum_exists_only_for_slowmos_outer_step(results, name):
    for res in results:
        r = res[name]
        fp32 = 4 * r["anchor_numel"]
        if name == "resume-slowmo":  # anchor and slow momentum, saved and resumed (bit-identically)
            assert r["saved_slow_momentum"] is not None and any(u.abs().max() > 0 for u in r["saved_slow_momentum"])
            assert r["slowmo_bytes"] == 2 * fp32
            assert all(torch.equal(a, b) for a, b in zip(r["straight"], r["resumed"], strict=True))
        else:  # another outer optimizer keeps its own state: no SlowMo buffer allocated, saved or restored
            assert r["saved_slow_momentum"] is None and r["slowmo_bytes"] == fp32


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"outer_optimizer": "Foo"}, "outer_optimizer 'Foo' is not a torch optimizer: pass 'slowmo', 'diloco' or the "
                                     "name of a torch.optim.Optimizer class, e.g. 'SGD' or 'Adam'"),
        ({"outer_optimizer": "lr_scheduler"}, "outer_optimizer 'lr_scheduler' is not a torch optimizer: pass 'slowmo', "
                                              "'diloco' or the name of a torch.optim.Optimizer class, e.g. 'SGD' or "
                                              "'Adam'"),
        ({"strategy": "localsgd", "outer_optimizer": "diloco"},
         "outer_optimizer='diloco' with strategy 'localsgd': only slowmo and cpdp take an outer step; use one of "
         "them, or leave outer_optimizer='slowmo'"),
        ({"outer_lr": 0.7}, "outer_lr/outer_momentum with outer_optimizer='slowmo': SlowMo's are slowmo_lr and "
                            "slowmo_momentum; pass those, or another outer_optimizer"),
        ({"outer_optimizer": "diloco", "outer_lr": 0.0}, "outer_lr must be > 0 or None, got 0.0: DiLoCo's is 0.7"),
        ({"slowmo_momentum": [0.0, 0.5]},
         "slowmo_momentum takes one value, got [0.0, 0.5]: construct one optimizer per value (cpdpkit bench sweeps "
         "--periods, --slowmo-momentum and --outer-lr)"),
    ],
)
def test_bad_outer_optimizer_is_one_line(options, message):
    with pytest.raises(ConfigError) as info:
        SyncConfig(**options)
    assert str(info.value) == message
