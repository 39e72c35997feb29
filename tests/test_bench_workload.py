"""The default bench workload, ``stdlib-text`` + ``char-mlp``, without launching anything:
deterministic data, a seed-independent block split, the documented shapes, the recorded corpus hash,
one-line errors for a broken corpus, and the model's output shape."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import pytest
import torch

from cpdpkit.bench.data import DATASETS, load_dataset, text
from cpdpkit.bench.models import MODELS, build_model
from cpdpkit.bench.periodic.config import BenchConfig
from cpdpkit.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

_TENSORS = ("x_train", "y_train", "x_test", "y_test")


def _letter_corpus(folder: Path, num_blocks: int = 30) -> list[str]:
    """One file per 4096-character block: train blocks are upper-case letters, held-out ones lower-case."""
    names = []
    for i in range(num_blocks):
        letter = "abcdefghij"[i // 10] if i % 10 == 9 else "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[i % 26]
        name = f"block{i:03d}.py"
        (folder / name).write_text(letter * (text.BLOCK_CHARS - 1) + "\n")
        names.append(name)
    return names


def test_loading_twice_gives_the_same_tensors_and_info():
    a, b = load_dataset("stdlib-text"), load_dataset("stdlib-text")
    for name in _TENSORS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.info == b.info


def test_the_split_and_windows_do_not_depend_on_the_global_seed():
    torch.manual_seed(0)
    a = text.load_stdlib_text(quick=True)
    torch.manual_seed(12345)
    torch.rand(7)  # a different global RNG state as well as a different seed
    b = text.load_stdlib_text(quick=True)
    for name in _TENSORS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_shapes_dtypes_and_classes_are_as_documented():
    ds = load_dataset("stdlib-text")
    assert "stdlib-text" in DATASETS and ds.name == "stdlib-text"
    assert ds.x_train.shape == (65_536, text.CONTEXT_LEN) and ds.x_test.shape == (32_768, text.CONTEXT_LEN)
    assert ds.y_train.shape == (65_536,) and ds.y_test.shape == (32_768,) and text.CONTEXT_LEN == 8
    for name in _TENSORS:
        tensor = getattr(ds, name)
        assert tensor.dtype == torch.int64, name
        assert 0 <= int(tensor.min()) and int(tensor.max()) < ds.num_classes, name
    assert ds.num_classes == text.NUM_CLASSES == 97 and ds.input_shape == (text.CONTEXT_LEN,)
    quick = load_dataset("stdlib-text", quick=True)
    assert quick.x_train.shape == (4_096, text.CONTEXT_LEN) and quick.y_test.shape == (4_096,)
    # a real learning problem with headroom: the most frequent character (the space) is ~30 %
    top = torch.bincount(ds.y_train, minlength=ds.num_classes).argmax()
    assert int(top) == text.encode(" ")[0] and 0.2 < float((ds.y_test == top).float().mean()) < 0.4


def test_encode_maps_newline_printable_ascii_and_everything_else():
    assert text.encode("a\n\t é~ ").tolist() == [ord("a") - 30, 1, 0, 2, 0, 96, 2]


def test_the_split_is_by_block_and_no_window_crosses_it(tmp_path):
    names = _letter_corpus(tmp_path)
    ds = text.load_stdlib_text(quick=True, root=tmp_path, files=names)
    newline = 1
    lower = set(text.encode("abcdefghij").tolist()) | {newline}
    upper = set(text.encode("ABCDEFGHIJKLMNOPQRSTUVWXYZ").tolist()) | {newline}
    test_ids = set(ds.x_test.unique().tolist()) | set(ds.y_test.unique().tolist())
    train_ids = set(ds.x_train.unique().tolist()) | set(ds.y_train.unique().tolist())
    assert test_ids <= lower and len(test_ids) > 1
    assert train_ids <= upper and len(train_ids) > 10


def test_the_corpus_hash_is_recorded_and_follows_the_files(tmp_path):
    ds = load_dataset("stdlib-text", quick=True)
    root = Path(sysconfig.get_paths()["stdlib"])
    digest = hashlib.sha256()
    for name in text.CORPUS_FILES:
        digest.update(name.encode() + b"\0" + (root / name).read_bytes() + b"\0")
    assert ds.info["corpus_sha256"] == digest.hexdigest()
    assert ds.info["context_len"] == text.CONTEXT_LEN and f"{len(text.CORPUS_FILES)} files" in ds.info["corpus"]
    names = _letter_corpus(tmp_path)
    before = text.load_stdlib_text(quick=True, root=tmp_path, files=names).info["corpus_sha256"]
    (tmp_path / names[3]).write_text("Z" + (tmp_path / names[3]).read_text()[1:])
    after = text.load_stdlib_text(quick=True, root=tmp_path, files=names).info["corpus_sha256"]
    assert before != after


def test_a_missing_corpus_file_is_one_clear_line(tmp_path):
    names = _letter_corpus(tmp_path)
    with pytest.raises(ConfigError) as info:
        text.load_stdlib_text(quick=True, root=tmp_path, files=[*names, "gone/missing.py"])
    message = str(info.value)
    assert "\n" not in message
    assert str(tmp_path / "gone" / "missing.py") in message and "missing" in message
    assert "--dataset digits --model cnn" in message  # the way out
    # the same line from the cheap check meant for validating options before any launch
    with pytest.raises(ConfigError) as early:
        text.check_corpus(tmp_path, [*names, "gone/missing.py"])
    assert str(early.value) == message
    text.check_corpus()  # this Python's stdlib holds every listed file


def test_an_undecodable_or_short_corpus_is_one_clear_line(tmp_path):
    names = _letter_corpus(tmp_path)
    (tmp_path / names[0]).write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(ConfigError, match="cannot be read as UTF-8") as info:
        text.load_stdlib_text(quick=True, root=tmp_path, files=names)
    assert "\n" not in str(info.value)
    short = _letter_corpus(tmp_path, num_blocks=12)  # one held-out block: fewer test windows than --quick needs
    with pytest.raises(ConfigError, match="fewer than the 4096 needed") as info:
        text.load_stdlib_text(quick=True, root=tmp_path, files=short)
    assert "\n" not in str(info.value)


def test_char_mlp_gives_batch_by_classes_and_refuses_images():
    assert "char-mlp" in MODELS
    torch.manual_seed(0)
    model = build_model("char-mlp", (text.CONTEXT_LEN,), text.NUM_CLASSES)
    x = torch.randint(0, text.NUM_CLASSES, (5, text.CONTEXT_LEN))
    assert model(x).shape == (5, text.NUM_CLASSES)
    num_params = sum(p.numel() for p in model.parameters())
    assert 150_000 <= num_params <= 170_000  # documented: 0.16 M
    with pytest.raises(ConfigError, match="use --model cnn"):
        build_model("char-mlp", (1, 8, 8), 10)
    with pytest.raises(ConfigError, match="use --model char-mlp"):
        build_model("cnn", (text.CONTEXT_LEN,), text.NUM_CLASSES)


def test_the_default_dataset_and_model_fit_together():
    config = BenchConfig()
    ds = load_dataset(config.dataset, quick=True)
    model = build_model(config.model, ds.input_shape, ds.num_classes)
    assert model(ds.x_test[:3]).shape == (3, ds.num_classes)
