"""Multi-process jobs for tests/test_planner_executor.py: TwoStageExecutor vs FSDP2 HSDP.

Each spawned rank joins through a ``file://`` rendezvous in the test's tmp dir (no port), on
plain gloo or on the emulated backend, builds one ``(replicate, shard)`` mesh, and per case
trains the same model with FSDP2 HSDP (``apply_plan``, a whole-shard optimizer, optionally
``clip_grad_norm_``) and with :class:`TwoStageExecutor` (stage 1 during backward, and with
``update_in_backward=False`` for bit-exactness); it writes what it saw to ``rank<R>.pt``.

Case keys: ``optimizer``; ``max_grad_norm`` (a number, or ``"alternate"``: chosen between the
norms of the unscaled and the scaled steps); ``loss_scales`` (per step); ``mp`` (``"bf16"``:
bf16 compute, fp32 reduce; ``"bf16-reduce"``: bf16 both); ``accum`` (micro-batches per step);
``exact`` (also run ``update_in_backward=False``); ``errors`` (check the one-line misuse errors,
last); ``profile`` (record collectives and labels, and call ``calibrate()``); ``slow`` (a model
that sleeps between units in backward, so stage-1 exchanges can finish in it); ``calibrate``
(steps after which to calibrate and measure again).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import _planner_jobs as pj
from _ranks import run_spawned

NUM_STEPS = 3
SLEEP_S = 0.03  # per unit boundary in a "slow" model's backward
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
}


# ---- helpers shared with tests/_partial_jobs.py -------------------------------------------------
def with_stage1_schedule(plan: Any, backward_s: float = 0.05) -> Any:
    """``plan`` with a schedule from long backward times in which both blocks' exchanges are stage 1: without
    ``at_points`` (the executors' launch points, under which the last block before the root cannot be), so
    these tests drive two speculative stage-1 units per step through the executors' trigger fallback."""
    from cpdpkit.planner import UnitTiming
    from cpdpkit.planner.schedule import exchange_schedule

    timings = [UnitTiming(name=u.name, forward_s=backward_s / 2, backward_s=backward_s) for u in plan.units]
    schedule = exchange_schedule(plan.units, timings, plan.topology, plan.config, plan.mesh.shard_size,
                                 at_points=False)
    return dataclasses.replace(plan, schedule=schedule)


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(SLEEP_S)
        return grad


class SlowNet(pj.Net):
    """:class:`pj.Net` (same parameters) whose backward sleeps before each block's input gradient
    flows on: compute time between units' gradient-ready points, for the exchanges to run in."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(_SleepInBackward.apply(x))
        return self.out(torch.relu(self.head(x)))


def make_net(case: dict[str, Any]) -> pj.Net:
    torch.manual_seed(1234)
    return SlowNet() if case.get("slow") else pj.Net()


def batches(rank: int, count: int = NUM_STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)  # every rank its own batch
    return [(torch.randn(6, 8, generator=gen), torch.randn(6, 5, generator=gen)) for _ in range(count)]


def loss_scales(case: dict[str, Any]) -> list[float]:
    return list(case.get("loss_scales", [1.0] * NUM_STEPS))


def alternate_max_norm(norms: list[float], scales: list[float]) -> float:
    """A max-norm between the unscaled steps' norms and the scaled ones' (geometric mean)."""
    low = max(n for n, s in zip(norms, scales) if s == 1.0)
    high = min(n for n, s in zip(norms, scales) if s != 1.0)
    assert low < high, (norms, scales)
    return math.sqrt(low * high)


def train_executor(ex: Any, net: nn.Module, case: dict[str, Any], data: list) -> dict[str, Any]:
    """``NUM_STEPS`` steps (``accum`` micro-batches each); losses, norms and what was pending after step()."""
    accum = case.get("accum", 1)
    losses, norms, pending = [], [], []
    for step, scale in enumerate(loss_scales(case)):
        ex.zero_grad()
        for k in range(accum):
            if accum > 1:
                ex.set_requires_gradient_sync(k == accum - 1)
            x, y = data[step * accum + k]
            loss = nn.functional.mse_loss(net(x), y) * scale
            loss.backward()
        norms.append(ex.step())
        # stage-2 exchanges are still in flight after step(); the next forward waits for them
        pending.append({u.name: u.pending_ag is not None for u in ex._units})
        losses.append(loss.item())
    ex.wait_exchanges()
    return {"losses": losses, "norms": norms, "pending": pending, "stats": ex.stats}


def misuse_errors(ex: Any, net: nn.Module, data: list) -> list[str]:
    """zero_grad() after in-backward updates, then a second synced backward: both one-line PlannerErrors."""
    from cpdpkit.planner import PlannerError

    errors = []
    x, y = data[0]
    nn.functional.mse_loss(net(x), y).backward()
    try:
        ex.zero_grad()
    except PlannerError as exc:
        errors.append(str(exc))
    try:
        nn.functional.mse_loss(net(x), y).backward()
    except PlannerError as exc:
        errors.append(str(exc))
    ex.step()  # consistent on every rank: the first backward's gradients are used
    ex.wait_exchanges()
    return errors


@contextlib.contextmanager
def recorded_events(enabled: bool):
    """Collect the c10d calls and cpdpkit/FSDP spans of a block as (name, thread, start, end)."""
    if not enabled:
        yield []
        return
    out: list[tuple[str, int, float, float]] = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield out
    out.extend((e.name, e.thread, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.name.startswith(("c10d::", "cpdpkit::", "FSDP::")))


def spawn_job(entry: Any, world_size: int, tmp_path: Path, name: str, args: tuple,
              timeout_s: float) -> list[dict[str, Any]]:
    out = tmp_path / name
    out.mkdir()
    return run_spawned(entry, (world_size, str(out), *args), world_size, out, timeout_s)


# ---- TwoStageExecutor vs HSDP -----------------------------------------------------------------
def spawn(world_size: int, tmp_path: Path, plan: dict[str, Any], cases: list[dict[str, Any]], *, emulated: bool,
          timeout_s: float = 150.0) -> list[dict[str, Any]]:
    name = f"w{world_size}{'emu' if emulated else 'gloo'}"
    return spawn_job(_entry, world_size, tmp_path, name, (plan, cases, emulated), timeout_s)


def _plan_and_mesh(plan_dict: dict[str, Any]) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from cpdpkit.planner import ShardingPlan

    plan = ShardingPlan.from_dict(plan_dict)
    return plan, init_device_mesh("cpu", plan.mesh.shape, mesh_dim_names=("replicate", "shard"))


def _entry(rank: int, world_size: int, out: str, plan_dict: dict[str, Any], cases: list[dict[str, Any]],
           emulated: bool) -> None:
    info = pj.init_rank(rank, world_size, out, emulated=emulated)
    from cpdpkit.emulator import meter

    with meter() if emulated else contextlib.nullcontext() as m:
        plan, mesh = _plan_and_mesh(plan_dict)
        results = [_run_case(rank, plan, mesh, case) for case in cases]
    pj.finish_rank(rank, out, {"backend": info.backend, "cases": results, "op_counts": m.op_counts if m else {}})


def _mp_policy(case: dict[str, Any]) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = case.get("mp")
    if mp is None:
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                reduce_dtype=torch.bfloat16 if mp == "bf16-reduce" else torch.float32)


def train_reference(net: nn.Module, opt: Any, case: dict[str, Any], data: list, clip: float | None, *,
                    reduce_grads: Any = None, norm_of: Any = float) -> dict[str, Any]:
    """The reference's ``NUM_STEPS`` steps: (accumulate,) ``reduce_grads(net)``, (clip,) step."""
    accum = case.get("accum", 1)
    losses, norms = [], []
    for step, scale in enumerate(loss_scales(case)):
        opt.zero_grad()
        for k in range(accum):
            x, y = data[step * accum + k]
            loss = nn.functional.mse_loss(net(x), y) * scale
            loss.backward()
        if reduce_grads is not None:
            reduce_grads(net)
        if clip is not None:
            norms.append(norm_of(torch.nn.utils.clip_grad_norm_(net.parameters(), clip)))
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms}


