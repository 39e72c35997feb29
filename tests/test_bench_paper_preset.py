"""``cpdpkit bench --preset paper``: ResNet-50 with a CIFAR stem, crop+flip augmentation, TinyImageNet from
disk, how a preset resolves against the options given, its bad inputs, and one real 2-rank run on tiny files.

Every data set here is generated in ``tmp_path``: a few CIFAR-100 records, a few PNG/JPEG images.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

import cpdpkit.cli.bench as cli_bench
from cpdpkit.bench.data import DATASETS, image_folders, load_dataset
from cpdpkit.bench.data.augment import (
    IMAGE_DATASETS,
    augment_generator,
    black_fill,
    epoch_augmenter,
    first_images,
    random_crop_flip,
)
from cpdpkit.bench.data.image_folders import TINY_IMAGENET_MEAN, TINY_IMAGENET_STD, find_tiny_imagenet
from cpdpkit.bench.models import build_model
from cpdpkit.bench.models.resnet_cifar import resnet50_cifar
from cpdpkit.bench.periodic.config import BenchConfig, RunSpec
from cpdpkit.bench.periodic.presets import PRESETS, apply_preset
from cpdpkit.cli import app
from cpdpkit.errors import ConfigError
from cpdpkit.sync.config import SyncConfig

pytestmark = pytest.mark.timeout(60)


# ---- generated data sets ------------------------------------------------------------------------------
def _write_cifar100(root: Path, n_train: int = 8, n_test: int = 4) -> Path:
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(7)
    for split, n in (("train", n_train), ("test", n_test)):
        fine = rng.integers(0, 100, n)
        entry = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"fine_labels": fine.tolist(),
                 b"coarse_labels": (fine // 5).tolist()}
        (folder / split).write_bytes(pickle.dumps(entry, protocol=2))
    return root


_COLOURS = {"n01443537": (200, 30, 30), "n01629819": (30, 200, 30), "n01641577": (30, 30, 200)}


def _write_tiny_imagenet(root: Path) -> Path:
    """TinyImageNet's own layout: 3 wnids x 2 training JPEGs (one greyscale, one 40x48), 3 validation JPEGs."""
    folder = root / "tiny-imagenet-200"
    for wnid, colour in _COLOURS.items():
        images = folder / "train" / wnid / "images"
        images.mkdir(parents=True)
        Image.new("RGB", (64, 64), colour).save(images / f"{wnid}_0.JPEG", "JPEG", quality=95)
        Image.new("RGB", (48, 40), colour).save(images / f"{wnid}_1.JPEG", "JPEG", quality=95)
        (folder / "train" / wnid / f"{wnid}_boxes.txt").write_text(f"{wnid}_0.JPEG\t0\t0\t63\t63\n")
    Image.new("L", (64, 64), 90).save(folder / "train" / "n01629819" / "images" / "n01629819_2.JPEG", "JPEG")
    (folder / "val" / "images").mkdir(parents=True)
    lines = []
    for i, (wnid, colour) in enumerate(reversed(list(_COLOURS.items()))):
        Image.new("RGB", (64, 64), colour).save(folder / "val" / "images" / f"val_{i}.JPEG", "JPEG", quality=95)
        lines.append(f"val_{i}.JPEG\t{wnid}\t0\t0\t63\t63")
    (folder / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    (folder / "wnids.txt").write_text("\n".join(_COLOURS) + "\n")
    (folder / "test" / "images").mkdir(parents=True)  # unlabelled: never read
    return root


def _normalised(rgb: tuple[int, int, int]) -> torch.Tensor:
    return (torch.tensor(rgb) / 255.0 - torch.tensor(TINY_IMAGENET_MEAN)) / torch.tensor(TINY_IMAGENET_STD)


# ---- the model ------------------------------------------------------------------------------------------
def _bottleneck_resnet_params(blocks, num_classes: int, stem: int) -> int:
    """Parameters of a torchvision-layout bottleneck ResNet, counted from its definition (conv, BN, fc)."""
    total, channels = stem + 2 * 64, 64
    for count, width in zip(blocks, (64, 128, 256, 512)):
        for j in range(count):
            out = 4 * width
            total += channels * width + 2 * width + 9 * width * width + 2 * width + width * out + 2 * out
            if j == 0:
                total += channels * out + 2 * out  # the 1x1 projection shortcut and its BN
            channels = out
    return total + channels * num_classes + num_classes


def test_resnet50_cifar_has_torchvisions_count_with_the_3x3_stem():
    model = resnet50_cifar(100)
    count = sum(p.numel() for p in model.parameters())
    assert count == 23_705_252
    # torchvision's resnet50(num_classes=100) has 23,712,932; conv1 goes from 7x7x3x64 to 3x3x3x64
    assert count == 23_712_932 - 9_408 + 1_728 and model.conv1.weight.numel() == 1_728
    assert count == _bottleneck_resnet_params((3, 4, 6, 3), 100, stem=3 * 9 * 64)
    assert [len(s) for s in (model.layer1, model.layer2, model.layer3, model.layer4)] == [3, 4, 6, 3]
    assert model.conv1.stride == (1, 1) and model.conv1.kernel_size == (3, 3)
    assert not any(isinstance(m, torch.nn.MaxPool2d) for m in model.modules())
    assert model.layer2[0].conv2.stride == (2, 2) and model.layer2[0].conv1.stride == (1, 1)  # v1.5
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()) == 1 + 3 * 16 + 4


