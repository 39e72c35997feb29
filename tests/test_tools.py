"""The developer tools in tools/: the layering checker, the docs' table renderer, the fixture builder.

tools/ is not a package (its scripts are run as ``python tools/NAME.py``), so the modules are
loaded from their files; the command-line contract (exit code, one line per violation) is
checked through a subprocess.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from cpdpkit.bench.periodic.report import aggregate

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"


def _tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_tools_{name}", TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=50, cwd=ROOT)


# ---- tools/check_layers.py ----------------------------------------------------------------------
def test_layering_holds_on_the_repository() -> None:
    check_layers = _tool("check_layers")
    found, num_modules, _ = check_layers.check(ROOT)
    assert [v.format(ROOT) for v in found] == []
    assert num_modules > 40  # it did read the tree


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


CLEAN_TREE = {
    "cpdpkit/__init__.py": "",
    "cpdpkit/errors.py": "class CpdpkitError(Exception):\n    pass\n",
    "cpdpkit/labels.py": "",
    "cpdpkit/network.py": "from cpdpkit.errors import CpdpkitError\n",
    "cpdpkit/topology.py": "from cpdpkit.labels import *\nfrom cpdpkit.network import CpdpkitError\n",
    "cpdpkit/sync/__init__.py": "import torch\n\nfrom cpdpkit.topology import CpdpkitError\n",
    "cpdpkit/cli/__init__.py": "def main():\n    from cpdpkit.sync import torch\n",
    "profiler/__init__.py": "from cpdpkit.topology import CpdpkitError\nfrom . import report\n",
    "profiler/report.py": "import json\n",
}


def test_layering_checker_passes_a_clean_tree(tmp_path: Path) -> None:
    _write(tmp_path, CLEAN_TREE)
    done = _run(str(TOOLS / "check_layers.py"), "--root", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("check_layers: ok")


def test_layering_checker_reports_each_violation_and_exits_1(tmp_path: Path) -> None:
    _write(tmp_path, {
        **CLEAN_TREE,
        # upward, inside a function: still a dependency
        "cpdpkit/topology.py": "from cpdpkit.network import CpdpkitError\n\n\ndef f():\n    import cpdpkit.sync\n",
        # torch at module level in a torch-free module
        "cpdpkit/network.py": "import torch\n",
        # the profiler importing above its allowance, and torch inside a function
        "profiler/report.py": "from cpdpkit.sync import x\n\n\ndef g():\n    import torch.nn\n",
        # a torch-free module reaching torch through another module's import
        "cpdpkit/cli/__init__.py": "from cpdpkit.sync import torch\n",
        # a module outside every layer
        "cpdpkit/stray.py": "",
    })
    done = _run(str(TOOLS / "check_layers.py"), "--root", str(tmp_path))
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert lines == [
        "cpdpkit/cli/__init__.py:1: from cpdpkit.sync import torch: torch-free (transitive): importing cpdpkit.cli "
        "imports torch: cpdpkit.cli -> cpdpkit.sync -> torch; move this import into the function that needs it",
        "cpdpkit/network.py:1: import torch: torch-free: cpdpkit.network must not import torch at module level "
        "(import it inside the function that needs it)",
        "cpdpkit/stray.py:1: (module cpdpkit.stray): unassigned: this module is in no layer; "
        "add it to COMPONENTS in tools/check_layers.py",
        "cpdpkit/topology.py:5: import cpdpkit.sync: layering: topology (layer 2) must not import sync (layer 3): "
        "dependencies point down (the layers are in tools/check_layers.py)",
        "profiler/report.py:1: from cpdpkit.sync import x: profiler: cpdpkit.profiler imports only cpdpkit.errors, "
        "cpdpkit.labels, cpdpkit.network, cpdpkit.topology and itself, not sync",
        "profiler/report.py:1: from cpdpkit.sync import x: torch-free (transitive): importing cpdpkit.profiler.report "
        "imports torch: cpdpkit.profiler.report -> cpdpkit.sync -> torch; move this import into the function "
        "that needs it",
        "profiler/report.py:5: import torch.nn: torch-free: cpdpkit.profiler never imports torch, "
        "not even inside a function",
    ]
    assert "7 violation(s)" in done.stderr


# ---- tools/docs_tables.py ---------------------------------------------------------------------
def _seed_run(strategy: str, period: int | None, *, acc: float, wall: float, exposed: float, nbytes: float,
              colls: float) -> dict:
    """One run's result as a launched bench worker hands it to cpdpkit.bench.periodic.report.aggregate."""
    return {"spec": {"strategy": strategy, "period": period, "seed": 0}, "status": "ok", "reason": None,
            "peak_test_acc": acc, "final_test_acc": acc - 0.005, "wall_s": wall, "step_s": wall / 500,
            "exposed_sync_s_per_step": exposed, "bytes_per_step": nbytes, "collectives_per_step": colls,
            "harness_total_s": 5.0, "curve": [{"epoch": 1, "wall_s": wall / 2, "test_acc": acc - 0.1},
                                              {"epoch": 2, "wall_s": wall, "test_acc": acc}]}


