"""The checkpoint folder as a fuzz target: truncated, corrupted and hostile folders handed to ``restore``.

A case is one checkpoint folder (``ckpt/step00000002/``) made from a real one (a ``Checkpointer`` save of
a small model under ``PeriodicSyncOptimizer``, world size 1) by one to three changes: a file's bytes
broken (truncated, flipped, random), a file dropped or added, the JSON skeleton or manifest mutated as a
tree, DCP's ``.metadata`` replaced by a pickle whose ``__reduce__`` would create a marker file, the files
of a DCP save holding a bytes entry with that payload, or ``.metadata`` claiming a tensor of 2^40
elements. Half the cases then forge the manifest (the hashes of the changed files, as an attacker who
can write the folder would), so the checks behind it are reached too. ``restore`` must load or end in
one ``CheckpointError`` line naming the folder; the marker must never appear (no code ran).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import pickle
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from _fuzz_docs import broken_bytes, dump_json, mutated_tree

__all__ = ["MARKER", "checkpoint_cases", "restore_case"]

MANIFEST = "cpdpkit-checkpoint.json"
STEP = "ckpt/step00000002"
MARKER = Path(tempfile.gettempdir()) / f"cpdpkit-fuzz-code-ran-{os.getpid()}"


class _Payload:
    """Unpickling this creates :data:`MARKER` (through ``builtins.eval``: no class of ours is needed to run it)."""

    def __reduce__(self):  # noqa: ANN204
        return (eval, (f"open({str(MARKER)!r}, 'w').close()",))


@contextlib.contextmanager
def _world1() -> Iterator[None]:
    """A one-rank gloo default group for the block (or the one already there)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _objects() -> tuple[Any, Any]:
    from _checkpoint_setup import setup

    model, opt, _ = setup({"strategy": "cpdp"})
    return model, opt


@functools.cache
def _seeds() -> dict[str, Any]:
    """The files of a real checkpoint, of a DCP save with a payload bytes entry, and a size-bomb ``.metadata``."""
    import torch
    import torch.distributed.checkpoint as dcp

    from cpdpkit.checkpoint import Checkpointer

    with tempfile.TemporaryDirectory() as tmp, _world1():
        model, opt = _objects()
        folder = Checkpointer(Path(tmp) / "ckpt", every=2).save(2, model=model, optimizer=opt)
        good = {p.name: p.read_bytes() for p in sorted(folder.iterdir())}
        dcp.save({"rank0/evil": _Payload(), "rank0/x": torch.zeros(2)}, checkpoint_id=str(Path(tmp) / "evil"))
        evil = {p.name: p.read_bytes() for p in sorted((Path(tmp) / "evil").iterdir())}
    metadata = pickle.loads(good[".metadata"])  # noqa: S301 - our own file, just written
    for md in metadata.state_dict_metadata.values():
        if hasattr(md, "size"):
            md.size = torch.Size([1 << 40])
            break
    return {"good": good, "evil": evil, "bomb": pickle.dumps(metadata),
            "skeleton": json.loads(good["rank0.skeleton.json"]), "manifest": json.loads(good[MANIFEST])}


def _forged(files: dict[str, bytes]) -> dict[str, bytes]:
    """The manifest rewritten to list ``files`` with their hashes (left as it is when it is not a JSON object)."""
    try:
        meta = json.loads(files[MANIFEST])
    except (KeyError, ValueError, RecursionError):
        return files
    if not isinstance(meta, dict):
        return files
    meta["files"] = {name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                     for name, data in sorted(files.items()) if name != MANIFEST}
    return {**files, MANIFEST: json.dumps(meta).encode()}


_CHANGES = ("bytes", "bytes", "drop", "add", "skeleton", "skeleton", "manifest", "payload-metadata",
            "bytes-entry", "size-bomb", "pickle-skeleton")


@st.composite
def checkpoint_cases(draw: st.DrawFn) -> dict[str, bytes]:
    seeds = _seeds()
    files = dict(seeds["good"])
    for _ in range(draw(st.integers(1, 3))):
        change = draw(st.sampled_from(_CHANGES))
        name = draw(st.sampled_from(sorted(files))) if files else MANIFEST
        if change == "bytes" and files:
            files[name] = draw(broken_bytes(files[name]))
        elif change == "drop" and files:
            files.pop(name)
        elif change == "add":
            files[draw(st.sampled_from(["notes.txt", "rank1.skeleton.json", "__1_0.distcp", ".metadata.bak"]))] = (
                draw(st.binary(max_size=64)))
        elif change == "skeleton":
            text = dump_json(draw(mutated_tree([seeds["skeleton"]])))
            files["rank0.skeleton.json"] = text.encode("utf-8", "surrogatepass")
        elif change == "manifest":
            files[MANIFEST] = dump_json(draw(mutated_tree([seeds["manifest"]]))).encode("utf-8", "surrogatepass")
        elif change == "payload-metadata":
            files[".metadata"] = pickle.dumps(_Payload(), protocol=draw(st.integers(0, 5)))
        elif change == "bytes-entry":
            files.update(seeds["evil"])
        elif change == "size-bomb":
            files[".metadata"] = seeds["bomb"]
        elif change == "pickle-skeleton":  # what format 1 wrote
            files["rank0.skeleton.json"] = pickle.dumps({"model": _Payload()})
    if draw(st.booleans()):
        files = _forged(files)
    return {f"{STEP}/{name}": data for name, data in files.items()} or {f"{STEP}/.keep": b""}


def restore_case(folder: Path) -> None:
    """``Checkpointer(folder / "ckpt").restore(...)`` into a fresh model and optimizer; no code may run."""
    from cpdpkit.checkpoint import Checkpointer

    MARKER.unlink(missing_ok=True)
    try:
        with _world1():
            model, opt = _objects()
            Checkpointer(folder / "ckpt", every=2).restore(model=model, optimizer=opt)
    finally:
        if MARKER.exists():
            MARKER.unlink()
            raise AssertionError("code from the checkpoint folder ran")  # noqa: B012 - the one thing that matters