def test_resnet50_cifar_through_build_model_on_cifar_and_tiny_imagenet_shapes():
    torch.manual_seed(0)
    tiny = build_model("resnet50-cifar", (3, 64, 64), 200).eval()
    with torch.no_grad():  # ResNet-50 on a CPU: about a second per small forward
        logits = build_model("resnet50-cifar", (3, 32, 32), 100).eval()(torch.randn(2, 3, 32, 32))
        assert logits.shape == (2, 100) and logits.isfinite().all()
        assert tiny(torch.randn(1, 3, 64, 64)).shape == (1, 200)
        assert build_model("resnet50-cifar", (1, 8, 8), 10).eval()(torch.randn(1, 1, 8, 8)).shape == (1, 10)  # digits
    assert sum(p.numel() for p in tiny.parameters()) == _bottleneck_resnet_params((3, 4, 6, 3), 200, 1_728)


# ---- augmentation ---------------------------------------------------------------------------------------
def _matches_a_crop(out: np.ndarray, image: np.ndarray, fill: np.ndarray, padding: int) -> tuple[int, int, bool]:
    """The (dy, dx, flipped) whose crop of the padded image equals ``out``; fails if none does."""
    c, h, w = image.shape
    padded = np.broadcast_to(fill[:, None, None], (c, h + 2 * padding, w + 2 * padding)).copy()
    padded[:, padding : padding + h, padding : padding + w] = image
    hits = [(dy, dx, flip) for dy in range(2 * padding + 1) for dx in range(2 * padding + 1) for flip in (False, True)
            if np.array_equal(out, (lambda v: v[:, :, ::-1] if flip else v)(padded[:, dy : dy + h, dx : dx + w]))]
    assert hits, "the output is no crop (flipped or not) of the padded image"
    return hits[0]


def test_random_crop_flip_is_a_padded_crop_and_mirror_of_each_image():
    x = torch.randn(64, 3, 6, 5)  # distinct values: one crop matches at most one (dy, dx, flip)
    fill = black_fill("cifar100", 3)
    out = random_crop_flip(x, augment_generator(0, 0, 0), fill=fill)
    assert out.shape == x.shape and out.is_contiguous()
    found = [_matches_a_crop(o.numpy(), i.numpy(), fill.numpy(), 4) for o, i in zip(out, x)]
    assert {dy for dy, _, _ in found} | {dx for _, dx, _ in found} <= set(range(9))
    assert 10 < sum(flip for _, _, flip in found) < 54  # mirrored with probability 1/2
    assert len({(dy, dx) for dy, dx, _ in found}) > 20  # offsets vary across the batch
    # black after CIFAR-100's normalisation, as torchvision's RandomCrop pads before Normalize
    assert fill.tolist() == pytest.approx([-0.5071 / 0.2673, -0.4865 / 0.2564, -0.4409 / 0.2762], rel=1e-6)
    assert black_fill("digits", 1).tolist() == [0.0] and black_fill("cifar100", 1).tolist() == [0.0]


