"""Step-time overhead of trainpipe's training loop against a bare torchrun + DDP loop.

Both run the same model, data, global batch and world size (the local profile,
2 gloo ranks) in this one process's lifetime; trainpipe runs with MLflow
tracking and checkpointing on. The figure is the ratio of steady-state time per
step (the first steps are warm-up and not counted). Runs alternate, and the
median of each side is reported, to damp the noise of a shared 2-core machine.

With ``--virtual-ranks K`` each round also runs trainpipe with ``train.virtual_ranks=K``
(trainer/loop/virtual_ranks.py: each rank's shards' gradients on their own, summed in one
fixed tree by ``all_to_all`` and ``all_gather``), reported against the bare DDP loop and
against trainpipe's own DDP step (target at K = world size: at most 1.15 times plain DDP's).

    .venv/bin/python benchmarks/step_overhead.py [--steps 150] [--rounds 2] [--virtual-ranks K] [--set k=v ...]
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
from trainpipe.trainer.data.shard import shard_dataset
from trainpipe.trainer.profile_files import load_profile
from trainpipe.trainer.supervise.attempt import run_module, train_attempt

WARMUP = 10


def per_step_ms(starts: list[float]) -> float:
    """Mean time per step over the steady state: from step WARMUP to the start of the last step."""
    steady = starts[WARMUP:]
    return (steady[-1] - steady[0]) / (len(steady) - 1) * 1000


def profile_sets(args: argparse.Namespace) -> list[str]:
    return [
        f"train.steps={args.steps}",
        "train.eval_every=0",
        "checkpoint.every_steps=50",
        "preflight.enabled=false",
        *args.overrides,
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--virtual-ranks", type=int, default=None, help="Also run with train.virtual_ranks=K.")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="trainpipe-bench-") as home:
        os.environ["TRAINPIPE_HOME"] = home
        profile = load_profile("local", profile_sets(args))
        dataset = shard_dataset(profile.data, profile.store)
        virtual = None
        if args.virtual_ranks:
            virtual = load_profile("local", [*profile_sets(args), f"train.virtual_ranks={args.virtual_ranks}"])
        bare, ours, tree = [], [], []
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
            line = f"round {r}: bare {bare[-1]:.1f} ms/step, trainpipe {ours[-1]:.1f} ms/step"
            if virtual is not None:
                run_id, _ = tracking.open_run(t.tracking_uri, t.experiment, f"bench-virtual-{r}")
                attempt = train_attempt(virtual, f"bench-virtual-{r}", dataset.uri, run_id)
                assert attempt.result, "\n".join(attempt.job.tail)
                tree.append(per_step_ms(attempt.result.step_starts_s))
                line += f", virtual ranks {tree[-1]:.1f} ms/step"
            print(line, flush=True)
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
    if tree:
        v = statistics.median(tree)
        print(
            json.dumps(
                {
                    "virtual_ranks": args.virtual_ranks,
                    "world_size": profile.cluster.world_size,
                    "virtual_ms_per_step": round(v, 2),
                    "ratio_to_bare_ddp": round(v / b, 4),
                    "ratio_to_trainpipe_ddp": round(v / o, 4),
                }
            )
        )
        print(
            f"virtual ranks K={args.virtual_ranks} step / plain DDP step: {v / b:.3f} against the bare loop, "
            f"{v / o:.3f} against trainpipe's DDP  (target <= 1.15)"
        )


if __name__ == "__main__":
    main()
