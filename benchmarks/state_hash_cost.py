"""What a checkpoint's state hash costs the save, against writing the same state.

The state is the local profile's model with AdamW's two moments (about three times
its parameters). Each round times, interleaved, ``torch.save`` of that state into
memory (the least a save does with it) and ``state_sum`` over it on one rank (what
the loop waits for at each save: trainer/checkpoint/state_hash.py). Medians over
the rounds; the ratio is the hash's time over the save's.

    .venv/bin/python benchmarks/state_hash_cost.py [--rounds 7] [--threads 1] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from trainpipe.trainer.checkpoint.state_hash import state_sum
from trainpipe.trainer.factory import build_model
from trainpipe.trainer.profile_files import load_profile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (a rank's cluster.threads_per_proc)")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(load_profile("local", args.overrides).model)
    weights = model.state_dict()
    state = {
        "model": weights,
        "optim": {
            "state": {k: {"exp_avg": torch.randn_like(v), "exp_avg_sq": torch.rand_like(v)} for k, v in weights.items()}
        },
    }
    elements = sum(t.numel() for t in weights.values()) * 3
    saves, hashes = [], []
    state_sum(state, 0)  # first-call costs out of the way
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        torch.save(state, io.BytesIO())
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        state_sum(state, 0)
        hashes.append(time.perf_counter() - t0)
    save_s, hash_s = statistics.median(saves), statistics.median(hashes)
    print(
        json.dumps(
            {
                "elements": elements,
                "threads": args.threads,
                "save_to_memory_s": round(save_s, 4),
                "state_hash_s": round(hash_s, 4),
                "hash_s_per_million_elements": round(hash_s / elements * 1e6, 4),
                "ratio_to_save": round(hash_s / save_s, 3),
                "rounds": args.rounds,
            }
        )
    )
    took = f"{hash_s * 1e3:.0f} ms, {elements:,} elements"
    print(f"state hash / torch.save of the same state: {hash_s / save_s:.2f} ({took})")


if __name__ == "__main__":
    main()
