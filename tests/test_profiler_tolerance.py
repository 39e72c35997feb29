"""What real traces contain: both NCCL kernel-name schemes, copies/sets/syncs on the GPU streams,
ranks from the file name or run.json, and the layouts of several torch versions."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from _trace_builder import cpu_scenario, kernel, launch, step, trace_doc, write_trace
from cpdpkit.profiler import analyze, analyze_trace, canonical_kind, load_trace
from cpdpkit.profiler.classify import classify_name
from cpdpkit.profiler.trace import rank_from_file_name

pytestmark = pytest.mark.timeout(60)

HTA_DATA = Path(__file__).resolve().parent / "data" / "hta"


@pytest.mark.parametrize("name,kind", [
    ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)", "all_reduce"),
    ("ncclKernel_Broadcast_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", "broadcast"),
    ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", "send_recv"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", "all_reduce"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all_gather"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "reduce_scatter"),
    ("ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "broadcast"),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "send_recv"),
    ("ncclAllReduceRingLLKernel_sum_f32(CollectiveArgs)", "all_reduce"),  # NCCL 2.7
    ("ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)", "other"),  # kind from the arguments only
])
def test_both_nccl_kernel_schemes(name: str, kind: str) -> None:
    c = classify_name(name)
    assert c.gpu_role == "gpu_comm" and c.kind == kind
    assert canonical_kind(name) == kind


@pytest.mark.parametrize("name", ["Memcpy DtoH (Device -> Pageable)", "Memcpy HtoD (Pinned -> Device)",
                                  "Memset (Device)", "Stream Wait Event", "Event Sync", "Context Sync",
                                  "cudaDeviceSynchronize"])
def test_copies_sets_and_syncs_are_not_compute_by_name(name: str) -> None:
    assert classify_name(name).gpu_role != "gpu_compute"


def _gpu(name: str, cat: str, ts: float, dur: float, stream: int = 7) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"stream": stream, "device": 0}}


def test_gpu_trace_with_both_schemes_copies_and_syncs(tmp_path: Path) -> None:
    """compute 0-100 only; comm 50-250 (two schemes), copies/sets/syncs everywhere else."""
    doc = trace_doc([
        kernel("void at::native::vectorized_elementwise_kernel<4>", 0, 100),
        kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 50, 100, stream=20),
        kernel("ncclKernel_Broadcast_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", 150, 50, stream=20),
        kernel("ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)", 200, 50, stream=20,
               **{"Collective name": "allgather"}),
        _gpu("Memcpy DtoH (Device -> Pageable)", "gpu_memcpy", 100, 100),
        _gpu("Memset (Device)", "gpu_memset", 120, 30),
        _gpu("Stream Wait Event", "cuda_sync", 150, 50),
        _gpu("Event Sync", "cuda_sync", 200, 10),
        _gpu("copy engine transfer", "gpu_memcpy", 200, 50, stream=9),  # no Memcpy in its name: the category says
    ])
    r = analyze_trace(load_trace(write_trace(tmp_path / "rank0.json", doc)))
    assert r.mode == "gpu"
    assert (r.compute_us, r.comm_us, r.hidden_us, r.exposed_us) == (100, 200, 50, 150)
    assert r.overlap_pct == 25.0
    assert {k: v.comm_us for k, v in r.by_kind.items()} == {"all_reduce": 100, "broadcast": 50, "all_gather": 50}


@pytest.mark.parametrize("name,rank", [
    ("rank3.json", 3), ("rank-3.json.gz", 3), ("rank_3.pt.trace.json", 3), ("job_rank_3_17.pt.trace.json", 3),
    ("host-a_Rank12.1700000000.pt.trace.json", 12), ("worker3.pt.trace.json", 3), ("worker_3.json", 3),
    ("host_1234.1700000000123.pt.trace.json", None), ("trace.json", None),
])
def test_rank_from_file_name(name: str, rank: int | None) -> None:
    assert rank_from_file_name(f"/runs/x/{name}") == rank


def _without_rank(doc: dict) -> dict:
    doc = copy.deepcopy(doc)
    del doc["distributedInfo"]
    return doc


def test_rank_from_run_json_map_file_name_and_trace(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_trace(run / "host_a.pt.trace.json", _without_rank(cpu_scenario()))   # run.json: 2
    write_trace(run / "rank0.json", _without_rank(cpu_scenario()))            # run.json beats the name: 1
    traced = cpu_scenario(0)
    traced["distributedInfo"]["world_size"] = 3
    write_trace(run / "worker9.json", traced)                                 # distributedInfo beats the name: 0
    (run / "run.json").write_text(json.dumps({"world_size": 3, "ranks": {"host_a.pt.trace.json": 2,
                                                                           "rank0.json": 1}}))
    report = analyze([run])
    assert report.errors == ()
    (r,) = report.runs
    assert [(k.rank, Path(k.path).name) for k in r.ranks] == [(0, "worker9.json"), (1, "rank0.json"),
                                                              (2, "host_a.pt.trace.json")]


def test_rank_fallback_takes_the_smallest_free_rank(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_trace(run / "a.json", _without_rank(cpu_scenario()))
    old_style = cpu_scenario()
    old_style["distributedInfo"] = {"rank": 0}  # old torch: no world size
    write_trace(run / "b.json", old_style)
    write_trace(run / "c.json", _without_rank(cpu_scenario()))
    report = analyze([run])
    assert report.errors == ()
    assert [(k.rank, Path(k.path).name) for k in report.runs[0].ranks] == [(0, "b.json"), (1, "a.json"),
                                                                           (2, "c.json")]


def _gpu_scenario() -> dict:
    """Two steps of 1000 us on a GPU trace: kernels launched from the CPU (correlation ids)."""
    events: list[dict[str, Any]] = []
    for n in (0, 1):
        t = 1000 * n
        events += [step(n, t, 1000), launch(t + 10, 10 * n + 1), launch(t + 20, 10 * n + 2),
                   kernel("void gemm_kernel", t + 100, 500, corr=10 * n + 1),
                   kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", t + 400, 400, stream=20, corr=10 * n + 2)]
    return trace_doc(events)


def _variant(doc: dict, *, info: str, ts: str, base: bool) -> dict:
    """The layouts of torch versions: distributedInfo full/old-style/none, ts int/float, baseTimeNanoseconds."""
    doc = copy.deepcopy(doc)
    if info == "old":
        doc["distributedInfo"] = {"rank": 0}
    elif info == "none":
        del doc["distributedInfo"]
    offset = 4458676522690 if base else 0  # µs since baseTimeNanoseconds, as torch >= 2.1 writes them
    for e in doc["traceEvents"]:
        if "ts" in e:
            e["ts"] = float(e["ts"] + offset) if ts == "float" else int(e["ts"] + offset)
            if "dur" in e:
                e["dur"] = float(e["dur"]) if ts == "float" else int(e["dur"])
    if base:
        doc["baseTimeNanoseconds"] = 1711964646000000000
    return doc


@pytest.mark.parametrize("scenario", [cpu_scenario, _gpu_scenario], ids=["cpu", "gpu"])
def test_torch_version_layouts_give_the_same_answer(tmp_path: Path, scenario: Any) -> None:
    results = []
    for info in ("full", "old", "none"):
        for ts in ("int", "float"):
            for base in (True, False):
                path = write_trace(tmp_path / f"{info}-{ts}-{base}" / "rank0.json",
                                   _variant(scenario(), info=info, ts=ts, base=base))
                trace = load_trace(path)
                assert trace.rank == 0
                d = analyze_trace(trace).to_dict()
                d.pop("path")
                groups = d.pop("by_process_group")  # from distributedInfo.pg_config: only the full layout has it
                assert (set(groups) == {"0"}) == (info == "full")
                results.append(d)
    assert all(d == results[0] for d in results[1:])
    assert results[0]["comm_us"] > 0 and len(results[0]["steps"]) == 2


def test_torch_18_category_names(tmp_path: Path) -> None:
    doc = cpu_scenario()
    for e in doc["traceEvents"]:
        if e.get("cat") == "cpu_op":
            e["cat"] = "Operator"
    old = analyze_trace(load_trace(write_trace(tmp_path / "old.json", doc)))
    new = analyze_trace(load_trace(write_trace(tmp_path / "new.json", cpu_scenario())))
    assert (old.exposed_us, old.hidden_us, old.compute_us) == (new.exposed_us, new.hidden_us, new.compute_us)


def test_fixture_layouts_differ_and_load() -> None:
    """The public fixtures are two torch versions: float ts and baseTimeNanoseconds (2024), int ts (2023)."""
    newer = load_trace(HTA_DATA / "nccl_2rank" / "rank-0.json.gz")
    older = load_trace(HTA_DATA / "sampled_128rank" / "rank-1.json.gz")
    assert "baseTimeNanoseconds" in newer.meta and "baseTimeNanoseconds" not in older.meta
    assert (newer.rank, older.rank) == (0, 1)
    assert older.meta["distributedInfo"] == {"backend": "nccl", "rank": 1, "world_size": 128}
