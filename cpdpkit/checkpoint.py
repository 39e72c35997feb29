"""Checkpoints that let a killed distributed run resume bit-identically: ``Checkpointer(directory, every=N)``.

Usage (every rank runs the same lines)::

    ckpt = Checkpointer("runs/ckpt", every=8)
    start = ckpt.restore(model=model, optimizer=opt)       # steps completed in the latest checkpoint, or 0
    for step in range(start + 1, total + 1):
        train_one_step(step)
        ckpt.maybe_save(step, model=model, optimizer=opt)  # saves when step % 8 == 0

``optimizer`` is a :class:`~cpdpkit.sync.PeriodicSyncOptimizer` (any strategy, mid-warm-up, mid-period,
a reconciliation in flight, over a plain, DDP or FSDP2-sharded model), a :class:`~cpdpkit.shard.TwoStageExecutor` or
:class:`~cpdpkit.shard.PartialShardExecutor`, or any object with ``state_dict``/``load_state_dict``
(a plain ``torch.optim`` optimizer). ``extra={"scheduler": sched}`` adds more such objects.

**Each rank keeps its own state.** Between reconciliations the ranks hold different parameters and
optimizer state, and torch.distributed.checkpoint (DCP) de-duplicates plain tensors that several
ranks save under one key (and, through ``get_optimizer_state_dict``, drops keys it does not know,
such as the optimizer's ``"cpdpkit"`` entry). So nothing is saved under a shared key: every rank
saves its whole state (model, optimizer, RNG, extras, all of it its own copy) under keys starting
``rank<R>/``. Each tensor is one DCP entry ``rank<R>/<path>``; everything else (the nesting, ints,
floats, strings, ``None``, the optimizer's ``"cpdpkit"`` dict around its tensors, Python's RNG
state) is JSON in ``rank<R>.skeleton.json``, in which tensors are references to their entries.
**A checkpoint is data, not code**: nothing is unpickled on restore (the skeleton is JSON, tensors
load through ``torch.load(weights_only=True)``, DCP's pickled ``.metadata`` through an unpickler that
admits only DCP's metadata classes, and no DCP bytes entry is written or read); anything in a state
dict that is not plain data is refused at save, naming its key. The manifest
``cpdpkit-checkpoint.json`` lists every file's size and SHA-256: restore refuses a truncated,
corrupted or foreign folder in one line before loading anything. Restoring builds DCP's load template
from the checkpoint's own metadata (the shapes and dtypes of this rank's entries), so it needs no
knowledge of what was saved, and puts the skeleton
back together: the same Python objects, and tensors equal bit for bit. Model tensors are copied
into the live model in place (parameters that are views of a flat buffer, FSDP2's sharded
parameters: a DTensor is saved as its local shard). The price: parameters replicated across ranks
are stored once per rank, and a checkpoint loads only into the same world size (checked).

**Atomicity.** A save writes into ``DIR/.tmp-step<N>`` (rank 0 empties it first; a barrier), every
rank writes its entries through ``dcp.save`` (rank 0 writes DCP's metadata once every rank's data
is written), then rank 0 writes ``cpdpkit-checkpoint.json`` and renames the folder to
``DIR/step<N>`` (8 digits), and a last barrier makes every rank return only after that rename.
The rename is the commit: :meth:`Checkpointer.restore` considers only ``step<N>`` folders holding
the JSON, so a crash mid-save leaves at most a ``.tmp-*`` folder that no restore picks (the next
restore removes it); a rank that dies mid-save makes the others raise :class:`CheckpointError`
within ``timeout_s``. The ``keep`` newest checkpoints are kept; pruning deletes only folders whose
manifest says this checkpointer wrote them.

**Randomness.** Each rank's RNG states are saved and restored: torch's CPU generator, CUDA's when
CUDA is initialised, Python's ``random`` and, when numpy is imported, numpy's global generator.
A training loop that draws from them (dropout, shuffling) continues the same draws after a
restart. Generators the loop creates itself (``torch.Generator()``) are not seen: derive them
from the step or epoch (as the bench does), or pass them in ``extra`` wrapped in an object with
``state_dict``/``load_state_dict``.

**Collectives.** Every collective runs on a gloo group the checkpointer creates on first use with
``timeout_s`` (DCP's own planning collectives included, and two monitored barriers per save): a
peer that died fails the others within the timeout instead of hanging them. Bad input (``every``,
a directory that is a file, a checkpoint of another world size, optimizer kind or strategy) raises
:class:`CheckpointError` before any collective. The folder must be shared by all ranks (one node,
or a shared filesystem); ranks that see different latest checkpoints are refused.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import sys
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException as DcpError  # a BaseException
from torch.distributed.checkpoint.stateful import Stateful

from cpdpkit import _checkpoint_files as files
from cpdpkit.contracts import SyncedExecutor
from cpdpkit.errors import CpdpkitError

__all__ = ["Checkpointer", "CheckpointError"]

_FORMAT = 2  # 1: the skeleton was a pickle (refused: loading it could run code)
_META_FILE = "cpdpkit-checkpoint.json"
_STEP_DIR = re.compile(r"^step(\d{8})$")
_TMP_PREFIX = ".tmp-step"
_SKELETON = "rank{rank}.skeleton.json"


class CheckpointError(CpdpkitError, ValueError):
    """A checkpoint cannot be written or does not fit this run (names the value and the fix)."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # ("MT19937", uint32 array, pos, has_gauss, cached): the array as plain ints
        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = (str(kind), [int(k) for k in keys], int(pos), int(has_gauss), float(cached))
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        kind, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((kind, numpy.asarray(keys, dtype=numpy.uint32), pos, has_gauss, cached))


