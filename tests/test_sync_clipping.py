"""``PeriodicSyncOptimizer.clip_grad_norm_`` and ``finish_gradients``, on 2 real gloo ranks.

``cpdp`` (average-then-step, K = 3, SGD with momentum) with clipping on every step against a reference written
here from the definitions: on the synchronous steps DDP + ``torch.nn.utils.clip_grad_norm_`` (the mean gradient,
then clipping), on the local steps clipping of each worker's own gradient. The reference shares no code with the
implementation (only the model builder and the data of tests/sync_reference.py). Also: ``step()`` after it does
not wait or average again (the buckets' finish count, the collectives count); torch's ``clip_grad_norm_`` called
directly before ``step()`` clips the local gradients (a different result); bad input, exact one-line messages.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from _ranks import RANKS_TIMEOUT_S, share_ranks
from _sync_helpers import max_diff
from cpdpkit.errors import ConfigError
from cpdpkit.sync import PeriodicSyncOptimizer
from cpdpkit.sync._grad_buckets import GradientBuckets
from sync_reference import batch, make_model

pytestmark = pytest.mark.timeout(RANKS_TIMEOUT_S)  # sync_ranks: all of it

PERIOD, STEPS, BETA, LR, MAX_NORM = 3, 9, 0.5, 0.05, 0.3
SYNC_STEPS = (3, 6, 9)  # average-then-step, no warm-up: the replicas are averaged at the end of steps 2, 5, 8
SAME_TOL = 1e-6


def _train(rank: int, clip: str) -> dict:
    """``clip``: "wrapper" (opt.clip_grad_norm_), "finish" (opt.finish_gradients() first), "torch" (torch's
    clip_grad_norm_ directly before step()), "none"."""
    finishes = []
    original = GradientBuckets.finish

    def counted(self, comm):  # the buckets' wait-and-write-back, counted
        finishes.append(1)
        return original(self, comm)

    GradientBuckets.finish = counted
    try:
        model = make_model(0)
        opt = PeriodicSyncOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), model=model,
                                    strategy="cpdp", period=PERIOD, slowmo_momentum=BETA, timeout_s=60)
        norms = []
        for n in range(1, STEPS + 1):
            opt.zero_grad()
            x, y = batch(rank, n)
            nn.functional.mse_loss(model(x), y).backward()
            if clip == "finish":
                opt.finish_gradients()
                opt.finish_gradients()  # a second call changes nothing
            if clip in ("wrapper", "finish"):
                norms.append(opt.clip_grad_norm_(MAX_NORM).item())
            elif clip == "torch":
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
    finally:
        GradientBuckets.finish = original
    return {"params": [p.detach().clone() for p in model.parameters()], "norms": norms, "finishes": len(finishes),
            "collectives": opt.stats.collectives, "gradient_syncs": opt.stats.gradient_syncs}


def _job(rank: int, world: int) -> dict:
    return {clip: _train(rank, clip) for clip in ("wrapper", "finish", "torch", "none")}


share_ranks(__name__, {"all": (_job, {})}, timeout_s=60.0)


def _reference(world: int = 2) -> tuple[list[list[torch.Tensor]], list[list[float]]]:
    """Every worker's final parameters and each step's norm (the one clipped), from the definitions."""
    models = [make_model(0) for _ in range(world)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in models]
    params = [list(m.parameters()) for m in models]
    anchor = [p.detach().clone() for p in params[0]]
    slow_u = [torch.zeros_like(p) for p in anchor]
    norms: list[list[float]] = [[] for _ in range(world)]
    for n in range(1, STEPS + 1):
        for r in range(world):
            opts[r].zero_grad()
            x, y = batch(r, n)
            nn.functional.mse_loss(models[r](x), y).backward()
        if n in SYNC_STEPS:  # DDP: every worker steps on the mean gradient
            for i in range(len(anchor)):
                mean = torch.stack([params[r][i].grad for r in range(world)]).mean(dim=0)
                for r in range(world):
                    params[r][i].grad = mean.clone()
        for r in range(world):
            norms[r].append(torch.nn.utils.clip_grad_norm_(params[r], MAX_NORM).item())
            opts[r].step()
        if (n + 1) in SYNC_STEPS:  # the average and SlowMo's outer update, before the synchronous step
            with torch.no_grad():
                for i in range(len(anchor)):
                    xbar = torch.stack([params[r][i] for r in range(world)]).mean(dim=0)
                    slow_u[i] = BETA * slow_u[i] + (anchor[i] - xbar) / LR
                    anchor[i] = anchor[i] - LR * slow_u[i]
                    for r in range(world):
                        params[r][i].copy_(anchor[i])
    return [[p.detach().clone() for p in ps] for ps in params], norms


@pytest.fixture(scope="module")
def results(sync_ranks):
    return sync_ranks[__name__]["all"]


@pytest.fixture(scope="module")
def reference():
    return _reference()


def test_reference_clips_on_synchronous_and_local_steps(reference):
    _, norms = reference  # else the comparison below would not test the clipping
    assert any(norms[0][n - 1] > MAX_NORM for n in SYNC_STEPS)
    assert any(norms[r][n - 1] > MAX_NORM for r in range(2) for n in range(1, STEPS + 1) if n not in SYNC_STEPS)


@pytest.mark.parametrize("clip", ["wrapper", "finish"])
def test_clip_grad_norm_equals_ddp_plus_clipping_on_sync_steps_and_local_clipping_otherwise(results, reference, clip):
    ref_params, ref_norms = reference
    for rank in range(2):
        got = results[rank][clip]
        assert max_diff(got["params"], ref_params[rank]) < SAME_TOL
        assert max(abs(a - b) for a, b in zip(got["norms"], ref_norms[rank], strict=True)) < SAME_TOL
    for n in SYNC_STEPS:  # the norm of the averaged gradients: the same on both ranks
        assert results[0][clip]["norms"][n - 1] == results[1][clip]["norms"][n - 1]


def test_step_after_it_does_not_wait_or_average_again(results):
    for rank in range(2):
        plain = results[rank]["none"]
        for clip in ("wrapper", "finish"):
            got = results[rank][clip]
            assert got["finishes"] == plain["finishes"] == len(SYNC_STEPS)
            assert got["collectives"] == plain["collectives"]
            assert got["gradient_syncs"] == plain["gradient_syncs"] == len(SYNC_STEPS)


def test_torch_clip_before_step_clips_the_local_gradients(results, reference):
    ref_params, _ = reference  # what the docs say: not the DDP-equivalent result
    assert max_diff(results[0]["torch"]["params"], ref_params[0]) > 1e-4


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_norm": 0.0}, "clip_grad_norm_ got max_norm=0.0: pass a positive number (e.g. 1.0)"),
    ({"max_norm": -1}, "clip_grad_norm_ got max_norm=-1: pass a positive number (e.g. 1.0)"),
    ({"max_norm": math.nan}, "clip_grad_norm_ got max_norm=nan: pass a positive number (e.g. 1.0)"),
    ({"max_norm": "1.0"}, "clip_grad_norm_ got max_norm='1.0': pass a positive number (e.g. 1.0)"),
    ({"max_norm": True}, "clip_grad_norm_ got max_norm=True: pass a positive number (e.g. 1.0)"),
    ({"max_norm": 1.0, "norm_type": 0},
     "clip_grad_norm_ got norm_type=0: pass a positive number (e.g. 2.0, or float('inf'))"),
])
def test_bad_clip_arguments_are_one_line_before_any_collective(world1, kwargs, message):
    model = make_model(0)
    opt = PeriodicSyncOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model=model, strategy="cpdp",
                                period=PERIOD)
    nn.functional.mse_loss(model(batch(0, 1)[0]), batch(0, 1)[1]).backward()
    before = opt.stats.collectives
    with pytest.raises(ConfigError) as exc:
        opt.clip_grad_norm_(**kwargs)
    assert str(exc.value) == message
    assert opt.stats.collectives == before


def test_inside_no_sync_is_refused(world1):
    model = make_model(0)
    opt = PeriodicSyncOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model=model, strategy="ddp")
    with opt.no_sync(), pytest.raises(ConfigError) as exc:
        opt.finish_gradients()
    assert str(exc.value) == ("finish_gradients() inside opt.no_sync(): call it after the last backward of the "
                              "step, outside the no_sync() block")
