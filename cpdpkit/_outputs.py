"""Output paths, checked before any work and written atomically: ``--json``, ``--plot``, ``--profile``.

:func:`check_output_file` runs before a command starts its work (a benchmark, a plan, reading
traces) and fails in one line when the path could not be written at the end: its folder cannot be
created, a file cannot be created in it (tried, then removed: ``os.access`` says yes to root even on
``/proc``), the path is a folder or a symbolic link, or it is one of the command's inputs (the same
file, or a file a run folder given as input would read as a trace). :func:`write_output` writes
into a temporary file beside the target and renames it into place (``os.replace``), so a reader
never sees half a file and a failed write leaves the old one. A symbolic link as the output is
refused rather than followed or replaced: which of the two the user meant cannot be known.
:func:`check_output_dir` does the same for folders (``--profile DIR``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from cpdpkit.errors import ConfigError

__all__ = ["PLOT_SUFFIXES", "check_output_file", "check_output_dir", "write_output"]

# The formats matplotlib's Agg backend writes without extra software (pgf needs LaTeX): a ``--plot`` path
# must end in one, since the format is read from the name (the temporary file keeps the suffix).
PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".svgz", ".eps", ".ps", ".jpg", ".jpeg", ".tif", ".tiff", ".webp")

Inputs = Iterable["str | os.PathLike[str] | None"]


def _is_trace_name(name: str) -> bool:  # the profiler's rule for the files of a run folder (profiler/runs.py)
    return (name.endswith((".json", ".json.gz")) and not name.startswith(".") and name != "run.json")


def _same(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _clashes(path: Path, inputs: Inputs, option: str) -> None:
    target = path.resolve()
    for given in inputs:
        if given is None or not Path(given).exists():  # a preset's name, not a file
            continue
        source = Path(given)
        if _same(path, source) or target == source.resolve():
            raise ConfigError(f"{option} {str(path)!r} is also an input of this command: writing it would "
                              "overwrite what is read; pass another output path")
        if source.is_dir() and target.parent == source.resolve() and _is_trace_name(path.name):
            raise ConfigError(f"{option} {str(path)!r} is inside the run folder {str(source)!r}, where the profiler "
                              "reads every *.json as a trace: write it elsewhere")


def check_output_file(path: str | os.PathLike[str] | None, option: str, *, inputs: Inputs = (),
                      suffixes: tuple[str, ...] | None = None) -> Path | None:
    """Before any work: ``path`` can be written (its folder made), is no symlink, folder or input, and ends in
    one of ``suffixes`` when given; else one line."""
    if path is None:
        return None
    out = Path(path)
    if suffixes is not None and out.suffix.lower() not in suffixes:
        got = f"ends in {out.suffix!r}" if out.suffix else "has no suffix"
        raise ConfigError(f"{option} {str(path)!r} {got}, which names no format it can be written in; end it in "
                          f"one of {', '.join(suffixes)} (e.g. {str(out.with_suffix(suffixes[0]))!r})")
    if out.is_symlink():
        raise ConfigError(f"{option} {str(path)!r} is a symbolic link (to {os.readlink(out)!r}): pass the file it "
                          "points to, or remove the link; outputs are never written through a link")
    if out.is_dir():
        raise ConfigError(f"{option} {str(path)!r} is a folder; pass a file name such as {str(out / 'out.json')!r}")
    _clashes(out, inputs, option)
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{out.name}.", suffix=".check"):
            pass
    except OSError as exc:
        raise ConfigError(f"{option} {str(path)!r} cannot be written ({exc.strerror or exc} in {str(parent)!r}); "
                          "pass a path in a writable folder") from None
    if out.exists() and not os.access(out, os.W_OK):
        raise ConfigError(f"{option} {str(path)!r} is read-only; pass another path or make it writable")
    return out


def check_output_dir(path: str | os.PathLike[str] | None, option: str, *, inputs: Inputs = (),
                     keep: bool = True) -> Path | None:
    """Before any work: ``path`` is (or can be made) a folder a file can be created in; else one line. With
    ``keep=False`` the folders it had to make are removed again (for a writer that makes them itself after checks
    of its own, which then leave nothing behind)."""
    if path is None:
        return None
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{option} {str(path)!r} is a file; pass a folder (it is created if missing)")
    for given in inputs:
        if given is not None and _same(out, Path(given)):
            raise ConfigError(f"{option} {str(path)!r} is also an input of this command; pass another folder")
    made = [] if keep else [d for d in (out, *out.parents) if not d.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".cpdpkit-", suffix=".check"):
            pass
    except OSError as exc:
        raise ConfigError(f"{option} {str(path)!r} cannot be written ({exc.strerror or exc}); pass a writable "
                          "folder") from None
    finally:
        for d in made:  # innermost first; the run that writes there creates it again
            try:
                d.rmdir()
            except OSError:
                break
    return out


def write_output(path: str | os.PathLike[str], data: bytes | Callable[[Path], None], option: str) -> None:
    """Write ``data`` (bytes, or ``data(tmp_path)`` writes it) to a temporary file beside ``path``, then rename."""
    out = Path(path)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=f".tmp{out.suffix}")  # keeps .png
    try:
        umask = os.umask(0o022)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would outlive the rename
        with os.fdopen(fd, "wb") as fh:
            if isinstance(data, bytes):
                fh.write(data)
        if not isinstance(data, bytes):
            data(Path(tmp))
        os.replace(tmp, out)
    except OSError as exc:
        raise ConfigError(f"{option} {str(path)!r} cannot be written ({exc.strerror or exc}); check the path and "
                          "the free space") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
