"""``cpdpkit.checkpoint.Checkpointer``: per-rank state through DCP, atomic commits, RNG, and bad input.

The kill -9 / restart end to end (every strategy and the two-stage executor) is in
tests/test_launch_restart.py; here: two real gloo ranks saving mid-warm-up, mid-period and with a
reconciliation in flight (AdamW and an LR scheduler as ``extra``), resumed into fresh objects and
compared bit for bit with an uninterrupted run; and one-rank checks of atomicity, RNG and refusals.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from _checkpoint_setup import TOTAL_STEPS
from _checkpoint_setup import setup as _setup
from _ranks import SPAWN_TIMEOUT_S, share_fn
from cpdpkit.checkpoint import Checkpointer, CheckpointError

CASES = {  # name: (sync options, steps completed at the save)
    "slowmo-mid-warmup": ({"strategy": "slowmo", "warmup_steps": 10}, 6),
    "cpdp-mid-period": ({"strategy": "cpdp", "warmup_steps": 1}, 7),  # reconciles at 5 and 9
    "cpdp-in-flight": ({"strategy": "cpdp", "warmup_steps": 1, "overlap_steps": 3}, 6),  # launched 5, applied 8
    "localsgd-mid-period": ({"strategy": "localsgd", "warmup_steps": 1}, 7),
}


def _step(model: nn.Module, opt: Any, sched: Any) -> None:
    x, y = torch.randn(8, 6), torch.randn(8, 3)  # global RNG: only equal after a resume if it was restored
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    sched.step()


def _same(a: Any, b: Any) -> bool:
    """Deep equality, tensors bit for bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _resume_case(rank: int, name: str, root: Path) -> dict[str, Any]:
    options, save_at = CASES[name]
    model, opt, sched = _setup(options)
    torch.manual_seed(100 + rank)  # each rank its own data and dropout masks
    for _ in range(TOTAL_STEPS):
        _step(model, opt, sched)
    uninterrupted = (opt.state_dict(), {n: p.detach().clone() for n, p in model.named_parameters()})

    folder = root / name
    model, opt, sched = _setup(options)
    torch.manual_seed(100 + rank)
    ckpt = Checkpointer(folder, every=save_at, timeout_s=60)
    assert ckpt.restore(model=model, optimizer=opt, extra={"sched": sched}) == 0
    for step in range(1, save_at + 1):
        _step(model, opt, sched)
        ckpt.maybe_save(step, model=model, optimizer=opt, extra={"sched": sched})
    saved_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    _step(model, opt, sched)  # the saved run goes on: the checkpoint must not depend on it

    model, opt, sched = _setup(options, seed=7)  # another init and another RNG state: restore() must replace both
    torch.manual_seed(999)
    fresh = Checkpointer(folder, every=save_at, timeout_s=60)
    start = fresh.restore(model=model, optimizer=opt, extra={"sched": sched})
    restored_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(start, TOTAL_STEPS):
        _step(model, opt, sched)
    resumed = (opt.state_dict(), {n: p.detach().clone() for n, p in model.named_parameters()})
    return {"start": start, "same_state": _same(resumed[0], uninterrupted[0]),
            "same_params": _same(resumed[1], uninterrupted[1]), "restored": _same(restored_params, saved_params),
            "saved_params": saved_params}


def _wrong_strategy(rank: int, root: Path) -> str:
    """Restore a cpdp checkpoint into slowmo: refused on every rank before any collective."""
    model, opt, _ = _setup({"strategy": "slowmo", "warmup_steps": 1})
    ckpt = Checkpointer(root / "cpdp-mid-period", every=7, timeout_s=60)
    calls = []
    real_new_group = dist.new_group
    dist.new_group = lambda *a, **k: calls.append("new_group") or real_new_group(*a, **k)  # type: ignore[assignment]
    try:
        ckpt.restore(model=model, optimizer=opt)
    except CheckpointError as exc:
        return f"{exc} | collectives before it: {calls}"
    finally:
        dist.new_group = real_new_group  # type: ignore[assignment]
    return "not refused"


def _two_rank_job(rank: int, world: int, root: str) -> dict[str, Any]:
    out = {name: _resume_case(rank, name, Path(root)) for name in CASES}
    out["wrong_strategy"] = _wrong_strategy(rank, Path(root))
    out["root"] = root
    return out


# on 2 ranks of the session's one spawned group (tests/conftest.py planner_spawn), in a folder of its own
share_fn(__name__, "resume", _two_rank_job, 2, timeout_s=90.0, root_kwarg="root")


