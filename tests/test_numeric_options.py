"""Numeric options: NaN and infinities refused, world sizes bounded, ddp has no period, no empty optimizer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from cpdpkit.errors import ConfigError, TopologyError
from cpdpkit.sync import PeriodicSyncOptimizer, SyncConfig
from cpdpkit.topology import MAX_RANKS, resolve_topology

pytestmark = pytest.mark.timeout(120)
FINITE = "is not a finite number; pass a real value (NaN and infinities are refused)"


# Every case's command line through the console entry point in ONE fresh interpreter (one torch import,
# not one per case): each call's exit code and what it wrote to stderr, by case.
_DRIVER = """
import contextlib, io, json, sys
from cpdpkit.cli import main
out = []
for args in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(args)
            code = 0
        except SystemExit as exc:
            code = exc.code
    out.append({"returncode": code, "stderr": err.getvalue()})
print(json.dumps(out))
"""

REFUSALS = [
    (["bench", "--lr", "nan"], f"error: --lr nan {FINITE}"),
    (["bench", "--lr", "inf"], f"error: --lr inf {FINITE}"),
    (["bench", "--slowmo-lr", "nan"], f"error: --slowmo-lr nan {FINITE}"),
    (["bench", "sharding", "--lr", "-inf"], f"error: --lr -inf {FINITE}"),
    (["topology", "show", "cluster", "-n", "2147483646"],
     "error: world_size = 2147483646 is too large; set it to a whole number <= 1,048,576 (the most ranks cpdpkit "
     "plans or emulates: its work grows with the ranks)"),
    (["plan", "--model", "resnet50", "--world-size", "1073741824"],
     "error: world_size = 1073741824 is too large; set it to a whole number <= 1,048,576 (the most ranks cpdpkit "
     "plans or emulates: its work grows with the ranks)"),
    (["bench", "--seeds", "100000000"],  # the fuzzer's seed-26 hang: the runs were built before any check
     "error: --seeds 100000000 with these strategies, periods and topologies makes 1200000000 runs, more than "
     "10000: pass fewer --seeds, --strategies or --periods"),
]


@pytest.fixture(scope="module")
def refused() -> list[dict[str, object]]:
    proc = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps([args for args, _ in REFUSALS])],
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", range(len(REFUSALS)), ids=[line for _, line in REFUSALS])
def test_cli_refuses_in_one_line(refused: list[dict[str, object]], case: int) -> None:
    line, got = REFUSALS[case][1], refused[case]
    assert got["returncode"] == 2 and str(got["stderr"]).strip() == line, got


@pytest.mark.parametrize("field", ["slowmo_lr", "slowmo_momentum", "bucket_cap_mb", "timeout_s", "target_exposed_frac"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_sync_config_refuses_nonfinite(field: str, value: float) -> None:
    with pytest.raises(ConfigError) as info:
        SyncConfig(**{field: value})
    assert str(info.value) == f"{field} = {value!r} {FINITE}"


def test_a_topology_placing_more_than_max_ranks_is_refused() -> None:
    assert resolve_topology("cluster", world_size=MAX_RANKS).world_size == MAX_RANKS
    with pytest.raises(TopologyError):
        resolve_topology("cluster", world_size=MAX_RANKS + 8)


def test_ddp_has_no_period() -> None:
    assert SyncConfig(strategy="ddp").period == 1 and SyncConfig().period == 4
    assert SyncConfig(strategy="ddp", period=1).period == 1
    with pytest.raises(ConfigError) as info:
        SyncConfig(strategy="ddp", period=4)
    assert str(info.value) == ("period = 4 with strategy 'ddp': ddp all-reduces gradients every step and has no "
                               "period; leave period unset (or 1), or use strategy 'cpdp' for K steps")


def test_an_optimizer_without_parameters_is_refused() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ConfigError) as info:
        PeriodicSyncOptimizer(torch.optim.SGD([{"params": []}], lr=0.1), model=model)
    assert str(info.value) == ("the SGD optimizer holds no parameters: there is nothing to synchronise; pass one "
                               "built from the model, e.g. SGD(model.parameters(), ...)")
