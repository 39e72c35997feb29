"""Output paths are checked before any work, never overwrite an input, never follow a link, and land atomically."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from _trace_builder import cpu_op, step, trace_doc, write_trace
from cpdpkit._outputs import PLOT_SUFFIXES, check_output_dir, check_output_file, write_output
from cpdpkit.errors import ConfigError

pytestmark = pytest.mark.timeout(120)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from cpdpkit.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=100)


def _trace(path: Path) -> Path:
    return write_trace(path, trace_doc([step(0, 0, 1000), cpu_op("c10d::allreduce_", 0, 100)], world_size=1))


def test_profile_never_overwrites_its_input_trace(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.json")
    before = trace.read_bytes()
    proc = _cli("profile", str(trace), "--json", str(trace))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (f"error: --json {str(trace)!r} is also an input of this command: writing it would "
                                   "overwrite what is read; pass another output path")
    assert trace.read_bytes() == before


def test_an_output_that_is_a_link_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.json")
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    (tmp_path / "out.json").symlink_to(target)
    proc = _cli("profile", str(trace), "--json", str(tmp_path / "out.json"))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (f"error: --json {str(tmp_path / 'out.json')!r} is a symbolic link (to "
                                   f"{str(target)!r}): pass the file it points to, or remove the link; outputs are "
                                   "never written through a link")
    assert target.read_text() == "keep me"


def test_an_output_in_a_run_folder_would_be_read_as_a_trace(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _trace(run / "rank0.json")
    with pytest.raises(ConfigError) as info:
        check_output_file(run / "report.json", "--json", inputs=[run])
    assert str(info.value) == (f"--json {str(run / 'report.json')!r} is inside the run folder {str(run)!r}, where "
                               "the profiler reads every *.json as a trace: write it elsewhere")
    assert check_output_file(run / "plot.png", "--plot", inputs=[run]) == run / "plot.png"


@pytest.mark.parametrize(("command", "option"), [(["profile", "TRACE"], "--json"), (["profile", "TRACE"], "--plot"),
                                                 (["plan", "--model", "resnet50", "--world-size", "8"], "--json")])
def test_an_unwritable_output_fails_before_any_output(tmp_path: Path, command: list[str], option: str) -> None:
    args = [str(_trace(tmp_path / "t.json")) if a == "TRACE" else a for a in command]
    out = "/proc/cpdpkit-test/out." + ("png" if option == "--plot" else "json")
    proc = _cli(*args, option, out)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    line = proc.stderr.strip()
    assert line.startswith(f"error: {option} {out!r} cannot be") and "\n" not in line, line


def test_bench_refuses_an_unwritable_json_before_any_run(tmp_path: Path) -> None:
    proc = _cli("bench", "--quick", "--json", "/proc/x.json")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --json '/proc/x.json' cannot be written (")
    assert "ddp" not in proc.stdout  # no run started


@pytest.mark.parametrize("name", ["plot", "plot.tmp", "plot.json"])
def test_a_plot_path_must_name_an_image_format(tmp_path: Path, name: str) -> None:
    # matplotlib reads the format from the name: without a known suffix it failed after the work (issue 25)
    plot = tmp_path / name
    suffix = Path(name).suffix
    got = f"ends in {suffix!r}" if suffix else "has no suffix"
    assert_line = (f"--plot {str(plot)!r} {got}, which names no format it can be written in; end it in one of .png, "
                   ".pdf, .svg, .svgz, .eps, .ps, .jpg, .jpeg, .tif, .tiff, .webp "
                   f"(e.g. {str(plot.with_suffix('.png'))!r})")
    with pytest.raises(ConfigError) as info:
        check_output_file(plot, "--plot", suffixes=PLOT_SUFFIXES)
    assert str(info.value) == assert_line
    assert check_output_file(tmp_path / "PLOT.PNG", "--plot", suffixes=PLOT_SUFFIXES) == tmp_path / "PLOT.PNG"
    if name == "plot":  # the commands check it before reading a trace or starting a run
        for command in (["profile", str(_trace(tmp_path / "t.json"))], ["bench", "--quick"]):
            proc = _cli(*command, "--plot", str(plot))
            assert (proc.returncode, proc.stdout, proc.stderr.strip()) == (2, "", "error: " + assert_line)
    assert not plot.exists()


def test_bench_refuses_a_work_dir_that_is_a_file_before_any_run(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from cpdpkit.cli import app

    (tmp_path / "a-file").write_text("keep")
    for suite in ([], ["hybrid"], ["sharding"]):  # in one process: each would pay a torch import otherwise
        result = CliRunner().invoke(app, ["bench", *suite, "--quick", "--work-dir", str(tmp_path / "a-file")])
        assert (result.exit_code, result.stdout) == (2, ""), (suite, result.output)
        assert result.stderr.strip() == (f"error: --work-dir {str(tmp_path / 'a-file')!r} is a file; pass a folder "
                                         "(it is created if missing)")
    assert (tmp_path / "a-file").read_text() == "keep"


def test_write_output_is_atomic_and_keeps_the_old_file_on_failure(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    write_output(out, b"old", "--json")
    assert out.read_bytes() == b"old" and (out.stat().st_mode & 0o777) != 0o600

    def fails(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(ConfigError) as info:
        write_output(out, fails, "--json")
    assert str(info.value) == (f"--json {str(out)!r} cannot be written (No space left on device); check the path and "
                               "the free space")
    assert out.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_output_folders(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ConfigError) as info:
        check_output_dir(tmp_path / "a-file", "--profile")
    assert str(info.value) == (f"--profile {str(tmp_path / 'a-file')!r} is a file; pass a folder (it is created if "
                               "missing)")
    proc = _cli("launch", "--profile", str(tmp_path / "a-file"), str(tmp_path / "a-file"))
    assert proc.returncode == 2 and proc.stderr.strip().startswith(f"error: --profile {str(tmp_path / 'a-file')!r} is")
    assert check_output_dir(tmp_path / "new" / "dir", "--profile") == tmp_path / "new" / "dir"


def test_output_folder_check_can_leave_nothing_behind(tmp_path: Path) -> None:
    assert check_output_dir(tmp_path / "a" / "b", "--work-dir", keep=False) == tmp_path / "a" / "b"
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "there").mkdir()
    check_output_dir(tmp_path / "there", "--work-dir", keep=False)
    assert [p.name for p in tmp_path.iterdir()] == ["there"] and list((tmp_path / "there").iterdir()) == []
