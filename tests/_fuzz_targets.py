"""The loaders cpdpkit reads user files with, as fuzz targets: each a strategy of broken inputs and a load.

A case is a file tree (``{relative path: bytes}``; a file named ``.keep`` only makes its folder). A
target writes it into an empty folder and loads it; the outcome is ``ok`` (it loaded), ``error`` (a
:class:`~cpdpkit.errors.CpdpkitError` whose message is one line naming the input) or ``crash``
(anything else: another exception, or a message of several lines or one that does not name the
input). Shared by ``tests/test_fuzz_loaders.py`` (a few hundred cases per target) and
``benchmarks/fuzz_loaders.py`` (thousands).
"""

from __future__ import annotations

import functools
import gzip
import io
import pickle
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import strategies as st

from _fuzz_docs import Raw, broken_bytes, dump_json, dump_toml, mutated_tree, nasty_values
from _trace_builder import cpu_scenario, kernel, trace_doc
from cpdpkit.errors import CpdpkitError, TraceError

__all__ = ["Case", "Target", "TARGETS", "outcome", "write_case", "read_case"]

Case = dict[str, bytes]


@dataclass(frozen=True)
class Target:
    """``cases()``: the strategy; ``load(folder)``: the loader on a written case; ``input_of``: what errors name."""

    name: str
    cases: Callable[[], st.SearchStrategy[Case]]
    load: Callable[[Path], Any]
    input_of: Callable[[Path], Path]


def write_case(case: Case, folder: Path) -> None:
    for rel, data in case.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.name != ".keep":
            path.write_bytes(data)


