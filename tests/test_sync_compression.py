"""Compressed reconciliations (``compression=``) with error feedback, on real gloo ranks.

* Error feedback against a reference written here (its own int8 and top-k quantisers, plain tensors,
  no cpdpkit code) over 8 reconciliations of 2 workers, and the identity it rests on: the sum of what
  was sent plus the residual equals the sum of the payloads.
* A checkpoint taken with residuals pending resumes bit-identically; a version-4 state (no residuals)
  loads; a state with another codec's residuals is refused in one line.
* On the emulated WAN, the bytes the emulator counted equal the network model's price of the codec's
  all-gathers.
* Bad input: exact one-line messages, before any collective.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import _emu_jobs as emu
from _ranks import RANKS_TIMEOUT_S, share_ranks
from _resume import params, straight_and_resumed, train
from _sync_helpers import int8_reference as _int8
from _sync_helpers import topk_reference as _topk
from cpdpkit.errors import ConfigError
from cpdpkit.sync import PeriodicSyncOptimizer, SyncConfig
from cpdpkit.sync._codec import Codec, ErrorFeedback
from sync_reference import batch, make_model

PERIOD, STEPS, LR = 2, 16, 0.05
RESUME_PERIOD, RESUME_STEPS, RESUME_STOP = 3, 12, 7


def _localsgd(rank: int, codec: str, overlap: int = 0) -> list[torch.Tensor]:
    model = make_model(0)
    opt = PeriodicSyncOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model=model, strategy="localsgd",
                                period=PERIOD, compression=codec, overlap_steps=overlap, timeout_s=60)
    train(opt, model, rank, range(1, STEPS + 1))
    return params(model)


def _build_cpdp(codec: str = "int8", overlap: int = 0) -> tuple[nn.Module, PeriodicSyncOptimizer]:
    model = make_model(0)
    inner = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    return model, PeriodicSyncOptimizer(inner, model=model, strategy="cpdp", period=RESUME_PERIOD,
                                        compression=codec, overlap_steps=overlap, timeout_s=60)


def _resume_in_flight(rank: int) -> dict:
    """Saved right after step 5 launched its compressed average (overlap_steps=1), resumed into fresh objects."""
    run = straight_and_resumed(lambda: _build_cpdp(overlap=1), rank, stop=5, steps=RESUME_STEPS, through_bytes=False)
    return {"straight": run.straight, "resumed": run.resumed,
            "in_flight": run.saved["opt"]["cpdpkit"]["in_flight"] is not None}


def _resume(rank: int) -> dict:
    run = straight_and_resumed(_build_cpdp, rank, stop=RESUME_STOP, steps=RESUME_STEPS)
    straight, resumed, ckpt = run.straight, run.resumed, run.saved
    old = {**ckpt["opt"], "cpdpkit": {**ckpt["opt"]["cpdpkit"], "version": 4}}
    del old["cpdpkit"]["residuals"]
    _, fresh = _build_cpdp()
    fresh.load_state_dict(old)  # a version-4 state: residuals start at zero
    _, other = _build_cpdp("bf16")
    try:
        other.load_state_dict(ckpt["opt"])
        refused = None
    except ConfigError as exc:
        refused = str(exc)
    return {"straight": straight, "resumed": resumed, "residuals": ckpt["opt"]["cpdpkit"]["residuals"],
            "version": ckpt["opt"]["cpdpkit"]["version"], "refused": refused}


def _job(rank: int, world: int) -> dict:
    return {"int8": _localsgd(rank, "int8"), "topk": _localsgd(rank, "topk:0.1"),
            "int8-overlap": _localsgd(rank, "int8", overlap=1), "none": _localsgd(rank, "none"),
            "resume": _resume(rank), "resume_in_flight": _resume_in_flight(rank)}


share_ranks(__name__, {"all": (_job, {})}, timeout_s=120.0)


@pytest.fixture(scope="module")
def results(sync_ranks):
    return sync_ranks[__name__]["all"]


# -- the independent reference (its quantisers: tests/_sync_helpers.py) ---------------------------
def _reference(quantise, world: int = 2, overlap: bool = False) -> list[list[torch.Tensor]]:
    """localsgd with error feedback: x ← x0 − mean_r q(x0 − x_r + e_r), e_r ← (x0 − x_r + e_r) − q(...).

    ``overlap``: the average of step n's parameters x_n is applied after step n + 1 as x ← x̄ + (x − x_n)."""
    models = [make_model(0) for _ in range(world)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    flat = [lambda m=m: torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in models]
    anchor = flat[0]()
    residual = [torch.zeros_like(anchor) for _ in range(world)]
    pending = None
    for n in range(1, STEPS + 1):
        for r in range(world):
            opts[r].zero_grad()
            x, y = batch(r, n)
            nn.functional.mse_loss(models[r](x), y).backward()
            opts[r].step()
        if pending is not None:
            average, launched = pending
            for r, m in enumerate(models):
                torch.nn.utils.vector_to_parameters(average + (flat[r]() - launched[r]), m.parameters())
            anchor, pending = average, None
        if n % PERIOD:
            continue
        sent = []
        for r in range(world):
            payload = anchor - flat[r]() + residual[r]
            sent.append(quantise(payload))
            residual[r] = payload - sent[r]
        average = anchor - torch.stack(sent).mean(dim=0)
        if overlap:
            pending = (average, [f() for f in flat])
            continue
        anchor = average
        for m in models:
            torch.nn.utils.vector_to_parameters(anchor.clone(), m.parameters())
    return [[p.detach().clone() for p in m.parameters()] for m in models]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


@pytest.mark.timeout(RANKS_TIMEOUT_S)
@pytest.mark.parametrize("codec", ["int8", "topk"])
def test_error_feedback_equals_an_independent_reference(results, codec):
    quantise = _int8 if codec == "int8" else (lambda p: _topk(p, 0.1))
    ref = _reference(quantise)
    for rank, res in enumerate(results):
        diff = _max_diff(res[codec], ref[rank])
        assert diff <= 1e-6, f"rank {rank}: {codec}: max |ours - reference| = {diff:.3g}"
        # the codec changes the result (else the reference proves nothing)
        assert _max_diff(res[codec], res["none"]) > 1e-5
    assert _max_diff(results[0][codec], results[1][codec]) == 0.0  # replicas identical after the last average


@pytest.mark.timeout(RANKS_TIMEOUT_S)
def test_overlapped_error_feedback_equals_the_reference(results):
    ref = _reference(_int8, overlap=True)
    for rank, res in enumerate(results):
        diff = _max_diff(res["int8-overlap"], ref[rank])
        assert diff <= 1e-6, f"rank {rank}: int8 overlapped: max |ours - reference| = {diff:.3g}"
        assert _max_diff(res["int8-overlap"], res["int8"]) > 1e-5  # applied late: a different trajectory


@pytest.mark.parametrize("compression", ["bf16", "int8", "topk:0.02", "topk:1"])
def test_sent_plus_residual_is_the_sum_of_payloads(compression):
    torch.manual_seed(0)
    shapes = [1000, 7, 513]
    feedback = ErrorFeedback(compression, shapes)
    sums = [torch.zeros(n, dtype=torch.float64) for n in shapes]
    sent = [torch.zeros(n, dtype=torch.float64) for n in shapes]
    for _ in range(50):
        payloads = [torch.randn(n) for n in shapes]
        codes = feedback.encode(payloads)
        for i, (codec, code, payload) in enumerate(zip(feedback.codecs, codes, payloads)):
            assert code.dtype is torch.uint8 and code.numel() == codec.nbytes
            sums[i] += payload.double()
            sent[i] += codec.decode(code).double()
    for i in range(len(shapes)):
        err = (sent[i] + feedback.residuals[i].double() - sums[i]).abs().max().item()
        assert err <= 1e-4, f"{compression} segment {i}: |sent + residual - payloads| = {err:.3g}"
        if compression != "topk:1":
            assert feedback.residuals[i].abs().max() > 0  # something was lost and is carried


def test_codec_sizes():
    assert Codec("bf16", 1000).nbytes == 2000
    assert Codec("int8", 1000).nbytes == 4 * 256 + 4 * 4  # 4 blocks, padded, one fp32 scale each
    assert Codec("topk:0.02", 1000).nbytes == 20 * 5 + 4
    assert Codec("topk:0.0001", 10).nbytes == 1 * 5 + 4  # at least one element


@pytest.mark.timeout(RANKS_TIMEOUT_S)
def test_resume_with_residuals_is_bit_identical(results):
    for rank, res in enumerate(results):
        r = res["resume"]
        assert r["version"] == 5
        assert any(t.abs().max() > 0 for t in r["residuals"]), "residuals must be pending at the save"
        assert all(torch.equal(a, b) for a, b in zip(r["straight"], r["resumed"], strict=True)), f"rank {rank}"
        assert r["refused"] == ("checkpoint holds compression='int8' residuals, this optimizer uses "
                                "compression='bf16': construct it with compression='int8' to resume it")


@pytest.mark.timeout(RANKS_TIMEOUT_S)
def test_resume_with_a_compressed_average_in_flight_is_bit_identical(results):
    for rank, res in enumerate(results):
        r = res["resume_in_flight"]
        assert r["in_flight"]
        assert all(torch.equal(a, b) for a, b in zip(r["straight"], r["resumed"], strict=True)), f"rank {rank}"


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    return emu.spawn_job("compression", 2, tmp_path_factory.mktemp("emu_compression"))


@pytest.mark.timeout(200)
def test_counted_wan_bytes_equal_the_network_model(emulated):
    wan = emu.TEST_TOPOLOGY.place(2).group((0, 1))
    reconciliations = emu.COMPRESSION_STEPS // emu.COMPRESSION_PERIOD
    for rank in emulated:
        numel = rank["none"]["numel"]
        assert rank["none"]["ops"] == {"all_reduce": reconciliations}
        assert rank["none"]["bytes"] == {"WAN": reconciliations * wan.wire_bytes("all_reduce", 4 * numel)}
        for codec in ("bf16", "int8", "topk:0.1"):
            code = Codec(codec, numel).nbytes
            assert rank[codec]["ops"] == {"all_gather": reconciliations}, codec
            assert rank[codec]["bytes"] == {"WAN": reconciliations * wan.wire_bytes("all_gather", 2 * code)}, codec
            assert rank[codec]["sent"] == reconciliations * code, codec
        assert rank["int8"]["bytes"]["WAN"] <= 0.3 * rank["none"]["bytes"]["WAN"]


@pytest.mark.parametrize(("options", "message"), [
    ({"compression": "zip"}, "compression 'zip' is not a codec: pass one of 'none', 'bf16', 'int8' or 'topk:F' "
                             "with F in (0, 1], e.g. 'topk:0.02'"),
    ({"compression": "topk:0"}, "compression 'topk:0': the top-k fraction '0' must be in (0, 1]; pass e.g. "
                                "'topk:0.02' for the largest 2 % of each payload"),
    ({"compression": "topk:1.5"}, "compression 'topk:1.5': the top-k fraction '1.5' must be in (0, 1]; pass e.g. "
                                  "'topk:0.02' for the largest 2 % of each payload"),
    ({"compression": "int8", "strategy": "ddp"},
     "compression='int8' with strategy 'ddp': ddp all-reduces fp32 gradients and has no reconciliation to "
     "compress; use strategy 'localsgd', 'slowmo' or 'cpdp', or compression='none'"),
    ({"compression": "int8", "period": "auto"},
     "compression='int8' with period='auto': the controller's numbers ride in an uncompressed average; pass a "
     "fixed period or compression='none'"),
])
def test_bad_compression_is_one_line(options, message):
    with pytest.raises(ConfigError) as exc:
        SyncConfig(**{"strategy": "cpdp", **options})
    assert str(exc.value) == message
