"""What the pipeline costs around training, on the local profile: with running servers against the embedded default.

In one run, each mode in a fresh TRAINPIPE_HOME (so each shards, preflights and trains from scratch):
1. ephemeral: `trainpipe run -p local` with no servers (Prefect's embedded server starts and stops inside the
   command; MLflow writes to its SQLite file);
2. servers: `trainpipe up` first (not timed), then the same command, which uses the running Prefect and MLflow
   servers.

Training time is the successful attempt's steps: from the first step's start to the final commit
(`steps_s` in the run summary). Everything else in the command's wall time is orchestration: server start,
sharding, preflight, torchrun and rank start-up, validation, reporting. Printed per mode as seconds and as a
share of the wall time, and the servers mode's non-training time as a ratio against the embedded default's.

    .venv/bin/python benchmarks/orchestration_overhead.py [--steps 600] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def trainpipe(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "trainpipe"), *args], capture_output=True, text=True, env=env, cwd=ROOT)


def run_mode(mode: str, steps: int, keep: bool) -> dict[str, float]:
    home = Path(tempfile.mkdtemp(prefix=f"tp-orch-{mode}-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(TRAINPIPE_HOME=str(home / "home"), PREFECT_HOME=str(home / "prefect"))
    try:
        if mode == "servers":
            up = trainpipe("up", "--prefect-port", "4391", "--mlflow-port", "5391", env=env)
            if up.returncode:
                raise SystemExit(f"trainpipe up failed: {up.stderr[-2000:]}")
        t0 = time.monotonic()
        proc = trainpipe("run", "-p", "local", "--set", f"train.steps={steps}", "--json", env=env)
        wall = time.monotonic() - t0
        if proc.returncode:
            raise SystemExit(f"{mode}: trainpipe run failed: {proc.stderr[-3000:]}")
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        return {"wall_s": wall, "flow_s": summary["wall_s"], "steps_s": summary["steps_s"]}
    finally:
        if mode == "servers":
            trainpipe("down", env=env)
        if not keep:
            shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=600, help="train.steps (the local profile's own is 600)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary homes")
    args = ap.parse_args()
    results = {mode: run_mode(mode, args.steps, args.keep) for mode in ("ephemeral", "servers")}
    print(f"local profile, {args.steps} steps, 2 gloo ranks on {os.cpu_count()} cores")
    print(f"{'mode':<10} {'wall s':>8} {'steps s':>8} {'other s':>8} {'other %':>8} {'outside flow s':>15}")
    for mode, r in results.items():
        other = r["wall_s"] - r["steps_s"]
        print(
            f"{mode:<10} {r['wall_s']:8.1f} {r['steps_s']:8.1f} {other:8.1f} {other / r['wall_s']:8.1%} "
            f"{r['wall_s'] - r['flow_s']:15.1f}"
        )
    e, s = results["ephemeral"], results["servers"]
    ratio = (s["wall_s"] - s["steps_s"]) / (e["wall_s"] - e["steps_s"])
    print(f"non-training time with running servers / with the embedded default: {ratio:.2f}")


if __name__ == "__main__":
    main()
