"""The detection table: for each fault class, how often the watchdog names the right culprit, how fast, and how
often it cries wolf on a healthy run.

On the local profile (gloo ranks on this machine), in one invocation:

- for each class, ``--trials`` attempts with a random rank and a random step:
  crash (SIGKILL from outside), hang (SIGSTOP from outside), compute straggler
  (drill ``slow``, 4x), slow link (drill ``slow_network``), data stall (drill
  ``slow_data``), loss spike (drill ``loss_spike``), flatline (``train.lr=1e-9``)
  and bitflip (drill ``bitflip``, on 4 replicas so that a majority exists);
- top-1 culprit accuracy: the incident names the faulty rank (slow link: the
  host; loss spike: the step; flatline: found at all);
- detection latency: in steps from the fault's step to the incident's (for
  crash and hang, in seconds from the signal to the incident; a hang's
  allowance is max(watchdog.hang_floor_s, hang_factor x median step));
- false alarms: findings per 1,000 healthy steps of one ``--healthy-steps``
  run with every check on.

    .venv/bin/python benchmarks/detection.py [--trials 3] [--healthy-steps 3000] [--seed 0]

The targets (issue 25): top-1 >= 0.95 for every class with a culprit; no false
alarm over 3,000 healthy steps; the slow classes within 2 straggler windows; a
hang within its allowance plus 5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainpipe.trainer.data.shard import shard_dataset
from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.profile_files import load_profile
from trainpipe.trainer.supervise.attempt import train_attempt

BASE = [
    "train.eval_every=0",
    "checkpoint.every_steps=1000",
    "tracking.enabled=false",
    "preflight.enabled=false",
    "train.steps=80",
    "watchdog.straggler_window=5",
]


@dataclass
class Trial:
    kind: str
    rank: int
    step: int
    found: Incident | None
    right: bool
    lag_steps: float | None  # from the fault's step to the incident's, in steps
    lag_s: float | None = None  # for the signals sent from outside: from the signal to the incident


class Signaller:
    """Sends ``sig`` to ``rank`` once it reports step ``step``: its pid comes from its own start beacon."""

    def __init__(self, rank: int, step: int, sig: int):
        self.rank, self.step, self.sig = rank, step, sig
        self.sent_at: float | None = None
        self._lock = threading.Lock()

    def __call__(self, progress: dict[int, dict]) -> None:
        p = progress.get(self.rank, {})
        with self._lock:
            if self.sent_at is None and p.get("step", -1) >= self.step and p.get("pid"):
                os.kill(int(p["pid"]), self.sig)
                self.sent_at = time.time()


def culprit_named(kind: str, found: Incident | None, rank: int, step: int) -> bool:
    if found is None:
        return False
    if kind == "slow_link":
        return found.kind == "network" and bool(found.node)
    if kind == "loss_spike":
        return found.kind == "loss_spike" and found.step == step
    if kind == "flatline":
        return found.kind == "flatline"
    expected = {"crash": "crash", "hang": "hang", "straggler": "straggler", "data_stall": "data_stall"}
    return found.kind == expected.get(kind, "sdc") and found.rank == rank


def first_of(outcome, kinds: tuple[str, ...]) -> Incident | None:
    candidates = [*([outcome.incident] if outcome.incident else []), *outcome.findings]
    return next((i for i in candidates if i.kind in kinds), candidates[0] if candidates else None)


CLASSES = {
    # class: (overrides for rank r at step s, the incident kinds it should produce)
    "crash": (lambda r, s: [], ("crash",)),
    "hang": (lambda r, s: [], ("hang",)),
    "straggler": (
        lambda r, s: ["faults.kind=slow", f"faults.rank={r}", f"faults.step={s}", "faults.factor=4"],
        ("straggler",),
    ),
    "slow_link": (lambda r, s: ["faults.kind=slow_network", f"faults.rank={r}", f"faults.step={s}"], ("network",)),
    "data_stall": (lambda r, s: ["faults.kind=slow_data", f"faults.rank={r}", f"faults.step={s}"], ("data_stall",)),
    "loss_spike": (
        lambda r, s: [
            "faults.kind=loss_spike",
            f"faults.rank={r}",
            f"faults.step={s}",
            "faults.factor=30",
            "watchdog.health_window=10",  # the default 50 steps would not be full before the fault
        ],
        ("loss_spike",),
    ),
    "flatline": (lambda r, s: ["train.lr=1e-9", "watchdog.flatline_steps=40"], ("flatline",)),
    "bitflip": (
        lambda r, s: [
            "faults.kind=bitflip",
            f"faults.rank={r}",
            f"faults.step={s}",
            "watchdog.sdc_every=5",
            "cluster.procs_per_node=4",
        ],
        ("sdc",),
    ),
}


def run_trial(kind: str, rng: random.Random, dataset_uri: str, n: int) -> Trial:
    world = 4 if kind == "bitflip" else 2
    rank, step = rng.randrange(world), rng.randint(20, 40)
    overrides, kinds = CLASSES[kind]
    prof = load_profile("local", [*BASE, *overrides(rank, step)])
    sig = {"crash": signal.SIGKILL, "hang": signal.SIGSTOP}.get(kind)
    signaller = Signaller(rank, step, sig) if sig else None
    out = train_attempt(prof, f"{kind}-{n}", dataset_uri, on_progress=signaller)
    found = first_of(out, kinds)
    lag_s = found.at - signaller.sent_at if found and signaller and signaller.sent_at else None
    fault_step = 40 if kind == "flatline" else step  # a flat loss is flat from the start: its window ends at 40
    lag_steps = found.step - fault_step if found and found.step is not None and not signaller else None
    return Trial(kind, rank, step, found, culprit_named(kind, found, rank, step), lag_steps, lag_s)


def healthy_run(dataset_uri: str, steps: int) -> tuple[int, list[Incident]]:
    prof = load_profile("local", [*BASE, f"train.steps={steps}", "checkpoint.every_steps=500"])
    out = train_attempt(prof, "healthy", dataset_uri)
    alarms = [*out.findings, *([out.incident] if out.incident else [])]
    return (out.result.final_step if out.result else 0), alarms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--healthy-steps", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--classes", default=",".join(CLASSES))
    args = p.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="trainpipe-bench-") as home:
        os.environ["TRAINPIPE_HOME"] = home
        prof = load_profile("local", BASE)
        dataset_uri = shard_dataset(prof.data, prof.store).uri
        rows = []
        for kind in args.classes.split(","):
            trials = [run_trial(kind, rng, dataset_uri, n) for n in range(args.trials)]
            lags = [t.lag_steps for t in trials if t.lag_steps is not None]
            secs = [t.lag_s for t in trials if t.lag_s is not None]
            row = {
                "class": kind,
                "trials": len(trials),
                "top1": round(sum(t.right for t in trials) / len(trials), 3),
                "lag_steps_median": round(statistics.median(lags), 1) if lags else None,
                "lag_s_median": round(statistics.median(secs), 2) if secs else None,
                "misses": [
                    f"rank {t.rank} step {t.step}: {t.found.line() if t.found else 'nothing found'}"
                    for t in trials
                    if not t.right
                ],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        healthy_steps, alarms = healthy_run(dataset_uri, args.healthy_steps) if args.healthy_steps else (0, [])
    print()
    print(f"{'class':<12} {'trials':>6} {'top-1':>6} {'lag (steps)':>12} {'lag (s)':>8}")
    for r in rows:
        lag = "-" if r["lag_steps_median"] is None else f"{r['lag_steps_median']:.1f}"
        secs = "-" if r["lag_s_median"] is None else f"{r['lag_s_median']:.2f}"
        print(f"{r['class']:<12} {r['trials']:>6} {r['top1']:>6.2f} {lag:>12} {secs:>8}")
    rate = 1000 * len(alarms) / healthy_steps if healthy_steps else float("nan")
    print(f"false alarms: {len(alarms)} in {healthy_steps} healthy steps ({rate:.2f} per 1,000 steps)")
    for a in alarms:
        print(f"  {a.line()}")


if __name__ == "__main__":
    main()
