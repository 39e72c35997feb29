"""Fuzz every input loader with hypothesis and count the crashes (issue 15: >= 2,000 cases per loader, 0 crashes).

The targets and their strategies are the tests' (``tests/_fuzz_targets.py``): trace files (``load_trace``
and ``analyze``), topology TOML (``load_topology`` and ``cpdpkit topology show --json``), plan JSON
(``ShardingPlan.load``), CIFAR-100 and TinyImageNet/ImageFolder folders, the checkpoint folder
(``Checkpointer.restore``, ``tests/_fuzz_checkpoint.py``) and every command's command line (validation
only: no rank starts, ``tests/_fuzz_cli.py``). A case either loads, or fails with one ``CpdpkitError``
line naming the input; anything else is a crash. Unlike ``make test``
(derandomized, a few hundred cases), each run draws new cases from a printed seed; the first input of
each kind of crash is written under ``--out`` and listed in the JSON::

    python benchmarks/fuzz_loaders.py [--cases 2000] [--seed N] [--out runs/fuzz] [TARGET ...]

Prints ``{target: {"cases", "ok", "errors", "crashes", "seconds", "failing_inputs": [...]}, "seed": N}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402

from _fuzz_targets import TARGETS, Target, outcome, write_case  # noqa: E402 - the tests' targets


def _signature(detail: str) -> str:
    """A crash's kind: its exception and message with paths and numbers blanked."""
    return re.sub(r"\d+", "N", re.sub(r"/\S+", "PATH", detail))[:120]


def fuzz(target: Target, cases: int, seed_value: int, out: Path) -> dict:
    counts: Counter[str] = Counter()
    failing: dict[str, dict] = {}

    @settings(max_examples=cases, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @seed(seed_value)
    @given(case=target.cases())
    def run(case: dict[str, bytes]) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            kind, detail = outcome(target, case, Path(tmp))
        counts[kind] += 1
        if kind != "crash":
            return
        sig = _signature(detail)
        if sig not in failing:
            digest = hashlib.sha256(repr(sorted(case.items())).encode()).hexdigest()[:10]
            folder = out / target.name / digest
            write_case(case, folder)
            failing[sig] = {"crash": detail, "input": str(folder), "count": 0}
        failing[sig]["count"] += 1

    start = time.perf_counter()
    run()
    return {"cases": sum(counts.values()), "ok": counts["ok"], "errors": counts["error"],
            "crashes": counts["crash"], "seconds": round(time.perf_counter() - start, 1),
            "failing_inputs": list(failing.values())}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("targets", nargs="*", choices=[[], *TARGETS], default=[], metavar="TARGET",
                        help=f"some of {', '.join(TARGETS)} (default: all)")
    parser.add_argument("--cases", type=int, default=2000, help="cases per target (default 2000)")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: a random one, printed)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "fuzz", help="where crashing inputs are written")
    args = parser.parse_args(argv)
    seed_value = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    print(f"# seed {seed_value} (rerun: --seed {seed_value})", file=sys.stderr, flush=True)
    results: dict[str, object] = {}
    for name in args.targets or list(TARGETS):
        results[name] = fuzz(TARGETS[name], args.cases, seed_value, args.out)
        print(f"# {name}: {json.dumps({k: v for k, v in results[name].items() if k != 'failing_inputs'})}",
              file=sys.stderr, flush=True)
    results["seed"] = seed_value
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