def test_augmentation_is_seeded_per_seed_epoch_and_rank():
    x = torch.randn(16, 3, 8, 8)

    def draw(seed, epoch, rank):
        return random_crop_flip(x, augment_generator(seed, epoch, rank))

    assert torch.equal(draw(1, 2, 0), draw(1, 2, 0))
    for other in ((1, 2, 1), (1, 3, 0), (2, 2, 0)):
        assert not torch.equal(draw(1, 2, 0), draw(*other)), other
    spec = _spec(augment=True, seed=1)
    a, b = epoch_augmenter(spec, 2, 0, 3), epoch_augmenter(spec, 2, 0, 3)
    assert torch.equal(a(x), b(x)) and not torch.equal(a(x), x)
    assert epoch_augmenter(_spec(augment=False), 0, 0, 3) is None


def _spec(**kw) -> RunSpec:
    base = dict(strategy="cpdp", period=2, seed=0, model="resnet50-cifar", dataset="cifar100", data_dir="d",
                epochs=1, batch_size=4, lr=0.1, momentum=0.9, sync=SyncConfig(slowmo_momentum=0.5), quick=True)
    return RunSpec(**{**base, **kw})


def test_run_spec_carries_augment_and_max_images_and_reads_older_specs():
    spec = _spec(augment=True, max_images=64)
    assert RunSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    older = {k: v for k, v in spec.to_dict().items() if k not in ("augment", "max_images")}
    assert RunSpec.from_dict(older).augment is False and RunSpec.from_dict(older).max_images is None


def test_augment_and_max_images_are_validated_before_anything_starts():
    for name in set(DATASETS) - {*IMAGE_DATASETS, "mnist1d"}:  # no images, no sequences (mnist1d shifts)
        with pytest.raises(ConfigError) as info:
            BenchConfig(dataset=name, augment=True)
        assert str(info.value) == (f"--augment crops and flips images, and --dataset {name} holds none: "
                                   "pass --no-augment")
    for bad in (0, 2.5, True):
        with pytest.raises(ConfigError, match=f"max_images must be an integer >= 1 or None, got {bad!r}: e.g. 64"):
            BenchConfig(max_images=bad)
    assert BenchConfig(dataset="digits", model="cnn", augment=True, max_images=1).runs()[0].max_images == 1


def test_first_images_caps_both_splits(tmp_path):
    data = load_dataset("cifar100", data_dir=_write_cifar100(tmp_path, 10, 6))
    capped = first_images(data, 5)
    assert len(capped.x_train) == 5 and len(capped.x_test) == 5 and torch.equal(capped.x_train, data.x_train[:5])
    assert first_images(data, None) is data and len(first_images(data, 100).x_test) == 6


