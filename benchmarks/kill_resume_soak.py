"""Kill-and-resume soak: ranks SIGKILLed at random steps, ``cpdpkit launch --max-restarts`` resumes, bit-identical.

Each trial launches ``tests/data/restart_train.py`` (six setups side by side: ddp, localsgd, slowmo, cpdp,
cpdp with overlap_steps=3, TwoStageExecutor; each with its own ``Checkpointer``) through
:func:`cpdpkit.launch.launch` with ``max_restarts=3``. From the seed it draws the world size (of
``--world-sizes``), one to three kills, each a rank and a step (steps increasing: the i-th kill is in
attempt i, after the first setup's step, before that step's checkpoint), so every kill loses the steps
since the last checkpoint. A trial passes when torch elastic restarted exactly once per kill and every
rank's final parameters of every setup equal, bit for bit, those of an uninterrupted run of the same
world size (one per world size, run first)::

    python benchmarks/kill_resume_soak.py [--trials 20] [--seed 0] [--steps 24] [--every 4] [--world-sizes 2]
        [--json FILE]

Prints one JSON line per trial on stderr and the summary JSON on stdout after the ranks' own lines
(and to ``--json FILE``):
``{"trials", "bit_identical", "restarts_as_planned", "wall_s", "seed", "command", "runs": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from cpdpkit.launch import LaunchConfig, launch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "data" / "restart_train.py")


def _finals(folder: Path, world: int) -> list[dict]:
    return [torch.load(folder / f"final-rank{r}.pt", weights_only=True) for r in range(world)]


def _run(out: Path, world: int, args: argparse.Namespace, kills: list[tuple[int, int]]) -> tuple[object, float]:
    out.mkdir(parents=True)
    script_args = [str(out), "--steps", str(args.steps), "--every", str(args.every)]
    if kills:
        script_args += ["--kills", ",".join(f"{rank}:{step}" for rank, step in kills)]
    t0 = time.perf_counter()
    result = launch(LaunchConfig(nproc_per_node=world, max_restarts=3, log_dir=str(out / "logs")), SCRIPT, script_args)
    return result, time.perf_counter() - t0


def _identical(resumed: list[dict], clean: list[dict]) -> bool:
    for got, want in zip(resumed, clean):
        for setup, params in want["params"].items():
            if got["params"][setup].keys() != params.keys():
                return False
            if not all(torch.equal(got["params"][setup][name], value) for name, value in params.items()):
                return False
    return True


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--world-sizes", default="2", help="comma-separated world sizes to draw from (default 2)")
    parser.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.world_sizes.split(",")]
    draw = random.Random(args.seed)
    command = "python benchmarks/kill_resume_soak.py " + " ".join(argv)
    start = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory(prefix="cpdpkit-soak-") as tmp:
        clean: dict[int, list[dict]] = {}
        for world in sorted(set(worlds)):
            result, seconds = _run(Path(tmp) / f"clean-{world}", world, args, [])
            if not result.ok:
                print(f"the uninterrupted run of {world} ranks failed: {result.error}", file=sys.stderr)
                return 1
            clean[world] = _finals(Path(tmp) / f"clean-{world}", world)
            print(f"# uninterrupted, {world} ranks: {seconds:.1f} s", file=sys.stderr, flush=True)
        for trial in range(args.trials):
            world = draw.choice(worlds)
            steps = sorted(draw.sample(range(1, args.steps + 1), draw.randint(1, 3)))
            kills = [(draw.randrange(world), step) for step in steps]
            out = Path(tmp) / f"trial-{trial}"
            result, seconds = _run(out, world, args, kills)
            identical = result.ok and _identical(_finals(out, world), clean[world])
            run = {"trial": trial, "world_size": world, "kills": kills, "ok": result.ok, "restarts": result.restarts,
                   "bit_identical": identical, "seconds": round(seconds, 1),
                   **({} if result.ok else {"error": result.error})}
            runs.append(run)
            print(json.dumps(run), file=sys.stderr, flush=True)
    summary = {"trials": len(runs), "bit_identical": sum(r["bit_identical"] for r in runs),
               "restarts_as_planned": sum(r["restarts"] == len(r["kills"]) for r in runs),
               "kills": sum(len(r["kills"]) for r in runs), "wall_s": round(time.perf_counter() - start, 1),
               "seed": args.seed, "command": command.strip(), "runs": runs}
    print(json.dumps(summary, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if summary["bit_identical"] == summary["trials"] == summary["restarts_as_planned"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
