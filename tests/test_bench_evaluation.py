"""The bench's evaluation: the mean of the ranks' parameters with rank 0's buffers, the test set split over ranks.

On 2 real gloo ranks whose parameters and BatchNorm statistics differ, the accuracy every rank gets
equals an independent reference: the ranks' state dicts averaged by hand (rank 0's buffers) and the
whole test set scored in one forward pass on one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _ranks import RANKS_TIMEOUT_S, share_ranks
from cpdpkit.bench.data.dataset import Dataset
from cpdpkit.bench.periodic import worker

TEST_N = 37  # odd: the two ranks' slices differ in size


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _data() -> Dataset:
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(TEST_N, 6, generator=g), torch.randint(0, 3, (TEST_N,), generator=g)
    return Dataset("toy", x[:4], y[:4], x, y, 3)


def _job(rank: int, world: int) -> dict:
    torch.manual_seed(100 + rank)  # every rank its own parameters
    model = _model()
    model.train()
    model(torch.randn(64, 6) * (1 + rank))  # and its own running statistics
    acc = worker._average_model_accuracy(model, _data(), rank, world)
    states: list = [None] * world
    dist.all_gather_object(states, {k: v.clone() for k, v in model.state_dict().items()})
    return {"acc": acc, "states": states, "training": model.training}


share_ranks(__name__, {"eval": (_job, {})}, timeout_s=30.0)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(RANKS_TIMEOUT_S)]


def test_split_evaluation_equals_the_whole_test_set_on_one_process(sync_ranks):
    results = sync_ranks[__name__]["eval"]
    states = results[0]["states"]
    params = {name for name, _ in _model().named_parameters()}
    reference = _model()
    reference.load_state_dict({k: (torch.stack([s[k] for s in states]).mean(0) if k in params else states[0][k])
                               for k in states[0]})
    reference.eval()
    data = _data()
    with torch.no_grad():
        expected = int((reference(data.x_test).argmax(1) == data.y_test).sum()) / TEST_N
    assert not torch.equal(states[0]["1.running_mean"], states[1]["1.running_mean"])  # rank 0's buffers matter
    assert 0 < expected < 1
    for rank, r in enumerate(results):
        assert r["acc"] == expected, f"rank {rank}: {r['acc']} != reference {expected}"
        assert r["training"], "evaluation must leave the trained module in training mode"
