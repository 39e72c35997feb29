"""PeriodicSyncOptimizer as a torch optimizer: hooks, LR schedulers, state dicts, construction.

Single process: a 1-rank gloo group on a TCPStore with a free port (port 0). On one rank,
strategy ``ddp`` changes no gradient (all-reduce of one rank, divided by 1), so the wrapper
must follow the bare inner optimizer bit for bit; that is the reference here.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler

from cpdpkit.errors import ConfigError
from cpdpkit.sync import PeriodicSyncOptimizer, SyncConfig, slowmo_beta_for

pytestmark = pytest.mark.timeout(60)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + n)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def _backward(model: nn.Module, n: int) -> None:
    x, y = _batch(n)
    nn.functional.mse_loss(model(x), y).backward()


def _wrapped(strategy: str = "ddp", lr: float = 0.1, **options):
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return model, inner, PeriodicSyncOptimizer(inner, model=model, strategy=strategy, **options)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, sched=None) -> None:
    for n in steps:
        opt.zero_grad()
        _backward(model, n)
        opt.step()
        if sched is not None:
            sched.step()


# -- construction: one source of defaults (no process group needed: refused before any) ----
KNOWN = ("strategy, period, warmup_steps, slowmo_momentum, slowmo_lr, buffers, "
         "optimizer_state, bucket_cap_mb, timeout_s, overlap_steps, target_exposed_frac, k_min, "
         "k_max, max_divergence, check_replicas, cpdp_order, outer_optimizer, outer_lr, outer_momentum, compression, "
         "fragments")


def test_unknown_keyword_is_one_line_naming_it_and_the_fields():
    model = nn.Linear(2, 2)
    with pytest.raises(ConfigError) as info:
        PeriodicSyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                              perod=4)
    assert str(info.value) == (
        f"unknown keyword 'perod' for PeriodicSyncOptimizer: known SyncConfig fields are {KNOWN}")


def test_config_and_keywords_together_are_refused():
    model = nn.Linear(2, 2)
    with pytest.raises(ConfigError) as info:
        PeriodicSyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                              config=SyncConfig(period=2), period=4, strategy="slowmo")
    assert str(info.value) == (
        "config= given together with period, strategy: pass config=dataclasses.replace("
        "config, period=..., strategy=...), or the keywords without config=")
    with pytest.raises(TypeError) as info:
        PeriodicSyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                              config={"period": 4})  # type: ignore[arg-type]
    assert str(info.value) == ("config must be a SyncConfig, got dict: "
                               "pass config=cpdpkit.sync.SyncConfig(...)")
    with pytest.raises(ConfigError, match=r"^period must be an integer >= 1 or 'auto', got 0"):
        PeriodicSyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                              period=0)


def test_config_and_keyword_forms_give_equal_config(world1):
    m1, m2, m3 = _model(), _model(), _model()
    by_kw = PeriodicSyncOptimizer(torch.optim.SGD(m1.parameters(), lr=0.1), model=m1,
                                  strategy="slowmo", period=3, warmup_steps=2, timeout_s=30)
    by_cfg = PeriodicSyncOptimizer(
        torch.optim.SGD(m2.parameters(), lr=0.1), model=m2,
        config=SyncConfig(strategy="slowmo", period=3, warmup_steps=2, timeout_s=30))
    assert by_kw.config == by_cfg.config
    assert by_kw.config.to_dict() == {
        "strategy": "slowmo", "period": 3, "warmup_steps": 2, "slowmo_momentum": 0.0,  # 1 replica's default
        "slowmo_lr": 1.0, "buffers": "average", "optimizer_state": "keep",
        "bucket_cap_mb": 25.0, "timeout_s": 30, "overlap_steps": 0, "target_exposed_frac": 0.05,
        "k_min": 1, "k_max": 8, "max_divergence": None, "check_replicas": False,
        "cpdp_order": "average-then-step", "outer_optimizer": "slowmo", "outer_lr": None,
        "outer_momentum": None, "compression": "none", "fragments": 1}
    plain = PeriodicSyncOptimizer(torch.optim.SGD(m3.parameters(), lr=0.1), model=m3)
    assert plain.config == SyncConfig().resolved(1)  # the defaults are SyncConfig's, β decided for 1 replica


def test_default_beta_is_the_measured_table_by_replicas_and_an_explicit_one_is_kept(world1, monkeypatch):
    import cpdpkit.sync.config as sync_config

    assert SyncConfig().slowmo_momentum is None  # decided at construction, from the replicas averaged
    assert [slowmo_beta_for(n) for n in (1, 2, 4, 8, 16)] == [0.0] * 5  # docs/results.md: 0 at 2, 4, 8
    monkeypatch.setattr(sync_config, "SLOWMO_BETAS", ((1, 0.0), (4, 0.2), (8, 0.5)))  # a table by replicas
    assert [SyncConfig().resolved(n).slowmo_momentum for n in (1, 3, 4, 7, 8, 64)] == [0.0, 0.0, 0.2, 0.2, 0.5, 0.5]
    assert SyncConfig(slowmo_momentum=0.6).resolved(8).slowmo_momentum == 0.6
    m1, m2 = _model(), _model()
    by_default = PeriodicSyncOptimizer(torch.optim.SGD(m1.parameters(), lr=0.1), model=m1, strategy="cpdp")
    given = PeriodicSyncOptimizer(torch.optim.SGD(m2.parameters(), lr=0.1), model=m2, strategy="cpdp",
                                  slowmo_momentum=0.5)
    assert by_default.config.slowmo_momentum == 0.0 and given.config.slowmo_momentum == 0.5
    # the number the run used is what its checkpoint records, and a β = 0.5 checkpoint (the old default) loads
    assert by_default.state_dict()["cpdpkit"]["config"]["slowmo_momentum"] == 0.0
    by_default.load_state_dict(given.state_dict())
    assert by_default.config.slowmo_momentum == 0.0


# -- the torch.optim.Optimizer surface ------------------------------------------------------
def test_param_groups_state_defaults_are_the_inner_objects(world1):
    model, inner, opt = _wrapped()
    assert opt.param_groups is inner.param_groups
    assert opt.state is inner.state and opt.defaults is inner.defaults
    opt.param_groups[0]["lr"] = 0.25
    assert inner.param_groups[0]["lr"] == 0.25
    inner.param_groups[0]["lr"] = 0.5
    assert opt.param_groups[0]["lr"] == 0.5
    _train(model, opt, range(1, 3))
    assert len(opt.state) == 4 and opt.state is inner.state
    sd = opt.state_dict()
    opt.load_state_dict(sd)  # the inner replaces its objects on load: still aliased
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    opt.optim.load_state_dict({k: v for k, v in sd.items() if k != "cpdpkit"})
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_add_param_group_is_refused(world1):
    _, inner, opt = _wrapped()
    extra = nn.Parameter(torch.zeros(3))
    with pytest.raises(ConfigError) as info:
        opt.add_param_group({"params": [extra]})
    assert str(info.value) == (
        "add_param_group on a PeriodicSyncOptimizer is not supported: add the group to the "
        "inner optimizer before wrapping it")
    assert len(inner.param_groups) == 1 and len(inner.param_groups[0]["params"]) == 4


def test_step_hooks_fire_in_order_once_per_step(world1):
    model, _, opt = _wrapped(strategy="cpdp", period=2)
    calls = []

    def hook(name):
        def record(optimizer, args, kwargs):
            assert optimizer is opt and args == (opt,) and kwargs == {}
            calls.append((name, opt.step_count))
        return record

    opt.register_step_pre_hook(hook("pre1"))
    opt.register_step_pre_hook(hook("pre2"))
    opt.register_step_post_hook(hook("post1"))
    handle = opt.register_step_post_hook(hook("post2"))
    _train(model, opt, range(1, 3))  # a local step and a reconciliation
    assert calls == [("pre1", 0), ("pre2", 0), ("post1", 1), ("post2", 1),
                     ("pre1", 1), ("pre2", 1), ("post1", 2), ("post2", 2)]
    handle.remove()
    calls.clear()
    _train(model, opt, range(3, 4))
    assert calls == [("pre1", 2), ("pre2", 2), ("post1", 3)]


def test_step_pre_hook_may_replace_the_arguments(world1):
    model, _, opt = _wrapped()

    def closure():
        opt.zero_grad()
        _backward(model, 1)
        return torch.tensor(7.0)

    opt.register_step_pre_hook(lambda o, args, kwargs: (args, {"closure": closure}))
    assert opt.step().item() == 7.0
    assert opt.step_count == 1


def test_global_step_hooks_fire_for_the_wrapper(world1):
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    model, _, opt = _wrapped()
    calls = []
    handles = [
        register_optimizer_step_pre_hook(
            lambda o, a, k: calls.append(("pre", type(o).__name__, opt.step_count))),
        register_optimizer_step_post_hook(
            lambda o, a, k: calls.append(("post", type(o).__name__, opt.step_count))),
    ]
    try:
        _train(model, opt, range(1, 2))
    finally:
        for h in handles:
            h.remove()
    # The inner optimizer is a torch optimizer too: its own step fires the global hooks
    # inside the wrapper's.
    assert calls == [("pre", "PeriodicSyncOptimizer", 0), ("pre", "SGD", 0),
                     ("post", "SGD", 0), ("post", "PeriodicSyncOptimizer", 1)]


SCHEDULERS = {
    "StepLR": lambda o: lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "LambdaLR": lambda o: lr_scheduler.LambdaLR(o, lambda n: 1.0 / (1 + n)),
    "CosineAnnealingLR": lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=5, eta_min=0.01),
    "OneCycleLR": lambda o: lr_scheduler.OneCycleLR(o, max_lr=0.2, total_steps=6),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_lr_scheduler_on_the_wrapper_drives_the_inner_optimizer(world1, name):
    model, inner, opt = _wrapped()
    bare_model = _model()
    bare = torch.optim.SGD(bare_model.parameters(), lr=0.1, momentum=0.9)
    sched, bare_sched = SCHEDULERS[name](opt), SCHEDULERS[name](bare)
    lrs, bare_lrs = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(1, 6):
            _train(model, opt, range(n, n + 1), sched)
            _train(bare_model, bare, range(n, n + 1), bare_sched)
            lrs.append((inner.param_groups[0]["lr"], inner.param_groups[0]["momentum"]))
            bare_lrs.append((bare.param_groups[0]["lr"], bare.param_groups[0]["momentum"]))
    assert [str(w.message) for w in caught] == []  # no "lr_scheduler.step() before ..."
    assert lrs == bare_lrs and len(set(lrs)) > 1
    assert sched.get_last_lr() == [inner.param_groups[0]["lr"]]
    for ours, theirs in zip(model.parameters(), bare_model.parameters()):
        assert torch.equal(ours, theirs)


# -- state dicts ----------------------------------------------------------------------------
def test_state_dict_is_torch_standard_plus_cpdpkit(world1):
    model, inner, opt = _wrapped(strategy="cpdp", period=3)
    _train(model, opt, range(1, 5))
    sd = opt.state_dict()
    assert sorted(sd) == ["cpdpkit", "param_groups", "state"]
    own = sd["cpdpkit"]
    assert sorted(own) == ["anchor", "config", "counts", "decisions", "fragments", "grad_residuals", "in_flight",
                           "layout", "outer", "residuals", "schedule", "slow_momentum", "step", "sync_step", "version"]
    assert own["outer"] is None  # SlowMo's state is anchor and slow_momentum
    assert own["in_flight"] is None and own["decisions"] == []
    assert own["schedule"] == {"period": 3, "last_reconcile": 3, "gap": 3}
    assert own["version"] == 5 and own["step"] == 4 and own["sync_step"] == 3  # averaged after step 2
    assert own["counts"] == {"local_steps": 3, "reconciliations": 1, "gradient_syncs": 1}
    assert own["layout"] == [[32, 8, 16, 2]] and own["config"] == opt.config.to_dict()
    plain = inner.state_dict()
    assert sd["param_groups"] == plain["param_groups"]
    assert sorted(sd["state"]) == sorted(plain["state"]) == [0, 1, 2, 3]
    for i in range(4):
        assert torch.equal(sd["state"][i]["momentum_buffer"], plain["state"][i]["momentum_buffer"])


def test_checkpoint_resume_in_fresh_objects_is_bit_identical(world1):
    model, _, opt = _wrapped(strategy="cpdp", period=3)
    _train(model, opt, range(1, 9))
    straight = [p.detach().clone() for p in model.parameters()]
    model, _, opt = _wrapped(strategy="cpdp", period=3)
    _train(model, opt, range(1, 5))
    ckpt = {"model": model.state_dict(), "opt": opt.state_dict()}
    model, _, opt = _wrapped(strategy="cpdp", period=3)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    assert opt.step_count == 4
    _train(model, opt, range(5, 9))
    assert all(torch.equal(a, b) for a, b in zip(straight, model.parameters()))


def test_state_dict_hooks_fire_and_may_modify_the_dict(world1):
    model, _, opt = _wrapped(strategy="cpdp", period=2)
    _train(model, opt, range(1, 4))
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append(("pre", o is opt)))

    def post(o, sd):
        calls.append(("post", sorted(sd)))
        sd["cpdpkit"]["tag"] = "edited"

    opt.register_state_dict_post_hook(post)
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
    sd = opt.state_dict()
    assert calls == [("pre", True), ("post", ["cpdpkit", "param_groups", "state"])]
    assert sd["cpdpkit"]["tag"] == "edited" and sd["extra"] == 1

    _, _, fresh = _wrapped(strategy="cpdp", period=2)
    seen = []
    stash = sd.pop("cpdpkit")  # a pre-hook that brings it back, e.g. from another file

    def load_pre(o, given):
        seen.append(("pre", sorted(given), given is sd))
        return {**given, "cpdpkit": stash}

    fresh.register_load_state_dict_pre_hook(load_pre)
    fresh.register_load_state_dict_post_hook(
        lambda o: seen.append(("post", o.step_count, o.optim.state_dict()["state"][0]
                               ["momentum_buffer"].sum().item())))
    fresh.load_state_dict(sd)
    momentum = sd["state"][0]["momentum_buffer"].sum().item()
    assert seen == [("pre", ["extra", "param_groups", "state"], False), ("post", 3, momentum)]


def test_load_state_dict_refusals(world1):
    model, _, opt = _wrapped(strategy="cpdp", period=2)
    _train(model, opt, range(1, 3))
    sd = opt.state_dict()
    with pytest.raises(ConfigError) as info:
        opt.load_state_dict({"state": sd["state"], "param_groups": sd["param_groups"]})
    assert str(info.value) == (
        "state_dict has no 'cpdpkit' key: pass what PeriodicSyncOptimizer.state_dict() returned "
        "(to load the inner optimizer alone, use opt.optim.load_state_dict)")
    _, _, other = _wrapped(strategy="slowmo", period=2)
    with pytest.raises(ConfigError) as info:
        other.load_state_dict(sd)
    assert str(info.value) == (
        "checkpoint was saved with strategy 'cpdp', this optimizer uses 'slowmo': construct it "
        "with strategy='cpdp'")
    wide = nn.Linear(4, 3)
    wide_opt = PeriodicSyncOptimizer(torch.optim.SGD(wide.parameters(), lr=0.1, momentum=0.9),
                                     model=wide, strategy="cpdp", period=2)
    with pytest.raises(ConfigError) as info:
        wide_opt.load_state_dict(sd)
    assert str(info.value) == (
        "checkpoint parameter layout differs from this optimizer's: load a checkpoint saved "
        "with the same model and param groups")
    with pytest.raises(ConfigError) as info:
        opt.load_state_dict({**sd, "cpdpkit": {**sd["cpdpkit"], "version": 9}})
    assert str(info.value) == (
        "checkpoint has cpdpkit state version 9, this cpdpkit reads 1 to 5: load it with the "
        "cpdpkit version that saved it")
    assert opt.step_count == 2  # nothing was loaded by a refused call


def _as_old_version(sd: dict, version: int) -> dict:
    """A checkpoint as cpdpkit wrote it before cpdp_order (state versions 1-3): no cpdp_order in the
    config, no sync_step; version 1 nested the inner state under "inner"."""
    own = {k: v for k, v in sd["cpdpkit"].items() if k != "sync_step"}
    own["config"] = {k: v for k, v in own["config"].items() if k != "cpdp_order"}
    own["version"] = version
    if version == 1:
        return {"inner": {"state": sd["state"], "param_groups": sd["param_groups"]}, "cpdpkit": own}
    return {"state": sd["state"], "param_groups": sd["param_groups"], "cpdpkit": own}


def test_version_1_checkpoint_still_loads(world1):
    old = {"cpdp_order": "step-then-average"}  # the order versions 1-3 were written by
    model, _, opt = _wrapped(strategy="cpdp", period=2, **old)
    _train(model, opt, range(1, 4))
    sd = opt.state_dict()
    _, _, fresh = _wrapped(strategy="cpdp", period=2, **old)
    fresh.load_state_dict(_as_old_version(sd, 1))
    assert fresh.step_count == 3
    assert torch.equal(fresh.state_dict()["cpdpkit"]["anchor"][0], sd["cpdpkit"]["anchor"][0])


def test_a_cpdp_checkpoint_from_before_cpdp_order_is_refused_in_one_line_or_loads_in_its_order(world1):
    model, _, opt = _wrapped(strategy="cpdp", period=2, cpdp_order="step-then-average")
    _train(model, opt, range(1, 4))
    v3 = _as_old_version(opt.state_dict(), 3)
    _, _, fresh = _wrapped(strategy="cpdp", period=2)
    with pytest.raises(ConfigError) as info:
        fresh.load_state_dict(v3)
    assert str(info.value) == (
        "checkpoint was saved by cpdp with cpdp_order='step-then-average', this optimizer uses "
        "'average-then-step': construct it with cpdp_order='step-then-average' to resume it")
    assert fresh.step_count == 0
    _, _, same_order = _wrapped(strategy="cpdp", period=2, cpdp_order="step-then-average")
    same_order.load_state_dict(v3)
    assert same_order.step_count == 3 and same_order.next_step_kind().value == "reconcile"  # 4 = 2·2


def test_distributed_checkpoint_reads_the_standard_part(world1):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, _, opt = _wrapped()
    _train(model, opt, range(1, 3))
    osd = get_optimizer_state_dict(model, opt)
    assert sorted(osd["state"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert osd["param_groups"][0]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert osd["param_groups"][0]["lr"] == 0.1
    assert torch.equal(osd["state"]["0.weight"]["momentum_buffer"],
                       opt.state[model[0].weight]["momentum_buffer"])
