"""``stdlib-text``: next-character prediction on Python's own standard library, and its model.

The default workload of ``cpdpkit bench``: a real learning problem with headroom (a small
model reaches about half of the held-out characters, far from 100 %) that needs no download,
because the text ships with every Python. The corpus is :data:`CORPUS_FILES`, a fixed, sorted
list of pure-Python modules of CPython's standard library (3.11 and later), read from
``sysconfig.get_paths()["stdlib"]``. It is deterministic for a given Python version; its
SHA-256 (over the file names and bytes) is recorded in :attr:`Dataset.info` so results say
what they trained on. A missing file is refused with one line, never silently skipped.

A sample is ``x`` = the previous :data:`CONTEXT_LEN` characters as int64 ids and ``y`` = the
next character's id, over :data:`NUM_CLASSES` ids: 0 any other character (tabs, non-ASCII),
1 the newline, 2-96 printable ASCII (space to ``~``). Accuracy is top-1 next-character
accuracy.

The split is fixed and independent of the run's seed: the concatenated corpus is cut into
blocks of :data:`BLOCK_CHARS` characters, every tenth block is held out, and every window lies
inside one block (no training label is ever a test label, no context crosses the split).
Training and test windows are drawn without replacement from their blocks with a fixed
generator.

The model, ``char-mlp`` (:mod:`cpdpkit.bench.models.char_mlp`), is a character embedding, two
hidden layers with LayerNorm, GELU and dropout, and a linear head (0.16 M parameters, 0.64 MB of fp32
gradients: a step computes
in about 10 ms on one CPU core, while the emulated WAN's all-reduce of its gradients takes 22 ms).
Why a short context and this size: docs/workload.md (longer contexts learned less in the same
number of steps).
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from cpdpkit.bench.data.dataset import Dataset
from cpdpkit.errors import ConfigError

__all__ = ["CORPUS_FILES", "CONTEXT_LEN", "NUM_CLASSES", "BLOCK_CHARS", "check_corpus", "encode",
           "load_stdlib_text", "read_corpus"]

# Large, long-lived pure-Python modules, present as these files in CPython 3.11, 3.12 and 3.13
# (checked); pathlib, zipfile, datetime and re became packages or thin shims, so they are not here.
# 1.56 M characters on 3.11. Sorted.
CORPUS_FILES = (
    "argparse.py", "ast.py", "calendar.py", "collections/__init__.py", "configparser.py",
    "dataclasses.py", "difflib.py", "email/message.py", "enum.py", "fractions.py", "functools.py",
    "heapq.py", "http/client.py", "inspect.py", "logging/__init__.py", "pickle.py", "pprint.py",
    "random.py", "shutil.py", "statistics.py", "subprocess.py", "tarfile.py", "textwrap.py",
    "threading.py", "tokenize.py", "typing.py",
)
CONTEXT_LEN = 8
NUM_CLASSES = 97
BLOCK_CHARS = 4096
_TEST_EVERY = 10  # every tenth block is held out
_SPLIT_SEED = 20_240_611  # fixed: the split and the windows never depend on a run's seed
# (train, test) windows; --quick takes fewer. 65,536 training windows are an epoch of 256 steps
# at the default batch (128 per rank, 2 ranks), 1,024 steps in 4 epochs; 32,768 test windows keep
# the test-sampling noise of a difference near 0.2 pp for two models that disagree on a fifth of
# the characters.
_WINDOWS = {False: (65_536, 32_768), True: (4_096, 4_096)}


def encode(text: str) -> torch.Tensor:
    """Character ids of ``text`` (int64): 1 newline, 2-96 printable ASCII, 0 anything else."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    table = np.zeros(128, dtype=np.int64)
    table[ord("\n")] = 1
    table[32:127] = np.arange(2, NUM_CLASSES)
    return torch.from_numpy(np.where(codes < 128, table[np.minimum(codes, 127)], 0))


def _folder(root: str | Path | None) -> Path:
    return Path(sysconfig.get_paths()["stdlib"] if root is None else root)


def check_corpus(root: str | Path | None = None, files: Sequence[str] = CORPUS_FILES) -> None:
    """Refuse, in one line, a corpus with a missing file (cheap: reads no file; for early checks)."""
    folder = _folder(root)
    for name in files:
        if not (folder / name).is_file():
            raise ConfigError(
                f"stdlib-text corpus file {folder / name} is missing (Python {sys.version.split()[0]}, stdlib at "
                f"{folder}): the data set needs all {len(files)} files of its list; use a complete CPython >= 3.11, "
                "or --dataset digits --model cnn"
            )


def read_corpus(root: str | Path | None = None, files: Sequence[str] = CORPUS_FILES) -> tuple[str, str]:
    """``(text, sha256)`` of ``files`` under ``root`` (default: this Python's stdlib), in order."""
    check_corpus(root, files)
    folder = _folder(root)
    digest, parts = hashlib.sha256(), []
    for name in files:
        path = folder / name
        try:
            data = path.read_bytes()
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"stdlib-text corpus file {path} cannot be read as UTF-8 text ({exc}): "
                              "repair the Python installation, or use --dataset digits --model cnn") from None
        digest.update(name.encode() + b"\0" + data + b"\0")
        parts.append(text if text.endswith("\n") else text + "\n")
    return "".join(parts), digest.hexdigest()


def _windows(ids: torch.Tensor, block_mask: torch.Tensor, count: int, g: torch.Generator,
             what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` windows whose context and target lie in one block of ``block_mask``."""
    offsets = torch.arange(CONTEXT_LEN, BLOCK_CHARS)
    targets = (torch.nonzero(block_mask).flatten()[:, None] * BLOCK_CHARS + offsets).flatten()
    if len(targets) < count:
        raise ConfigError(f"the stdlib-text corpus has {len(targets)} {what} windows, fewer than the "
                          f"{count} needed: the corpus files are truncated; repair the Python installation")
    pos = targets[torch.randperm(len(targets), generator=g)[:count]]
    return ids[pos[:, None] + torch.arange(-CONTEXT_LEN, 0)], ids[pos]


def load_stdlib_text(*, quick: bool = False, root: str | Path | None = None,
                     files: Sequence[str] = CORPUS_FILES) -> Dataset:
    """The ``stdlib-text`` data set (see the module docstring); ``root``/``files`` for tests."""
    text, sha256 = read_corpus(root, files)
    ids = encode(text)
    num_blocks = len(ids) // BLOCK_CHARS
    is_test = torch.arange(num_blocks) % _TEST_EVERY == _TEST_EVERY - 1
    n_train, n_test = _WINDOWS[quick]
    g = torch.Generator().manual_seed(_SPLIT_SEED)
    x_train, y_train = _windows(ids, ~is_test, n_train, g, "training")
    x_test, y_test = _windows(ids, is_test, n_test, g, "test")
    info = {"corpus": f"CPython {sys.version_info.major}.{sys.version_info.minor} stdlib, {len(files)} files",
            "corpus_sha256": sha256, "corpus_chars": len(ids), "context_len": CONTEXT_LEN}
    return Dataset("stdlib-text", x_train, y_train, x_test, y_test, NUM_CLASSES, info=info)