# ---- TinyImageNet / ImageFolder --------------------------------------------------------------------------
def test_tiny_imagenet_layout_is_read_with_sorted_wnids_balanced_order_and_normalised_rgb(tmp_path):
    data = load_dataset("tinyimagenet", data_dir=_write_tiny_imagenet(tmp_path))
    assert data.name == "tinyimagenet" and data.num_classes == 3 and data.input_shape == (3, 64, 64)
    assert data.x_train.dtype == torch.float32 and data.y_train.dtype == torch.int64
    # dealt round-robin over the classes: every class's first image, then every class's second, ...
    assert data.y_train.tolist() == [0, 1, 2, 0, 1, 2, 1]
    colours = list(_COLOURS.values())
    for i in range(6):  # solid colours survive JPEG within a few levels; the 48x40 ones were resized
        expect = _normalised(colours[int(data.y_train[i])])
        assert torch.allclose(data.x_train[i].mean((1, 2)), expect, atol=4 / 255 / 0.22)
    assert torch.allclose(data.x_train[6].mean((1, 2)), _normalised((90, 90, 90)), atol=4 / 255 / 0.22)  # greyscale
    assert data.y_test.tolist() == [0, 1, 2]  # val_annotations.txt labels, in the same wnid order
    assert torch.allclose(data.x_test[0].mean((1, 2)), _normalised(colours[0]), atol=4 / 255 / 0.22)
    assert find_tiny_imagenet(tmp_path)[0] == "tiny-imagenet"
    assert find_tiny_imagenet(tmp_path / "tiny-imagenet-200")[0] == "tiny-imagenet"


def test_generic_image_folder_png_pixels_exact_and_quick_balanced(tmp_path, monkeypatch):
    rng = np.random.default_rng(3)
    pixels = {}
    for split, per_class in (("train", 3), ("val", 2)):
        for cls in ("cat", "dog"):
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(per_class):
                array = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
                Image.fromarray(array).save(tmp_path / split / cls / f"{i}.png")
                pixels[(split, cls, i)] = array
    (tmp_path / "train" / "cat" / "notes.txt").write_text("not an image")
    assert find_tiny_imagenet(tmp_path) == ("imagefolder", tmp_path)
    data = load_dataset("tinyimagenet", data_dir=tmp_path)
    assert data.num_classes == 2 and data.y_train.tolist() == [0, 1, 0, 1, 0, 1]
    assert data.y_test.tolist() == [0, 1, 0, 1]
    mean, std = np.array(TINY_IMAGENET_MEAN, np.float32), np.array(TINY_IMAGENET_STD, np.float32)
    expect = ((pixels[("train", "dog", 1)] / np.float32(255) - mean) / std).transpose(2, 0, 1)
    assert np.allclose(data.x_train[3].numpy(), expect, atol=1e-5)
    monkeypatch.setattr(image_folders, "_QUICK_IMAGES", 3)
    quick = load_dataset("tinyimagenet", data_dir=tmp_path, quick=True)
    assert quick.y_train.tolist() == [0, 1, 0] and quick.y_test.tolist() == [0, 1, 0]


def test_tiny_imagenet_errors_name_the_folder_and_the_layouts(tmp_path):
    layouts = ("tiny-imagenet-200/train/<wnid>/images/*.JPEG with val/images/*.JPEG and val/val_annotations.txt, "
               "or an ImageFolder train/<class>/*, val/<class>/*")
    with pytest.raises(ConfigError) as info:
        find_tiny_imagenet(tmp_path)
    assert str(info.value) == (f"--data-dir {str(tmp_path)!r} holds no TinyImageNet (looked for {layouts}): "
                               "extract tiny-imagenet-200.zip there")
    with pytest.raises(ConfigError) as info:
        BenchConfig(dataset="tinyimagenet")
    assert str(info.value) == f"--dataset tinyimagenet needs --data-dir: the folder holding {layouts}"
    root = _write_tiny_imagenet(tmp_path / "a")
    ann = root / "tiny-imagenet-200" / "val" / "val_annotations.txt"
    ann.write_text(ann.read_text() + "val_9.JPEG\tn99999999\t0\t0\t1\t1\n")
    with pytest.raises(ConfigError, match="val_9.JPEG is labelled 'n99999999', which is not a class of"):
        load_dataset("tinyimagenet", data_dir=root)
    root = _write_tiny_imagenet(tmp_path / "b")
    (root / "tiny-imagenet-200" / "train" / "n01443537" / "images" / "n01443537_0.JPEG").write_bytes(b"not a jpeg")
    with pytest.raises(ConfigError, match=r"n01443537_0.JPEG is not a readable image \(.*\): remove or re-extract it"):
        load_dataset("tinyimagenet", data_dir=root)


