"""The files of a checkpoint folder as data: a JSON skeleton, a manifest, and DCP metadata read safely.

A checkpoint folder is something a user (or anyone who can write to the folder) hands to
``Checkpointer.restore``, so nothing in it may run code:

- The non-tensor part of each rank's state (the nesting, numbers, strings, ``None``) is JSON
  (``rank<R>.skeleton.json``), written by :func:`encode_skeleton` and read back by
  :func:`decode_skeleton`. Only plain data is saved: anything else a state dict carries (a
  function, a class instance, a ``torch.dtype``, ...) is refused at save in one line naming its
  key. Tensors are DCP entries, loaded by DCP with ``torch.load(weights_only=True)``; no DCP bytes
  entry is written (DCP loads those with ``torch.load(weights_only=False)``, i.e. unpickling).
- DCP's own ``.metadata`` is a pickle; :class:`SafeReader` reads it with an unpickler that admits
  only the handful of torch classes DCP's metadata is made of (no ``os.system``, no ``eval``).
- The manifest (``cpdpkit-checkpoint.json``) lists every file with its size and SHA-256, so a
  truncated, corrupted or foreign folder is refused in one line before anything is loaded, and
  pruning deletes only folders whose manifest says this checkpointer wrote them.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import pickle
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

__all__ = ["WRITER", "SafeReader", "decode_skeleton", "encode_skeleton", "hash_files", "verify_files"]

WRITER = "cpdpkit.Checkpointer"
MAX_SKELETON_BYTES = 256 << 20  # a state's non-tensor part is small; a bigger file is not ours
MAX_METADATA_BYTES = 1 << 30
_PLAIN = (type(None), bool, int, str)


class SkeletonError(ValueError):
    """A value that is not plain data (at save), or a skeleton file that is not one of ours (at restore)."""


# -- the skeleton: plain data with tensor references, as JSON ---------------------------------------
def encode_skeleton(obj: Any, path: str, ref: Callable[[torch.Tensor, str], dict[str, Any]]) -> Any:
    """``obj`` as JSON-able nodes; ``ref(tensor, path)`` stores a tensor and returns its node.

    Every JSON object in the result is a tagged node (``{"$dict": ...}``, ``{"$tuple": ...}``,
    ``{"$float": ...}`` or the tensor node ``ref`` returns, ``{"$tensor": key, ...}``), so a user's
    dict can never be mistaken for one. Raises :class:`SkeletonError` naming ``path`` for anything else.
    """
    if isinstance(obj, torch.Tensor):
        return ref(obj, path)
    if type(obj) in _PLAIN:
        return obj
    if type(obj) is float:
        return obj if math.isfinite(obj) else {"$float": repr(obj)}  # nan, inf, -inf: strict JSON has none
    if type(obj) in (dict, OrderedDict):
        items = [[encode_skeleton(k, f"{path}/<key {k!r}>", ref), encode_skeleton(v, f"{path}/{k}", ref)]
                 for k, v in obj.items()]
        return {"$dict": items, "ordered": type(obj) is OrderedDict}
    if type(obj) is list:
        return [encode_skeleton(v, f"{path}/{i}", ref) for i, v in enumerate(obj)]
    if type(obj) is tuple:
        return {"$tuple": [encode_skeleton(v, f"{path}/{i}", ref) for i, v in enumerate(obj)]}
    raise SkeletonError(f"{path} is a {type(obj).__module__}.{type(obj).__qualname__}, which a checkpoint does not "
                        "save: state dicts may hold only tensors, numbers, strings, None, lists, tuples and dicts")


def decode_skeleton(node: Any, tensor: Callable[[dict[str, Any]], Any]) -> Any:
    """The inverse of :func:`encode_skeleton`; ``tensor(node)`` resolves a tensor node."""
    if type(node) in _PLAIN or type(node) is float:
        return node
    if type(node) is list:
        return [decode_skeleton(v, tensor) for v in node]
    if type(node) is dict:
        if "$tensor" in node:
            return tensor(node)
        if set(node) == {"$tuple"} and type(node["$tuple"]) is list:
            return tuple(decode_skeleton(v, tensor) for v in node["$tuple"])
        if set(node) == {"$float"} and node["$float"] in ("nan", "inf", "-inf"):
            return float(node["$float"])
        if set(node) == {"$dict", "ordered"} and type(node["$dict"]) is list:
            out: dict[Any, Any] = OrderedDict() if node["ordered"] is True else {}
            for item in node["$dict"]:
                if type(item) is not list or len(item) != 2:
                    raise SkeletonError(f"a dict item is {str(item)[:40]}, not a [key, value] pair")
                key = decode_skeleton(item[0], tensor)
                if not isinstance(key, (str, int, float, type(None))):
                    raise SkeletonError(f"a dict key is a {type(key).__name__}")
                out[key] = decode_skeleton(item[1], tensor)
            return out
        raise SkeletonError(f"unknown node with keys {sorted(node)[:4]}")
    raise SkeletonError(f"unknown node of type {type(node).__name__}")


def skeleton_text(node: Any) -> bytes:
    return json.dumps(node, allow_nan=False, separators=(",", ":")).encode("utf-8")


def read_skeleton(path: Path) -> Any:
    """The decoded JSON of a skeleton file (at most ``MAX_SKELETON_BYTES``); :class:`SkeletonError` otherwise."""
    if not path.is_file():
        raise SkeletonError(f"{path.name} is missing")
    with open(path, "rb") as fh:
        data = fh.read(MAX_SKELETON_BYTES + 1)
    if len(data) > MAX_SKELETON_BYTES:
        raise SkeletonError(f"{path.name} is over {MAX_SKELETON_BYTES:,} bytes")
    return skeleton_from(data)


def skeleton_from(data: bytes) -> Any:
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise SkeletonError(f"not the JSON this checkpointer writes ({type(exc).__name__}: {exc})") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# -- the manifest ---------------------------------------------------------------------------------
def hash_files(folder: Path, skip: str) -> dict[str, dict[str, Any]]:
    """``{name: {"bytes", "sha256"}}`` of every file in ``folder`` except ``skip`` (the manifest)."""
    out = {}
    for entry in sorted(folder.iterdir()):
        if entry.name != skip:
            out[entry.name] = {"bytes": entry.stat().st_size, "sha256": _sha256(entry)}
    return out


def verify_files(folder: Path, listed: Any, skip: str) -> str | None:
    """Why ``folder`` does not hold exactly the files ``listed`` (sizes, then hashes), or None."""
    if not isinstance(listed, dict) or not listed:
        return "its manifest lists no files"
    present = {}
    for entry in folder.iterdir():
        if entry.name != skip:
            if not entry.is_file() or entry.is_symlink():
                return f"{entry.name} is not a plain file"
            present[entry.name] = entry
    if set(present) != set(listed):
        missing, extra = sorted(set(listed) - set(present)), sorted(set(present) - set(listed))
        return f"files differ from its manifest (missing {missing[:3]}, not listed {extra[:3]})"
    for name, entry in sorted(present.items()):
        want = listed[name]
        if not (isinstance(want, dict) and isinstance(want.get("bytes"), int) and isinstance(want.get("sha256"), str)):
            return f"its manifest entry for {name} is malformed"
        size = entry.stat().st_size
        if size != want["bytes"]:
            return f"{name} is {size:,} bytes, its manifest says {want['bytes']:,} (truncated or overwritten)"
    for name, entry in sorted(present.items()):
        if _sha256(entry) != listed[name]["sha256"]:
            return f"{name} does not match its SHA-256 in the manifest (corrupted or changed after the save)"
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


# -- DCP's metadata, unpickled with a closed list of classes ----------------------------------------
_DCP = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP, "Metadata"), (_DCP, "TensorStorageMetadata"), (_DCP, "BytesStorageMetadata"),
    (_DCP, "ChunkStorageMetadata"), (_DCP, "TensorProperties"), (_DCP, "MetadataIndex"), (_DCP, "StorageMeta"),
    (_DCP, "_MEM_FORMAT_ENCODING"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def load_metadata(data: bytes) -> Metadata:
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - broken bytes make pickle raise almost anything (its docs say so)
        raise SkeletonError(" ".join(f"{type(exc).__name__}: {exc}".split())[:200]) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise SkeletonError(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader with ``.metadata`` unpickled by :class:`_MetadataUnpickler` (torch's uses pickle.load)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise SkeletonError("per-rank DCP metadata files are not used by this checkpointer")
        path = Path(os.fspath(self.path)) / ".metadata"
        with open(path, "rb") as fh:
            data = fh.read(MAX_METADATA_BYTES + 1)
        if len(data) > MAX_METADATA_BYTES:
            raise SkeletonError(f".metadata is over {MAX_METADATA_BYTES:,} bytes")
        metadata = load_metadata(data)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