def exercise_executor(ex: Any, net: nn.Module, case: dict[str, Any], data: list, params: Any) -> dict[str, Any]:
    """Train; with the case's ``profile``/``calibrate``/``errors`` extras when it updates in backward."""
    extras = ex.update_in_backward
    with recorded_events(case.get("profile") and extras) as events:
        run = train_executor(ex, net, case, data)
        run["stages"] = {u.name: (u.stage, u.order) for u in ex._units}
        if case.get("profile") and extras:
            run["calibrated"] = ex.calibrate()
    run.update(params=params(net), state_bytes=ex.state_bytes(), events=events,
               grads_freed=all(p.grad is None for p in net.parameters()))
    if case.get("calibrate") and extras:
        ex.reset_stats()
        run["stats_before"] = train_executor(ex, net, case, data)["stats"]
        run["schedule"] = ex.calibrate()
        run["schedule_stages"] = {u.name: (u.stage, u.order) for u in ex._units}
        ex.reset_stats()
        run["stats_after"] = train_executor(ex, net, case, data)["stats"]
    if case.get("errors") and extras:
        run["errors"] = misuse_errors(ex, net, data)
    return run


def _hsdp(rank: int, plan: Any, mesh: Any, case: dict[str, Any], clip: float | None) -> dict[str, Any]:
    from cpdpkit.shard import apply_plan
    from cpdpkit.shard.executor import optimizer_state_bytes

    net = make_net(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_plan(net, plan, mesh, mp_policy=_mp_policy(case))
    opt = OPTIMIZERS[case["optimizer"]](net.parameters())
    run = train_reference(net, opt, case, batches(rank, NUM_STEPS * case.get("accum", 1)), clip,
                          norm_of=lambda norm: float(norm.full_tensor()))
    return {**run, "params": pj.full_params(net), "state_bytes": optimizer_state_bytes(opt)}


def _executor(rank: int, plan: Any, mesh: Any, case: dict[str, Any], clip: float | None, *,
              update_in_backward: bool = True) -> dict[str, Any]:
    from cpdpkit.shard.executor import TwoStageExecutor

    net = make_net(case)
    ex = TwoStageExecutor(net, plan, OPTIMIZERS[case["optimizer"]], mesh=mesh, max_grad_norm=clip,
                          update_in_backward=update_in_backward, mp_policy=_mp_policy(case))
    return exercise_executor(ex, net, case, batches(rank, NUM_STEPS * case.get("accum", 1)), pj.full_params)


def _run_case(rank: int, plan: Any, mesh: Any, case: dict[str, Any]) -> dict[str, Any]:
    from cpdpkit.planner import ShardingPlan

    plan = ShardingPlan.from_dict(case["plan"]) if "plan" in case else plan  # a case's own schedule
    clip = case.get("max_grad_norm")
    if clip == "alternate":
        clip = alternate_max_norm(_hsdp(rank, plan, mesh, case, 1e30)["norms"], loss_scales(case))
    out = {"name": case["name"], "max_grad_norm": clip, "hsdp": _hsdp(rank, plan, mesh, case, clip),
           "ex": _executor(rank, plan, mesh, case, clip)}
    if case.get("exact"):
        out["exact"] = _executor(rank, plan, mesh, case, clip, update_in_backward=False)
    return out


# ---- checkpoint / resume through torch.distributed.checkpoint -----------------------------------
def spawn_resume(world_size: int, tmp_path: Path, plan: dict[str, Any], cases: list[dict[str, Any]],
                 timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """Per case: an uninterrupted run vs one saved with ``dcp.save`` after ``case["k"]`` steps and
    resumed into a fresh model/executor (another init) with ``dcp.load``."""
    return spawn_job(_resume_entry, world_size, tmp_path, f"resume{world_size}", (plan, cases), timeout_s)


def _resume_entry(rank: int, world_size: int, out: str, plan_dict: dict[str, Any],
                  cases: list[dict[str, Any]]) -> None:
    pj.init_rank(rank, world_size, out, emulated=False)
    plan, mesh = _plan_and_mesh(plan_dict)
    results = [resume_case(rank, plan, mesh, case, Path(out, f"ckpt-{case['name']}")) for case in cases]
    pj.finish_rank(rank, out, {"cases": results})


def _train(net: nn.Module, ex: Any, data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    losses = []
    for x, y in data:
        ex.zero_grad()
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        ex.step()
        losses.append(loss.item())
    return losses


def resume_case(rank: int, plan: Any, mesh: Any, case: dict[str, Any], ckpt: Path,
                executor: Any = None, params: Any = pj.full_params) -> dict[str, Any]:
    """Uninterrupted vs saved after ``k`` steps and resumed into a fresh model/executor (any executor class)."""
    import torch.distributed.checkpoint as dcp

    from cpdpkit.planner import PlannerError
    from cpdpkit.shard.executor import TwoStageExecutor

    executor = executor or TwoStageExecutor
    factory, clip, k = OPTIMIZERS[case["optimizer"]], case.get("max_grad_norm"), case["k"]
    data = batches(rank)

    net = pj.make_net()
    ex = executor(net, plan, factory, mesh=mesh, max_grad_norm=clip)
    full_losses = _train(net, ex, data)
    ex.wait_exchanges()
    full_params = params(net)

    net1 = pj.make_net()
    ex1 = executor(net1, plan, factory, mesh=mesh, max_grad_norm=clip)
    first_losses = _train(net1, ex1, data[:k])
    if case.get("stateful"):  # the executor itself as a DCP Stateful
        dcp.save({"executor": ex1}, storage_writer=dcp.FileSystemWriter(str(ckpt)))
    else:
        dcp.save(ex1.state_dict(), storage_writer=dcp.FileSystemWriter(str(ckpt)))
    dist.barrier()
    # keep training the saved run: the checkpoint must not depend on what happens afterwards
    _train(net1, ex1, data[k:])

    torch.manual_seed(4321 + rank)  # another init, new objects
    net2 = pj.Net()
    ex2 = executor(net2, plan, factory, mesh=mesh, max_grad_norm=clip)
    fresh_differs = any(not torch.equal(a, full_params[n]) for n, a in params(net2).items())
    if case.get("stateful"):
        dcp.load({"executor": ex2}, storage_reader=dcp.FileSystemReader(str(ckpt)))
    else:
        sd = ex2.state_dict()
        dcp.load(sd, storage_reader=dcp.FileSystemReader(str(ckpt)))
        ex2.load_state_dict(sd)
    errors = []
    sd2 = ex2.state_dict(include_model=False)
    key = next(iter(sd2["optim"]))
    for bad in ({"optim": {"rep9of9_shard0of2": sd2["optim"][key]}},
                {"optim": {key: {**sd2["optim"][key], "layout": sd2["optim"][key]["layout"].replace(
                    '"numel": ', '"numel": 1')}}}):
        try:
            ex2.load_state_dict(bad)
        except PlannerError as exc:
            errors.append(str(exc))
    resumed_losses = _train(net2, ex2, data[k:])
    ex2.wait_exchanges()
    return {"name": case["name"], "full_params": full_params, "resumed_params": params(net2),
            "full_losses": full_losses, "resumed_losses": first_losses + resumed_losses,
            "fresh_differs": fresh_differs, "errors": errors, "optim_keys": sorted(sd2["optim"])}
