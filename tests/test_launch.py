"""``cpdpkit launch`` and ``cpdpkit topology``: end to end on 2 ranks, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cpdpkit.cli import app
from cpdpkit.emulator.env import TOPOLOGY_ENV, topology_from_env
from cpdpkit.errors import ConfigError, LaunchError, TopologyError
from cpdpkit.launch import LaunchConfig, launch, torchrun_args
from cpdpkit.topology import preset

TINY = str(Path(__file__).parent / "data" / "launch_tiny.py")
runner = CliRunner()


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [str(Path(sys.executable).with_name("cpdpkit")), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=150, env={**os.environ, "COLUMNS": "200"})


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_launch_wan_profile_writes_traces_and_run_json(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _cli("launch", "--nproc-per-node", "2", "--topology", "wan", "--profile", str(out), TINY, "--steps", "2")
    assert proc.returncode == 0, proc.stderr
    assert "rank=0 world=2 backend=emu topology=wan sum=4 args=['--steps', '2']" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["rank0.pt.trace.json", "rank1.pt.trace.json", "run.json"]
    info = json.loads((out / "run.json").read_text())
    assert info["topology"] == "wan" and info["world_size"] == 2
    assert info["topology_config"]["world_size"] == 2
    trace = json.loads((out / "rank0.pt.trace.json").read_text())
    emu = [e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("cpdpkit::emu::all_reduce[")]
    assert len(emu) == 2 and "tier=WAN,ranks=0-1" in emu[0]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_launch_failing_rank_gives_one_line_and_traceback_tail(tmp_path: Path) -> None:
    result = launch(LaunchConfig(nproc_per_node=2, topology="lan", log_dir=str(tmp_path / "logs")), TINY,
                    ["--fail-rank", "1"])
    assert not result.ok and result.exit_code == 1 and result.failed_rank == 1
    assert result.error == "rank 1 failed (exit code 1): ValueError: rank 1 was told to fail"
    assert result.traceback_tail[0].strip().startswith(f'File "{TINY}"')
    assert result.traceback_tail[-1].strip() == "ValueError: rank 1 was told to fail"
    assert json.loads(json.dumps(result.to_dict()))["failed_rank"] == 1


def test_torchrun_args_use_a_free_port_by_default() -> None:
    args = torchrun_args(LaunchConfig(nproc_per_node=2, topology="wan"), "s.py", ["--x", "1"], log_dir="/tmp/l")
    assert "--standalone" in args and not any(a.startswith("--master-port") for a in args)
    assert args[-4:] == ["--", "s.py", "--x", "1"]
    multi = torchrun_args(LaunchConfig(nproc_per_node=8, nnodes="2", rdzv_backend="c10d", rdzv_endpoint="h:29400",
                                       rdzv_id="job"), "s.py", [], log_dir="/tmp/l")
    assert {"--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=h:29400", "--rdzv-id=job"} <= set(multi)
    assert "--standalone" not in multi


def test_a_placed_topology_is_passed_on_not_resolved_again() -> None:
    placed = preset("wan", world_size=4)
    config = LaunchConfig(nproc_per_node=4, topology=placed, profile_dir="/tmp/p")
    assert config.resolve_topology() is placed and config.topology_name == "wan"
    assert '"topology": "wan"' in torchrun_args(config, "s.py", [], log_dir="/tmp/l")[-3]  # run.json names it
    with pytest.raises(TopologyError, match=r"^topology 'wan' places 4 ranks .* but the world size is 2; "):
        LaunchConfig(nproc_per_node=2, topology=placed).resolve_topology()


def test_topology_env_is_read_in_one_place(tmp_path: Path) -> None:
    assert topology_from_env({}, world_size=2) is None
    assert topology_from_env({TOPOLOGY_ENV: " "}, world_size=2) is None
    assert topology_from_env({TOPOLOGY_ENV: "wan"}, world_size=2) == preset("wan", world_size=2)
    path = tmp_path / "t.toml"
    path.write_text(preset("cluster", world_size=4).to_toml())
    assert topology_from_env({TOPOLOGY_ENV: str(path)}, world_size=4) == preset("cluster", world_size=4)


def test_launch_bad_input_raises_before_starting(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="script 'missing.py' does not exist; pass the path of a Python file"):
        launch(LaunchConfig(nproc_per_node=2), "missing.py")
    with pytest.raises(TopologyError, match="needs a world size divisible by 2"):
        launch(LaunchConfig(nproc_per_node=3, topology="wan"), TINY)
    with pytest.raises(ConfigError, match=r"nproc_per_node = 0 is invalid; use a whole number >= 1"):
        LaunchConfig(nproc_per_node=0)


@pytest.mark.parametrize(("args", "message"), [
    (["topology", "show", "moon"],
     "error: unknown topology preset 'moon'; use one of lan, wan, wan-variable, cluster, multisite, "
     "cluster-slow-ib, cluster-slower-ib or a path to a .toml file"),
    (["topology", "show", "wan", "--world-size", "3"],
     "error: topology 'wan' needs a world size divisible by 2 (2 site(s) x 1 node(s) x ? rank(s)); got 3; "
     "run a multiple of 2 ranks or use a TOML file"),
    (["launch", "--nproc-per-node", "2", "--topology", "moon", TINY],
     "error: unknown topology preset 'moon'; use one of lan, wan, wan-variable, cluster, multisite, "
     "cluster-slow-ib, cluster-slower-ib or a path to a .toml file"),
    (["launch", "--nproc-per-node", "2", "nope.py"],
     "error: script 'nope.py' does not exist; pass the path of a Python file"),
])
def test_cli_bad_input_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    result = runner.invoke(app, args, env={"COLUMNS": "300"})
    assert result.exit_code == 2
    assert result.stderr.strip() == message


def test_cli_bad_toml_field_is_one_line_and_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(preset("wan").to_toml().replace("latency_s", "latency_ms", 1))
    result = runner.invoke(app, ["topology", "show", str(path)], env={"COLUMNS": "300"})
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        f"error: {path} [tiers.LAN]: unknown key 'latency_ms'; use one of bandwidth_bytes_per_s, "
        "bandwidth_jitter_frac, collective_overhead_s, latency_jitter_frac, latency_s"
    )


def test_cli_topology_show_table_and_json() -> None:
    result = runner.invoke(app, ["topology", "show", "wan", "--world-size", "2"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "8.3 ms" in result.stdout and "1 Gbit/s" in result.stdout and "between sites" in result.stdout
    # all_reduce of the 4 MiB sample over the WAN: ring = 2*8.3 ms + 4194304 B / 125e6 B/s = 50.154 ms
    assert "all_reduce" in result.stdout and "50.154 ms" in result.stdout
    as_json = runner.invoke(app, ["topology", "show", "cluster", "-n", "4", "--json"])
    data = json.loads(as_json.stdout)
    assert data["ranks_per_node"] == 2 and data["world_size"] == 4


def test_init_distributed_emu_without_topology_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    from cpdpkit.emulator import init_distributed
    from cpdpkit.errors import DistributedSetupError

    monkeypatch.delenv(TOPOLOGY_ENV, raising=False)
    with pytest.raises(DistributedSetupError) as info:
        init_distributed(backend="emu", rank=0, world_size=1)
    assert str(info.value) == (
        "backend 'emu' needs a topology; set CPDPKIT_TOPOLOGY=wan (or a TOML path) or pass topology="
    )


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_launch_py_spy_records_every_rank(tmp_path: Path) -> None:
    result = launch(LaunchConfig(nproc_per_node=2, py_spy_dir=str(tmp_path / "spy"), log_dir=str(tmp_path / "logs")),
                    TINY, [])
    assert result.ok, result.error
    assert [Path(p).name for p in result.py_spy_files] == ["rank0.speedscope.json", "rank1.speedscope.json"]
    profile = json.loads(Path(result.py_spy_files[0]).read_text())
    assert "speedscope" in profile["$schema"]


def test_child_gives_the_script_the_active_profiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m cpdpkit._child --profile`` (what torchrun runs per rank), in-process on one rank."""
    from cpdpkit import _child
    from cpdpkit.tracing import active_profiler

    script = tmp_path / "steps.py"
    script.write_text(
        "import sys\n"
        "import torch\n"
        "from cpdpkit.launch import active_profiler\n"
        "prof = active_profiler()\n"
        "for _ in range(3):\n"
        "    torch.mm(torch.ones(8, 8), torch.ones(8, 8))\n"
        "    prof.step()\n"
        "open(sys.argv[1], 'w').write(type(prof).__name__)\n"
    )
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv(TOPOLOGY_ENV, raising=False)
    out, seen = tmp_path / "run", tmp_path / "seen.txt"
    assert _child.main(["--profile", str(out), "--run-info", '{"strategy": "ddp"}', "--", str(script), str(seen)]) == 0
    assert seen.read_text() == "profile"
    assert active_profiler() is None  # reset when the script's block closed
    assert sorted(p.name for p in out.iterdir()) == ["rank0.pt.trace.json", "run.json"]
    assert json.loads((out / "run.json").read_text())["launcher"] == "cpdpkit launch"
    assert '"ProfilerStep#2"' in (out / "rank0.pt.trace.json").read_text()
