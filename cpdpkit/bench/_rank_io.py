"""The files a bench run folder holds, and how a launched rank hands its result back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = ["SPEC_FILE", "RESULT_FILE", "PROGRESS_FILE", "finish_rank"]

SPEC_FILE, RESULT_FILE, PROGRESS_FILE = "spec.json", "result.json", "progress.jsonl"


def finish_rank(run_dir: Path, rank: int, result: dict[str, Any]) -> None:
    """Rank 0 writes ``run_dir/result.json``; every rank then leaves the process group cleanly."""
    if rank == 0:
        (run_dir / RESULT_FILE).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()
