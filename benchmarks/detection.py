"""Hang and crash detection latency, trainpipe vs plain torchrun + gloo, and the cost of watching.

In one run, on the local profile (2 gloo ranks):
1. trainpipe: SIGSTOP rank 1 mid-run -> the watchdog declares the hang, names the
   rank and tears the job down; SIGKILL rank 1 -> crash reported and torn down.
   Latency = from the signal to the job fully gone.
2. plain torchrun with default settings (gloo's 30-minute timeout, torchrun's
   defaults) running the same bare DDP loop: the same two signals; the wait for a
   hang is capped at --cap seconds and reported as "> cap".
3. Overhead: steady-state time per step with beacons + watchdog + straggler
   statistics against the same trainer with none, alternating rounds.

    .venv/bin/python benchmarks/detection.py [--cap 120] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil

from benchmarks.step_overhead import per_step_ms
from trainpipe.trainer.config import load_profile
from trainpipe.trainer.data.shard import shard_dataset
from trainpipe.trainer.protocol import SUPERVISED_ENV
from trainpipe.trainer.supervise.attempt import run_module, train_attempt
from trainpipe.trainer.supervise.job import run_job
from trainpipe.trainer.supervise.launch import AGENT, torchrun_command, worker_env


def find_rank(marker: str, module: str, rank: str, timeout: float = 120) -> psutil.Process:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in psutil.process_iter(["cmdline"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if f"-m {module}" in cmd and marker in cmd:
                try:
                    if p.environ().get("RANK") == rank:
                        return p
                except psutil.Error:
                    pass
        time.sleep(0.05)
    raise TimeoutError("worker not found")


def fault_after(marker: str, module: str, sig: int, delay_s: float, out: dict) -> None:
    victim = find_rank(marker, module, "1")
    time.sleep(delay_s)
    out["at"] = time.monotonic()
    victim.send_signal(sig)


def trainpipe_latency(profile, dataset_uri: str, sig: int, home: str, name: str) -> tuple[float, dict]:
    marks: dict = {}
    t = threading.Thread(target=fault_after, args=(home, "trainpipe.trainer", sig, 8.0, marks))
    t.start()
    run = train_attempt(profile, name, dataset_uri)
    gone = time.monotonic()
    t.join()
    found = run.incident  # what the user sees: the incident
    return gone - marks["at"], {"kind": found.kind, "rank": found.rank, "detail": found.detail}


def plain_latency(profile, dataset_uri: str, sig: int, home: str, cap: float) -> float | None:
    marks: dict = {}
    cmd = torchrun_command(
        profile,
        "benchmarks.bare_ddp",
        [
            "--profile",
            str(Path(home) / "bare.yaml"),
            "--dataset-uri",
            dataset_uri,
            "--out-dir",
            home,
        ],
    )
    cmd[cmd.index(AGENT)] = "torch.distributed.run"  # plain torchrun, not trainpipe's failure-reporting entry
    env = {k: v for k, v in worker_env(profile).items() if k != SUPERVISED_ENV}
    t = threading.Thread(target=fault_after, args=(home, "benchmarks.bare_ddp", sig, 8.0, marks))
    t.start()
    outcome = run_job(cmd, env, timeout_s=cap + 60)
    gone = time.monotonic()
    t.join()
    latency = gone - marks["at"]
    return None if outcome.timed_out or latency >= cap else latency


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cap", type=float, default=120.0, help="Longest wait for plain torchrun to notice a hang.")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="trainpipe-bench-") as home:
        os.environ["TRAINPIPE_HOME"] = home
        base = [
            "train.eval_every=0",
            "checkpoint.every_steps=1000",
            "tracking.enabled=false",
            "preflight.enabled=false",
        ]
        long = load_profile("local", [*base, "train.steps=5000"])
        dataset_uri = shard_dataset(long.data, long.store).uri
        (Path(home) / "bare.yaml").write_text(long.to_yaml())

        hang_s, hang = trainpipe_latency(long, dataset_uri, signal.SIGSTOP, home, "hang")
        crash_s, crash = trainpipe_latency(long, dataset_uri, signal.SIGKILL, home, "crash")
        allowance = max(long.watchdog.hang_floor_s, 0.0)
        print(
            f"trainpipe: hang detected and torn down {hang_s:.1f}s after SIGSTOP ({hang}); "
            f"crash {crash_s:.1f}s after SIGKILL ({crash})",
            flush=True,
        )
        plain_crash = plain_latency(long, dataset_uri, signal.SIGKILL, home, args.cap)
        plain_hang = plain_latency(long, dataset_uri, signal.SIGSTOP, home, args.cap)

        def fmt(v: float | None) -> str:
            return f"{v:.1f} s" if v is not None else f"> {args.cap:.0f} s"

        print(f"plain torchrun+gloo (defaults): hang {fmt(plain_hang)}, crash {fmt(plain_crash)}", flush=True)

        short = [*base, "train.steps=150"]
        on, off = [], []
        for r in range(args.rounds):
            prof = load_profile("local", short)
            res = train_attempt(prof, f"on-{r}", dataset_uri).result
            on.append(per_step_ms(res["step_starts_s"]))
            res = run_module(
                load_profile("local", [*short, "watchdog.enabled=false"]),
                "trainpipe.trainer",
                ["--run-name", f"off-{r}", "--dataset-uri", dataset_uri],
                900,
                beacons=False,
            ).result
            off.append(per_step_ms(res["step_starts_s"]))
            print(f"round {r}: watched {on[-1]:.1f} ms/step, unwatched {off[-1]:.1f} ms/step", flush=True)
    ratio = statistics.median(on) / statistics.median(off)
    print(
        json.dumps(
            {
                "trainpipe_hang_s": round(hang_s, 2),
                "trainpipe_crash_s": round(crash_s, 2),
                "hang_culprit": hang,
                "crash_culprit": crash,
                "plain_hang_s": round(plain_hang, 2) if plain_hang is not None else f"> {args.cap:.0f}",
                "plain_crash_s": round(plain_crash, 2) if plain_crash is not None else f"> {args.cap:.0f}",
                "hang_allowance_floor_s": allowance,
                "watch_overhead_ratio": round(ratio, 4),
            }
        )
    )
    print(
        f"hang: trainpipe {hang_s:.1f} s vs plain {fmt(plain_hang)}; "
        f"crash: trainpipe {crash_s:.1f} s vs plain {fmt(plain_crash)}; "
        f"watching overhead ratio {ratio:.3f} (target <= 1.02)"
    )


if __name__ == "__main__":
    main()
