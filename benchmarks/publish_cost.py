"""What exporting a checkpoint costs (``trainpipe models export``), against a plain read of its files.

Three GPT sizes are trained one step (DDP over 2 ranks, so two rank files hold the state) and committed. For each,
rounds interleave two fresh processes that import the same modules:

- **read**: read every file of the checkpoint (weights, optimizer, metadata) front to back, 4 MiB at a time;
- **verified read**: the same, each file through sha256 as well: what any reader that does not trust the store
  does (``trainpipe validate`` checks every file so), and the least an export can do;
- **export**: ``export_checkpoint``: stream the model's chunks into a safetensors file, verify each file's sha256,
  read the written weights back and hash them against the recorded digest, write config and tokenizer;
- **export with the state check** (what the publish stage and ``trainpipe models export`` do): the same, and
  every other record decoded and summed into the state hash its proof records.

Each process imports what the export imports first (transformers' lazy first imports are not the work) and
reports its wall time for the work and its peak RSS over its RSS once the imports are done. Medians
over the rounds; the ratios are export over read and over verified read (wall), and the export's peak RSS growth
against the largest tensor plus 200 MB (the target: at most 1).

    .venv/bin/python benchmarks/publish_cost.py [--rounds 5] [--sizes 256,512,1024]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, os, resource, sys, time
sys.path.insert(0, sys.argv[4])
from trainpipe.trainer.profile_files import load_profile
from trainpipe.trainer.export.folder import export_checkpoint
# What the export imports on the way, imported first in every process: the figures are the work's, not
# transformers' lazy first imports (about 0.7 s of a cold `trainpipe models export`).
from transformers import GenerationConfig, GPT2Config, LlamaConfig, PreTrainedTokenizerFast
import tokenizers, safetensors
import torch._dynamo  # the model's shapes are checked on the meta device, whose first normal_ imports it (0.7 s)

def rss_kb():
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))

what, uri, out = sys.argv[1], sys.argv[2], sys.argv[3]
profile = load_profile("local", [])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start_rss = rss_kb()
t0 = time.perf_counter()
if what in ("read", "verify"):
    import hashlib
    n = 0
    for root, _, files in os.walk(uri):
        for f in sorted(files):
            digest = hashlib.sha256()
            with open(os.path.join(root, f), "rb") as fh:
                while block := fh.read(4 << 20):
                    n += len(block)
                    if what == "verify":
                        digest.update(block)
    result = {"bytes": n}
else:
    r = export_checkpoint(uri, out, profile, check_state=what == "export-state")
    result = {"bytes": r.read_bytes, "weights": r.weight_bytes, "largest": r.largest_tensor_bytes}
wall = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({**result, "wall_s": wall, "peak_growth_mb": (peak - max(before, start_rss)) / 1024}))
"""


def train(home: Path, width: int) -> str:
    from trainpipe.trainer.data.shard import shard_dataset
    from trainpipe.trainer.profile_files import load_profile
    from trainpipe.trainer.supervise.attempt import train_attempt

    os.environ["TRAINPIPE_HOME"] = str(home)
    sets = [
        f"model.n_embd={width}",
        "model.n_head=8",
        "model.n_layer=4",
        "model.block_size=32",
        "train.steps=1",
        "train.global_batch=4",
        "train.micro_batch=2",
        "train.warmup_steps=1",
        "train.eval_every=1",
        "train.eval_batches=1",
        "train.strategy=ddp",
        "cluster.procs_per_node=2",
        "checkpoint.every_steps=1",
        "checkpoint.async=false",
        "tracking.enabled=false",
        "preflight.enabled=false",
        "data.max_bytes=400000",
    ]
    prof = load_profile("local", sets)
    run = train_attempt(prof, f"w{width}", shard_dataset(prof.data, prof.store).uri)
    if run.result is None:
        raise SystemExit("\n".join(run.job.tail[-20:]))
    return run.result.checkpoint_uri


def measure(what: str, uri: str, work: Path, i: int) -> dict:
    out = work / f"{what}-{Path(uri).parent.parent.name}-{i}"
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, what, uri, str(out), str(ROOT)], capture_output=True, text=True, check=True
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sizes", default="256,512,1024", help="model.n_embd of each size (4 layers)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="publish-cost-") as tmp:
        work = Path(tmp)
        for width in (int(w) for w in args.sizes.split(",")):
            uri = train(work / f"home-{width}", width)
            reads, verifies, exports, checked = [], [], [], []
            for i in range(args.rounds):  # interleaved: a busy moment of the machine costs each alike
                reads.append(measure("read", uri, work, i))
                verifies.append(measure("verify", uri, work, i))
                exports.append(measure("export", uri, work, i))
                checked.append(measure("export-state", uri, work, i))
            read_s = statistics.median(r["wall_s"] for r in reads)
            verify_s = statistics.median(r["wall_s"] for r in verifies)
            export_s = statistics.median(e["wall_s"] for e in exports)
            checked_s = statistics.median(e["wall_s"] for e in checked)
            growth = statistics.median(e["peak_growth_mb"] for e in exports)
            largest_mb = exports[0]["largest"] / 2**20
            print(
                json.dumps(
                    {
                        "n_embd": width,
                        "checkpoint_mb": round(reads[0]["bytes"] / 2**20, 1),
                        "weights_mb": round(exports[0]["weights"] / 2**20, 1),
                        "largest_tensor_mb": round(largest_mb, 2),
                        "read_s": round(read_s, 3),
                        "export_s": round(export_s, 3),
                        "verified_read_s": round(verify_s, 3),
                        "wall_ratio": round(export_s / read_s, 2),
                        "wall_ratio_verified": round(export_s / verify_s, 2),
                        "export_state_s": round(checked_s, 3),
                        "state_ratio_verified": round(checked_s / verify_s, 2),
                        "export_state_peak_growth_mb": round(
                            statistics.median(e["peak_growth_mb"] for e in checked), 1
                        ),
                        "read_peak_growth_mb": round(statistics.median(r["peak_growth_mb"] for r in reads), 1),
                        "export_peak_growth_mb": round(growth, 1),
                        "rss_ratio": round(growth / (largest_mb + 200), 2),
                        "rounds": args.rounds,
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
