"""The checkpoint folder and every command line, fuzzed (derandomized: the same cases on every run).

The targets are in ``_fuzz_checkpoint.py`` and ``_fuzz_cli.py`` (registered in ``_fuzz_targets.py``);
``benchmarks/fuzz_loaders.py checkpoint cli`` runs thousands of cases from a random seed. A truncated,
corrupted or hostile checkpoint folder must restore or end in one ``CheckpointError`` line naming it,
with no code run; a command line must be accepted (the ranks would start) or refused with exit 2
before any rank starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given

from _fuzz_cases import fuzzed as _fuzzed
from _fuzz_cases import no_crash as _no_crash
from _fuzz_targets import TARGETS, outcome

pytestmark = pytest.mark.timeout(120)


@_fuzzed(120)
@given(case=TARGETS["checkpoint"].cases())
def test_checkpoint_folder_fuzzed(case: dict[str, bytes]) -> None:
    _no_crash("checkpoint", case)


@_fuzzed(120)
@given(case=TARGETS["cli"].cases())
def test_command_lines_fuzzed(case: dict[str, bytes]) -> None:
    _no_crash("cli", case)


def test_a_manifest_value_with_a_newline_is_shown_as_its_repr(tmp_path: Path) -> None:
    """Found by the fuzzer (seed 25): a world size of ``"a\\nb"`` in the manifest made a message of two lines."""
    from _fuzz_checkpoint import MANIFEST, STEP, _seeds

    files = dict(_seeds()["good"])
    files[MANIFEST] = json.dumps({**json.loads(files[MANIFEST]), "world_size": "a\nb"}).encode()
    kind, detail = outcome(TARGETS["checkpoint"], {f"{STEP}/{n}": d for n, d in files.items()}, tmp_path)
    assert kind == "error", detail
    assert detail == (f"checkpoint '{tmp_path}/{STEP}' was written by 'a\\nb' ranks, this run has 1: launch 'a\\nb' "
                      f"ranks, or point Checkpointer at another directory than '{tmp_path}/ckpt'")
