"""Builders for small synthetic Kineto (Chrome-trace) files used by the profiler tests."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

PID = 100
TRAIN = 100  # training thread id
GLOO = 201  # a pt_gloo_runloop thread


def cpu_op(name: str, ts: float, dur: float, tid: int = TRAIN, **args: Any) -> dict:
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": PID, "tid": tid, "ts": ts, "dur": dur,
            "args": {"External id": 1, **args}}


def annotation(name: str, ts: float, dur: float, tid: int = TRAIN) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": PID, "tid": tid, "ts": ts, "dur": dur,
            "args": {}}


def step(n: int, ts: float, dur: float) -> dict:
    return annotation(f"ProfilerStep#{n}", ts, dur)


def kernel(name: str, ts: float, dur: float, stream: int = 7, corr: int | None = None, **args: Any) -> dict:
    a: dict[str, Any] = {"stream": stream, "device": 0, **args}
    if corr is not None:
        a["correlation"] = corr
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur, "args": a}


def launch(ts: float, corr: int, dur: float = 5.0) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": PID, "tid": TRAIN,
            "ts": ts, "dur": dur, "args": {"correlation": corr}}


def thread_name(tid: int, name: str) -> dict:
    return {"ph": "M", "name": "thread_name", "pid": PID, "tid": tid, "ts": 0, "args": {"name": name}}


def trace_doc(events: list[dict], *, rank: int = 0, world_size: int = 2,
              pg_config: list[dict] | None = None) -> dict:
    pgs = pg_config if pg_config is not None else [
        {"pg_name": "0", "pg_desc": "default_pg", "backend_config": "cpu:gloo", "pg_size": world_size,
         "ranks": list(range(world_size))}]
    return {
        "schemaVersion": 1,
        "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": world_size, "pg_count": len(pgs),
                            "pg_config": pgs},
        "traceEvents": [thread_name(TRAIN, "thread 100 (python)"), thread_name(GLOO, "thread 201 (pt_gloo_runloop)"),
                        *events],
        "traceName": "synthetic",
    }


def write_trace(path: Path, doc: dict | list | str | bytes, *, gz: bool | None = None) -> Path:
    """Write ``doc`` (an object, or raw text/bytes) as ``path``; gzip when the name ends in .gz."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(doc, bytes):
        data = doc
    elif isinstance(doc, str):
        data = doc.encode()
    else:
        data = json.dumps(doc, indent=1).encode()
    if gz if gz is not None else path.name.endswith(".gz"):
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


def cpu_scenario(rank: int = 0) -> dict:
    """Two steps of 1000 us on a CPU trace with a known answer.

    step 0 [0, 1000]: all_reduce issued at 0 (call site 0-10), gloo op 10-400 on the gloo
      thread, compute 10-300 (one op), wait gap 300-400 (collective completes at 400),
      compute 400-1000. comm = 0-400; exposed = 0-10 (call site) + 300-400 (wait) = 110,
      hidden = 10-300 = 290.
    step 1 [1000, 2000]: broadcast 1000-1010 call site, gloo op 1010-1100 fully under
      compute 1010-2000 (ops 1010-1500 and 1505-1990; the 5 us gap and the 10 us before the
      step ends are overhead, compute). comm = 1000-1100 (100); exposed 10, hidden 90.
    """
    return trace_doc([
        step(0, 0, 1000),
        cpu_op("c10d::allreduce_", 0, 10),
        annotation("gloo:all_reduce", 10, 390, tid=GLOO),
        cpu_op("aten::mm", 10, 290),
        cpu_op("aten::add", 400, 600),
        step(1, 1000, 1000),
        cpu_op("c10d::broadcast_", 1000, 10),
        annotation("gloo:broadcast", 1010, 90, tid=GLOO),
        cpu_op("aten::mm", 1010, 490),
        cpu_op("aten::mm", 1505, 485),
    ], rank=rank)
