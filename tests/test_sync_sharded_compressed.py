"""cpdp's compressed gradient exchange over FSDP2 (4 ranks: 2 sites x 2), off FSDP2's hook.

The replicate groups ({0, 2}, {1, 3}) run on the emulated backend, so its wait records (the seconds each
thread spent in ``EmulatedWork.wait``, by tier) say where the WAN exchange was waited for: inside backward
(FSDP2's all-reduce hook) or in ``step()``. The shard groups (the sites) stay on plain gloo. The reference is
the same run with every exchange waited inside the hook (``defer = False``, the path before the proof).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import _sharded_sync_jobs as jobs
from _ranks import SPAWN_TIMEOUT_S, share_fn
from cpdpkit.sync._code_exchange import ChunkedFeedback
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
FOUR_SITES = dataclasses.replace(SITES, name="test-four-sites", num_sites=4)
CHUNKED_NUMEL, CHUNKED_ROUNDS = 1001, 4  # 4 chunks of 251 (the last padded), int8 blocks of 256
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
    out: dict[Any, Any] = {defer: _run(rank, replicates[rank % 2], mesh["shard"], defer=defer)
                           for defer in (True, False)}
    out["chunked"] = _chunked(rank, world)
    return out


def _payload(rank: int, round_: int) -> torch.Tensor:
    return torch.randn(CHUNKED_NUMEL, generator=torch.Generator().manual_seed(100 * rank + round_))


def _chunked(rank: int, world: int) -> dict[str, Any]:
    """Four sites of one rank: the reduce-scatter of codes, through a real FSDP2 unit's hook and in training."""
    from torch.distributed.device_mesh import init_device_mesh

    from cpdpkit.emulator import EmulatorConfig, meter, register_emulated_backend
    from cpdpkit.sync import PeriodicSyncOptimizer
    from cpdpkit.sync._comm import Communicator
    from cpdpkit.sync._sharded import ShardGradientSync

    register_emulated_backend(EmulatorConfig(topology=FOUR_SITES.place(world)))
    replicate = dist.new_group(backend="emu")
    sites = init_device_mesh("cpu", (4, 1), mesh_dim_names=("replicate", "shard"))["shard"]
    comm = Communicator(replicate, timeout_s=60)

    def sync() -> ShardGradientSync:
        return ShardGradientSync(jobs.shard(jobs.make_model(), sites), target=lambda: comm, compression="int8",
                                 compressed=lambda: True, replicas=world)

    out: dict[str, Any] = {}
    exchange, means = sync(), []
    with meter(replicate) as m:
        for round_ in range(CHUNKED_ROUNDS):  # FSDP2's hook on a payload of our own, waited in the hook
            grad = _payload(rank, round_)
            exchange._on_reduced([], 0, grad)
            means.append(grad)
            if round_ == 1:
                saved = exchange.state()
    out.update(means=means, ops=m.op_counts, wan_bytes=m.bytes_by_tier, sent=comm.bytes_sent, state=exchange.state())
    resumed = sync()
    resumed.load(saved)
    out["resumed"] = []
    for round_ in range(2, CHUNKED_ROUNDS):
        grad = _payload(rank, round_)
        resumed._on_reduced([], 0, grad)
        out["resumed"].append(grad)
    # in training: cpdp over the four sites, the synchronous steps' codes reduce-scattered, deferred to step()
    for defer in (True, False):
        model = jobs.shard(jobs.make_model(), sites)
        opt = PeriodicSyncOptimizer(jobs.adamw(model), model=model, group=replicate, strategy="cpdp", period=PERIOD,
                                    warmup_steps=1, compression="int8", timeout_s=60)
        opt._shard_grads.defer = defer
        with meter(replicate) as m:
            jobs.train(model, opt, rank, range(1, 6))
        own = opt.state_dict()["cpdpkit"]
        out[f"train_{defer}"] = {"ops": m.op_counts, "wan_bytes": m.bytes_by_tier, "params": jobs.full(model),
                                 "grad_residuals": own["grad_residuals"],
                                 "local_numel": sum(p.to_local().numel() for p in model.parameters())}
    return out


# after the other 4-rank jobs: it leaves emulated groups behind in the shared processes
share_fn(__name__, "offhook", _job, 4, timeout_s=90.0, order=1)


@pytest.fixture(scope="module")
def ranks(planner_spawn) -> list[dict]:
    return planner_spawn[__name__]["offhook"]