def _bench_json(tmp_path: Path) -> Path:
    config = {"strategies": ["ddp", "cpdp", "localsgd-torch"], "periods": [4], "model": "char-mlp",
              "dataset": "stdlib-text", "data_dir": None, "epochs": 2, "batch_size": 128, "lr": 0.1, "momentum": 0.9,
              "slowmo_momentum": 0.0,
              "world_size": 2, "topology": "wan", "seeds": 1, "quick": False, "profile_dir": None}
    runs = [_seed_run("ddp", None, acc=0.975, wall=10.0, exposed=0.018, nbytes=153_100.0, colls=1.0),
            _seed_run("localsgd-torch", 4, acc=0.97, wall=3.0, exposed=0.0045, nbytes=38_275.0, colls=0.25),
            _seed_run("cpdp", 4, acc=0.98, wall=5.0, exposed=0.009, nbytes=76_550.0, colls=0.5),
            {"spec": {"strategy": "slowmo", "period": 4, "seed": 0}, "status": "failed", "reason": "rank 1: boom"}]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(aggregate(config, runs).to_dict()))  # the schema cpdpkit bench --json writes
    return path


def test_docs_tables_renders_the_bench_table_and_goals(tmp_path: Path) -> None:
    docs_tables = _tool("docs_tables")
    text, report = docs_tables.render(_bench_json(tmp_path))
    assert docs_tables.kind_of(report) == "main"
    lines = text.splitlines()
    assert lines[0] == "### char-mlp on stdlib-text, 2 ranks, topology wan, lr 0.1, 2 epochs, 1 seed(s)"
    assert lines[2].startswith("`cpdpkit bench --strategies ddp,cpdp,localsgd-torch --periods 4 --epochs 2 --json ")
    assert ("| strategy | status | peak acc % | final acc % | Δ pp | wall s | Δ wall % | step ms | exposed ms/step "
            "| coll/step | KB/step | max KB/step | harness s |") in lines
    rows = [line for line in lines if line.startswith("| ") and (" ok | " in line or " failed | " in line)]
    assert rows == [
        "| ddp | ok | 97.50±0.00 | 97.00 | +0.00 | 10.00±0.00 | +0.0 | 20.00 | 18.00 | 1.00 | 153.1 | - | 5.0 |",
        "| localsgd-torch K=4 | ok | 97.00±0.00 | 96.50 | -0.50 | 3.00±0.00 | -70.0 | 6.00 | 4.50 | 0.25 | 38.3 "
        "| - | 5.0 |",  # max KB/step: "-" for results from before it was recorded
        "| cpdp K=4 | ok | 98.00±0.00 | 97.50 | +0.50 | 5.00±0.00 | -50.0 | 10.00 | 9.00 | 0.50 | 76.5 | - | 5.0 |",
        "| slowmo K=4 | failed | - | - | - | - | - | - | - | - | - | - | - |",
    ]
    assert "| `cpdp` K=4 wall clock <= 0.80 × `ddp` | 5.00 s / 10.00 s = 0.50× | met |" in lines
    assert "| `cpdp` K=4 exposed sync per step <= 0.5 × `ddp` | 9.00 / 18.00 ms = 0.500× | met |" in lines
    assert "| `cpdp` accuracy >= `localsgd-torch` at the same K | K=4: 98.00 vs 97.00 % | met |" in lines


