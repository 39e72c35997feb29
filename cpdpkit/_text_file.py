"""One reader for the text files a user hands cpdpkit: bounded, UTF-8, and one line when it fails.

A topology TOML (:func:`cpdpkit.topology.load_topology`), a plan JSON
(:meth:`cpdpkit.planner.ShardingPlan.load`), a ``CPDPKIT_FAULTS`` TOML and an image folder's
annotations all come through :func:`read_text_file`: it reads at most ``max_bytes`` (so a wrong
path to a huge file or a device costs that much and no more) and raises the caller's error class
with the file's name, the reason and the fix.
"""

from __future__ import annotations

import os

from cpdpkit.errors import CpdpkitError

__all__ = ["read_text_file"]


def read_text_file(path: str | os.PathLike[str], *, what: str, max_bytes: int, error: type[CpdpkitError],
                   fix: str) -> str:
    """The UTF-8 text of ``path`` (``what``, e.g. ``"topology file"``, names it in errors).

    Raises ``error`` (one line) when the file cannot be read, holds more than ``max_bytes`` bytes, or
    is not UTF-8 (then ``fix`` says what to do about it).
    """
    name = f"{what} {os.fspath(path)!r}"
    try:
        with open(path, "rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        raise error(f"{name} cannot be read ({exc.strerror or exc}); check the path") from None
    if len(data) > max_bytes:
        raise error(f"{name} is over {max_bytes:,} bytes, the most a {what} may hold; check the path") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{name} is not UTF-8 text (byte {exc.start}: {exc.reason}); {fix}") from None