def _reference_chunked_means(world: int) -> list[torch.Tensor]:
    """An independent reference: the reduce-scatter of int8 codes, every rank simulated here from its payloads."""
    n, chunk = CHUNKED_NUMEL, -(-CHUNKED_NUMEL // world)
    codec = Codec("int8", chunk)
    first = [torch.zeros(world * chunk) for _ in range(world)]  # per rank: what its chunk codes lost (padded)
    second = [torch.zeros(chunk) for _ in range(world)]  # per rank j: what its chunk-mean code lost
    means = []
    for round_ in range(CHUNKED_ROUNDS):
        sent = []  # sent[r][j]: rank r's decoded code of chunk j
        for r in range(world):
            p = torch.cat([_payload(r, round_), torch.zeros(world * chunk - n)]) + first[r]
            sent.append([codec.decode(codec.encode(p[j * chunk:(j + 1) * chunk])[0]) for j in range(world)])
            first[r] = p - torch.cat(sent[r])
            first[r][n:] = 0  # the padding is no payload
        out = []
        for j in range(world):
            total = torch.zeros(chunk)
            for r in range(world):
                total += sent[r][j]
            m = total / world + second[j]
            decoded = codec.decode(codec.encode(m)[0])
            second[j] = m - decoded
            out.append(decoded)
        means.append(torch.cat(out)[:n])
    return means


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
        for defer in (True, False):
            run = r[defer]
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


def test_the_reduce_scatter_of_codes_equals_an_independent_reference(ranks: list[dict]) -> None:
    world = len(ranks)
    reference = _reference_chunked_means(world)
    true_means = [torch.stack([_payload(r, t) for r in range(world)]).mean(0) for t in range(CHUNKED_ROUNDS)]
    for r in ranks:
        run = r["chunked"]
        for t, (ours, ref) in enumerate(zip(run["means"], reference, strict=True)):
            torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)
            assert torch.equal(ours, ranks[0]["chunked"]["means"][t])  # the same mean on every rank, bit for bit
            assert (ours - true_means[t]).abs().max() < 0.05  # two int8 roundings of values about N(0, 1/4)
        # its state: the payload residual and the chunk residual; a resume continues bit-identically
        assert run["state"][0].numel() == ChunkedFeedback.state_numel(CHUNKED_NUMEL, world) == CHUNKED_NUMEL + 251
        assert all(torch.equal(a, b) for a, b in zip(run["resumed"], run["means"][2:], strict=True))


def test_the_reduce_scatter_of_codes_sends_what_the_network_model_prices(ranks: list[dict]) -> None:
    world = len(ranks)
    wan = FOUR_SITES.place(world).group(tuple(range(world)))
    chunk_code = Codec("int8", -(-CHUNKED_NUMEL // world)).nbytes
    for r in ranks:
        run = r["chunked"]
        assert run["ops"] == {"all_to_all": CHUNKED_ROUNDS, "all_gather": CHUNKED_ROUNDS}
        per_round = wan.wire_bytes("all_to_all", world * chunk_code) + wan.wire_bytes("all_gather", world * chunk_code)
        assert run["wan_bytes"] == {"WAN": CHUNKED_ROUNDS * per_round}
        assert run["sent"] == CHUNKED_ROUNDS * (world * chunk_code + chunk_code)
        # less than the all-gather of whole codes at 4 replicas: (W - 1) codes received and W decoded
        assert per_round < wan.wire_bytes("all_gather", world * Codec("int8", CHUNKED_NUMEL).nbytes)
        # in training (warm-up 1, K=2, 5 steps: averages after steps 2 and 4, synchronous steps 3 and 5)
        train, blocking = run["train_True"], run["train_False"]
        # deferred to step() (two rounds there) or waited in the hook: the same numbers and the same bytes
        assert all(torch.equal(a, b) for a, b in zip(train["params"], blocking["params"], strict=True))
        assert (train["ops"], train["wan_bytes"]) == (blocking["ops"], blocking["wan_bytes"])
        units = [ChunkedFeedback.numel_of_state(t.numel(), world) for t in train["grad_residuals"]]
        assert len(units) >= 2 and sum(units) == train["local_numel"]  # one rank per site: the whole model
        grads = [Codec("int8", -(-n // world)).nbytes for n in units]
        params = Codec("int8", train["local_numel"]).nbytes
        assert train["ops"] == {"all_reduce": len(units), "all_gather": 2 * len(units) + 2,
                                "all_to_all": 2 * len(units)}
        assert train["wan_bytes"]["WAN"] == (
            sum(wan.wire_bytes("all_reduce", 4 * n) for n in units)  # warm-up's fp32 gradients
            + 2 * sum(wan.wire_bytes("all_to_all", world * g) + wan.wire_bytes("all_gather", world * g) for g in grads)
            + 2 * wan.wire_bytes("all_gather", world * params))
