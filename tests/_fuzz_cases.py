"""The fuzz tests' shared settings (derandomised: the same cases on every run) and crash check."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings

from _fuzz_targets import TARGETS, outcome


def fuzzed(max_examples: int):  # noqa: ANN201 - a decorator
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def no_crash(target: str, case: dict[str, bytes]) -> str:
    """Run ``case`` through ``target``; fail on a crash, else return the outcome's kind."""
    with tempfile.TemporaryDirectory() as tmp:
        kind, detail = outcome(TARGETS[target], case, Path(tmp))
    assert kind != "crash", f"{target} crashed on {sorted(case)}: {detail}"
    return kind
