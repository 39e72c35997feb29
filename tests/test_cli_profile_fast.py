"""``cpdpkit profile``'s fast entry (no typer, no rich) against the typer command it stands in for.

A plain ``cpdpkit profile ...`` runs through :mod:`cpdpkit.cli._fast_profile`; ``--help`` and
mistyped options go to typer. The two must accept the same options and print, write and
exit the same; and the fast entry, as a process, must not load typer, rich or torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from _trace_builder import cpu_op, cpu_scenario, step, trace_doc, write_trace
from cpdpkit.cli import app, main
from cpdpkit.cli._fast_profile import FLAG_OPTIONS, VALUE_OPTIONS, parse_profile_args

pytestmark = pytest.mark.timeout(120)


def _run(folder: Path, strategy: str, exposed_us: float, world: int = 2) -> Path:
    for rank in range(world):
        events = []
        for n in (0, 1):
            t = n * 1000
            events += [step(n, t, 1000), cpu_op("c10d::allreduce_", t, exposed_us + 10 * rank),
                       cpu_op("aten::mm", t + exposed_us + 10 * rank, 1000 - exposed_us - 10 * rank)]
        write_trace(folder / f"rank{rank}.pt.trace.json", trace_doc(events, rank=rank, world_size=world))
    (folder / "run.json").write_text(json.dumps({"strategy": strategy}))
    return folder


def test_the_same_options_as_the_typer_command():
    command = typer.main.get_command(app).commands["profile"]
    flags = {opt for p in command.params if getattr(p, "is_flag", False) for opt in p.opts}
    values = {opt for p in command.params if p.param_type_name == "option" and not p.is_flag for opt in p.opts}
    assert flags == set(FLAG_OPTIONS) and values == set(VALUE_OPTIONS)
    fields = {p.name for p in command.params}
    assert set(FLAG_OPTIONS.values()) | set(VALUE_OPTIONS.values()) | {"run_dirs"} == fields


def test_parsing_follows_click():
    debug, args = parse_profile_args(["--debug", "profile", "a", "--json=o.json", "--baseline", "x", "b",
                                      "--baseline", "y", "--per-step", "--", "--c"])
    assert debug and args.run_dirs == (Path("a"), Path("b"), Path("--c"))
    assert args.json_path == Path("o.json") and args.baseline == "y" and args.per_step and args.plot is None
    for handed_to_typer in (["profile"], ["profile", "a", "--help"], ["profile", "a", "--nope"],
                            ["profile", "a", "--json"], ["plan", "a"], ["--debug"], []):
        assert parse_profile_args(handed_to_typer) is None, handed_to_typer


def _both(capsys: pytest.CaptureFixture[str], args: list[str], tmp_path: Path) -> list[tuple[int, str, str, object]]:
    """(exit code, stdout, stderr, JSON written) through main() (the fast entry) and through typer."""
    results = []
    for entry in ("fast", "typer"):
        out = tmp_path / f"{entry}.json"
        argv = ["profile", *args, "--json", str(out)]
        if entry == "fast":
            assert parse_profile_args(argv) is not None
            with pytest.raises(SystemExit) as exit_info:
                main(argv)
            captured = capsys.readouterr()
            code, stdout, stderr = exit_info.value.code, captured.out, captured.err
        else:
            result = CliRunner().invoke(app, argv)
            code, stdout, stderr = result.exit_code, result.stdout, result.stderr
        written = json.loads(out.read_text()) if out.exists() else None
        results.append((code, stdout, stderr, written))
    return results


@pytest.mark.parametrize("case", ["plain", "regression", "bad-input", "bad-option-value"])
def test_fast_entry_prints_writes_and_exits_like_typer(case, capsys, tmp_path):
    old = _run(tmp_path / "old", "ddp", 100)
    new = _run(tmp_path / "new", "ddp", 300)
    args = {
        "plain": [str(new), str(old), "--per-step", "--baseline", "ddp"],
        "regression": [str(new), "--baseline", str(old), "--max-regression", "10%"],
        "bad-input": [str(old), str(tmp_path / "missing")],
        "bad-option-value": [str(old), "--max-regression", "ten"],
    }[case]
    fast, slow = _both(capsys, args, tmp_path)
    assert fast == slow
    code, stdout, stderr, written = fast
    if case == "plain":
        assert code == 0 and "Per step" in stdout and stderr == "" and written["errors"] == []
    elif case == "regression":
        assert code == 1 and stderr.startswith("regression: exposed communication per step of run ddp")
    elif case == "bad-input":
        assert code == 2 and stderr == f"error: {tmp_path / 'missing'}: no such file or folder\n"
        assert [r["name"] for r in written["runs"]] == ["ddp"]
    else:
        assert code == 2 and written is None and stdout == ""
        assert stderr == ("error: --max-regression 'ten' is not a percentage >= 0; pass one such as 10 (exit 1 "
                          "when exposed communication per step grows by more than 10 %)\n")


def test_the_fast_entry_loads_neither_typer_nor_rich_nor_torch_nor_numpy(tmp_path):
    run = tmp_path / "ddp"
    for rank in (0, 1):
        write_trace(run / f"rank{rank}.pt.trace.json", cpu_scenario(rank))
    code = ("import sys; from cpdpkit.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as exc:\n    code = exc.code\n"
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'typer', 'click', 'rich', 'torch', 'numpy'})\n"
            "print('exit', code, 'heavy', heavy, file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code, "profile", str(run), "--json", str(tmp_path / "p.json")],
                          capture_output=True, text=True, timeout=60)
    assert proc.stderr.strip().splitlines()[-1] == "exit 0 heavy []", proc.stderr
    assert "Communication per step" in proc.stdout
    assert json.loads((tmp_path / "p.json").read_text())["runs"][0]["name"] == "ddp"
