"""The issue-24 table of docs/results.md from the three saved bench runs (benchmarks/i24/*.json).

Run: .venv/bin/python tools/issue24_tables.py. Each variant is compared with the same strategy uncompressed and
unfragmented (paired by seed, a 95 % t interval), and its exposed sync time with ddp's of the first run.
"""

import json
import statistics as st
from pathlib import Path

T975 = {1: 12.706, 2: 4.303}
RUNS = Path(__file__).resolve().parent.parent / "benchmarks" / "i24"


def load(name):
    return json.loads((RUNS / name).read_text())["results"]


rows = load("cpdp-codecs.json") + load("overlap-f1.json") + load("overlap-f4.json")


def key(r):
    return (r["strategy"], r.get("compression", "none"), r.get("fragments", 1))


by = {key(r): r for r in rows}
ddp = by[("ddp", "none", 1)]


def seeds(r, k):
    return {s["seed"]: s[k] for s in r["seeds"] if s["status"] == "ok"}


def paired(r, base, k="peak_test_acc", scale=100):
    a, b = seeds(r, k), seeds(base, k)
    d = [(a[i] - b[i]) * scale for i in sorted(set(a) & set(b))]
    m = st.fmean(d)
    if len(d) < 2:
        return f"{m:+.2f}"
    h = T975[len(d) - 1] * st.stdev(d) / len(d) ** 0.5
    return f"{m:+.2f} [{m - h:+.2f}, {m + h:+.2f}]"


print("| strategy K=4 | codec | fragments | peak acc % (3 seeds) | Δ pp [95 % CI] | bytes/step | × | "
      "max bytes/step | × | exposed ms/step | × ddp's |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for r in rows:
    s, c, f = key(r)
    base = by[(s, "none", 1)]
    acc = f"{r['peak_test_acc'] * 100:.2f} ± {r['std']['peak_test_acc'] * 100:.2f}"
    d = "-" if r is base else paired(r, base)
    exposed = r["exposed_sync_s_per_step"]
    print(f"| {s} | {c} | {f} | {acc} | {d} | {r['bytes_per_step']:,.0f} | "
          f"{r['bytes_per_step'] / base['bytes_per_step']:.3f} | {r['max_bytes_per_step']:,.0f} | "
          f"{r['max_bytes_per_step'] / base['max_bytes_per_step']:.3f} | {exposed * 1e3:.2f} | "
          f"{exposed / ddp['exposed_sync_s_per_step']:.3f} |")
