"""Build the small trace fixtures the tests read into ``tests/data/`` (a developer tool, not installed).

What it builds:

* ``tests/data/hta/``: the public NCCL traces of Holistic Trace Analysis' test data (MIT), copied
  byte for byte from ``../shared/traces`` (the folder CI lays beside the checkout) and checked
  against the SHA-256 sums below, plus a README giving their origin, licence and HTA's own
  figures (what ``tests/test_profiler_hta.py`` compares cpdpkit's profiler with).
* ``tests/data/bench_quick.json`` (only with ``--bench-quick``: it trains for about a minute):
  the ``--json`` output of ``cpdpkit bench --quick``, which ``tests/test_tools.py`` feeds to
  ``tools/docs_tables.py`` so the table tool is checked against the real schema.

Usage::

    python tools/build_fixtures.py                 # copy the HTA traces, write their README
    python tools/build_fixtures.py --check         # exit 1 if a fixture is missing or differs
    python tools/build_fixtures.py --bench-quick   # also re-record tests/data/bench_quick.json

Run it from anywhere; paths are relative to the repository root. The results are meant to be
committed: the tests never read ``../shared`` and never skip because it is absent.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SHARED = ROOT.parent / "shared" / "traces"
DEFAULT_OUT = ROOT / "tests" / "data"


@dataclass(frozen=True)
class TraceFixture:
    """One public trace: its path under the shared folder (kept under ``hta/``) and its SHA-256."""

    path: str
    sha256: str
    num_bytes: int
    what: str


HTA_TRACES = (
    TraceFixture("nccl_2rank/rank-0.json.gz",
                 "c1cf9c575fdcd7bdc6326ceab834f94b351f81ae55577a7471aa9e328fb8b58e", 749_757,
                 "rank 0 of a 2-rank NCCL run"),
    TraceFixture("sampled_128rank/rank-0.json.gz",
                 "71b98c30a2751cc56d9bf78f8fb76467acd56e0be6a1f0da23c600941d29aafd", 124_247,
                 "rank 0 of a 128-rank NCCL run (sampled)"),
    TraceFixture("sampled_128rank/rank-1.json.gz",
                 "2f9a65fd5f319ec8e60468a22dc9a624eb4b40369c729f6f897259d587eca57e", 119_799,
                 "rank 1 of a 128-rank NCCL run (sampled)"),
)

HTA_README = """\
# Public NCCL traces from Holistic Trace Analysis (test fixtures)

Written by `tools/build_fixtures.py`; do not edit by hand (re-run the tool).

PyTorch profiler (Kineto) traces of real GPU training runs with NCCL, from the test data of
[Holistic Trace Analysis](https://github.com/facebookresearch/HolisticTraceAnalysis) (HTA),
copied byte for byte from the project's `shared/traces/` folder (SHA-256 sums in the tool).
`tests/test_profiler_hta.py` checks that cpdpkit's profiler agrees with HTA on them.

| file | size | what |
|---|---|---|
{rows}

HTA's figures for them (holistictraceanalysis 0.5.0):

| folder | `get_comm_comp_overlap`: comp_comm_overlap_pctg | `get_temporal_breakdown`: idle / compute / non-compute us |
|---|---|---|
| `nccl_2rank/` | rank 0: 14.31 | 338781 / 75169 / 21636 |
| `sampled_128rank/` | rank 0: 11.81, rank 1: 20.05 | r0: 321378 / 106252 / 172428; r1: 328671 / 135548 / 136455 |

HTA's definition: GPU kernels only; communication = NCCL kernels, computation = the other
non-memory kernels; each class merged into disjoint intervals; overlap percentage =
|comm ∩ comp| / |comm| × 100.

## Licence

HTA and its test data are under the MIT licence:

    MIT License

    Copyright (c) Meta Platforms, Inc. and affiliates.

    Permission is hereby granted, free of charge, to any person obtaining a copy
    of this software and associated documentation files (the "Software"), to deal
    in the Software without restriction, including without limitation the rights
    to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
    copies of the Software, and to permit persons to whom the Software is
    furnished to do so, subject to the following conditions:

    The above copyright notice and this permission notice shall be included in all
    copies or substantial portions of the Software.

    THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
    IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
    FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
    AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
    LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
    OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
    SOFTWARE.
"""


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def hta_readme() -> str:
    rows = "\n".join(f"| `{t.path}` | {t.num_bytes / 1000:.0f} KB | {t.what} |" for t in HTA_TRACES)
    return HTA_README.format(rows=rows)


def build_hta(shared: Path, out: Path) -> list[str]:
    """Copy and verify the HTA traces into ``out/hta``; returns the problems (empty when done)."""
    problems = []
    for t in HTA_TRACES:
        src = shared / t.path
        if not src.is_file():
            problems.append(f"{src}: missing; pass --shared DIR (the folder holding nccl_2rank/ and sampled_128rank/)")
            continue
        got = sha256(src)
        if got != t.sha256:
            problems.append(f"{src}: SHA-256 {got} is not the expected {t.sha256}; "
                            "check the source, then update HTA_TRACES in tools/build_fixtures.py")
            continue
        dst = out / "hta" / t.path
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        print(f"copied {src} -> {dst.relative_to(ROOT) if dst.is_relative_to(ROOT) else dst}")
    if not problems:
        (out / "hta" / "README.md").write_text(hta_readme(), encoding="utf-8")
        print(f"wrote {out / 'hta' / 'README.md'}")
    return problems


def check_hta(out: Path) -> list[str]:
    """What is missing or different in ``out/hta`` (empty when the fixtures are as built)."""
    problems = []
    for t in HTA_TRACES:
        path = out / "hta" / t.path
        if not path.is_file():
            problems.append(f"{path}: missing; run python tools/build_fixtures.py")
        elif sha256(path) != t.sha256:
            problems.append(f"{path}: content differs from the expected SHA-256; run python tools/build_fixtures.py")
    readme = out / "hta" / "README.md"
    if not readme.is_file() or readme.read_text(encoding="utf-8") != hta_readme():
        problems.append(f"{readme}: missing or stale; run python tools/build_fixtures.py")
    return problems


def build_bench_quick(out: Path) -> list[str]:
    """Record ``cpdpkit bench --quick --json out/bench_quick.json`` (about a minute on 2 cores)."""
    target = out / "bench_quick.json"
    cli = Path(sys.executable).with_name("cpdpkit")
    cmd = [str(cli) if cli.exists() else "cpdpkit", "bench", "--quick", "--json", str(target)]
    print("running", " ".join(cmd))
    done = subprocess.run(cmd, cwd=ROOT, check=False)
    return [] if done.returncode == 0 else [f"{' '.join(cmd)} exited with {done.returncode}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/build_fixtures.py",
                                     description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--shared", type=Path, default=DEFAULT_SHARED,
                        help=f"folder holding the public traces (default: {DEFAULT_SHARED})")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"fixture folder (default: {DEFAULT_OUT})")
    parser.add_argument("--check", action="store_true", help="only verify the fixtures; exit 1 if any is off")
    parser.add_argument("--bench-quick", action="store_true",
                        help="also re-record bench_quick.json with cpdpkit bench --quick (about a minute)")
    args = parser.parse_args(argv)
    if args.check:
        problems = check_hta(args.out)
    else:
        problems = build_hta(args.shared, args.out)
        if args.bench_quick and not problems:
            problems = build_bench_quick(args.out)
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
