"""From a rank's SIGKILL to the first step of the resumed attempt, measured from outside, against a cold start.

Each round runs `trainpipe run` on the local profile (100 steps, a checkpoint every 20, no preflight), sends
SIGKILL to a random rank at a random moment after the first commit, and reads the run's summary: the resumed
attempt's first step (its first beacon's wall clock) minus the moment the signal was sent is the recovery;
its parts are the incident chain's (detection, the policy's decision, the new attempt's start). Each round runs
twice, in alternating order: with the warm host (the default: the retry's agent is forked with torch imported,
docs/architecture.md §4) and with ``cluster.warm_host=false`` (the retry starts a cold interpreter), the
baseline. Printed: each round, the medians, the ratio of warm to cold recovery, the first attempt's cold start,
and the warm recovery against issue 27's 2 s target.

With ``--launcher slurm`` (root, Debian's slurm-wlm and munge), the runs go to a one-node Slurm cluster started
here (``tests/slurm_cluster.py``): warm, the retry runs in the run's allocation, whose host stayed up; cold
(``cluster.warm_host=false``), each attempt is a new sbatch job.

With ``--tier memory`` the runs also snapshot into host memory every step (``checkpoint.memory_every_steps``,
trainer.checkpoint.memory_tier), and each round says which tier the retry resumed from: the memory tier where
its host kept it (warm: the run's attempts, or the held Slurm job's host), the store where the attempt came
up on a new host (cold under Slurm: a new job). The target for a resume from memory is 1 s (issue 42).
``--tier memory`` takes DCP snapshots (``checkpoint.memory_snapshot: dcp``), ``--tier flash`` flash ones
(trainer.checkpoint.flash).

    .venv/bin/python benchmarks/recovery_time.py [--rounds 3] [--launcher local|slurm] [--tier store|memory|flash]
        [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
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
TARGETS_S = {"store": 2.0, "memory": 1.0, "flash": 1.0}
SETS = ["train.steps=100", "checkpoint.every_steps=20", "train.eval_every=50", "preflight.enabled=false"]


def ranks(run_pid: int, home: Path | None = None) -> list[psutil.Process]:
    """The rank processes (named ``trainpipe-r{RANK}`` by torchrun's agent) under the ``trainpipe run`` process
    ``run_pid`` (a rank forked by a warm host carries that host's command line, not the run's) or, with ``home``,
    under the Slurm job's host supervisors of runs in that TRAINPIPE_HOME."""
    roots = [run_pid]
    if home is not None:
        roots = [
            p.pid
            for p in psutil.process_iter(["cmdline"])
            if "--serve" in (p.info["cmdline"] or []) and str(home) in " ".join(p.info["cmdline"])
        ]
    family = []
    for root in roots:
        with contextlib.suppress(psutil.Error):
            family += psutil.Process(root).children(recursive=True)
    found = []
    for p in family:
        with contextlib.suppress(psutil.Error):
            if p.name().startswith("trainpipe-r"):
                found.append(p)
    return found


def one_round(home: Path, name: str, warm: bool, launcher: dict[str, str] | None, tier: str) -> dict[str, float]:
    sets = [*SETS, f"cluster.warm_host={str(warm).lower()}"] + (["launcher.kind=slurm"] if launcher else [])
    sets += ["checkpoint.memory_every_steps=1"] if tier in ("memory", "flash") else []
    sets += [f"checkpoint.memory_snapshot={'flash' if tier == 'flash' else 'dcp'}"] if tier != "store" else []
    args = [a for item in sets for a in ("--set", item)]
    env = {**os.environ, "TRAINPIPE_HOME": str(home), **(launcher or {})}
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
    victims = ranks(proc.pid, home if launcher else None)
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
        "kill_to_detected_s": chain["detected_at"] - killed_at,
        "decision_s": chain["decision_s"] or 0.0,
        "resume_s": chain["resume_s"] or 0.0,
        "cold_start_s": cold,
        "from_memory": float(chain.get("resumed_tier") in ("memory", "peer")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--launcher", choices=("local", "slurm"), default="local")
    parser.add_argument("--tier", choices=tuple(TARGETS_S), default="store", help="memory, flash: snapshots too")
    parser.add_argument("--keep", action="store_true", help="keep the temporary TRAINPIPE_HOME")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="tp-recovery-")) / "home"
    rows: dict[str, list[dict[str, float]]] = {"warm": [], "cold": []}
    with contextlib.ExitStack() as stack:
        launcher = None
        if args.launcher == "slurm":
            sys.path.insert(0, str(ROOT))
            from tests import slurm_cluster

            if why := slurm_cluster.available():
                raise SystemExit(f"--launcher slurm: {why}")
            cluster = stack.enter_context(slurm_cluster.cluster(home.parent / "slurm"))
            launcher = {"SLURM_CONF": cluster.env["SLURM_CONF"]}
        run_rounds(home, args, rows, launcher)
    if not args.keep:
        shutil.rmtree(home.parent, ignore_errors=True)
    report(args, rows)


def run_rounds(home: Path, args: argparse.Namespace, rows: dict, launcher: dict[str, str] | None) -> None:
    for i in range(args.rounds):
        for variant in ("warm", "cold") if i % 2 == 0 else ("cold", "warm"):
            row = one_round(home, f"recovery-{variant}-{i}", variant == "warm", launcher, args.tier)
            rows[variant].append(row)
            print(
                f"round {i + 1} {variant}: SIGKILL to the first resumed step {row['recovery_s']:.2f} s (detected "
                f"{row['kill_to_detected_s']:.2f} s after the signal, {row['detection_s']:.2f} after the rank's last "
                f"beacon; decision {row['decision_s']:.2f}, new attempt to its first step "
                f"{row['resume_s']:.2f}); first attempt's cold start {row['cold_start_s']:.2f} s; resumed from "
                f"{'host memory' if row['from_memory'] else 'the store'}",
                flush=True,
            )


def report(args: argparse.Namespace, rows: dict) -> None:
    med = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in rows.items()}
    print(f"\nmedians over {args.rounds} rounds ({args.launcher} launcher, {args.tier} tier):")
    for v in ("warm", "cold"):
        m = med[v]
        print(
            f"  {v}: recovery {m['recovery_s']:.2f} s (new attempt to its first step {m['resume_s']:.2f} s), "
            f"first attempt's cold start {m['cold_start_s']:.2f} s; "
            f"{sum(r['from_memory'] for r in rows[v]):.0f} of {len(rows[v])} resumed from host memory"
        )
    print(f"  ratio warm/cold recovery: {med['warm']['recovery_s'] / med['cold']['recovery_s']:.2f}")
    target = TARGETS_S[args.tier]
    verdict = "meets" if med["warm"]["recovery_s"] <= target else "misses"
    print(f"  warm recovery {med['warm']['recovery_s']:.2f} s {verdict} the {target:.0f} s target ({args.tier} tier)")


if __name__ == "__main__":
    main()
