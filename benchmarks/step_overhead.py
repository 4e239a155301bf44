"""Step-time overhead of trainpipe's training loop against a bare torchrun + DDP loop.

Both run the same model, data, global batch and world size (the local profile,
2 gloo ranks) in this one process's lifetime; trainpipe runs with MLflow
tracking and checkpointing on. The figure is the ratio of steady-state time per
step (the first steps are warm-up and not counted). Runs alternate, and the
median of each side is reported, to damp the noise of a shared 2-core machine.

    .venv/bin/python benchmarks/step_overhead.py [--steps 150] [--rounds 2] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainpipe.trainer import tracking
from trainpipe.trainer.config import load_profile
from trainpipe.trainer.data.shard import shard_dataset
from trainpipe.trainer.supervise.attempt import run_module, train_attempt

WARMUP = 10


def per_step_ms(starts: list[float]) -> float:
    """Mean time per step over the steady state: from step WARMUP to the start of the last step."""
    steady = starts[WARMUP:]
    return (steady[-1] - steady[0]) / (len(steady) - 1) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="trainpipe-bench-") as home:
        os.environ["TRAINPIPE_HOME"] = home
        profile = load_profile(
            "local",
            [
                f"train.steps={args.steps}",
                "train.eval_every=0",
                "checkpoint.every_steps=50",
                "preflight.enabled=false",
                *args.overrides,
            ],
        )
        dataset = shard_dataset(profile.data, profile.store)
        bare, ours = [], []
        for r in range(args.rounds):
            starts = Path(home) / f"bare-{r}.json"
            args_ = ["--dataset-uri", dataset.uri, "--starts-file", str(starts)]
            job = run_module(profile, "benchmarks.bare_ddp", args_, 900)
            assert starts.exists(), "\n".join(job.job.tail)
            bare.append(per_step_ms(json.loads(starts.read_text())["step_starts_s"]))

            t = profile.tracking
            run_id, _ = tracking.open_run(t.tracking_uri, t.experiment, f"bench-{r}")
            attempt = train_attempt(profile, f"bench-{r}", dataset.uri, run_id)
            assert attempt.result, "\n".join(attempt.job.tail)
            ours.append(per_step_ms(attempt.result.step_starts_s))
            print(f"round {r}: bare {bare[-1]:.1f} ms/step, trainpipe {ours[-1]:.1f} ms/step", flush=True)
    b, o = statistics.median(bare), statistics.median(ours)
    print(
        json.dumps(
            {
                "bare_ms_per_step": round(b, 2),
                "trainpipe_ms_per_step": round(o, 2),
                "ratio": round(o / b, 4),
                "steps": args.steps,
                "checkpoint_every": 50,
                "tracking": True,
                "rounds": args.rounds,
            }
        )
    )
    print(f"step overhead ratio (trainpipe / bare torchrun+DDP): {o / b:.3f}  (target <= 1.03)")


if __name__ == "__main__":
    main()
