"""cpdpkit bench's parts without launching: data loaders, models, config errors, aggregation."""

from __future__ import annotations

import pickle
import re

import numpy as np
import pytest
import torch

from cpdpkit.bench.data import DATASETS, find_cifar100, load_dataset
from cpdpkit.bench.models import MODELS, build_model
from cpdpkit.bench.periodic.config import BenchConfig
from cpdpkit.bench.periodic.report import aggregate
from cpdpkit.errors import ConfigError

pytestmark = pytest.mark.timeout(60)


def _cifar_arrays(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 3072), dtype=np.uint8), rng.integers(0, 100, n)


def _write_python_layout(root, n_train=12, n_test=5):
    folder = root / "cifar-100-python"
    folder.mkdir()
    for split, n in (("train", n_train), ("test", n_test)):
        data, fine = _cifar_arrays(n, len(split))
        entry = {b"data": data, b"fine_labels": fine.tolist(), b"coarse_labels": (fine // 5).tolist()}
        (folder / split).write_bytes(pickle.dumps(entry, protocol=2))
    return folder


def _write_binary_layout(root, n_train=12, n_test=5):
    folder = root / "cifar-100-binary"
    folder.mkdir()
    for split, n in (("train", n_train), ("test", n_test)):
        data, fine = _cifar_arrays(n, len(split))
        records = np.concatenate([(fine // 5)[:, None], fine[:, None], data], axis=1).astype(np.uint8)
        (folder / f"{split}.bin").write_bytes(records.tobytes())
    return folder


@pytest.mark.parametrize("writer", [_write_python_layout, _write_binary_layout])
def test_cifar100_loader_reads_both_official_layouts(tmp_path, writer):
    writer(tmp_path)
    ds = load_dataset("cifar100", data_dir=tmp_path)
    assert ds.x_train.shape == (12, 3, 32, 32) and ds.x_test.shape == (5, 3, 32, 32)
    assert ds.num_classes == 100 and ds.y_train.dtype == torch.int64
    data, fine = _cifar_arrays(12, len("train"))
    assert ds.y_train.tolist() == fine.tolist()
    # pixel (0, 0) of channel 0, normalised with CIFAR-100's mean/std
    expected = (data[0, 0] / 255.0 - 0.5071) / 0.2673
    assert ds.x_train[0, 0, 0, 0].item() == pytest.approx(expected, rel=1e-5)


def test_cifar100_errors(tmp_path):
    with pytest.raises(ConfigError) as info:
        find_cifar100(tmp_path)
    assert str(info.value) == (
        f"--data-dir {str(tmp_path)!r} holds no CIFAR-100 (looked for cifar-100-python/train and "
        "cifar-100-binary/train.bin): extract cifar-100-python.tar.gz or cifar-100-binary.tar.gz there")
    folder = tmp_path / "cifar-100-binary"
    folder.mkdir()
    (folder / "train.bin").write_bytes(b"\0" * 100)
    (folder / "test.bin").write_bytes(b"\0" * 100)
    with pytest.raises(ConfigError, match="has 100 bytes, not a multiple of CIFAR-100's 3074-byte"):
        load_dataset("cifar100", data_dir=tmp_path)


def test_cifar100_python_loader_refuses_foreign_pickles(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    evil = pickle.dumps({b"data": __import__("os").getcwd})  # a callable reference, not data
    (folder / "train").write_bytes(evil)
    (folder / "test").write_bytes(evil)
    with pytest.raises(ConfigError, match="is not a CIFAR-100 python file .*posix.getcwd is not allowed"):
        load_dataset("cifar100", data_dir=tmp_path)


def test_digits_and_synthetic_splits_are_fixed():
    a, b = load_dataset("digits"), load_dataset("digits")
    assert torch.equal(a.x_test, b.x_test) and a.x_train.shape == (1437, 1, 8, 8)
    s = load_dataset("synthetic", quick=True)
    assert s.x_train.shape == (800, 1, 12, 12) and s.num_classes == 10


def test_models_build_for_each_input():
    for shape in ((1, 8, 8), (3, 32, 32)):
        out = build_model("cnn", shape, 10)(torch.zeros(2, *shape))
        assert out.shape == (2, 10)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"periods": (0,)}, "period K must be an integer >= 1, got 0: e.g. --periods 2,4"),
        ({"strategies": ("ddp", "fedavg")}, "unknown strategy 'fedavg': choose from ddp, "
                                            "localsgd-torch, localsgd, slowmo, cpdp, cpdp-overlap, cpdp-auto, "
                                            "slowmo-overlap, cpdp-step-then-average"),
        # the lists are whatever the bench offers; the message's form is what is pinned here
        ({"model": "gpt9"}, f"unknown model 'gpt9': choose one of {', '.join(MODELS)}"),
        ({"dataset": "mnist"}, f"unknown dataset 'mnist': choose one of {', '.join(DATASETS)}"),
        ({"dataset": "cifar100"}, "--dataset cifar100 needs --data-dir: the folder holding "
                                  "cifar-100-python/"),
        ({"epochs": 0}, "--epochs must be > 0, got 0: e.g. --epochs 30"),
    ],
)
def test_bench_config_errors(kwargs, message):
    with pytest.raises(ConfigError) as info:
        BenchConfig(**kwargs)
    assert str(info.value) == message


def test_runs_cover_every_strategy_period_and_seed():
    runs = BenchConfig(periods=(2, 4), seeds=2).runs()
    labels = [(r.strategy, r.period, r.seed) for r in runs]
    assert labels[:3] == [("ddp", None, 0), ("localsgd-torch", 2, 0), ("localsgd-torch", 4, 0)]
    # ddp and cpdp-auto once; localsgd-torch, localsgd, slowmo, cpdp and cpdp-overlap at each K
    assert len(runs) == 2 * (2 + 5 * 2)
    assert ("cpdp-overlap", 4, 1) in labels and ("cpdp-auto", None, 0) in labels
    assert ("slowmo-overlap", 2, 0) not in labels  # not in the default list


def _run(strategy, period, seed, acc, wall, status="ok"):
    return {"spec": {"strategy": strategy, "period": period, "seed": seed}, "status": status,
            "reason": None if status == "ok" else "rank 1 crashed", "peak_test_acc": acc,
            "final_test_acc": acc, "wall_s": wall, "step_s": wall / 10,
            "exposed_sync_s_per_step": wall / 20, "bytes_per_step": 100.0,
            "collectives_per_step": 1.0, "harness_total_s": 2.0,
            "curve": [{"epoch": 1, "wall_s": wall, "test_acc": acc}]}


def test_aggregate_means_deltas_and_failures():
    runs = [_run("ddp", None, 0, 0.90, 10.0), _run("ddp", None, 1, 0.92, 12.0),
            _run("cpdp", 4, 0, 0.93, 8.0), _run("cpdp", 4, 1, 0.95, 6.0),
            _run("slowmo", 4, 0, 0.0, 0.0, status="failed")]
    report = aggregate({"x": 1}, runs)
    ddp, cpdp, slowmo = report.results
    assert ddp.means["peak_test_acc"] == pytest.approx(0.91)
    assert ddp.stds["wall_s"] == pytest.approx(np.std([10.0, 12.0], ddof=1))
    assert cpdp.delta_acc_pp == pytest.approx(3.0)
    assert cpdp.delta_wall_pct == pytest.approx((7.0 / 11.0 - 1) * 100)
    assert slowmo.status == "failed" and slowmo.reasons == ("seed 0: rank 1 crashed",)
    out = report.to_dict()
    assert out["results"][1]["period"] == 4 and out["results"][0]["period"] is None
    assert set(out["results"][1]) >= {"strategy", "period", "peak_test_acc", "final_test_acc",
                                       "wall_s", "step_s", "exposed_sync_s_per_step",
                                       "bytes_per_step", "seeds"}


@pytest.mark.parametrize(("dataset", "module", "package", "extra", "args"), [
    ("digits", "sklearn", "scikit-learn", "data", ["--model", "cnn"]),
    ("tinyimagenet", "PIL", "pillow", "data", ["--model", "cnn", "--data-dir", "."]),
])
def test_a_data_set_whose_extra_is_missing_is_one_line_naming_the_extra(monkeypatch, tmp_path, dataset, module,
                                                                      package, extra, args):
    # scikit-learn and pillow are the optional extra `data` (pyproject; make setup installs it): hide one
    import importlib.util

    from typer.testing import CliRunner

    from cpdpkit.cli import app

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    line = (f"--dataset {dataset} needs the {package} package, which is not installed: pip install "
            f"'cpdpkit[{extra}]' (make setup installs it)")
    with pytest.raises(ConfigError) as info:
        BenchConfig(dataset=dataset, model="cnn", data_dir=str(tmp_path))
    assert str(info.value) == line
    result = CliRunner().invoke(app, ["bench", "--dataset", dataset, *args, "--work-dir", str(tmp_path / "w")])
    assert result.exit_code == 2, result.output
    assert [ln for ln in result.output.splitlines() if ln.strip()] == [f"error: {line}"]
    assert not (tmp_path / "w").exists()
    with pytest.raises(ConfigError, match=r"^" + re.escape(line) + "$"):
        load_dataset(dataset, data_dir=tmp_path)


def test_scikit_learn_and_pillow_are_the_data_extra_that_make_setup_installs():
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith(("scikit-learn", "pillow"))]
    assert sorted(d.split(">")[0] for d in project["optional-dependencies"]["data"]) == ["pillow", "scikit-learn"]
    assert "-e '.[tools,dev,mnist1d,data]'" in (root / "Makefile").read_text()
