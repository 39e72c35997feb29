"""``RankTrace.rows_of`` and ``launch_rows`` (byte-table row selection) against a plain scan of
the columns, for few and many distinct names (one, several and too many 256-name pages)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from _trace_builder import GLOO, annotation, cpu_op, kernel, launch, step, trace_doc, write_trace
from cpdpkit.profiler import load_trace

pytestmark = pytest.mark.timeout(60)


def _events(num_names: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    events = [step(1, 0, 5000), step(2, 5000, 5000)]
    for i in range(3000):
        k = rng.randrange(num_names)
        pick = rng.randrange(6)
        if pick == 0:
            events.append(kernel(f"gemm_{k}", i, 1, stream=rng.choice([0, 7, 20, -5]), corr=i))
        elif pick == 1:
            events.append(kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", i, 1, stream=20, corr=i))
        elif pick == 2:
            events.append(launch(i, corr=rng.choice([i, -1, 0])))
        elif pick == 3:
            events.append(annotation("gloo:all_reduce", i, 2, tid=GLOO))
        elif pick == 4:
            events.append(cpu_op("c10d::allreduce_", i, 1))
        else:
            events.append(cpu_op(f"aten::op_{k}", i, 1))
    return events


@pytest.mark.parametrize("num_names", [10, 300, 2100])
def test_rows_of_matches_a_plain_scan(tmp_path: Path, num_names: int) -> None:
    trace = load_trace(write_trace(tmp_path / "rank0.json", trace_doc(_events(num_names, num_names))))
    assert len(trace.names) > min(num_names, 260)
    classes = [trace.name_classes[n] for n in trace.name_id]
    names = [trace.names[n] for n in trace.name_id]
    rows = range(trace.num_events)
    gpu = [s != -1 for s in trace.stream]  # stream -5 is a GPU stream too: only -1 is the CPU

    def plain(gpu_roles: set[str], cpu_roles: set[str], steps: bool = False) -> list[int]:
        def cpu_pick(r: int) -> bool:
            return classes[r].cpu_role in cpu_roles or (steps and names[r].startswith("ProfilerStep#"))
        return [r for r in rows if (classes[r].gpu_role in gpu_roles if gpu[r] else cpu_pick(r))]

    for gpu_roles, cpu_roles, steps in [({"gpu_compute"}, set(), False), ({"gpu_comm"}, set(), False),
                                        (set(), {"backend"}, False), (set(), {"callsite", "cpu"}, False),
                                        (set(), set(), True), ({"gpu_comm", "gpu_compute"}, {"backend"}, True)]:
        got = trace.rows_of(gpu_roles=gpu_roles, cpu_roles=cpu_roles, steps=steps)
        assert got == plain(gpu_roles, cpu_roles, steps), (gpu_roles, cpu_roles, steps)
        assert got or not plain(gpu_roles, cpu_roles, steps)
    assert trace.rows_of() == []
    assert trace.launch_rows() == [r for r in rows if not gpu[r] and trace.correlation[r] >= 0]
