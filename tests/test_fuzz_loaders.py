"""Every input loader fuzzed with hypothesis: a broken file loads or fails with one CpdpkitError line naming it.

The targets (trace files, topology TOML, plan JSON, CIFAR-100 and ImageFolder folders) and their
strategies are in ``_fuzz_targets.py``; ``benchmarks/fuzz_loaders.py`` runs thousands of cases of the
same targets from a random seed. Here each target runs a fixed, derandomized set of cases, and every
input a fuzzer once crashed a loader with is replayed from ``tests/data/fuzz/<target>/<case>/``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import given

from _fuzz_cases import fuzzed as _fuzzed
from _fuzz_cases import no_crash as _no_crash
from _fuzz_targets import TARGETS, outcome, read_case

pytestmark = pytest.mark.timeout(120)

DATA = Path(__file__).parent / "data" / "fuzz"


# ---- fuzzed, derandomized (the same cases on every run) ----------------------------------------------------
@_fuzzed(250)
@given(case=TARGETS["trace"].cases())
def test_load_trace_fuzzed(case: dict[str, bytes]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        kind, detail = outcome(TARGETS["trace"], case, Path(tmp))
    assert kind != "crash", f"load_trace crashed: {detail}"


@_fuzzed(200)
@given(case=TARGETS["trace-analyze"].cases())
def test_analyze_fuzzed(case: dict[str, bytes]) -> None:
    _no_crash("trace-analyze", case)


@_fuzzed(300)
@given(case=TARGETS["topology"].cases())
def test_topology_toml_fuzzed(case: dict[str, bytes]) -> None:
    _no_crash("topology", case)


@_fuzzed(300)
@given(case=TARGETS["plan"].cases())
def test_plan_json_fuzzed(case: dict[str, bytes]) -> None:
    _no_crash("plan", case)


@_fuzzed(200)
@given(case=TARGETS["cifar"].cases())
def test_cifar_fuzzed(case: dict[str, bytes]) -> None:
    _no_crash("cifar", case)


@_fuzzed(250)
@given(case=TARGETS["image-folder"].cases())
def test_image_folder_fuzzed(case: dict[str, bytes]) -> None:
    _no_crash("image-folder", case)


# ---- inputs that once crashed a loader, replayed -------------------------------------------------------
def _kept(target: str) -> list[Path]:
    return sorted(p for p in (DATA / target).iterdir() if p.is_dir())


def _replay(target: str, folder: Path) -> None:
    """A kept input named ``loads-*`` must load; any other is broken and must fail in one line naming it."""
    expected = "ok" if folder.name.startswith("loads-") else "error"
    assert _no_crash(target, read_case(folder)) == expected, f"{folder}: expected {expected}"


@pytest.mark.parametrize("target", ["topology", "plan", "cifar", "image-folder"])
def test_kept_inputs_fail_in_one_line(target: str) -> None:
    kept = _kept(target)
    assert kept, f"no kept inputs in {DATA / target}"
    for folder in kept:
        _replay(target, folder)


@pytest.mark.parametrize("folder", _kept("trace"), ids=lambda p: p.name)
def test_kept_trace_inputs_are_reported_by_analyze(folder: Path) -> None:
    _replay("trace-analyze", folder)


@pytest.mark.parametrize("folder", _kept("trace"), ids=lambda p: p.name)
def test_kept_trace_inputs_load_or_fail_in_one_line(folder: Path) -> None:
    _replay("trace", folder)


# ---- what the fixed messages say ---------------------------------------------------------------------
def _message(target: str, case_name: str) -> str:
    folder = DATA / target / case_name
    with tempfile.TemporaryDirectory() as tmp:
        kind, detail = outcome(TARGETS[target], read_case(folder), Path(tmp))
    assert kind == "error", detail
    return detail.split(tmp, 1)[-1]


@pytest.mark.parametrize("target,case_name,expected", [
    ("topology", "not-utf8", "/topo.toml' is not UTF-8 text (byte 28: invalid start byte); save it as UTF-8"),
    ("topology", "arrays-nested-1000-deep", "/topo.toml: not valid TOML (arrays or tables nested too deeply); "
                                          "fix the syntax"),
    ("topology", "ranks-per-node-400-digits", "/topo.toml: ranks_per_node = 1000000000000000000000000000..."
                                             "0000000000000000000000000000 (401 characters) is too large; set it "
                                             "to a whole number <= 1,048,576 (the most ranks cpdpkit plans or "
                                             "emulates: its work grows with the ranks)"),
    ("topology", "description-is-a-list", "/topo.toml: topology 'wan': description = [1] is invalid; make it a string"),
    ("plan", "topology-missing", "/plan.json: plan field 'topology' is missing; re-run cpdpkit plan"),
    ("plan", "arrays-nested-2000-deep", "/plan.json: not valid JSON (arrays or objects nested too deeply); pass "
                                        "cpdpkit plan --json's file"),
    ("cifar", "label-out-of-range", "/cifar-100-python/train: the fine labels are int64 of shape (1,), expected 1 "
                                    "integers in 0..99 (one per image): re-extract it"),
    ("image-folder", "annotations-not-utf8", "/val/val_annotations.txt' is not UTF-8 text (byte 10: invalid start "
                                             "byte); re-extract it"),
])
def test_fixed_messages_name_the_value_and_the_fix(target: str, case_name: str, expected: str) -> None:
    assert _message(target, case_name) == expected
