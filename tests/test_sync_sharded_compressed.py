"""cpdp's compressed gradient exchange over FSDP2 (4 ranks: 2 sites x 2), off FSDP2's hook.

The replicate groups ({0, 2}, {1, 3}) run on the emulated backend, so its wait records (the seconds each
thread spent in ``EmulatedWork.wait``, by tier) say where the WAN exchange was waited for: inside backward
(FSDP2's all-reduce hook) or in ``step()``. The shard groups (the sites) stay on plain gloo. The reference is
the same run with every exchange waited inside the hook (``defer = False``, the path before the proof).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import _sharded_sync_jobs as jobs
from _ranks import SPAWN_TIMEOUT_S, share_fn
from cpdpkit.sync._codec import Codec
from cpdpkit.topology import Tier, TopologySpec

pytestmark = pytest.mark.timeout(SPAWN_TIMEOUT_S)

# Two sites of two ranks; small delays: the test reads the emulator's wait records and counts, not its clock.
SITES = TopologySpec(
    name="test-two-sites",
    tiers=(Tier(name="LAN", latency_s=1e-4, bandwidth_bytes_per_s=1e9),
           Tier(name="WAN", latency_s=2e-3, bandwidth_bytes_per_s=100e6)),
    intra_node_tier="LAN", inter_site_tier="WAN", ranks_per_node=None, nodes_per_site=1, num_sites=2,
)
# K=2, no warm-up, average-then-step: averages end steps 1, 3, 5, 7, 9; the compressed synchronous steps follow
STEPS, PERIOD = 9, 2
RECONCILED, SYNC_STEPS = (1, 3, 5, 7, 9), (2, 4, 6, 8)


def _run(rank: int, replicate: Any, shard_mesh: Any, *, defer: bool) -> dict[str, Any]:
    from cpdpkit.emulator import meter
    from cpdpkit.sync import PeriodicSyncOptimizer

    model = jobs.shard(jobs.make_model(), shard_mesh)
    opt = PeriodicSyncOptimizer(jobs.adamw(model), model=model, group=replicate, strategy="cpdp", period=PERIOD,
                                warmup_steps=0, compression="int8", timeout_s=60)
    opt._shard_grads.defer = defer  # False: today's blocking path, the reference
    steps = []
    with meter(replicate) as total:
        for n in range(1, STEPS + 1):
            x, y = jobs.batch(rank, n)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            with meter(replicate) as in_backward:
                loss.backward()
            with meter(replicate) as in_step:
                opt.step()
            steps.append({"backward_wan_s": in_backward.blocked_s_by_tier.get("WAN", 0.0),
                          "backward_ops": in_backward.op_counts,
                          "step_wan_s": in_step.blocked_s_by_tier.get("WAN", 0.0), "step_ops": in_step.op_counts})
    own = opt.state_dict()["cpdpkit"]
    return {"params": jobs.full(model), "residuals": [t.clone() for t in own["residuals"]],
            "grad_residuals": [t.clone() for t in own["grad_residuals"]], "sent": opt.stats.bytes_sent,
            "wan_bytes": total.bytes_by_tier, "ops": total.op_counts, "steps": steps,
            "local_numel": sum(p.to_local().numel() for p in model.parameters())}


def _job(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from cpdpkit.emulator import EmulatorConfig, register_emulated_backend

    register_emulated_backend(EmulatorConfig(topology=SITES.place(world)))
    replicates = [dist.new_group([0, 2], backend="emu"), dist.new_group([1, 3], backend="emu")]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))  # its shard dim: the sites
    return {defer: _run(rank, replicates[rank % 2], mesh["shard"], defer=defer) for defer in (True, False)}


# after the other 4-rank jobs: it leaves emulated groups behind in the shared processes
share_fn(__name__, "offhook", _job, 4, timeout_s=90.0, order=1)


@pytest.fixture(scope="module")
def ranks(planner_spawn) -> list[dict]:
    return planner_spawn[__name__]["offhook"]


def test_deferred_decode_equals_the_blocking_path_bit_for_bit(ranks: list[dict]) -> None:
    for r in ranks:
        deferred, blocking = r[True], r[False]
        assert all(torch.equal(a, b) for a, b in zip(deferred["params"], blocking["params"], strict=True))
        for key in ("residuals", "grad_residuals"):  # the error feedback of 5 reconciliations and 4 exchanges
            assert all(torch.equal(a, b) for a, b in zip(deferred[key], blocking[key], strict=True)), key
            assert all(t.abs().max() > 0 for t in deferred[key]), key
        assert (deferred["sent"], deferred["ops"], deferred["wan_bytes"]) == \
            (blocking["sent"], blocking["ops"], blocking["wan_bytes"])
    # the training moved the parameters (a vacuous equality otherwise)
    assert not all(torch.equal(a, b) for a, b in zip(ranks[0][True]["params"], jobs.full(jobs.make_model())))


def test_counted_wan_bytes_are_the_codes_at_the_network_models_price(ranks: list[dict]) -> None:
    wan = SITES.place(4).group((0, 2))
    for r in ranks:
        run = r[True]
        units = [t.numel() for t in run["grad_residuals"]]  # one residual per FSDP2 unit, shard-sized
        assert len(units) >= 2 and sum(units) >= run["local_numel"]
        reconciliations = len(RECONCILED)
        assert run["ops"] == {"all_gather": len(SYNC_STEPS) * len(units) + reconciliations}
        grad_wire = sum(wan.wire_bytes("all_gather", 2 * Codec("int8", n).nbytes) for n in units)
        param_wire = wan.wire_bytes("all_gather", 2 * Codec("int8", run["local_numel"]).nbytes)
        assert run["wan_bytes"] == {"WAN": len(SYNC_STEPS) * grad_wire + reconciliations * param_wire}
        assert run["sent"] == len(SYNC_STEPS) * sum(Codec("int8", n).nbytes for n in units) \
            + reconciliations * Codec("int8", run["local_numel"]).nbytes


def test_the_wan_wait_is_in_step_not_in_the_hook_once_proved(ranks: list[dict]) -> None:
    for r in ranks:
        units = len(r[True]["grad_residuals"])
        for defer, run in r.items():
            for n, s in enumerate(run["steps"], start=1):
                # the averages cross in step(), after backward; on the other steps nothing crosses under backward
                assert s["step_ops"] == ({"all_gather": 1} if n in RECONCILED else {}), (defer, n)
                if n not in SYNC_STEPS:
                    assert (s["backward_ops"], s["backward_wan_s"]) == ({}, 0.0), (defer, n)
                    continue
                # every unit's codes are launched under backward, whichever path waits for them
                assert s["backward_ops"] == {"all_gather": units}, (defer, n)
                if not defer or n == SYNC_STEPS[0]:  # the reference, and the step that proves the aliasing
                    assert s["backward_wan_s"] > 0, (defer, n)
                else:  # no wait on the WAN inside backward at all: FSDP2's hook returned with the work pending
                    assert s["backward_wan_s"] == 0.0, (defer, n)
                    assert s["step_wan_s"] > 0, (defer, n)
