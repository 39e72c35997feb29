"""One rank of one ``cpdpkit bench`` run (launched by torchrun through :mod:`cpdpkit.launch`).

    python -m cpdpkit.bench.periodic.worker RUN_DIR [RUN_DIR ...]

for each run folder in turn (several: one launch of :func:`cpdpkit.bench.launcher.run_jobs`, each run in a
process group of its own), reads ``RUN_DIR/spec.json`` (a :class:`~cpdpkit.bench.periodic.config.RunSpec`),
trains, and rank 0 writes ``RUN_DIR/result.json`` and appends one line per epoch to ``RUN_DIR/progress.jsonl``.

Only training steps count towards the strategy's wall clock. Evaluation (of the average of the
ranks' parameters, so periodic strategies are judged on one model without disturbing their
training), data loading and start-up are harness time, reported separately.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from cpdpkit.bench.data import load_dataset
from cpdpkit.bench.data.augment import epoch_augmenter, first_images
from cpdpkit.bench.data.dataset import Dataset
from cpdpkit.bench.launcher import PROGRESS_FILE, finish_rank, job_store, read_specs
from cpdpkit.bench.models import build_model
from cpdpkit.bench.periodic.config import RunSpec
from cpdpkit.bench.periodic.strategies import StrategyRunner, build_strategy

__all__ = ["main"]

_DIVERGED_LOSS = 1e4


@torch.no_grad()
def _average_model_accuracy(module: nn.Module, data: Dataset, rank: int, world: int) -> float:
    """Test accuracy of the mean of all ranks' parameters with rank 0's buffers (a copy; training is untouched).

    Every rank scores its own contiguous slice of the test set and the counts are summed, so one
    evaluation costs each rank 1/world of the test set (the same accuracy as every rank scoring all of it).
    """
    params = [p.detach() for p in module.parameters()]
    buffers = [b for b in module.buffers() if b.is_floating_point()]
    flat = torch.cat([p.reshape(-1) for p in params]) / world
    if buffers:  # rank 0's (the others add zeros): BatchNorm's running statistics as rank 0 has them
        mine = torch.cat([b.reshape(-1).to(flat.dtype) for b in buffers])
        flat = torch.cat([flat, mine if rank == 0 else torch.zeros_like(mine)])
    dist.all_reduce(flat)
    evaluator = copy.deepcopy(module)
    offset = 0
    for t in [*evaluator.parameters(), *(b for b in evaluator.buffers() if b.is_floating_point())]:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    evaluator.eval()
    n = len(data.x_test)
    lo, hi = rank * n // world, (rank + 1) * n // world
    correct = torch.zeros(1, dtype=torch.int64)
    for i in range(lo, hi, 512):
        j = min(i + 512, hi)
        correct += int((evaluator(data.x_test[i:j]).argmax(1) == data.y_test[i:j]).sum())
    dist.all_reduce(correct)
    return int(correct) / n


def _steps_per_epoch(spec: RunSpec, data: Dataset, world: int) -> int:
    """Optimizer steps in one epoch: full global batches only (the last partial one is dropped)."""
    return len(data.x_train) // (spec.batch_size * world)


def _epoch_batches(spec: RunSpec, data: Dataset, epoch: int, rank: int, world: int):
    """This rank's batches: one global shuffle per (seed, epoch), dealt round-robin."""
    g = torch.Generator().manual_seed(1_000_003 * spec.seed + epoch)
    order = torch.randperm(len(data.x_train), generator=g)
    per_step = spec.batch_size * world
    for step in range(_steps_per_epoch(spec, data, world)):
        start = step * per_step + rank * spec.batch_size
        idx = order[start : start + spec.batch_size]
        yield data.x_train[idx], data.y_train[idx]


