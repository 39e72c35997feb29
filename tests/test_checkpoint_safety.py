"""A checkpoint folder is data, not code: hostile, truncated, corrupted and foreign folders.

Each hostile case builds what an attacker who can write the folder would: a payload whose
``__reduce__`` creates a marker file, placed where an unpickler would run it (DCP's ``.metadata``,
a DCP bytes entry, the state dict at save), with the manifest rewritten to match (the attacker can
do that too). The marker never appears, and restore ends in one line.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from _checkpoint_setup import setup as _setup
from cpdpkit import _checkpoint_files as files
from cpdpkit.checkpoint import Checkpointer, CheckpointError

MANIFEST = "cpdpkit-checkpoint.json"
pytestmark = pytest.mark.timeout(120)


class Payload:
    """Unpickling this creates ``marker``: proof that code from the folder ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (open, (str(self.marker), "w"))


def _saved(tmp_path: Path) -> tuple[Path, Path, tuple]:
    model, opt, _ = _setup({"strategy": "cpdp"})
    folder = Checkpointer(tmp_path / "ckpt", every=2).save(2, model=model, optimizer=opt)
    return folder, tmp_path / "marker", (model, opt)


def _forge_manifest(folder: Path) -> None:
    """What an attacker does after changing the files: list them again with their new hashes."""
    meta = json.loads((folder / MANIFEST).read_text())
    meta["files"] = files.hash_files(folder, skip=MANIFEST)
    (folder / MANIFEST).write_text(json.dumps(meta))


def _restore_error(tmp_path: Path, objects: tuple) -> str:
    model, opt = objects
    with pytest.raises(CheckpointError) as info:
        Checkpointer(tmp_path / "ckpt", every=2).restore(model=model, optimizer=opt)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_a_payload_in_the_state_dict_is_refused_at_save_naming_its_key(world1, tmp_path: Path) -> None:
    model, opt, _ = _setup({"strategy": "cpdp"})
    opt.param_groups[0]["evil"] = Payload(tmp_path / "marker")
    with pytest.raises(CheckpointError) as info:
        Checkpointer(tmp_path / "ckpt", every=2).save(2, model=model, optimizer=opt)
    assert str(info.value) == (
        "cannot save checkpoint state: rank0/optimizer/param_groups/0/evil is a test_checkpoint_safety.Payload, "
        "which a checkpoint does not save: state dicts may hold only tensors, numbers, strings, None, lists, "
        "tuples and dicts")
    assert not list((tmp_path / "ckpt").glob("step*"))


def test_a_pickled_payload_as_dcp_metadata_never_runs(world1, tmp_path: Path) -> None:
    folder, marker, objects = _saved(tmp_path)
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _forge_manifest(folder)
    message = _restore_error(tmp_path, objects)
    assert message.startswith(f"checkpoint {str(folder)!r} cannot be read safely (UnpicklingError: io.open "
                              "is not allowed in DCP metadata)")
    assert not marker.exists()


def test_a_dcp_bytes_entry_is_never_loaded(world1, tmp_path: Path) -> None:
    folder, marker, objects = _saved(tmp_path)
    # DCP writes a non-tensor value as a bytes entry (torch.save) and loads it with weights_only=False
    dcp.save({"rank0/evil": Payload(marker), "rank0/x": torch.zeros(2)}, checkpoint_id=str(tmp_path / "other"))
    for entry in (tmp_path / "other").iterdir():
        (folder / entry.name).write_bytes(entry.read_bytes())
    _forge_manifest(folder)
    assert _restore_error(tmp_path, objects) == (
        f"checkpoint {str(folder)!r} holds a bytes entry 'rank0/evil', which this checkpointer never writes nor "
        "loads: use another directory")
    assert not marker.exists()


@pytest.mark.parametrize(("skeleton", "problem"), [
    (b'{"$tensor": "rank0/nope"}', "it names a tensor 'rank0/nope' that is not there"),
    (b'{"$tensor": {"a": 1}}', "it names a tensor \"{'a': 1}\" that is not there"),  # fuzzer, seed 26
    (b'{"$set": [1]}', "unknown node with keys ['$set']"),
    (b"[NaN]", "ValueError: NaN is not JSON"),
    (b"[" * 100000, "RecursionError"),
])
def test_a_forged_skeleton_is_one_line(world1, tmp_path: Path, skeleton: bytes, problem: str) -> None:
    folder, _, objects = _saved(tmp_path)
    (folder / "rank0.skeleton.json").write_bytes(skeleton)
    _forge_manifest(folder)
    assert problem in _restore_error(tmp_path, objects)


def test_truncated_corrupted_and_foreign_folders_are_refused(world1, tmp_path: Path) -> None:
    folder, _, objects = _saved(tmp_path)
    data = folder / "__0_0.distcp"
    whole = data.read_bytes()
    fix = "delete that folder to resume from the one before it"
    data.write_bytes(whole[:-10])
    assert _restore_error(tmp_path, objects) == (
        f"checkpoint {str(folder)!r} is damaged or not ours: __0_0.distcp is {len(whole) - 10:,} bytes, its manifest "
        f"says {len(whole):,} (truncated or overwritten); {fix}")
    data.write_bytes(whole[:100] + bytes([whole[100] ^ 1]) + whole[101:])
    assert _restore_error(tmp_path, objects) == (
        f"checkpoint {str(folder)!r} is damaged or not ours: __0_0.distcp does not match its SHA-256 in the manifest "
        f"(corrupted or changed after the save); {fix}")
    data.write_bytes(whole)
    (folder / "notes.txt").write_text("mine")
    assert _restore_error(tmp_path, objects) == (
        f"checkpoint {str(folder)!r} is damaged or not ours: files differ from its manifest (missing [], not listed "
        f"['notes.txt']); {fix}")


def test_format_1_checkpoints_are_refused_in_one_line(world1, tmp_path: Path) -> None:
    folder, _, objects = _saved(tmp_path)
    meta = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps({**meta, "format": 1}))
    assert _restore_error(tmp_path, objects) == (
        f"checkpoint {str(folder)!r} has format 1 (its state is a pickle, which this cpdpkit never loads: loading it "
        "could run code): delete it, or resume it with cpdpkit before format 2 if you trust whoever could write that "
        "folder")


def test_pruning_deletes_only_folders_it_wrote(world1, tmp_path: Path) -> None:
    model, opt, _ = _setup({"strategy": "ddp"})
    mine = tmp_path / "ckpt" / "step00000001"
    mine.mkdir(parents=True)
    (mine / "results.csv").write_text("a user's folder that happens to look like a checkpoint")
    ckpt = Checkpointer(tmp_path / "ckpt", every=2, keep=1)
    for step in (2, 4):
        ckpt.maybe_save(step, model=model, optimizer=opt)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step00000001", "step00000004"]
    assert (mine / "results.csv").is_file()


def test_skeleton_round_trips_plain_data() -> None:
    from collections import OrderedDict
    value = {"a": (1, 2.5, float("inf"), float("-inf")), 3: [None, True, "s"], "o": OrderedDict(b=1), 0.5: {}}
    node = files.skeleton_from(files.skeleton_text(files.encode_skeleton(value, "x", lambda t, p: {})))
    back = files.decode_skeleton(node, lambda ref: None)
    assert back == value and type(back["o"]) is OrderedDict and type(back["a"]) is tuple
    nan = files.decode_skeleton(files.skeleton_from(files.skeleton_text(
        files.encode_skeleton(float("nan"), "x", lambda t, p: {}))), lambda ref: None)
    assert nan != nan
