"""Trace capture: file names in torch-tb-profiler's layout, run.json, steps the profiler reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cpdpkit.profiler import analyze
from cpdpkit.tracing import default_schedule, trace_file_name, trace_rank, write_run_json

pytestmark = pytest.mark.timeout(60)


def _work(n: int = 3, prof=None) -> None:  # type: ignore[no-untyped-def]
    a = torch.randn(64, 64)
    for _ in range(n):
        a = torch.mm(a, a).tanh()
        if prof is not None:
            prof.step()


def test_whole_block_with_steps_and_run_json(tmp_path: Path) -> None:
    with trace_rank(tmp_path, run_info={"strategy": "ddp", "period": 1}) as prof:
        _work(3, prof)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.pt.trace.json", "run.json"]
    info = json.loads((tmp_path / "run.json").read_text())
    assert info == {"strategy": "ddp", "period": 1, "world_size": 1}
    (run,) = analyze([tmp_path]).runs
    assert run.name == "ddp" and [s.step for s in run.ranks[0].steps][:3] == [0, 1, 2]
    assert run.ranks[0].steps[-1].partial  # the step left open at exit


def test_schedule_gzip_and_worker_name(tmp_path: Path) -> None:
    with trace_rank(tmp_path, worker_name="w7", schedule=default_schedule(wait=1, warmup=1, active=2),
                    gzip=True) as prof:
        _work(6, prof)
    assert [p.name for p in tmp_path.iterdir()] == ["w7.pt.trace.json.gz"]
    (run,) = analyze([tmp_path]).runs
    assert [s.step for s in run.ranks[0].steps] == [2, 3]
    assert trace_file_name("w", cycle=2) == "w.2.pt.trace.json"


def test_write_run_json_merges(tmp_path: Path) -> None:
    write_run_json(tmp_path, strategy="cpdp", period=4)
    write_run_json(tmp_path, topology="2x2-wan")
    assert json.loads((tmp_path / "run.json").read_text()) == {"strategy": "cpdp", "period": 4, "topology": "2x2-wan"}


def test_bad_worker_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="plain file-name stem"):
        with trace_rank(tmp_path, worker_name="a/b"):
            pass


def test_active_profiler_is_the_open_blocks_and_reset_on_exit(tmp_path: Path) -> None:
    import threading

    import cpdpkit.launch
    from cpdpkit.tracing import active_profiler

    assert cpdpkit.launch.active_profiler is active_profiler  # the launcher's name is a re-export
    assert active_profiler() is None
    seen_in_thread = []
    with trace_rank(tmp_path / "a") as prof:
        assert active_profiler() is prof
        worker = threading.Thread(target=lambda: seen_in_thread.append(active_profiler()))
        worker.start()
        worker.join()
        _work(2, active_profiler())
    assert active_profiler() is None
    assert seen_in_thread == [None]  # a thread starts from an empty context: steps belong to the block's thread
    with pytest.raises(RuntimeError, match="boom"):
        with trace_rank(tmp_path / "b"):
            raise RuntimeError("boom")
    assert active_profiler() is None
    (run,) = analyze([tmp_path / "a"]).runs
    assert [s.step for s in run.ranks[0].steps][:2] == [0, 1]