class _Progress:
    """What a run has done so far (curve, times, steps, last loss): saved with its checkpoints."""

    def __init__(self) -> None:
        self.state = {"curve": [], "train_s": 0.0, "harness_s": 0.0, "steps": 0, "loss": math.nan}

    def state_dict(self) -> dict:
        return copy.deepcopy(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = copy.deepcopy(state)


class _Resumable:
    """The checkpoints (``spec.checkpoint_every``) and the injected fault (``spec.fault``) of one run."""

    def __init__(self, spec: RunSpec, runner: StrategyRunner, run_dir: Path, rank: int, progress: _Progress) -> None:
        from cpdpkit.bench.periodic.faults import parse_fault

        self.runner, self.rank, self.progress = runner, rank, progress
        self.fault = parse_fault(spec.fault) if spec.fault else None
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.ckpt = None
        if spec.checkpoint_every:
            from cpdpkit.checkpoint import Checkpointer

            self.ckpt = Checkpointer(run_dir / "ckpt", every=spec.checkpoint_every)
        self.extra = {"progress": progress, **({"scheduler": runner.scheduler} if runner.scheduler else {})}

    def restore(self) -> int:
        if self.ckpt is None:
            return 0
        return self.ckpt.restore(model=self.runner.module, optimizer=self.runner.optimizer, extra=self.extra)

    def after_step(self, step: int, *, save: bool) -> None:
        fault = self.fault
        if fault is not None and self.attempt == 0 and self.rank == fault.rank and step == fault.step:
            print(f"rank {self.rank}: injected fault {fault}: SIGKILL after step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if save and self.ckpt is not None:
            self.ckpt.maybe_save(step, model=self.runner.module, optimizer=self.runner.optimizer, extra=self.extra)


def _train(spec: RunSpec, runner: StrategyRunner, data: Dataset, run_dir: Path,
           rank: int, world: int, prof) -> dict:
    progress = _Progress()
    resumable = _Resumable(spec, runner, run_dir, rank, progress)
    resumed_from = resumable.restore()
    p = progress.state
    per_epoch = _steps_per_epoch(spec, data, world)
    status, reason = "ok", None
    for epoch in range(resumed_from // per_epoch if per_epoch else spec.epochs, spec.epochs):
        dist.barrier()
        start = time.perf_counter()
        augment = epoch_augmenter(spec, epoch, rank, data.input_shape[0])  # None unless spec.augment
        done_in_epoch = p["steps"] - epoch * per_epoch  # > 0 only in the epoch a resumed run continues
        for i, (x, y) in enumerate(_epoch_batches(spec, data, epoch, rank, world)):
            if augment is not None:  # training batches only; evaluation sees the test set as it is
                x = augment(x)  # also for the batches a resumed run skips: the same draws afterwards
            if i < done_in_epoch:
                continue
            p["loss"] = runner.train_step(x, y)
            p["steps"] += 1
            if prof is not None:
                prof.step()
            resumable.after_step(p["steps"], save=i + 1 < per_epoch)  # an epoch's last step: after evaluation
        p["train_s"] += time.perf_counter() - start
        h0 = time.perf_counter()
        # one collective for both: did any rank diverge, and the slowest rank's train time
        loss = p["loss"]
        bad = 0.0 if math.isfinite(loss) and abs(loss) < _DIVERGED_LOSS else 1.0
        flags = torch.tensor([bad, p["train_s"]], dtype=torch.float64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0].item() > 0:
            status, reason = "diverged", f"training loss became {loss:.4g} in epoch {epoch + 1}"
            break
        wall = flags[1]
        acc = _average_model_accuracy(runner.module, data, rank, world)
        p["curve"].append({"epoch": epoch + 1, "wall_s": float(wall), "test_acc": acc, "loss": loss})
        if rank == 0:
            with (run_dir / PROGRESS_FILE).open("a") as fh:
                fh.write(json.dumps({"epoch": epoch + 1, "epochs": spec.epochs, "test_acc": acc}) + "\n")
        p["harness_s"] += time.perf_counter() - h0
        resumable.after_step(p["steps"], save=True)
    return {"curve": p["curve"], "train_s": p["train_s"], "harness_s": p["harness_s"], "steps": p["steps"],
            "status": status, "reason": reason, "final_loss": p["loss"], "resumed_from_step": resumed_from,
            "attempt": resumable.attempt}


def _params_sha256(module: nn.Module, world: int) -> list[str]:
    """Every rank's sha256 of its parameters' bytes (in ``named_parameters`` order), in rank order."""
    digest = hashlib.sha256()
    for name, p in module.named_parameters():
        digest.update(name.encode())
        digest.update(p.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    out: list[str | None] = [None] * world
    dist.all_gather_object(out, digest.hexdigest())
    return [str(d) for d in out]


def _profiled(spec: RunSpec):
    import contextlib

    if spec.profile_dir is None:
        return contextlib.nullcontext(None)
    from cpdpkit.tracing import default_schedule, trace_rank

    name = spec.strategy if spec.period is None else f"{spec.strategy}-k{spec.period}"
    folder = Path(spec.profile_dir) / (name if spec.seed == 0 else f"{name}-seed{spec.seed}")
    info = {"strategy": spec.strategy, "period": spec.period, "seed": spec.seed}
    return trace_rank(folder, schedule=default_schedule(wait=2, warmup=2, active=8), run_info=info)


def main(argv: list[str] | None = None) -> None:
    for index, (run_dir, raw) in enumerate(read_specs(sys.argv[1:] if argv is None else argv)):
        _run(index, run_dir, RunSpec.from_dict(raw))


def _run(index: int, run_dir: Path, spec: RunSpec) -> None:
    """The launch's run ``index``: its own process group (started here unless the caller has one), destroyed
    at the end (:func:`finish_rank`)."""
    from cpdpkit.emulator import init_distributed

    t0 = time.perf_counter()
    torch.set_num_threads(1)
    store = None if dist.is_initialized() else job_store(index)
    info = init_distributed(jitter_seed=spec.seed, store=store)  # paired seeds see the same network draws
    rank, world = info.rank, info.world_size
    data = first_images(load_dataset(spec.dataset, data_dir=spec.data_dir, quick=spec.quick), spec.max_images)
    torch.manual_seed(spec.seed)
    module = build_model(spec.model, data.input_shape, data.num_classes)
    total_steps = spec.epochs * _steps_per_epoch(spec, data, world)  # the LR schedule spans the run
    runner = build_strategy(spec.strategy, spec.period, module, lr=spec.lr, momentum=spec.momentum,
                            lr_schedule=spec.lr_schedule, total_steps=total_steps, sync=spec.sync,
                            overlap_steps=spec.overlap_steps)
    setup_s = time.perf_counter() - t0
    with _profiled(spec) as prof:
        out = _train(spec, runner, data, run_dir, rank, world, prof)
    m = runner.finish()
    params_sha256 = _params_sha256(runner.module, world)
    meter = torch.tensor([m.exposed_s, float(runner.max_step_bytes)], dtype=torch.float64)
    dist.all_reduce(meter, op=dist.ReduceOp.MAX)  # the slowest rank's exposed time, the largest step payload
    steps = max(out["steps"], 1)
    wall = max((p["wall_s"] for p in out["curve"]), default=out["train_s"])
    result = {
        "spec": spec.to_dict(), "status": out["status"], "reason": out["reason"], "dataset_info": data.info,
        "world_size": world, "topology": info.topology.name if info.topology else None,
        "peak_test_acc": max((p["test_acc"] for p in out["curve"]), default=math.nan),
        "final_test_acc": out["curve"][-1]["test_acc"] if out["curve"] else math.nan,
        "wall_s": wall, "step_s": wall / steps, "steps": out["steps"],
        "exposed_sync_s_per_step": float(meter[0]) / steps,
        "collectives_per_step": m.collectives / steps, "bytes_per_step": m.bytes_sent / steps,
        "max_bytes_per_step": float(meter[1]), "compression": spec.sync.compression, "fragments": spec.sync.fragments,
        "final_loss": out["final_loss"], "curve": out["curve"],
        "harness_s": {"setup": setup_s, "eval_and_checks": out["harness_s"]},
        "final_params_sha256": params_sha256,
    }
    if spec.checkpoint_every:  # a resumed run's meters (exposed, collectives) cover its last attempt only
        result["resumed_from_step"], result["attempt"] = out["resumed_from_step"], out["attempt"]
    k_over_time = runner.period_history()  # ours only: K at step 0 and each controller decision
    if k_over_time is not None:
        result["period_history"], result["mean_period"] = k_over_time
    finish_rank(run_dir, rank, result)


if __name__ == "__main__":
    main()