@pytest.mark.slow
@pytest.mark.timeout(SPAWN_TIMEOUT_S)  # the first test to ask for planner_spawn waits for all of it
def test_two_ranks_resume_bit_identical_and_keep_their_own_state(planner_spawn) -> None:
    results = planner_spawn[__name__]["resume"]
    root = Path(results[0]["root"])
    for rank, res in enumerate(results):
        for name, (_, save_at) in CASES.items():
            case = res[name]
            assert case["start"] == save_at, (name, rank)
            assert case["restored"], f"{name} rank {rank}: restored parameters differ from the saved ones"
            assert case["same_params"], f"{name} rank {rank}: resumed parameters differ from an uninterrupted run"
            assert case["same_state"], f"{name} rank {rank}: resumed optimizer state differs"
        message = res["wrong_strategy"]
        assert message.startswith("checkpoint '") and "was written with strategy 'cpdp', this run uses 'slowmo': " \
            "resume with the settings that wrote it, or point Checkpointer at another directory" in message, message
        assert message.endswith("| collectives before it: []"), message
    # mid-period and mid-warm-up saves hold different parameters per rank (mid-warm-up: identical,
    # since warm-up steps all-reduce gradients), and each rank's came back
    for name in ("cpdp-mid-period", "localsgd-mid-period", "cpdp-in-flight"):
        assert not _same(results[0][name]["saved_params"], results[1][name]["saved_params"]), name
    # every rank's state is its own set of DCP entries; nothing under a shared key
    folder = next((root / "cpdp-mid-period").glob("step*"))
    keys = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    assert {k.split("/", 1)[0] for k in keys} == {"rank0", "rank1"}
    assert {"rank0/model/0.weight", "rank1/model/0.weight"} <= set(keys)
    assert all(hasattr(md, "size") for md in keys.values())  # tensors only: no DCP bytes entry (a pickle)
    assert {"rank0.skeleton.json", "rank1.skeleton.json"} <= {p.name for p in folder.iterdir()}
    assert any(k.startswith("rank1/optimizer/cpdpkit/anchor") for k in keys)


# ---- one rank (the world1 fixture of tests/conftest.py): atomicity, RNG, refusals ------------
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"every": 0}, "every = 0 is invalid; use a whole number of steps >= 1, e.g. every=100"),
    ({"every": 2.5}, "every = 2.5 is invalid; use a whole number of steps >= 1, e.g. every=100"),
    ({"every": True}, "every = True is invalid; use a whole number of steps >= 1, e.g. every=100"),
    ({"every": 4, "keep": 0}, "keep = 0 is invalid; use a whole number >= 1, or None to keep all"),
    ({"every": 4, "timeout_s": -1}, "timeout_s = -1 is invalid; use seconds > 0, e.g. timeout_s=300"),
])
def test_bad_arguments_are_one_line(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(CheckpointError) as info:
        Checkpointer(tmp_path / "ckpt", **kwargs)
    assert str(info.value) == message


def test_directory_that_is_a_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    path.write_text("not a folder")
    with pytest.raises(CheckpointError) as info:
        Checkpointer(path, every=4)
    assert str(info.value) == (f"checkpoint directory {str(path)!r} is a file: pass a folder path "
                               "(it is created if missing)")


def test_objects_that_are_not_dcp_stateful_are_refused_before_any_collective(tmp_path: Path) -> None:
    class SaveOnly:  # state_dict without load_state_dict: not torch.distributed.checkpoint's Stateful
        def state_dict(self) -> dict:
            return {}

    model = nn.Linear(2, 2)
    ckpt = Checkpointer(tmp_path / "ckpt", every=1)
    fix = "pass a torch optimizer, PeriodicSyncOptimizer, TwoStageExecutor or an object with both methods"
    with pytest.raises(CheckpointError) as info:
        ckpt.maybe_save(1, model=model, optimizer=SaveOnly())
    assert str(info.value) == f"optimizer = SaveOnly has no state_dict/load_state_dict: {fix}"
    with pytest.raises(CheckpointError) as info:
        ckpt.restore(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), extra={"s": SaveOnly()})
    assert str(info.value) == f"extra['s'] = SaveOnly has no state_dict/load_state_dict: {fix}"


def test_no_checkpoint_restores_nothing(world1, tmp_path: Path) -> None:
    model, opt, _ = _setup({"strategy": "cpdp"})
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert Checkpointer(tmp_path / "new", every=4).restore(model=model, optimizer=opt) == 0
    assert _same(before, {n: p.detach() for n, p in model.named_parameters()}) and opt.step_count == 0


