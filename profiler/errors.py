"""The profiler's error type: one line that names the file and what is wrong with it."""

from __future__ import annotations

import os

from cpdpkit.errors import TraceError  # torch-free: cpdpkit.errors imports nothing

__all__ = ["TraceError", "TraceFileError"]


class TraceFileError(TraceError):
    """A trace file or folder cannot be read; ``str()`` is ``"<path>: <problem>"``."""

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path = os.fspath(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")