# ---- the preset: resolution and bad input ------------------------------------------------------------------
_NONE = dict(strategies=None, periods=None, epochs=None, model=None, batch_size=None, lr=None, momentum=None,
             world_size=None, topology=None, profile_dir=None, augment=None)


def _resolve(**given) -> BenchConfig:
    """``_bench_config`` as the CLI calls it: options not given are None."""
    kw = {**_NONE, "quick": False, "dataset": None, "data_dir": None, "seeds": 1, **given}
    return cli_bench._bench_config(preset="paper", **kw)


def test_paper_preset_settings(tmp_path):
    data = str(_write_cifar100(tmp_path))
    assert _resolve(data_dir=data) == BenchConfig(
        model="resnet50-cifar", dataset="cifar100", data_dir=data, lr=0.1, lr_schedule="constant", momentum=0.9,
        batch_size=128, epochs=200, periods=(2, 4), topology="wan", augment=True)
    assert set(PRESETS) == {"paper", "mnist1d"}


def test_options_given_override_the_preset_which_overrides_the_defaults(tmp_path):
    cifar, tiny = str(_write_cifar100(tmp_path / "c")), str(_write_tiny_imagenet(tmp_path / "t"))
    got = _resolve(data_dir=cifar, epochs=5, batch_size=16, momentum=0.5, augment=False, lr=0.05, seeds=2,
                   strategies="ddp,cpdp", periods="4")
    assert (got.epochs, got.batch_size, got.momentum, got.augment, got.lr, got.seeds) == (5, 16, 0.5, False, 0.05, 2)
    assert got.strategies == ("ddp", "cpdp") and got.periods == (4,) and got.model == "resnet50-cifar"
    assert _resolve(data_dir=tiny, dataset="tinyimagenet").dataset == "tinyimagenet"
    # an option given equal to its default still wins over the preset
    assert _resolve(data_dir=cifar, dataset="digits").dataset == "digits"
    # --quick: its strategies, periods and epoch cap; then the preset's smoke-run sizes; options given win
    quick = _resolve(data_dir=cifar, quick=True)
    assert (quick.strategies, quick.periods, quick.epochs) == (("ddp", "localsgd-torch", "cpdp"), (4,), 3)
    assert (quick.batch_size, quick.max_images, quick.model, quick.augment) == (4, 64, "resnet50-cifar", True)
    assert _resolve(data_dir=cifar, quick=True, batch_size=2, epochs=1).batch_size == 2
    # without a preset nothing changes
    assert cli_bench._bench_config(**{**_NONE, "quick": False, "dataset": None, "data_dir": None,
                                      "seeds": 1}) == BenchConfig()
    assert apply_preset("paper", {"data_dir": "x", "model": "cnn"}, quick=False)["model"] == "cnn"