def _describe(optimizer: Any) -> tuple[str, str | None]:
    """``(kind, strategy)`` of what is checkpointed: a saved checkpoint must match both."""
    from cpdpkit.sync import PeriodicSyncOptimizer

    if isinstance(optimizer, PeriodicSyncOptimizer):
        return "PeriodicSyncOptimizer", optimizer.config.strategy
    if isinstance(optimizer, SyncedExecutor):
        return type(optimizer).__name__, optimizer.plan.strategy
    return type(optimizer).__name__, None


def _check_stateful(name: str, obj: Any) -> None:
    if not isinstance(obj, Stateful):  # DCP's protocol: state_dict() and load_state_dict(state_dict)
        raise CheckpointError(f"{name} = {type(obj).__name__} has no state_dict/load_state_dict: pass a torch "
                              "optimizer, PeriodicSyncOptimizer, TwoStageExecutor or an object with both methods")


class Checkpointer:
    """Save every ``every`` steps and restore the latest complete checkpoint (module docstring).

    Args:
        directory: the folder holding ``step<N>`` checkpoints (created if missing; shared by all ranks).
        every: save when the number of completed steps is a multiple of it (>= 1).
        keep: how many of the newest checkpoints to keep (``None``: all).
        timeout_s: the timeout of every collective the checkpointer issues.
    """

    def __init__(self, directory: str | os.PathLike[str], *, every: int, keep: int | None = 2,
                 timeout_s: float = 300.0) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise CheckpointError(f"every = {every!r} is invalid; use a whole number of steps >= 1, e.g. every=100")
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
            raise CheckpointError(f"keep = {keep!r} is invalid; use a whole number >= 1, or None to keep all")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise CheckpointError(f"timeout_s = {timeout_s!r} is invalid; use seconds > 0, e.g. timeout_s=300")
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"checkpoint directory {str(directory)!r} is a file: pass a folder path "
                                  "(it is created if missing)")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"checkpoint directory {str(directory)!r} cannot be created ({exc.strerror}): "
                                  "pass a writable folder path") from exc
        self.every, self.keep, self.timeout_s = every, keep, float(timeout_s)
        self._group: Any = None

    # -- public -----------------------------------------------------------------------------------
    def latest(self) -> tuple[int, Path] | None:
        """``(steps, folder)`` of the newest complete checkpoint in the directory, or None (no collective)."""
        found = []
        for entry in self.directory.iterdir() if self.directory.is_dir() else ():
            match = _STEP_DIR.match(entry.name)
            if match and (entry / _META_FILE).is_file() and (entry / ".metadata").is_file():
                found.append((int(match.group(1)), entry))
        return max(found) if found else None

    def restore(self, *, model: nn.Module, optimizer: Any, extra: Mapping[str, Any] | None = None) -> int:
        """Load the latest complete checkpoint into ``model``, ``optimizer``, ``extra`` and the RNGs.

        Returns the number of steps it had completed (0, changing nothing, when there is none).
        Every rank must call it.
        """
        extra = dict(extra or {})
        self._check_objects(model, optimizer, extra)
        latest = self.latest()
        if latest is not None:
            self._check_fits(latest[1], optimizer, extra)
        self._agree_on(latest)
        if self._rank() == 0:  # a crash mid-save may have left these; nobody is saving now
            for stale in [*self.directory.glob(f"{_TMP_PREFIX}*"), *self.directory.glob(".old-step*")]:
                shutil.rmtree(stale, ignore_errors=True)
        if latest is None:
            return 0
        step, folder = latest
        state = self._load(folder)
        try:
            self._apply(state, model, optimizer, extra)
        except CheckpointError as exc:
            raise CheckpointError(f"checkpoint {str(folder)!r}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a forged skeleton (manifest matched) can make load_state_dict raise anything
            raise CheckpointError(f"checkpoint {str(folder)!r} does not fit this model and optimizer "
                                  f"({_one_line(exc)}); the model, optimizer or RNGs may be partly restored: build "
                                  "them again, and delete that folder to resume from the one before it") from None
        return step

    def maybe_save(self, step: int, *, model: nn.Module, optimizer: Any,
                   extra: Mapping[str, Any] | None = None) -> bool:
        """Save a checkpoint of ``step`` completed steps if ``step % every == 0`` (and step >= 1).

        Returns whether it saved. Every rank must call it with the same ``step``.
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise CheckpointError(f"step = {step!r} is invalid; pass the number of completed steps (an int >= 0)")
        if step == 0 or step % self.every:
            return False
        extra = dict(extra or {})
        self._check_objects(model, optimizer, extra)
        self.save(step, model=model, optimizer=optimizer, extra=extra)
        return True

    def save(self, step: int, *, model: nn.Module, optimizer: Any, extra: Mapping[str, Any] | None = None) -> Path:
        """Save a checkpoint of ``step`` completed steps now, whatever ``every`` says; its folder."""
        extra = dict(extra or {})
        self._check_objects(model, optimizer, extra)
        rank = self._rank()
        tensors, skeleton = self._gather(step, model, optimizer, extra)  # before any collective: fails alone
        tmp = self.directory / f"{_TMP_PREFIX}{step:08d}"
        final = self.directory / f"step{step:08d}"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self._barrier("before writing checkpoint")
        with open(tmp / _SKELETON.format(rank=rank), "wb") as fh:
            fh.write(skeleton)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            dcp.save(tensors, checkpoint_id=str(tmp), process_group=self._pg())
        except (Exception, DcpError) as exc:  # noqa: BLE001 - a peer that died mid-save fails DCP in many ways
            raise CheckpointError(f"checkpoint save of step {step} into {str(tmp)!r} failed ({_one_line(exc)}): "
                                  "nothing was committed (the latest checkpoint is the one before); check that every "
                                  "rank is alive and calls maybe_save at the same step") from None
        if rank == 0:
            self._commit(step, tmp, final, optimizer, extra)
        self._barrier("after committing checkpoint")
        return final

    # -- saving -----------------------------------------------------------------------------------
    def _gather(self, step: int, model: nn.Module, optimizer: Any,
                extra: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], bytes]:
        # The optimizer first: it finishes exchanges in flight (an executor writes them into the model).
        if isinstance(optimizer, SyncedExecutor):  # the model is saved on its own, below
            optim_state = optimizer.state_dict(include_model=False)
        else:
            optim_state = optimizer.state_dict()
        whole = {"step": step, "optimizer": optim_state, "model": model.state_dict(),
                 "extra": {name: obj.state_dict() for name, obj in extra.items()}, "rng": _rng_state()}
        prefix = f"rank{self._rank()}"
        tensors: dict[str, torch.Tensor] = {}
        local: list[str] = []

        def ref(tensor: torch.Tensor, path: str) -> dict[str, Any]:
            key = path if path not in tensors else f"{path}#{len(tensors)}"
            tensors[key] = _local(tensor).detach()
            if hasattr(tensor, "to_local"):
                local.append(key)
            return {"$tensor": key, "local": hasattr(tensor, "to_local")}

        try:
            skeleton = files.skeleton_text(files.encode_skeleton(whole, prefix, ref))
        except files.SkeletonError as exc:
            raise CheckpointError(f"cannot save checkpoint state: {exc}") from None
        # PeriodicSyncOptimizer wraps local shards back into DTensors when it loads; a plain optimizer cannot
        rebuilds = _describe(optimizer)[0] == "PeriodicSyncOptimizer"
        if any(k.startswith(f"{prefix}/extra/") or (k.startswith(f"{prefix}/optimizer/") and not rebuilds)
               for k in local):
            raise CheckpointError(f"{type(optimizer).__name__}'s state holds DTensors (FSDP2 with a plain optimizer), "
                                  "which restore could not rebuild: wrap the optimizer in PeriodicSyncOptimizer or use "
                                  "TwoStageExecutor, or dcp.save(get_state_dict(model, optimizer)) for such a model")
        return tensors, skeleton

    def _commit(self, step: int, tmp: Path, final: Path, optimizer: Any, extra: Mapping[str, Any]) -> None:
        kind, strategy = _describe(optimizer)
        meta = {"format": _FORMAT, "step": step, "world_size": dist.get_world_size(), "optimizer": kind,
                "strategy": strategy, "extra": sorted(extra), "torch": torch.__version__,
                "saved_unix_s": time.time(), "writer": files.WRITER,
                "files": files.hash_files(tmp, skip=_META_FILE)}
        with open(tmp / _META_FILE, "w", encoding="utf-8") as fh:
            json.dump(meta, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        trash = None
        if final.exists():  # saved again at the same step (e.g. a rerun): replace it
            trash = self.directory / f".old-{final.name}-{os.getpid()}"
            os.rename(final, trash)
        os.rename(tmp, final)
        _fsync_dir(self.directory)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        self._prune()

    def _prune(self) -> None:
        if self.keep is None:
            return
        steps = sorted(p for p in self.directory.iterdir() if _STEP_DIR.match(p.name) and _ours(p))
        for old in steps[: max(0, len(steps) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)

    # -- restoring --------------------------------------------------------------------------------
    def _check_fits(self, folder: Path, optimizer: Any, extra: Mapping[str, Any]) -> None:
        """Refuse a checkpoint of another world size, optimizer kind, strategy or extras (no collective)."""
        try:
            meta = _read_manifest(folder)
        except (OSError, ValueError, RecursionError) as exc:
            raise CheckpointError(f"checkpoint {str(folder)!r} has an unreadable {_META_FILE} ({_one_line(exc)}): "
                                  "delete that folder to resume from the one before it") from None
        world = dist.get_world_size()
        kind, strategy = _describe(optimizer)
        elsewhere = f"point Checkpointer at another directory than {str(self.directory)!r}"
        fix = f"resume with the settings that wrote it, or {elsewhere}"
        if not isinstance(meta, dict):
            raise CheckpointError(f"checkpoint {str(folder)!r} has a {_META_FILE} that is not an object: it was not "
                                  f"written by cpdpkit's Checkpointer; {elsewhere}")
        if meta.get("format") == 1:
            raise CheckpointError(f"checkpoint {str(folder)!r} has format 1 (its state is a pickle, which this cpdpkit "
                                  "never loads: loading it could run code): delete it, or resume it with cpdpkit "
                                  "before format 2 if you trust whoever could write that folder")
        if meta.get("format") != _FORMAT or meta.get("writer") != files.WRITER:
            raise CheckpointError(f"checkpoint {str(folder)!r} has format {meta.get('format')!r} from "
                                  f"{meta.get('writer')!r}, this cpdpkit reads {_FORMAT} from {files.WRITER!r}: load "
                                  "it with the cpdpkit version that wrote it")
        problem = files.verify_files(folder, meta.get("files"), skip=_META_FILE)
        if problem is not None:
            raise CheckpointError(f"checkpoint {str(folder)!r} is damaged or not ours: {problem}; delete that folder "
                                  "to resume from the one before it")
        if meta.get("world_size") != world:
            saved = _shown(meta.get("world_size"))
            raise CheckpointError(f"checkpoint {str(folder)!r} was written by {saved} ranks, this run has {world}: "
                                  f"launch {saved} ranks, or {elsewhere}")
        if meta.get("optimizer") != kind:
            raise CheckpointError(f"checkpoint {str(folder)!r} holds a {_shown(meta.get('optimizer'))} state, this run "
                                  f"passes a {kind}: {fix}")
        if meta.get("strategy") != strategy:
            raise CheckpointError(f"checkpoint {str(folder)!r} was written with strategy {meta.get('strategy')!r}, "
                                  f"this run uses {strategy!r}: {fix}")
        if meta.get("extra") != sorted(extra):
            raise CheckpointError(f"checkpoint {str(folder)!r} holds extra state {meta.get('extra')!r}, this run "
                                  f"passes extra={sorted(extra)}: pass the same extra objects")

    def _agree_on(self, latest: tuple[int, Path] | None) -> None:
        """One all-reduce: every rank must have found the same latest checkpoint."""
        mine = -1 if latest is None else latest[0]
        both = torch.tensor([mine, -mine], dtype=torch.int64)
        work = dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self._pg(), async_op=True)
        self._wait(work, "agreeing on the latest checkpoint")
        high, low = int(both[0]), -int(both[1])
        if high != low:
            raise CheckpointError(f"ranks found different latest checkpoints in {str(self.directory)!r} (steps "
                                  f"{low} to {high}; -1: none): put the folder on storage every rank sees")

    def _load(self, folder: Path) -> dict[str, Any]:
        rank = self._rank()
        prefix = f"rank{rank}/"
        reader = files.SafeReader(str(folder))
        skeleton_file = folder / _SKELETON.format(rank=rank)
        unsafe = f"checkpoint {str(folder)!r} cannot be read safely"
        fix = "delete that folder to resume from the one before it"
        try:
            metadata = reader.read_metadata()
            node = files.read_skeleton(skeleton_file)
        except (files.SkeletonError, OSError) as exc:  # the manifest matched: written by a hostile hand
            raise CheckpointError(f"{unsafe} ({exc}): {fix}") from None
        template = self._template(folder, metadata, prefix)
        try:
            dcp.load(template, checkpoint_id=str(folder), storage_reader=reader, process_group=self._pg())
        except (Exception, DcpError) as exc:  # noqa: BLE001 - the metadata is DCP's own classes but may be forged
            raise CheckpointError(f"{unsafe} (DCP could not load its tensors: {_one_line(exc)}): {fix}") from None

        def tensor(ref: dict[str, Any]) -> torch.Tensor:
            if not isinstance(ref.get("$tensor"), str) or ref["$tensor"] not in template:  # a forged name may be a dict
                raise files.SkeletonError(f"it names a tensor {str(ref.get('$tensor'))[:80]!r} that is not there")
            return template[ref["$tensor"]]

        try:
            state = files.decode_skeleton(node, tensor)
        except (files.SkeletonError, RecursionError) as exc:
            raise CheckpointError(f"checkpoint {str(folder)!r} has a bad {skeleton_file.name} ({exc}): delete "
                                  "that folder to resume from the one before it") from None
        if not isinstance(state, dict) or not {"model", "optimizer", "extra", "rng"} <= set(state):
            raise CheckpointError(f"checkpoint {str(folder)!r} has no state for rank {rank}: it was not written by "
                                  "this Checkpointer with this world size; use another directory")
        return state

    @staticmethod
    def _template(folder: Path, metadata: Any, prefix: str) -> dict[str, torch.Tensor]:
        """Empty tensors of this rank's entries: at most as many bytes as the folder's data files hold."""
        unsafe = f"checkpoint {str(folder)!r} cannot be read safely"
        stored = sum(p.stat().st_size for p in folder.iterdir() if p.name.endswith(".distcp"))
        shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        try:
            for key, md in metadata.state_dict_metadata.items():
                if isinstance(key, str) and key.startswith(prefix):
                    if not hasattr(md, "size"):  # a bytes entry: DCP would torch.load(weights_only=False) it
                        raise CheckpointError(f"checkpoint {str(folder)!r} holds a bytes entry {key!r}, which this "
                                              "checkpointer never writes nor loads: use another directory")
                    shape, dtype = tuple(int(n) for n in md.size), md.properties.dtype
                    if min(shape, default=0) < 0 or not isinstance(dtype, torch.dtype):
                        raise ValueError(f"entry {key[:80]!r} has shape {shape[:4]} and dtype {dtype!r}")
                    shapes[key] = shape, dtype
            wanted = sum(math.prod(shape) * dtype.itemsize for shape, dtype in shapes.values())
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - forged metadata objects: any attribute may be missing or odd
            raise CheckpointError(f"{unsafe} (its DCP metadata is malformed: {_one_line(exc)}): delete that folder to "
                                  "resume from the one before it") from None
        if wanted > stored:  # what a forged .metadata could make restore allocate
            raise CheckpointError(f"{unsafe} (its DCP metadata describes {wanted:,} bytes of tensors, its data files "
                                  f"hold {stored:,}): delete that folder to resume from the one before it")
        return {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in shapes.items()}

    def _apply(self, state: dict[str, Any], model: nn.Module, optimizer: Any, extra: Mapping[str, Any]) -> None:
        self._copy_into_model(model, state["model"])
        optimizer.load_state_dict(state["optimizer"])  # an executor copies the model into its slices here
        for name, obj in extra.items():
            obj.load_state_dict(state["extra"][name])
        _set_rng_state(state["rng"])

    @torch.no_grad()
    def _copy_into_model(self, model: nn.Module, saved: Mapping[str, torch.Tensor]) -> None:
        live = model.state_dict()
        if set(live) != set(saved):
            missing, unexpected = sorted(set(live) - set(saved)), sorted(set(saved) - set(live))
            raise CheckpointError(f"its model keys differ from this model's (missing {missing[:3]}, "
                                  f"unexpected {unexpected[:3]}): restore into the model the checkpoint was saved from")
        for key, value in saved.items():  # every entry checked before the first is copied
            target = _local(live[key])
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"model entry {key!r} is a {type(value).__name__}, not a tensor: "
                                      "delete that folder to resume from the one before it")
            if target.shape != value.shape or target.dtype != value.dtype:
                raise CheckpointError(f"model entry {key!r} is {tuple(value.shape)} {value.dtype}, this "
                                      f"model's is {tuple(target.shape)} {target.dtype}: restore into the same model")
        for key, value in saved.items():
            _local(live[key]).copy_(value)

    # -- plumbing ---------------------------------------------------------------------------------
    def _check_objects(self, model: Any, optimizer: Any, extra: Mapping[str, Any]) -> None:
        if not isinstance(model, nn.Module):
            raise CheckpointError(f"model = {type(model).__name__} is not an nn.Module: pass model=<your module>")
        _check_stateful("optimizer", optimizer)
        for name, obj in extra.items():
            if not isinstance(name, str) or not name or "/" in name:
                raise CheckpointError(f"extra key {name!r} is invalid; use a non-empty name without '/'")
            _check_stateful(f"extra[{name!r}]", obj)
        if not (dist.is_available() and dist.is_initialized()):
            raise CheckpointError("torch.distributed is not initialised: call cpdpkit.init_distributed() (or "
                                  "init_process_group) before restore/maybe_save")

    @staticmethod
    def _rank() -> int:
        return dist.get_rank()

    def _pg(self) -> Any:
        # A gloo group of its own: DCP's planning collectives get this timeout, and checkpoint
        # traffic never goes through an emulated (delayed) default group.
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        return self._group

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise CheckpointError(f"checkpoint collective {what} failed or timed out after {self.timeout_s:g} s "
                                  f"({str(exc).splitlines()[0] if str(exc) else exc!r}): check that every rank "
                                  "calls restore/maybe_save at the same step") from exc

    def _barrier(self, what: str) -> None:
        try:
            dist.monitored_barrier(group=self._pg(), timeout=timedelta(seconds=self.timeout_s), wait_all_ranks=True)
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            raise CheckpointError(f"checkpoint barrier {what} failed or timed out after {self.timeout_s:g} s "
                                  f"({first}): check that every rank calls maybe_save at the same step") from exc


def _read_manifest(folder: Path) -> Any:
    with open(folder / _META_FILE, "rb") as fh:
        data = fh.read(files.MAX_SKELETON_BYTES + 1)
    if len(data) > files.MAX_SKELETON_BYTES:
        raise ValueError(f"it is over {files.MAX_SKELETON_BYTES:,} bytes")
    return json.loads(data.decode("utf-8"))


def _shown(value: Any) -> str:
    """A manifest's value in a message: as it is when it is a plain int or name, else its (one-line) repr."""
    plain = type(value) is int or (isinstance(value, str) and value.isidentifier())
    return str(value) if plain else repr(value)[:100]


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:200]


def _ours(folder: Path) -> bool:
    """Whether ``folder``'s manifest says this checkpointer wrote it (pruning deletes nothing else)."""
    try:
        meta = _read_manifest(folder)
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(meta, dict) and meta.get("writer") == files.WRITER and isinstance(meta.get("files"), dict)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
