"""From a rank's SIGKILL to the first step of the resumed attempt, measured from outside, against a cold start.

Each round runs `trainpipe run` on the local profile (100 steps, a checkpoint every 20, no preflight), sends
SIGKILL to a random rank at a random moment after the first commit, and reads the run's summary: the resumed
attempt's first step (its first beacon's wall clock) minus the moment the signal was sent is the recovery;
its parts are the incident chain's (detection, the policy's decision, the new attempt's start). The baseline,
measured in the same run, is the first attempt's cold start: from its launch to its first step. Printed: each
round, the medians, the ratio of recovery to cold start, and the recovery against issue 27's 2 s target.

    .venv/bin/python benchmarks/recovery_time.py [--rounds 3] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TARGET_S = 2.0
SETS = ["train.steps=100", "checkpoint.every_steps=20", "train.eval_every=50", "preflight.enabled=false"]


def ranks(marker: str) -> list[psutil.Process]:
    """The rank processes (named ``trainpipe-r{RANK}`` by torchrun's agent) of the run whose store is ``marker``."""
    found = []
    for p in psutil.process_iter(["name", "cmdline"]):
        if (p.info["name"] or "").startswith("trainpipe-r") and marker in " ".join(p.info["cmdline"] or []):
            found.append(p)
    return found


def one_round(home: Path, name: str) -> dict[str, float]:
    args = [a for item in SETS for a in ("--set", item)]
    env = {**os.environ, "TRAINPIPE_HOME": str(home)}
    proc = subprocess.Popen(
        [str(BIN / "trainpipe"), "run", "-p", "local", *args, "--run-name", name, "--json"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    committed = home / "store" / "runs" / name / "checkpoints" / "step-00000020" / "trainpipe.json"
    deadline = time.monotonic() + 300
    while not committed.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{name}: no first commit: {proc.communicate()[1][-2000:]}")
        time.sleep(0.05)
    time.sleep(random.uniform(0, 1.0))
    victims = ranks(str(home))
    if not victims:
        raise SystemExit(f"{name}: no rank to kill")
    killed_at = time.time()
    random.choice(victims).send_signal(signal.SIGKILL)
    out, err = proc.communicate(timeout=600)
    if proc.returncode:
        raise SystemExit(f"{name}: the run failed: {err[-2000:]}")
    summary = json.loads(out.strip().splitlines()[-1])
    [chain] = [c for c in summary["incident_chains"] if c["kind"] == "crash"]
    cold = summary["badput"]["attempts"][0]["startup"]
    return {
        "recovery_s": chain["resumed_at"] - killed_at,
        "detection_s": chain["detection_s"] or 0.0,
        "decision_s": chain["decision_s"] or 0.0,
        "resume_s": chain["resume_s"] or 0.0,
        "cold_start_s": cold,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the temporary TRAINPIPE_HOME")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="tp-recovery-")) / "home"
    rows = []
    try:
        for i in range(args.rounds):
            row = one_round(home, f"recovery-{i}")
            rows.append(row)
            print(
                f"round {i + 1}: SIGKILL to the first resumed step {row['recovery_s']:.2f} s (detection "
                f"{row['detection_s']:.2f}, decision {row['decision_s']:.2f}, new attempt to its first step "
                f"{row['resume_s']:.2f}); cold start {row['cold_start_s']:.2f} s",
                flush=True,
            )
    finally:
        if not args.keep:
            shutil.rmtree(home.parent, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"\nmedians over {args.rounds} rounds: recovery {med['recovery_s']:.2f} s, cold start ", end="")
    print(f"{med['cold_start_s']:.2f} s")
    print(f"  ratio recovery/cold start: {med['recovery_s'] / med['cold_start_s']:.2f}")
    verdict = "meets" if med["recovery_s"] <= TARGET_S else "misses"
    print(f"  recovery {med['recovery_s']:.2f} s {verdict} the {TARGET_S:.0f} s target")


if __name__ == "__main__":
    main()
