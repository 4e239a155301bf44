"""Throughput and memory per rank of each ``parallel`` layout against DDP, on one model and one global batch.

Every layout trains the same model (the local profile's GPT) on the same data and global batch over the same
world size (4 processes here), with tracking off and one checkpoint at the end. Each round runs every layout
once, in turn, so a shared machine's noise falls on all of them alike; the median over rounds is reported.

- tokens/s: global batch × block size over the steady-state time per step (steps after the first WARMUP);
- peak RSS per rank: the largest resident set any rank process reached, sampled every 0.2 s (on a CPU most
  of it is the interpreter and torch; the difference between layouts is their weights, optimizer state and
  activations);
- state per rank: the most MB of weights and optimizer state any rank holds (``TrainResult.state_mb``: its
  shards, its pipeline stage); on a GPU also the peak allocated device memory (``peak_device_mb``);
- MFU on a GPU (``perf/mfu``, from ``cluster.peak_tflops`` or a known GPU), when the run had one.

    .venv/bin/python benchmarks/parallel_layouts.py [--steps 60] [--rounds 2] [--procs 4] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainpipe.trainer.data.shard import shard_dataset
from trainpipe.trainer.profile_files import load_profile
from trainpipe.trainer.supervise.attempt import train_attempt

WARMUP = 10
LAYOUTS = {  # name -> settings, over the same world size; the first is the baseline
    "ddp": ["train.strategy=ddp"],
    "fsdp": ["train.strategy=fsdp"],
    "hsdp 2x2": ["train.strategy=fsdp", "parallel.dp_replicate=2"],
    "dp2 x tp2": ["train.strategy=fsdp", "parallel.tp=2"],
    "pp2 x dp2 1f1b": ["train.strategy=fsdp", "parallel.pp=2"],
    "pp2 x dp2 gpipe": ["train.strategy=fsdp", "parallel.pp=2", "parallel.pp_schedule=gpipe"],
    "pp2 x tp2 1f1b": ["train.strategy=fsdp", "parallel.pp=2", "parallel.tp=2"],
}


class PeakRss:
    """The largest resident set of any descendant process (the ranks) while it runs."""

    def __init__(self) -> None:
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        me = psutil.Process()
        while not self._stop.wait(0.2):
            for p in me.children(recursive=True):
                try:
                    if "trainpipe.trainer" in " ".join(p.cmdline()) or p.name().startswith("python"):
                        self.peak = max(self.peak, p.memory_info().rss)
                except psutil.Error:
                    continue


def per_step_s(starts: list[float]) -> float:
    steady = starts[WARMUP:]
    return (steady[-1] - steady[0]) / (len(steady) - 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()
    common = [
        f"cluster.procs_per_node={args.procs}",
        f"train.steps={args.steps}",
        "train.eval_every=0",
        f"checkpoint.every_steps={args.steps}",
        "checkpoint.async=false",
        "tracking.enabled=false",
        "preflight.enabled=false",
        "watchdog.on_straggler=warn",
        *args.overrides,
    ]
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in LAYOUTS}
    with tempfile.TemporaryDirectory(prefix="trainpipe-bench-") as home:
        os.environ["TRAINPIPE_HOME"] = home
        base = load_profile("local", common)
        dataset = shard_dataset(base.data, base.store)
        tokens = base.train.global_batch * base.model.block_size
        for r in range(args.rounds):
            for name, settings in LAYOUTS.items():
                profile = load_profile("local", [*common, *settings])
                run = f"{name.replace(' ', '-')}-{r}"
                with PeakRss() as rss:
                    t0 = time.monotonic()
                    attempt = train_attempt(profile, run, dataset.uri)
                assert attempt.result, "\n".join(attempt.job.tail[-30:])
                step_s = per_step_s(attempt.result.step_starts_s)
                samples[name].append(
                    {
                        "tokens_per_s": tokens / step_s,
                        "peak_rss_mb": rss.peak / 2**20,
                        "state_mb": max(attempt.result.state_mb),
                        "device_mb": max(attempt.result.peak_device_mb, default=float("nan")),
                        "mfu": attempt.result.mfu if attempt.result.mfu is not None else float("nan"),
                        "wall_s": time.monotonic() - t0,
                    }
                )
                print(f"round {r} {name}: {tokens / step_s:,.0f} tokens/s, {step_s * 1000:.0f} ms/step", flush=True)
    rows = {name: {k: statistics.median(s[k] for s in runs) for k in runs[0]} for name, runs in samples.items()}
    ddp = rows["ddp"]["tokens_per_s"]
    print(f"\n{base.cluster.world_size} processes, global batch {base.train.global_batch} × {base.model.block_size}")
    print(
        "| layout | tokens/s | vs DDP | state per rank (MB) | peak device per rank (MB) | peak RSS per rank (MB) "
        "| MFU |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        mfu = "n/a" if row["mfu"] != row["mfu"] else f"{row['mfu']:.1%}"
        device = "n/a" if row["device_mb"] != row["device_mb"] else f"{row['device_mb']:.0f}"
        print(
            f"| {name} | {row['tokens_per_s']:,.0f} | {row['tokens_per_s'] / ddp:.2f} | {row['state_mb']:.2f} | "
            f"{device} | {row['peak_rss_mb']:.0f} | {mfu} |"
        )
    print(json.dumps({"rounds": args.rounds, "steps": args.steps, "layouts": rows}))


if __name__ == "__main__":
    main()