def test_crash_mid_save_leaves_the_previous_checkpoint(world1, tmp_path: Path, monkeypatch) -> None:
    model, opt, sched = _setup({"strategy": "localsgd"})
    ckpt = Checkpointer(tmp_path / "ckpt", every=4)
    for step in range(1, 5):
        _step(model, opt, sched)
        ckpt.maybe_save(step, model=model, optimizer=opt)
    at_4 = {n: p.detach().clone() for n, p in model.named_parameters()}

    def crash(*args: Any, **kwargs: Any) -> None:  # the process dies after writing, before the commit
        raise KeyboardInterrupt

    monkeypatch.setattr(Checkpointer, "_commit", crash)
    for step in range(5, 9):
        _step(model, opt, sched)
        if step == 8:
            with pytest.raises(KeyboardInterrupt):
                ckpt.maybe_save(step, model=model, optimizer=opt)
    monkeypatch.undo()
    assert (tmp_path / "ckpt" / ".tmp-step00000008" / ".metadata").is_file()  # every byte written, not committed
    model, opt, _ = _setup({"strategy": "localsgd"}, seed=3)
    again = Checkpointer(tmp_path / "ckpt", every=4)
    assert again.restore(model=model, optimizer=opt) == 4
    assert _same(at_4, {n: p.detach() for n, p in model.named_parameters()})
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step00000004"]  # the partial one removed


def test_rng_states_are_restored(world1, tmp_path: Path) -> None:
    model, opt, _ = _setup({"strategy": "ddp"})
    ckpt = Checkpointer(tmp_path / "ckpt", every=1)
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    ckpt.maybe_save(1, model=model, optimizer=opt)
    expected = (torch.rand(4), random.random(), np.random.rand())
    torch.manual_seed(6)
    random.seed(6)
    np.random.seed(6)
    assert ckpt.restore(model=model, optimizer=opt) == 1
    got = (torch.rand(4), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def test_other_world_size_is_refused_before_any_collective(world1, tmp_path: Path, monkeypatch) -> None:
    model, opt, _ = _setup({"strategy": "cpdp"})
    folder = Checkpointer(tmp_path / "ckpt", every=2).save(2, model=model, optimizer=opt)
    meta = json.loads((folder / "cpdpkit-checkpoint.json").read_text())
    (folder / "cpdpkit-checkpoint.json").write_text(json.dumps({**meta, "world_size": 4}))
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: pytest.fail("a collective before the check"))
    with pytest.raises(CheckpointError) as info:
        Checkpointer(tmp_path / "ckpt", every=2).restore(model=model, optimizer=opt)
    assert str(info.value) == (f"checkpoint {str(folder)!r} was written by 4 ranks, this run has 1: launch 4 ranks, "
                               f"or point Checkpointer at another directory than {str(tmp_path / 'ckpt')!r}")


def test_other_optimizer_kind_and_model_are_refused(world1, tmp_path: Path) -> None:
    model, opt, _ = _setup({"strategy": "cpdp"})
    Checkpointer(tmp_path / "ckpt", every=2).save(2, model=model, optimizer=opt)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CheckpointError) as info:
        Checkpointer(tmp_path / "ckpt", every=2).restore(model=model, optimizer=plain)
    assert "holds a PeriodicSyncOptimizer state, this run passes a SGD: resume with the settings" in str(info.value)
    shutil.rmtree(tmp_path / "ckpt")
    folder = Checkpointer(tmp_path / "ckpt", every=2).save(2, model=model, optimizer=plain)
    bigger = nn.Sequential(nn.Linear(6, 17), nn.Tanh(), nn.Dropout(0.2), nn.Linear(17, 3))
    with pytest.raises(CheckpointError) as info:
        Checkpointer(tmp_path / "ckpt", every=2).restore(
            model=bigger, optimizer=torch.optim.SGD(bigger.parameters(), lr=0.1))
    assert str(info.value) == (f"checkpoint {str(folder)!r}: model entry '0.weight' is (16, 6) torch.float32, "
                               "this model's is (17, 6) torch.float32: restore into the same model")


def test_keep_prunes_old_checkpoints_and_bad_step_is_refused(world1, tmp_path: Path) -> None:
    model, opt, _ = _setup({"strategy": "ddp"})
    ckpt = Checkpointer(tmp_path / "ckpt", every=2, keep=2)
    saved = [step for step in range(0, 9) if ckpt.maybe_save(step, model=model, optimizer=opt)]
    assert saved == [2, 4, 6, 8]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step00000006", "step00000008"]
    assert ckpt.latest() == (8, tmp_path / "ckpt" / "step00000008")
    with pytest.raises(CheckpointError) as info:
        ckpt.maybe_save(-2, model=model, optimizer=opt)
    assert str(info.value) == "step = -2 is invalid; pass the number of completed steps (an int >= 0)"