def test_cli_options_override_the_preset_through_typer(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(cli_bench, "_run_main", lambda config, **kw: seen.append(config))
    data = str(_write_cifar100(tmp_path))
    for args in (["--preset", "paper", "--data-dir", data],
                 ["--preset", "paper", "--data-dir", data, "--dataset", "digits", "--no-augment", "--seeds", "1"],
                 ["--data-dir", data, "--dataset", "cifar100", "--model", "cnn", "--augment"]):
        result = CliRunner().invoke(app, ["bench", *args])
        assert result.exit_code == 0, result.output
    paper, overridden, plain = seen
    assert (paper.model, paper.dataset, paper.batch_size, paper.epochs, paper.augment) == (
        "resnet50-cifar", "cifar100", 128, 200, True)
    assert (overridden.model, overridden.dataset, overridden.augment) == ("resnet50-cifar", "digits", False)
    assert (plain.model, plain.dataset, plain.batch_size, plain.augment) == ("cnn", "cifar100", 128, True)


_NO_CIFAR = ("--preset paper reads CIFAR-100 from disk and downloads nothing: give --data-dir DIR, the folder "
             "holding cifar-100-python/{train,test} (python layout) or cifar-100-binary/{train,test}.bin "
             "(binary layout)")
_NO_TINY = ("--preset paper reads TinyImageNet from disk and downloads nothing: give --data-dir DIR, the folder "
            "holding tiny-imagenet-200/train/<wnid>/images/*.JPEG with val/images/*.JPEG and "
            "val/val_annotations.txt, or an ImageFolder train/<class>/*, val/<class>/*")


@pytest.mark.parametrize(("args", "message"), [
    (["--preset", "paper"], _NO_CIFAR),
    (["--preset", "paper", "--quick"], _NO_CIFAR),
    (["--preset", "paper", "--dataset", "tinyimagenet"], _NO_TINY),
    (["--preset", "paper", "--data-dir", "{empty}"],
     "--data-dir '{empty}' holds no CIFAR-100 (looked for cifar-100-python/train and cifar-100-binary/train.bin): "
     "extract cifar-100-python.tar.gz or cifar-100-binary.tar.gz there"),
    (["--preset", "paper", "--dataset", "tinyimagenet", "--data-dir", "{empty}"],
     "--data-dir '{empty}' holds no TinyImageNet (looked for tiny-imagenet-200/train/<wnid>/images/*.JPEG with "
     "val/images/*.JPEG and val/val_annotations.txt, or an ImageFolder train/<class>/*, val/<class>/*): extract "
     "tiny-imagenet-200.zip there"),
    (["--preset", "papr"], "unknown preset 'papr': choose one of paper, mnist1d"),
])
def test_bad_preset_input_is_one_exact_line_and_exit_2(args, message, tmp_path):
    empty, work = tmp_path / "empty", tmp_path / "work"
    empty.mkdir()
    work.mkdir()
    args = [a.replace("{empty}", str(empty)) for a in args]
    result = CliRunner().invoke(app, ["bench", *args, "--work-dir", str(work)])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert lines == ["error: " + message.replace("{empty}", str(empty))], result.output
    assert not any(work.iterdir()), "nothing may start before the options are valid"


# ---- end to end --------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_paper_preset_quick_runs_ddp_and_cpdp_on_two_ranks(tmp_path):
    data, out = _write_cifar100(tmp_path / "data", n_train=16, n_test=4), tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "cpdpkit.cli", "bench", "--preset", "paper", "--data-dir", str(data), "--quick",
         "--strategies", "ddp,cpdp", "--periods", "2", "--epochs", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=140,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "resnet50-cifar on cifar100" in proc.stdout
    report = json.loads(out.read_text())
    cfg = report["config"]
    assert (cfg["model"], cfg["dataset"], cfg["lr"], cfg["momentum"], cfg["augment"]) == (
        "resnet50-cifar", "cifar100", 0.1, 0.9, True)
    assert (cfg["batch_size"], cfg["max_images"], cfg["epochs"], cfg["topology"]) == (4, 64, 1, "wan")
    ddp, cpdp = report["results"]
    assert (ddp["strategy"], cpdp["strategy"], cpdp["period"]) == ("ddp", "cpdp", 2)
    for r in (ddp, cpdp):  # 16 images, 2 ranks x 4: two steps, then evaluation on the 4 test images
        assert r["status"] == "ok" and r["seeds"][0]["steps"] == 2
        assert 0.0 <= r["final_test_acc"] <= r["peak_test_acc"] <= 1.0
    # ddp all-reduces ResNet-50's 94.8 MB of gradients every step; cpdp K=2 steps locally, then all-reduces
    # the gradients and averages the parameters (and the BatchNorm buffers, 0.2 MB): the same bytes per step
    assert ddp["bytes_per_step"] == pytest.approx(23_705_252 * 4, rel=0.01)
    assert cpdp["bytes_per_step"] == pytest.approx(23_705_252 * 4, rel=0.01)
