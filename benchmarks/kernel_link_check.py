"""The network model against the Linux kernel: gloo over a real, rate-shaped link (prints JSON).

    sudo .venv/bin/python benchmarks/kernel_link_check.py [--rate-mbit 100] [--repeats 3]

Needs root and ``ip``/``tc`` (network namespaces; netem is not needed: only the rate is shaped).
It makes two network namespaces joined by a veth pair, shapes both ends with ``tc qdisc ... tbf``
at ``--rate-mbit``, and starts gloo ranks inside them with ``ip netns exec`` (each rank on its
namespace's veth: ``GLOO_SOCKET_IFNAME``):

* ``pair``: 2 ranks, one per namespace: all_reduce of 4 MB and 16 MB, against the model's
  ``time_s`` for a 2-rank group on a tier of the shaped rate (latency: the veth's, ~0);
* ``concurrent``: 4 ranks, two per namespace: groups {0, 2} and {1, 3} all-reduce 4 MB alone,
  then both at once: the ratio against the model's :func:`cpdpkit.network.concurrent_time_s` (2x).

The namespaces are removed on the way out, whatever happens. Not part of ``make test``: a
measurement, it asserts nothing. The ranks' own TCP/IP overhead (headers, ACKs, slow start) is
what the model leaves out: expect the kernel ~5-7 % above it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SIZES = (4_000_000, 16_000_000)
CONCURRENT_BYTES = 4_000_000
PORT = 29517


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


def _setup(names: tuple[str, str], rate_mbit: int) -> tuple[str, str]:
    """Two namespaces joined by a shaped veth pair; returns their addresses."""
    a, b = names
    addrs = ("10.213.77.1", "10.213.77.2")
    for ns in names:
        _sh("ip", "netns", "add", ns)
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
    _sh("ip", "link", "add", f"{a}-v", "type", "veth", "peer", "name", f"{b}-v")
    for ns, addr in zip(names, addrs):
        dev = f"{ns}-v"
        _sh("ip", "link", "set", dev, "netns", ns)
        _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{addr}/24", "dev", dev)
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", dev, "up")
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit",
            "burst", "64kb", "latency", "100ms")
    return addrs


def _cleanup(names: tuple[str, str]) -> None:
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _run_job(job: str, world: int, names: tuple[str, str], addrs: tuple[str, str], repeats: int) -> dict[str, Any]:
    """Start ``world`` ranks, the first half in namespace A, the rest in B; rank 0's JSON."""
    procs = []
    per_ns = world // 2
    for rank in range(world):
        ns = names[rank // per_ns]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": f"{ns}-v", "MASTER_ADDR": addrs[0], "MASTER_PORT": str(PORT),
               "RANK": str(rank), "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, __file__, "--worker", job, "--repeats", str(repeats)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"a {job} rank failed ({p.returncode}): {err.strip().splitlines()[-1:]}")
    return json.loads(outs[0][0])


def _worker(job: str, repeats: int) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()

    def timed(fn: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        mine = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the makespan over the ranks
        return float(mine)

    out: dict[str, Any] = {}
    if job == "pair":
        for n in SIZES:
            x = torch.ones(n // 4)
            dist.all_reduce(x)  # warm-up (TCP slow start, gloo's buffers)
            out[str(n)] = [timed(lambda x=x: dist.all_reduce(x)) for _ in range(repeats)]
    else:
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        mine = groups[rank % 2]
        x = torch.ones(CONCURRENT_BYTES // 4)
        dist.all_reduce(x, group=mine)

        def alone() -> None:
            if rank % 2 == 0:
                dist.all_reduce(x, group=mine)

        out["alone"] = [timed(alone) for _ in range(repeats)]
        out["together"] = [timed(lambda: dist.all_reduce(x, group=mine)) for _ in range(repeats)]
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(out))


def _model(rate_mbit: int) -> Any:
    from cpdpkit.topology import Tier, TopologySpec

    tier = Tier(name="VETH", latency_s=25e-6, bandwidth_bytes_per_s=rate_mbit * 1e6 / 8)
    return TopologySpec(name="veth", tiers=(Tier(name="LOCAL_NS", latency_s=1e-6, bandwidth_bytes_per_s=1e10), tier),
                    intra_node_tier="LOCAL_NS", inter_node_tier="VETH", ranks_per_node=None, nodes_per_site=2)


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate-mbit", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.repeats)
        return {}
    from cpdpkit.network import concurrent_time_s

    names = (f"cpdk{os.getpid()}a", f"cpdk{os.getpid()}b")
    rows = []
    try:
        addrs = _setup(names, args.rate_mbit)
        pair = _run_job("pair", 2, names, addrs, args.repeats)
        quad = _run_job("concurrent", 4, names, addrs, args.repeats)
    finally:
        _cleanup(names)
    left = [ns for ns in names if ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout]
    model2, model4 = _model(args.rate_mbit).place(2), _model(args.rate_mbit).place(4)
    for n in SIZES:
        modeled = model2.group([0, 1]).cost("all_reduce", n).time_s
        measured = statistics.median(pair[str(n)])
        rows.append({"case": f"all_reduce {n / 1e6:g} MB, 2 ranks", "kernel_ms": round(measured * 1e3, 1),
                     "modeled_ms": round(modeled * 1e3, 1), "kernel/model": round(measured / modeled, 3)})
    one = model4.group([0, 2]).cost("all_reduce", CONCURRENT_BYTES)
    alone, together = statistics.median(quad["alone"]), statistics.median(quad["together"])
    rows.append({"case": "two concurrent 4 MB all_reduces over one link / one alone",
                 "kernel_ratio": round(together / alone, 3),
                 "model_ratio": round(concurrent_time_s([one, one]) / one.time_s, 3),
                 "kernel_alone_ms": round(alone * 1e3, 1), "kernel_together_ms": round(together * 1e3, 1)})
    result = {"benchmark": "kernel_link_check", "rate_mbit": args.rate_mbit, "repeats": args.repeats,
              "loadavg": Path("/proc/loadavg").read_text().split()[:3], "rows": rows, "namespaces_left": left}
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
