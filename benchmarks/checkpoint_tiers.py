"""Save and restore time of each checkpoint tier against model size, the store's as the baseline, in one run.

The tiers: ``memory`` (the memory tier: a private folder in /dev/shm, trainer.checkpoint.memory_tier),
``store:s3`` (an S3 bucket on a moto_server started here: the object store) and ``store:disk`` (a local
folder, the local profile's store). Each save goes through the ranks' one save path (``Checkpointer``: DCP's
async save into reused CPU buffers, the files hashed while written, the commit manifest) in a one-rank gloo
world; each restore is ``load_checkpoint`` of the committed checkpoint, every file verified against its
manifest as it is read. The state is a GPT's weights and its AdamW state (after one step), at three sizes.
Rounds interleave the tiers, in a rotating order. Printed per size: the median blocking time of a save (what
the training loop waits for), the median time to its commit, and the median restore, per tier, and the memory
tier's figures as ratios of the S3 store's. No peer tier yet (issue 42 item 1's copy on a peer host).

    .venv/bin/python benchmarks/checkpoint_tiers.py [--rounds 5] [--sizes 128x2,384x4,768x8]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.store_throughput import model_state, start_moto


def one_round(root: str, so: dict, state: dict, step: int) -> tuple[float, float, float]:
    """(blocked, committed, restored) seconds for one save of ``state`` under ``root`` and its restore."""
    from trainpipe.trainer.checkpoint import catalog
    from trainpipe.trainer.checkpoint.checkpointer import Checkpointer
    from trainpipe.trainer.checkpoint.loading import load_checkpoint

    ckpt = Checkpointer(root, keep_last=1, storage_options=so, use_async=True, hash_staged=True, tier="memory")
    t0 = time.perf_counter()
    blocked = ckpt.save(step, state, {"rng": {}, "step": step}, {"step": step})
    ckpt.wait()
    committed = time.perf_counter() - t0
    info = catalog.inspect_checkpoint(ckpt.committed.uri, so, verify=False)  # type: ignore[union-attr]
    t0 = time.perf_counter()
    load_checkpoint(info.uri, state, so, expected=info.manifest["files"], sizes=info.manifest.get("sizes"))
    restored = time.perf_counter() - t0
    return blocked, committed, restored


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes", default="128x2,384x4,768x8", help="n_embd x n_layer of each GPT")
    args = ap.parse_args()

    import torch.distributed as dist

    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    moto, port = start_moto()
    memory = tempfile.mkdtemp(prefix="tp-tiers-", dir="/dev/shm")
    disk = tempfile.mkdtemp(prefix="tp-tiers-")
    try:
        import s3fs

        so_s3 = {"endpoint_url": f"http://127.0.0.1:{port}"}
        bucket = f"tiers-{uuid.uuid4().hex[:8]}"
        s3fs.S3FileSystem(**so_s3).mkdir(bucket)
        tiers = {"memory": (memory, {}), "store:s3": (f"s3://{bucket}", so_s3), "store:disk": (disk, {})}
        print(f"{'model':>12s} {'state MB':>8s} {'tier':>10s} {'blocked ms':>10s} {'commit s':>8s} {'restore s':>9s}")
        for size in args.sizes.split(","):
            n_embd, n_layer = (int(x) for x in size.split("x"))
            _, state = model_state(n_embd, n_layer)
            mb = _mb(state)
            times: dict[str, list[tuple[float, float, float]]] = {t: [] for t in tiers}
            names = list(tiers)
            for r in range(args.rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate who goes first
                    root, so = tiers[name]
                    times[name].append(one_round(f"{root}/{size}/checkpoints", so, state, r + 1))
            med = {t: [statistics.median(x[i] for x in times[t]) for i in range(3)] for t in tiers}
            for name in tiers:
                b, c, rs = med[name]
                print(f"{size:>12s} {mb:8.0f} {name:>10s} {b * 1000:10.1f} {c:8.3f} {rs:9.3f}")
            m, s3 = med["memory"], med["store:s3"]
            print(
                f"{size:>12s} memory / store:s3: blocked {m[0] / s3[0]:.2f}, commit {m[1] / s3[1]:.3f}, "
                f"restore {m[2] / s3[2]:.3f}"
            )
    finally:
        moto.kill()
        shutil.rmtree(memory, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
        dist.destroy_process_group()


def _mb(state: dict) -> float:
    import torch

    total = 0

    def walk(obj) -> None:
        nonlocal total
        if isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    walk(state)
    return total / 2**20


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
