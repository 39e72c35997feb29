"""Streaming fragments (``fragments=F``) on real gloo ranks.

* The split: F contiguous element ranges of the flat layout, of equal bytes (a parameter may be cut).
* Numerics against a reference written here (plain tensors, simulated workers, no cpdpkit code) for plain SGD:
  localsgd and cpdp (average-then-step, SlowMo's outer step), blocking and overlapped, each fragment reconciled
  every K steps at its offset ⌊f·K/F⌋, cpdp's synchronous step all-reducing that fragment's gradients only
  (fragments that cut parameters: make_model's 212 elements in 2 and 4).
* The largest step's payload, counted: cpdp-overlap K=4 with 4 equal fragments sends at most 0.30× (here
  exactly 1/4) of what the unfragmented one sends in its largest step.
* A checkpoint with fragments in flight (and int8 residuals) resumes bit-identically.
* Bad input: more fragments than parameters, fragments with ddp / period='auto' / a DDP module: one line.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from _ranks import RANKS_TIMEOUT_S, share_ranks
from _sync_helpers import flat_grads, max_diff, train
from cpdpkit.errors import ConfigError
from cpdpkit.sync import PeriodicSyncOptimizer, SyncConfig
from cpdpkit.sync._fragments import check_fragments, split_params
from sync_reference import batch, make_model

K, STEPS, LR, BETA = 4, 14, 0.05, 0.5




def _run(rank: int, strategy: str, fragments: int, overlap: int) -> list[torch.Tensor]:
    model = make_model(0)
    opt = PeriodicSyncOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model=model, strategy=strategy,
                                period=K, fragments=fragments, overlap_steps=overlap, slowmo_momentum=BETA,
                                timeout_s=60)
    train(opt, model, rank, range(1, STEPS + 1))
    opt.flush()
    return [p.detach().clone() for p in model.parameters()]


def _equal_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16, bias=False), nn.Tanh(), nn.Linear(16, 8, bias=False), nn.Tanh(),
                         nn.Linear(8, 16, bias=False), nn.Tanh(), nn.Linear(16, 8, bias=False))


def _max_step_bytes(rank: int, fragments: int) -> dict:
    """cpdp-overlap (τ = 3) K=4 on 4 parameters of 128 elements each: the most one step sent."""
    model = _equal_model()
    opt = PeriodicSyncOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), model=model,
                                strategy="cpdp", period=K, overlap_steps=3, fragments=fragments, timeout_s=60)
    per_step = []
    for n in range(1, 4 * K + 1):
        before = opt.stats.bytes_sent
        opt.zero_grad()
        x, _ = batch(rank, n)
        model(x).square().mean().backward()
        opt.step()
        per_step.append(opt.stats.bytes_sent - before)
    return {"per_step": per_step, "total": opt.stats.bytes_sent}


def _build_resumable() -> tuple[nn.Module, PeriodicSyncOptimizer]:
    model = make_model(0)
    return model, PeriodicSyncOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), model=model,
                                        strategy="cpdp", period=K, fragments=4, overlap_steps=2, compression="int8",
                                        timeout_s=60)


def _resume(rank: int) -> dict:
    model, opt = _build_resumable()
    train(opt, model, rank, range(1, STEPS + 1))
    straight = [p.detach().clone() for p in model.parameters()]
    model, opt = _build_resumable()
    train(opt, model, rank, range(1, 7))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    ckpt = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    model, opt = _build_resumable()
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    train(opt, model, rank, range(7, STEPS + 1))
    saved = ckpt["opt"]["cpdpkit"]["fragments"]
    fresh = make_model(0)
    whole = PeriodicSyncOptimizer(torch.optim.SGD(fresh.parameters(), lr=LR, momentum=0.9), model=fresh,
                                  strategy="cpdp", period=K, overlap_steps=2, compression="int8", timeout_s=60)
    try:
        whole.load_state_dict(ckpt["opt"])
        refused = None
    except ConfigError as exc:
        refused = str(exc)
    return {"straight": straight, "resumed": [p.detach().clone() for p in model.parameters()],
            "in_flight": [f["in_flight"] is not None for f in saved], "refused": refused}


def _job(rank: int, world: int) -> dict:
    runs = {(s, f, t): _run(rank, s, f, t) for s in ("localsgd", "cpdp") for f in (2, 4) for t in (0, 2)}
    runs[("cpdp", 1, 0)] = _run(rank, "cpdp", 1, 0)
    return {"runs": runs, "bytes1": _max_step_bytes(rank, 1), "bytes4": _max_step_bytes(rank, 4),
            "resume": _resume(rank)}


share_ranks(__name__, {"all": (_job, {})}, timeout_s=90.0)


@pytest.fixture(scope="module")
def results(sync_ranks):
    return sync_ranks[__name__]["all"]


# -- the split -------------------------------------------------------------------------------------
def test_split_is_contiguous_equal_bytes_to_the_element():
    assert split_params([(212, 4)], 4) == [[(0, 0, 53)], [(0, 53, 106)], [(0, 106, 159)], [(0, 159, 212)]]
    assert split_params([(212, 4)], 2) == [[(0, 0, 106)], [(0, 106, 212)]]
    # two segments (fp32 then bf16): byte cuts, a fragment may span both
    assert split_params([(10, 4), (20, 2)], 2) == [[(0, 0, 10)], [(1, 0, 20)]]
    assert split_params([(10, 4), (20, 2)], 4) == [[(0, 0, 5)], [(0, 5, 10)], [(1, 0, 10)], [(1, 10, 20)]]
    assert split_params([(9, 4), (2, 2)], 2) == [[(0, 0, 5)], [(0, 5, 9), (1, 0, 2)]]
    with pytest.raises(ConfigError) as exc:
        check_fragments(3, 2)
    assert str(exc.value) == ("fragments=3 but the optimizer holds 2 parameter(s): pass fragments <= 2 (each "
                              "fragment is about 1/F of the parameters' bytes)")


# -- the independent reference ---------------------------------------------------------------------
def _reference(strategy: str, fragments: int, tau: int, world: int = 2) -> list[list[torch.Tensor]]:
    """Plain SGD on ``world`` workers, their parameters as one vector x (in parameter order) of n elements;
    fragment f is the slice [⌊f·n/F⌋, ⌊(f+1)·n/F⌋) and reconciles at the steps n = K + o_f + j·K, o_f = ⌊f·K/F⌋.

    localsgd: at the end of step n its slice is averaged (τ = 0), or its average x̄_n is applied at the end of
    step n + τ as x ← x̄_n + (x − x_n). cpdp: the average and SlowMo's outer step (u ← β·u + (x0 − x̄)/γ,
    x0 ← x0 − γ·u) run at the end of step n − 1 (τ = 0: x ← x0, then step n averages the slice's gradients),
    or are applied at the end of step a = n − 1 + τ as x ← x0 + (x − x_launch), and step a + 1 averages them."""
    models = [make_model(0) for _ in range(world)]
    params = [list(m.parameters()) for m in models]
    n_all = sum(p.numel() for p in params[0])
    cut = [(f * n_all) // fragments for f in range(fragments + 1)]
    first = [K + (f * K) // fragments for f in range(fragments)]

    def flat(r: int) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in params[r]])

    def write(r: int, f: int, values: torch.Tensor) -> None:
        x = flat(r)
        x[cut[f] : cut[f + 1]] = values
        torch.nn.utils.vector_to_parameters(x, params[r])

    def piece(r: int, f: int) -> torch.Tensor:
        return flat(r)[cut[f] : cut[f + 1]].clone()

    x0 = [piece(0, f) for f in range(fragments)]
    u = [torch.zeros_like(x0[f]) for f in range(fragments)]
    pending: list[tuple | None] = [None] * fragments  # (apply step, reconciled slice, each worker's launched slice)
    sync_step: list[int | None] = [None] * fragments  # cpdp: the step that averages fragment f's gradients

    def reconciles(f: int, n: int) -> bool:
        return n >= first[f] and (n - first[f]) % K == 0

    def apply(f: int, n: int) -> None:
        _, reconciled, launched = pending[f]
        for r in range(world):
            write(r, f, reconciled + (piece(r, f) - launched[r]))
        pending[f] = None
        sync_step[f] = n + 1

    for n in range(1, STEPS + 1):
        grads = flat_grads(models, n)
        for f in range(fragments):
            if strategy == "cpdp" and sync_step[f] == n:
                mean = torch.stack([g[cut[f] : cut[f + 1]] for g in grads]).mean(dim=0)
                for g in grads:
                    g[cut[f] : cut[f + 1]] = mean
        for r in range(world):
            torch.nn.utils.vector_to_parameters(flat(r) - LR * grads[r], params[r])
        for f in range(fragments):
            if reconciles(f, n if strategy == "localsgd" else n + 1):
                if pending[f] is not None:
                    apply(f, n)
                xbar = torch.stack([piece(r, f) for r in range(world)]).mean(dim=0)
                if strategy == "cpdp":
                    u[f] = BETA * u[f] + (x0[f] - xbar) / LR
                    x0[f] = x0[f] - LR * u[f]
                    xbar = x0[f].clone()
                if tau == 0:
                    for r in range(world):
                        write(r, f, xbar)
                    sync_step[f] = n + 1
                else:
                    pending[f] = (n + tau, xbar, [piece(r, f) for r in range(world)])
            elif pending[f] is not None and n >= pending[f][0]:
                apply(f, n)
    for f in range(fragments):
        if pending[f] is not None:
            apply(f, STEPS)
    return [[p.detach().clone() for p in ps] for ps in params]




@pytest.mark.timeout(RANKS_TIMEOUT_S)
@pytest.mark.parametrize("strategy", ["localsgd", "cpdp"])
@pytest.mark.parametrize("fragments", [2, 4])
@pytest.mark.parametrize("tau", [0, 2])
def test_fragments_equal_an_independent_reference(results, strategy, fragments, tau):
    n_all = sum(p.numel() for p in make_model(0).parameters())
    assert split_params([(n_all, 4)], fragments) == [[(0, (f * n_all) // fragments, ((f + 1) * n_all) // fragments)]
                                                     for f in range(fragments)]
    ref = _reference(strategy, fragments, tau)
    for rank, res in enumerate(results):
        diff = max_diff(res["runs"][(strategy, fragments, tau)], ref[rank])
        assert diff <= 1e-6, f"rank {rank}: {strategy} F={fragments} τ={tau}: max |ours - reference| = {diff:.3g}"
    if (strategy, tau) == ("cpdp", 0):  # fragments change the trajectory (else the reference proves little)
        assert max_diff(results[0]["runs"][("cpdp", fragments, 0)], results[0]["runs"][("cpdp", 1, 0)]) > 1e-5


@pytest.mark.timeout(RANKS_TIMEOUT_S)
def test_largest_step_payload_is_a_quarter_with_four_fragments(results):
    param_bytes = 4 * 128  # each of the 4 fragments
    for res in results:
        whole, four = max(res["bytes1"]["per_step"]), max(res["bytes4"]["per_step"])
        # unfragmented: the synchronous step's gradients and the next average's launch, both the whole model
        assert whole == 2 * 4 * param_bytes
        # fragmented: one fragment's gradients and one fragment's launch at most
        assert four == 2 * param_bytes
        assert four <= 0.30 * whole
        # about the same bytes in all (the staggered fragments' last exchanges fall after the 16 steps)
        assert abs(res["bytes4"]["total"] - res["bytes1"]["total"]) <= 8 * param_bytes


@pytest.mark.timeout(RANKS_TIMEOUT_S)
def test_resume_with_fragments_in_flight_is_bit_identical(results):
    for rank, res in enumerate(results):
        r = res["resume"]
        assert any(r["in_flight"]), "a fragment's average must be in flight at the save"
        assert all(torch.equal(a, b) for a, b in zip(r["straight"], r["resumed"], strict=True)), f"rank {rank}"
        assert r["refused"] == ("checkpoint was saved with fragments=4, this optimizer uses fragments=1: construct "
                                "it with fragments=4 to resume it")


# -- bad input ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("options", "message"), [
    ({"strategy": "ddp", "fragments": 2},
     "fragments=2 with strategy 'ddp' never reconciles: use strategy 'localsgd', 'slowmo' or 'cpdp', or fragments=1"),
    ({"period": "auto", "fragments": 2},
     "fragments=2 with period='auto' decides one K for the whole model: pass a fixed period, or fragments=1"),
    ({"fragments": 0}, "fragments must be an integer >= 1, got 0: pass 1 to reconcile the whole model at once, or "
                       "e.g. 4 to stream it in 4 fragments"),
    ({"fragments": 2, "optimizer_state": "reset"},
     "fragments=2 with optimizer_state='reset' acts on the whole optimizer at each reconciliation: use "
     "optimizer_state='keep', or fragments=1"),
])
def test_bad_fragments_config_is_one_line(options, message):
    with pytest.raises(ConfigError) as exc:
        SyncConfig(**{"strategy": "cpdp", **options})
    assert str(exc.value) == message


@pytest.mark.timeout(60)
def test_more_fragments_than_parameters_is_one_line_before_any_collective(world1):
    model = make_model(0)
    with pytest.raises(ConfigError) as exc:
        PeriodicSyncOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model=model, strategy="localsgd",
                              period=K, fragments=5)
    assert str(exc.value) == ("fragments=5 but the optimizer holds 4 parameter(s): pass fragments <= 4 (each "
                              "fragment is about 1/F of the parameters' bytes)")
    ddp = nn.parallel.DistributedDataParallel(make_model(0))
    with pytest.raises(ConfigError) as exc:
        PeriodicSyncOptimizer(torch.optim.SGD(ddp.parameters(), lr=LR), model=ddp, strategy="localsgd", period=K,
                              fragments=2)
    assert str(exc.value) == ("fragments=2 with a DDP-wrapped model: streaming fragments need a plain module (its "
                              "gradients in cpdpkit's own buckets); pass the plain module, or fragments=1")
