"""Checkpoint stall (async vs sync) and recovery time from SIGKILL to the first resumed step.

1. Stall: the same model state saved to the same store every few steps, once with
   DCP async save and once synchronously; the figure is the median time the
   training loop was blocked per (non-final) checkpoint, async / sync.
2. Recovery: a rank is SIGKILLed right after the first commit; the attempt is
   torn down and relaunched as the Prefect task's retry would do; the figure is
   the time from the kill to the first step of the resumed attempt, split into
   detection/teardown and relaunch/resume.

    .venv/bin/python benchmarks/checkpoint_stall.py [--n-embd 384] [--n-layer 4]
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

from trainpipe.trainer.checkpoint import catalog
from trainpipe.trainer.data.shard import shard_dataset
from trainpipe.trainer.profile_files import load_profile
from trainpipe.trainer.store_paths import CHECKPOINT_MANIFEST, RunPaths
from trainpipe.trainer.supervise.attempt import train_attempt


def stall_ms(profile, name: str, dataset_uri: str) -> tuple[float, int]:
    run = train_attempt(profile, name, dataset_uri)
    assert run.result, "\n".join(run.job.tail)
    stalls = run.result.checkpoint_stalls_s[:-1]  # the final save is synchronous by design
    return statistics.median(stalls) * 1000, len(stalls)


def recovery(profile, dataset_uri: str, home: str) -> dict[str, float]:
    first_commit = Path(
        RunPaths(profile.store.root, "recover").checkpoint(profile.checkpoint.every_steps), CHECKPOINT_MANIFEST
    )
    killed: dict[str, float] = {}

    def kill() -> None:
        while not first_commit.exists():
            time.sleep(0.01)
        for p in psutil.process_iter(["cmdline"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if "-m trainpipe.trainer" in cmd and home in cmd and p.environ().get("RANK") == "1":
                killed["at"] = time.time()
                p.send_signal(signal.SIGKILL)
                return

    killer = threading.Thread(target=kill)
    killer.start()
    first = train_attempt(profile, "recover", dataset_uri, attempt=1)
    killer.join()
    detected = time.time()
    assert first.result is None and "at" in killed
    second = train_attempt(profile, "recover", dataset_uri, attempt=2)
    assert second.result and second.first_step_at
    return {
        "kill_to_first_resumed_step_s": second.first_step_at - killed["at"],
        "detect_and_teardown_s": detected - killed["at"],
        "relaunch_to_first_step_s": second.first_step_at - detected,
        "resumed_from_step": second.result.start_step,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-embd", type=int, default=384)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--steps", type=int, default=13)
    p.add_argument("--every", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="trainpipe-bench-") as home:
        os.environ["TRAINPIPE_HOME"] = home
        base = [
            f"model.n_embd={args.n_embd}",
            f"model.n_layer={args.n_layer}",
            "model.n_head=4",
            f"train.steps={args.steps}",
            "train.global_batch=8",
            "train.micro_batch=4",
            "train.eval_every=0",
            f"checkpoint.every_steps={args.every}",
            "checkpoint.keep_last=2",
            "tracking.enabled=false",
        ]
        profile = load_profile("local", [*base, "checkpoint.async=true"])
        dataset = shard_dataset(profile.data, profile.store)
        params = profile.model.n_layer * 12 * profile.model.n_embd**2
        async_ms, n = stall_ms(profile, "async", dataset.uri)
        sync_ms, _ = stall_ms(load_profile("local", [*base, "checkpoint.async=false"]), "sync", dataset.uri)
        size_mb = (
            sum(i.size_bytes for i in catalog.list_checkpoints(RunPaths(profile.store.root, "sync").checkpoints)[-1:])
            / 1e6
        )
        print(f"checkpoint of ~{params / 1e6:.1f}M params ({size_mb:.0f} MB with optimizer state), {n} saves each")
        print(f"loop blocked per checkpoint: async {async_ms:.1f} ms, sync {sync_ms:.1f} ms")
        rec = recovery(
            load_profile(
                "local", ["train.steps=30", "checkpoint.every_steps=10", "tracking.enabled=false", "train.eval_every=0"]
            ),
            dataset.uri,
            home,
        )
    print(
        json.dumps(
            {
                "async_stall_ms": round(async_ms, 2),
                "sync_stall_ms": round(sync_ms, 2),
                "stall_ratio": round(async_ms / sync_ms, 4),
                "checkpoint_mb": round(size_mb, 1),
                **{k: round(v, 2) for k, v in rec.items()},
            }
        )
    )
    print(f"checkpoint stall ratio (async / sync): {async_ms / sync_ms:.3f}  (target <= 0.10)")
    print(
        f"recovery: SIGKILL -> first resumed step {rec['kill_to_first_resumed_step_s']:.1f}s "
        f"(detect+teardown {rec['detect_and_teardown_s']:.1f}s, relaunch+resume {rec['relaunch_to_first_step_s']:.1f}s)"
    )


if __name__ == "__main__":
    main()
