"""Save and restore time of each checkpoint tier against model size, the store's as the baseline, in one run.

Two ranks (a gloo world of two processes), each holding the same state, as DDP replicas do. The tiers:
``flash`` (the memory tier's flash snapshots on one host: each rank's tensors copied into a shared-memory
slot, an XXH3-64 checksum each, trainer.checkpoint.flash, after two untimed ones that map the slots and fault
their pages in, as a run's first two do; its restore reads them back, checked, into the state), ``flash+peer`` (flash
snapshots on two hosts, one rank each, each host a folder of its own: every snapshot's slot also copied to the
other host, trainer.checkpoint.flash_peers; its restore is host 1's rank after the host was lost, into an
empty folder as on a replacement host: it fetches its slot back from host 0's copy, then reads it),
``memory`` (the memory tier's DCP snapshots on one host: both ranks' snapshot in one private folder in
/dev/shm, trainer.checkpoint.memory_tier), ``peer`` (the memory tier on two hosts, one rank each, each host a
folder of its own: every snapshot's files copied to the other host before it commits,
trainer.checkpoint.peer_copy; its restore is after host 1 lost its memory: host 1 gathers the files back from
host 0, then loads), ``store:s3`` (an S3 bucket on a moto_server started here: the object store) and
``store:disk`` (a local folder, the local profile's store). Every tier but flash saves through the ranks' one
save path (``Checkpointer``: DCP's async save into reused CPU buffers, the files hashed while written, the
commit manifest) and restores by ``load_checkpoint`` of the committed checkpoint on both ranks, every file
verified against its manifest as it is read. None computes the state hash here. The state is a GPT's weights
and its AdamW state (after one step), at three sizes. Rounds interleave the tiers, in a rotating order.
Printed per size: the median blocking time of a save (what the training loop waits for), the median time to
its commit, and the median restore, per tier, and the memory tiers' figures as ratios of the S3 store's.

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

RANKS = 2
TIERS = ("flash", "flash+peer", "memory", "peer", "store:s3", "store:disk")
MEMORY_TIERS = ("flash", "flash+peer", "memory", "peer")
_flash: dict = {}  # root -> this rank's FlashSnapshots, kept across rounds as a run keeps its own


def one_round(root: str, so: dict, state: dict, step: int, peer: bool) -> tuple[float, float, float]:
    """(blocked, committed, restored) seconds for one save of ``state`` under ``root`` (this rank's host's) and its
    restore; with ``peer``, the save copies to the other host and the restore follows host 1's loss."""
    import torch.distributed as dist

    from trainpipe.trainer.checkpoint import catalog
    from trainpipe.trainer.checkpoint.checkpointer import Checkpointer
    from trainpipe.trainer.checkpoint.loading import load_checkpoint
    from trainpipe.trainer.checkpoint.peer_copy import PeerRing, gather_snapshot, held_files
    from trainpipe.trainer.store_paths import step_uri

    rank = dist.get_rank()
    ring = PeerRing(rank, RANKS, 1) if peer else None
    ckpt = Checkpointer(root, 1, so, use_async=True, hash_staged=True, tier="memory", peers=ring)
    dist.barrier()
    t0 = time.perf_counter()
    blocked = ckpt.save(step, state, {"rng": {}, "step": step}, {"step": step})
    ckpt.wait()
    committed = time.perf_counter() - t0
    uri = step_uri(root, step)
    box = [catalog.inspect_checkpoint(uri, so, verify=False).manifest if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    manifest = box[0]
    if ring is not None and rank == 1:
        shutil.rmtree(uri)  # host 1 lost its memory
    dist.barrier()
    t0 = time.perf_counter()
    if ring is not None:
        held: list = [None] * RANKS
        dist.all_gather_object(held, held_files(uri) if os.path.isdir(uri) else set())
        _, problem = gather_snapshot(uri, manifest, held, ring, None)
        assert not problem, problem
    load_checkpoint(uri, state, so, expected=manifest["files"], sizes=manifest.get("sizes"))
    dist.barrier()
    return blocked, committed, time.perf_counter() - t0


def flash_round(root: str, state: dict, step: int) -> tuple[float, float, float]:
    """(blocked, committed, restored) seconds for one flash snapshot of ``state`` and its restore: read (every
    tensor checked against its checksum, copied out of the slot) and copied into ``state``, as a resume loads it."""
    import torch.distributed as dist

    from trainpipe.trainer.checkpoint.flash import FlashProof, FlashSnapshots

    flash = _flash.get(root)
    if flash is None:  # a run's first two snapshots map and fill its slots' pages: once, so not timed here
        _flash[root] = flash = FlashSnapshots(root, dist.get_rank())
        for _ in range(2):
            flash.save(0, state, {}, {}, FlashProof(rng="0" * 64, ledger=None, samples=0))
        flash.wait()
    dist.barrier()
    t0 = time.perf_counter()
    blocked = flash.save(step, state, {"step": step}, {"step": step}, FlashProof(rng="0" * 64, ledger=None, samples=0))
    flash.wait()
    dist.barrier()  # every rank's record written
    committed = time.perf_counter() - t0
    t0 = time.perf_counter()
    _copy_into(state, flash.read(step)[0])
    dist.barrier()
    return blocked, committed, time.perf_counter() - t0


def flash_peer_round(root: str, state: dict, step: int, group) -> tuple[float, float, float]:
    """(blocked, committed, restored) seconds for one flash snapshot of ``state`` copied to the other host (the
    commit: both ranks' records written and their copies kept), and host 1's restore after it was lost."""
    import torch.distributed as dist

    from trainpipe.trainer.checkpoint.flash import FlashProof, FlashSnapshots
    from trainpipe.trainer.checkpoint.flash_peers import FlashPeers, fetch, fetch_plan
    from trainpipe.trainer.checkpoint.peer_copy import PeerRing

    rank, proof = dist.get_rank(), FlashProof(rng="0" * 64, ledger=None, samples=0)
    flash = _flash.get(root)
    if flash is None:  # as flash_round: the first two snapshots (and copies) fill the pages, untimed
        os.makedirs(f"{root}/host-{rank}", mode=0o700, exist_ok=True)
        peers = FlashPeers(PeerRing(rank, RANKS, 1), group)
        _flash[root] = flash = FlashSnapshots(f"{root}/host-{rank}", rank, peers)
        for _ in range(2):
            flash.save(0, state, {}, {}, proof)
        flash.wait()
    assert flash.peers is not None
    dist.barrier()
    t0 = time.perf_counter()
    blocked = flash.save(step, state, {"step": step}, {"step": step}, proof)
    flash.wait()
    dist.barrier()
    committed = time.perf_counter() - t0
    replacement = tempfile.mkdtemp(prefix="host-1-new-", dir=root) if rank == 1 else ""
    dist.barrier()
    t0 = time.perf_counter()
    mine = FlashSnapshots(replacement, rank, flash.peers) if rank == 1 else flash
    views: list = [None] * RANKS
    assert mine.copies is not None
    dist.all_gather_object(
        views, ({r.step for r in mine.records().values()}, {r.step for r in mine.copies.records().values()})
    )
    problem = fetch(fetch_plan(views, step, flash.peers.ring), step, mine, flash.copies, flash.peers)
    assert not problem, problem
    _copy_into(state, mine.read(step)[0])
    dist.barrier()
    restored = time.perf_counter() - t0
    if replacement:
        shutil.rmtree(replacement)
    return blocked, committed, restored


def _copy_into(live, saved) -> None:
    import torch

    if isinstance(live, torch.Tensor):
        live.copy_(saved)
    elif isinstance(live, dict):
        for k in live:
            _copy_into(live[k], saved[k])
    elif isinstance(live, (list, tuple)):
        for a, b in zip(live, saved, strict=True):
            _copy_into(a, b)


def rank_main(rank: int, args: argparse.Namespace, port: int, roots: dict[str, tuple[str, dict]]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    copies = dist.new_group(backend="gloo")  # the flash copies' own group, as a run's
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{'model':>12s} {'state MB':>8s} {'tier':>10s} {'blocked ms':>10s} {'commit s':>8s} {'restore s':>9s}")
    for size in args.sizes.split(","):
        n_embd, n_layer = (int(x) for x in size.split("x"))
        _, state = model_state(n_embd, n_layer)
        mb = _mb(state)
        times: dict[str, list[tuple[float, float, float]]] = {t: [] for t in TIERS}
        for r in range(args.rounds):
            for name in TIERS[r % len(TIERS) :] + TIERS[: r % len(TIERS)]:  # rotate who goes first
                root, so = roots[name]
                if name == "peer":
                    root = f"{root}/host-{rank}"
                if name == "flash":
                    times[name].append(flash_round(f"{root}/{size}", state, r + 1))
                    continue
                if name == "flash+peer":
                    times[name].append(flash_peer_round(f"{root}/{size}", state, r + 1, copies))
                    continue
                times[name].append(one_round(f"{root}/{size}/checkpoints", so, state, r + 1, name == "peer"))
        med = {t: [statistics.median(x[i] for x in times[t]) for i in range(3)] for t in TIERS}
        for name in TIERS:
            b, c, rs = med[name]
            say(f"{size:>12s} {mb:8.0f} {name:>10s} {b * 1000:10.1f} {c:8.3f} {rs:9.3f}")
        s3 = med["store:s3"]
        for name in MEMORY_TIERS:
            m = med[name]
            say(
                f"{size:>12s} {name} / store:s3: blocked {m[0] / s3[0]:.2f}, commit {m[1] / s3[1]:.3f}, "
                f"restore {m[2] / s3[2]:.3f}"
            )
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes", default="128x2,384x4,768x8", help="n_embd x n_layer of each GPT")
    args = ap.parse_args()

    import torch.multiprocessing as mp

    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    moto, port = start_moto()
    memory = tempfile.mkdtemp(prefix="tp-tiers-", dir="/dev/shm")
    disk = tempfile.mkdtemp(prefix="tp-tiers-")
    try:
        import s3fs

        so_s3 = {"endpoint_url": f"http://127.0.0.1:{port}"}
        bucket = f"tiers-{uuid.uuid4().hex[:8]}"
        s3fs.S3FileSystem(**so_s3).mkdir(bucket)
        roots = {
            "flash": (f"{memory}/flash", {}),
            "flash+peer": (f"{memory}/flash-two-hosts", {}),
            "memory": (f"{memory}/one-host", {}),
            "peer": (f"{memory}/two-hosts", {}),
            "store:s3": (f"s3://{bucket}", so_s3),
            "store:disk": (disk, {}),
        }
        mp.spawn(rank_main, args=(args, _free_port(), roots), nprocs=RANKS)
    finally:
        moto.kill()
        shutil.rmtree(memory, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


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
