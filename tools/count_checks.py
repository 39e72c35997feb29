"""Count the checks of the test suite with ``ast`` (a developer tool; not installed, not run by ``make``).

A check is an ``assert`` statement, a call of ``pytest.raises``, ``pytest.approx``, ``pytest.fail``,
``pytest.warns``, ``pytest.deprecated_call`` or ``torch.testing.assert_close`` outside an ``assert``,
or a ``raise AssertionError(...)`` (the rank runners' "a rank failed / hung"). Counted per file of
``tests/`` (test modules and their ``_*.py`` helpers, where the jobs that ranks run hold their own
asserts), so a restructuring of the suite can say how many checks it had before and after::

    python tools/count_checks.py            # the total and one line per file
    python tools/count_checks.py --total    # the total only
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CALLS = {"raises", "approx", "fail", "warns", "assert_close", "deprecated_call"}


def _call_name(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def count(source: str) -> int:
    """The checks of one module's source: its assert statements, then the check calls outside them."""
    tree = ast.parse(source)
    asserts = [n for n in ast.walk(tree) if isinstance(n, ast.Assert)]
    inside = {id(c) for a in asserts for c in ast.walk(a) if isinstance(c, ast.Call)}
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and id(n) not in inside
             and _call_name(n) in CALLS]
    raised = [n for n in ast.walk(tree) if isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call)
              and _call_name(n.exc) == "AssertionError"]
    return len(asserts) + len(calls) + len(raised)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", default=str(ROOT / "tests"))
    parser.add_argument("--total", action="store_true", help="print the total only")
    args = parser.parse_args(argv)
    per_file = {p.name: count(p.read_text(encoding="utf-8")) for p in sorted(Path(args.folder).glob("*.py"))}
    if not args.total:
        for name, n in per_file.items():
            print(f"{n:6d}  {name}")
    print(f"{sum(per_file.values())} checks in {len(per_file)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