def read_case(folder: Path) -> Case:
    """A case kept on disk (``tests/data/fuzz/<target>/<case>/``) back as a file tree."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def outcome(target: Target, case: Case, folder: Path) -> tuple[str, str]:
    """``("ok" | "error" | "crash", detail)`` of loading ``case`` written into the empty ``folder``."""
    write_case(case, folder)
    named = str(target.input_of(folder))
    try:
        target.load(folder)
    except CpdpkitError as exc:
        message = str(exc)
        if "\n" in message or named not in message:
            return "crash", f"{type(exc).__name__} not one line naming {named}: {message[:300]!r}"
        return "error", message
    except Exception as exc:  # noqa: BLE001 - any other exception is what the fuzzers look for
        return "crash", f"{type(exc).__name__}: {str(exc)[:300]}"
    return "ok", ""


def _single_file(folder: Path) -> Path:
    (path,) = [p for p in folder.rglob("*") if p.is_file()]
    return path


# ---- trace files ------------------------------------------------------------------------------------
@functools.cache
def _trace_seeds() -> list[Any]:
    comm = trace_doc([kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 10, 50, corr=3, **{
        "Collective name": "allreduce", "Process Group Name": "0", "Seq": "4", "In msg nelems": 1024,
        "Out msg nelems": 1024, "dtype": "Float", "Process Group Ranks": "[0, 1]", "Group size": 2})])
    return [cpu_scenario(0), comm, {"traceEvents": []}]


@st.composite
def _trace_cases(draw: st.DrawFn) -> Case:
    text = dump_json(draw(mutated_tree(_trace_seeds()))).encode("utf-8", "surrogatepass")
    if draw(st.booleans()):
        return {"rank0.pt.trace.json.gz": draw(broken_bytes(gzip.compress(text, mtime=0)))}
    return {"rank0.pt.trace.json": draw(broken_bytes(text))}


def _load_trace(folder: Path) -> None:
    from cpdpkit.profiler import load_trace

    load_trace(_single_file(folder))


def _analyze(folder: Path) -> None:
    """``analyze`` never raises for a bad file: it reports it; each report line must be one naming the file."""
    from cpdpkit.profiler import analyze

    for issue in analyze([_single_file(folder)]).errors:
        assert "\n" not in issue.error, issue.error
        if not issue.warning:  # a warning (no step found) comes with the analysis: the file loaded
            raise TraceError(issue.error)


# ---- topology TOML ------------------------------------------------------------------------------------
@functools.cache
def _topology_seeds() -> list[Any]:
    from cpdpkit.topology import preset

    texts = [preset(name).to_toml() for name in ("lan", "wan", "wan-variable", "cluster")]
    texts.append(preset("cluster", world_size=16).to_toml() + 'description = "x"\n')
    return [tomllib.loads(t) for t in texts]


@st.composite
def _topology_cases(draw: st.DrawFn) -> Case:
    text = dump_toml(draw(mutated_tree(_topology_seeds()))).encode("utf-8", "surrogatepass")
    return {"topo.toml": draw(broken_bytes(text))}


def _load_topology(folder: Path) -> None:
    """``load_topology``, the loaded topology written back, and ``cpdpkit topology show [--json] FILE``.

    The tables only for up to 4,096 placed ranks: they cost every collective over all ranks.
    """
    from typer.testing import CliRunner

    from cpdpkit.cli import app
    from cpdpkit.topology import load_topology

    path = _single_file(folder)
    topo = load_topology(path)
    topo.to_toml()
    small = topo.fixed_world_size is None or topo.fixed_world_size <= 4096
    for args in [["--json", str(path)]] + ([[str(path)]] if small else []):
        result = CliRunner().invoke(app, ["topology", "show", *args])
        if result.exit_code != 0 or result.exception is not None:
            raise AssertionError(f"cpdpkit topology show {' '.join(args)} exited {result.exit_code}: "
                                 f"{result.exception!r}")


# ---- plan JSON --------------------------------------------------------------------------------------------
@functools.cache
def _plan_seeds() -> list[Any]:
    from cpdpkit.planner import BlockSpec, ModelSpec, ParamSpec, PlannerConfig, fsdp2_default_plan, plan_sharding

    params = (ParamSpec(fqn="blk.w", shape=(5, 3), block=0), ParamSpec(fqn="b", shape=(8,)))
    spec = ModelSpec(name="tiny", params=params, blocks=(BlockSpec(fqn="blk", container=""),))
    plans = [plan_sharding(spec, "cluster", world_size=4, ranks_per_node=2),
             plan_sharding(spec, "wan", world_size=4, config=PlannerConfig(param_sharding="replicated")),
             fsdp2_default_plan(spec, "lan", world_size=2)]
    seeds = [p.to_dict() for p in plans]
    return [*seeds, {"plan": seeds[0], "summary": {}}]


@st.composite
def _plan_cases(draw: st.DrawFn) -> Case:
    text = dump_json(draw(mutated_tree(_plan_seeds()))).encode("utf-8", "surrogatepass")
    return {"plan.json": draw(broken_bytes(text))}


def _load_plan(folder: Path) -> None:
    from cpdpkit.planner import ShardingPlan

    ShardingPlan.load(_single_file(folder))


# ---- CIFAR-100 on disk ------------------------------------------------------------------------------
def _picklable(value: Any) -> Any:
    if isinstance(value, Raw):
        return value.text[:100]
    if isinstance(value, dict):
        return {k: _picklable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_picklable(v) for v in value]
    return value


_ARRAYS = st.sampled_from([
    lambda n: np.zeros((n, 3072), np.uint8), lambda n: np.zeros((n, 3071), np.uint8),
    lambda n: np.zeros((n, 3, 32, 32), np.uint8), lambda n: np.full((n, 3072), 1e9, np.float64),
    lambda n: np.full((n, 3072), np.nan, np.float32), lambda n: np.zeros(0, np.uint8), lambda n: np.zeros((), np.int64),
    lambda n: np.zeros((n, 3072), np.int64) - 5, lambda n: np.array(["x"] * n), lambda n: [[0] * 3072] * n,
    lambda n: b"\0" * 3072 * n, lambda n: np.zeros((n, 3072), np.complex64),
])


def _deep_pickle(depth: int) -> bytes:
    """A protocol-2 pickle of ``{b"data": <depth nested lists>, b"fine_labels": [...]}`` built from opcodes."""
    key = lambda k: b"C" + bytes([len(k)]) + k  # noqa: E731 - SHORT_BINBYTES
    nested = b"(" * depth + b"l" * depth
    return b"\x80\x02}(" + key(b"data") + nested + key(b"fine_labels") + nested + b"u."


@st.composite
def _cifar_python_entry(draw: st.DrawFn) -> bytes:
    n = draw(st.integers(0, 3))
    entry: Any = {b"data": np.zeros((n, 3072), np.uint8), b"fine_labels": list(range(n)), b"coarse_labels": [0] * n}
    for _ in range(draw(st.integers(0, 2))):
        op = draw(st.sampled_from(["data", "labels", "label", "drop", "str-keys", "not-a-dict", "deep"]))
        if op == "deep":
            return _deep_pickle(draw(st.sampled_from([30, 1000, 100_000])))
        if not isinstance(entry, dict):
            break
        if op == "data":
            entry[b"data"] = draw(_ARRAYS)(n)
        elif op == "labels":
            entry[b"fine_labels"] = _picklable(draw(nasty_values()))
        elif op == "label" and isinstance(entry.get(b"fine_labels"), list) and entry[b"fine_labels"]:
            labels = entry[b"fine_labels"]
            labels[draw(st.integers(0, len(labels) - 1))] = _picklable(draw(nasty_values()))
        elif op == "drop":
            entry.pop(draw(st.sampled_from(sorted(entry))), None)
        elif op == "str-keys":
            entry = {k.decode() if isinstance(k, bytes) else k: v for k, v in entry.items()}
        elif op == "not-a-dict":
            entry = _picklable(draw(nasty_values()))
    return pickle.dumps(entry, protocol=draw(st.integers(0, 5)))


@st.composite
def _cifar_cases(draw: st.DrawFn) -> Case:
    split = draw(st.sampled_from(["train", "test"]))
    if draw(st.booleans()):
        good = pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"fine_labels": [1, 2]}, protocol=2)
        files = {"train": good, "test": good, split: draw(broken_bytes(draw(_cifar_python_entry())))}
        return {f"cifar-100-python/{k}": v for k, v in files.items()}
    records = draw(st.lists(st.tuples(st.integers(0, 255), st.integers(0, 255)), max_size=3))
    data = b"".join(bytes([coarse, fine]) + b"\x80" * 3072 for coarse, fine in records)
    good = bytes([0, 7]) + b"\0" * 3072
    files = {"train.bin": good, "test.bin": good, f"{split}.bin": draw(broken_bytes(data))}
    return {f"cifar-100-binary/{k}": v for k, v in files.items()}


def _load_cifar(folder: Path) -> None:
    from cpdpkit.bench.data import load_dataset

    load_dataset("cifar100", data_dir=folder)


# ---- TinyImageNet / ImageFolder -------------------------------------------------------------------------
@functools.cache
def _seed_images() -> tuple[bytes, ...]:
    from PIL import Image

    out = []
    for mode, size, fmt in [("RGB", (64, 64), "JPEG"), ("L", (40, 48), "JPEG"), ("RGBA", (3, 2), "PNG"),
                            ("P", (1, 1), "PNG"), ("1", (5, 5), "BMP"), ("I;16", (4, 4), "TIFF"),
                            ("CMYK", (8, 8), "JPEG"), ("RGB", (2, 70), "WEBP"), ("LA", (3, 3), "PNG")]:
        buf = io.BytesIO()
        Image.new(mode, size).save(buf, fmt)
        out.append(buf.getvalue())
    return tuple(out)


_CLASSES = ("n01", "n02", "a b", "é", "x.png")
_EXTENSIONS = (".JPEG", ".JPEG", ".png", ".bmp", ".tif", ".webp", ".txt", "")


@st.composite
def _image_file(draw: st.DrawFn) -> bytes:
    image = draw(st.sampled_from(_seed_images()))
    return image if draw(st.integers(0, 3)) else draw(broken_bytes(image))


@st.composite
def _image_folder_cases(draw: st.DrawFn) -> Case:
    classes = draw(st.lists(st.sampled_from(_CLASSES), min_size=1, max_size=3, unique=True))
    tiny = draw(st.booleans())
    root = "tiny-imagenet-200/" if draw(st.booleans()) else ""
    case: Case = {}
    for name in classes:
        sub = f"{root}train/{name}/images/" if tiny else f"{root}train/{name}/"
        case[sub + ".keep"] = b""
        for i in range(draw(st.sampled_from([1, 1, 2, 0]))):
            case[f"{sub}{i}{draw(st.sampled_from(_EXTENSIONS))}"] = draw(_image_file())
    if tiny:
        case[f"{root}val/images/.keep"] = b""
        lines = []
        for i in range(draw(st.integers(1, 3))):
            case[f"{root}val/images/v{i}.JPEG"] = draw(_image_file())
            label = draw(st.sampled_from(classes)) if draw(st.integers(0, 3)) else draw(st.sampled_from(_CLASSES))
            lines.append(f"v{i}.JPEG\t{label}\t0\t0\t9\t9" if draw(st.integers(0, 3)) else draw(st.sampled_from(
                [f"v{i}.JPEG {label}", f"v{i}.JPEG\t{label}", f"../train/{label}\t{label}", "\t", ""])))
        case[f"{root}val/val_annotations.txt"] = draw(broken_bytes("\n".join(lines).encode()))
    else:
        for name in draw(st.lists(st.sampled_from(classes), min_size=1, unique=True) | st.lists(
                st.sampled_from(_CLASSES), max_size=2, unique=True)):
            case[f"{root}val/{name}/.keep"] = b""
            for i in range(draw(st.integers(0, 2))):
                case[f"{root}val/{name}/v{i}{draw(st.sampled_from(_EXTENSIONS))}"] = draw(_image_file())
    return case


def _load_image_folder(folder: Path) -> None:
    from cpdpkit.bench.data import load_dataset

    load_dataset("tinyimagenet", data_dir=folder)


TARGETS: dict[str, Target] = {t.name: t for t in [
    Target("trace", _trace_cases, _load_trace, _single_file),
    Target("trace-analyze", _trace_cases, _analyze, _single_file),
    Target("topology", _topology_cases, _load_topology, _single_file),
    Target("plan", _plan_cases, _load_plan, _single_file),
    Target("cifar", _cifar_cases, _load_cifar, lambda folder: folder),
    Target("image-folder", _image_folder_cases, _load_image_folder, lambda folder: folder),
]}


# ---- the checkpoint folder and every command line (issue 25; their own modules) ---------------------------
from _fuzz_checkpoint import checkpoint_cases, restore_case  # noqa: E402 - after Target, which they are wrapped in
from _fuzz_cli import cli_cases, run_cli_case  # noqa: E402

TARGETS["checkpoint"] = Target("checkpoint", checkpoint_cases, restore_case, lambda folder: folder / "ckpt")
TARGETS["cli"] = Target("cli", cli_cases, run_cli_case, lambda folder: folder)