def test_docs_tables_command_line_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")  # the tools extra; `make setup` installs it
    path, png, out = _bench_json(tmp_path), tmp_path / "acc.png", tmp_path / "table.md"
    done = _run(str(TOOLS / "docs_tables.py"), str(path), "--plot", str(png), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "| cpdp K=4 | ok |" in out.read_text()


def test_docs_tables_reads_what_cpdpkit_bench_quick_writes() -> None:
    # tests/data/bench_quick.json: `cpdpkit bench --quick --json` (python tools/build_fixtures.py --bench-quick)
    docs_tables = _tool("docs_tables")
    text, _ = docs_tables.render(ROOT / "tests" / "data" / "bench_quick.json")
    assert "`cpdpkit bench --quick --json " in text
    labels = [line.split(" | ")[0][2:] for line in text.splitlines() if line.endswith("|") and " | ok | " in line]
    assert labels == ["ddp", "localsgd-torch K=4", "cpdp K=4"]


def test_docs_tables_renders_the_sharding_suite(tmp_path: Path) -> None:
    docs_tables = _tool("docs_tables")

    def result(strategy: str, step_ms: float, exposed_ms: float, state: int) -> dict:
        return {"strategy": strategy, "status": "ok", "reason": None, "step_s": step_ms / 1e3,
                "exposed_comm_s_per_step": exposed_ms / 1e3,
                "tier_bytes_per_step": {"IB": 1_730_000, "NVLINK": 5_040_000},
                "optimizer_state_bytes_per_rank": state, "peak_mem_bytes": 139_000_000, "final_loss": 5.399612}

    report = {"config": {"strategies": ["hsdp", "two-stage"], "model": "gpt-tiny", "world_size": 4,
                         "topology": "cluster-slow-ib", "steps": 10, "warmup_steps": 2, "batch_size": 4, "lr": 0.003,
                         "optimizer": "adamw", "seed": 0, "memory_budget": None, "max_grad_norm": None,
                         "profile_dir": None, "ranks_per_node": 2, "num_replicas": 2,
                         "plan": {"strategy": "hsdp-node+state", "mesh": [2, 2]}},
              "results": [result("hsdp", 124.9, 68.2, 3_451_904),
                          {**result("two-stage", 73.2, 35.4, 1_725_952), "stage1_units": 2.5,
                           "stage1_units_predicted": 3, "num_units": 5}],
              "goals": {"two-stage": {"stage1": {"measured": 2.5, "predicted": 3, "num_units": 5, "abs_diff": 0.5,
                                                 "target": 1.0, "min": 1.0, "met": True},
                                      "optimizer_state": {"bytes": 1_725_952, "target": 1_725_952.0, "ratio": 1.0,
                                                          "met": True}}}}
    path = tmp_path / "sharding.json"
    path.write_text(json.dumps(report))
    text, _ = docs_tables.render(path)
    lines = text.splitlines()
    assert lines[2].startswith("`cpdpkit bench sharding --strategies hsdp,two-stage --json ")
    assert "| hsdp | ok | 124.9 | 68.2 | 1.73 | 5.04 | 3.452 | 139 | 5.399612 | - |" in lines
    assert "| two-stage | ok | 73.2 | 35.4 | 1.73 | 5.04 | 1.726 | 139 | 5.399612 | 2.50 / 3 of 5 |" in lines
    # the goals exactly as `cpdpkit bench sharding` prints them, partial blocks included
    assert ("two-stage optimizer state 1725952 B/rank = x1.000 of hsdp's / replicas (1725952; target <= 1) met"
            in lines)
    assert ("two-stage stage-1 exchanges per step: measured 2.50 vs predicted 3 of 5 (target >= 1, |diff| <= 1) met"
            in lines)


def test_docs_tables_skips_other_json(tmp_path: Path) -> None:
    (tmp_path / "plan.json").write_text(json.dumps({"plan": {}, "summary": {}}))
    done = _run(str(TOOLS / "docs_tables.py"), str(tmp_path / "plan.json"))
    assert done.returncode == 1
    assert "not a cpdpkit bench result" in done.stderr


# ---- tools/build_fixtures.py and tools/docs_cli.py --------------------------------------------
def test_fixtures_are_built_and_intact() -> None:
    build_fixtures = _tool("build_fixtures")
    assert build_fixtures.check_hta(ROOT / "tests" / "data") == []


def test_docs_cli_has_a_section_per_command() -> None:
    done = _run(str(TOOLS / "docs_cli.py"), "--stdout")
    assert done.returncode == 0, done.stderr
    for command in ("cpdpkit launch", "cpdpkit profile", "cpdpkit plan", "cpdpkit topology show", "cpdpkit bench"):
        assert f"## `{command}`" in done.stdout
