"""Object-store figures on S3 (a moto_server started here), trainpipe against raw s3fs on the same endpoint.

Every request goes through a counting TCP proxy (``tests/fault_proxy.py`` in "pass" mode), so bytes read are
bytes on the wire. One process, no process group (world size 1); each figure is the median of ``--repeat``.

1. Checkpoint save: a GPT's model + AdamW state saved synchronously by trainpipe's ``Checkpointer`` (DCP
   files hashed while written, the rank's extra state, the commit manifest, pruning) against s3fs
   ``pipe_file`` of the same files' bytes. Figure: throughput ratio (target >= 0.8).
2. Shard read: ``TokenStream`` loading (and verifying) every train shard of a dataset against s3fs
   ``cat_file`` of the same files. Figure: throughput ratio (target >= 0.8).
3. Bytes read per resume on one rank: what the resume path reads (the manifests, the rank's extra state and
   the DCP files, each verified as it is read) over the checkpoint's size (target <= 1.1); beside it the path
   before this change (hash every file of the newest checkpoint, then load it). Then two DDP ranks under
   torchrun resuming a run of the same model: the bytes of every checkpoint request, both ranks together,
   over the checkpoint's size (target <= 1.0).
4. Async stall: the time the loop is blocked by an async save (DCP staging) against a synchronous save of
   the same state to the same store (target <= 0.10).

    .venv/bin/python benchmarks/store_throughput.py [--n-embd 512] [--n-layer 6] [--corpus-mb 32] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen, int]:
    port = free_port()
    moto = Path(sys.executable).parent / "moto_server"
    proc = subprocess.Popen(
        [str(moto), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 60
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, port
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("moto_server did not start")


def model_state(n_embd: int, n_layer: int):
    import torch

    from trainpipe.trainer.config import ModelConfig
    from trainpipe.trainer.model import GPT

    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=n_layer, n_head=8, n_embd=n_embd, block_size=256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 256, (2, 257))
    model(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())[1].backward()
    opt.step()
    return model, {"model": model.state_dict(), "optim": opt.state_dict()}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def save_figures(root: str, so: dict, state: dict, fs, repeat: int) -> dict:
    """Checkpoint save throughput (trainpipe vs raw s3fs) and the async stall vs a sync save."""
    import torch

    from trainpipe.trainer.checkpoint.checkpointer import Checkpointer
    from trainpipe.trainer.store_paths import step_uri

    extra = {"rng": torch.get_rng_state(), "step": 0}
    ours, stalls, syncs, raw = [], [], [], []
    size = 0
    for i in range(repeat):
        sync_root, async_root = f"{root}/sync-{i}", f"{root}/async-{i}"
        sync = Checkpointer(sync_root, 100, so, use_async=False)
        ours.append(timed(lambda c=sync: c.save(1, state, extra, {"step": 1}, sync=True)))
        syncs.append(ours[-1])
        base = step_uri(sync_root, 1).removeprefix("s3://")
        files = {p: fs.cat_file(p) for p in fs.find(base)}
        size = sum(len(b) for b in files.values())
        raw_root = f"{root.removeprefix('s3://')}/raw-{i}"
        raw.append(
            timed(lambda fl=files, r=raw_root: [fs.pipe_file(f"{r}/{p.rsplit('/', 1)[-1]}", b) for p, b in fl.items()])
        )
        ck = Checkpointer(async_root, 100, so, use_async=True)
        stalls.append(ck.save(1, state, extra, {"step": 1}))
        ck.wait()
    t_ours, t_raw = statistics.median(ours), statistics.median(raw)
    return {
        "checkpoint_mb": size / 1e6,
        "save_mb_s": size / 1e6 / t_ours,
        "raw_put_mb_s": size / 1e6 / t_raw,
        "save_ratio": t_raw / t_ours,
        "async_stall_s": statistics.median(stalls),
        "sync_save_s": statistics.median(syncs),
        "stall_ratio": statistics.median(stalls) / statistics.median(syncs),
    }


def resume_figures(root: str, so: dict, state: dict, proxy) -> dict:
    """Bytes on the wire to resume one rank from the checkpoint saved under ``root``/sync-0."""
    from trainpipe.trainer.checkpoint.catalog import latest_valid, list_checkpoints
    from trainpipe.trainer.checkpoint.loading import load_checkpoint, load_rank_extra

    ckpts = f"{root}/sync-0"
    before = proxy.bytes_down
    info = list_checkpoints(ckpts, so, verify=False)[-1]
    load_rank_extra(info.uri, 0, so, expected=info.manifest["files"])
    load_checkpoint(info.uri, state, so, expected=info.manifest["files"])
    now = proxy.bytes_down - before
    before = proxy.bytes_down
    found, _ = latest_valid(ckpts, so)  # the path before: every file hashed, then loaded
    load_rank_extra(found.uri, 0, so)
    load_checkpoint(found.uri, state, so)
    then = proxy.bytes_down - before
    return {"resume_read_ratio": now / info.size_bytes, "resume_read_ratio_before": then / info.size_bytes}


def ddp_resume_figures(bucket: str, proxy, n_embd: int, n_layer: int) -> dict:
    """Bytes of checkpoint requests on the wire when two DDP ranks (torchrun, gloo) resume: a run trained to
    its final checkpoint, then retried, which resumes from it."""
    from trainpipe.trainer.checkpoint.catalog import latest_valid
    from trainpipe.trainer.data.shard import shard_dataset
    from trainpipe.trainer.profile_files import load_profile
    from trainpipe.trainer.store_paths import RunPaths
    from trainpipe.trainer.supervise.attempt import train_attempt

    os.environ["AWS_ENDPOINT_URL_S3"] = proxy.url
    sets = [f"model.n_embd={n_embd}", f"model.n_layer={n_layer}", "model.n_head=8", "model.block_size=64"]
    sets += ["train.steps=4", "train.global_batch=4", "train.micro_batch=2", "checkpoint.every_steps=4"]
    sets += ["tracking.enabled=false", "preflight.enabled=false", f"store.root=s3://{bucket}/ddp"]
    sets += ["data.max_bytes=2000000", "cluster.procs_per_node=2", "train.eval_batches=1"]
    prof = load_profile("local", sets)
    uri = shard_dataset(prof.data, prof.store).uri
    first = train_attempt(prof, "ddp", uri)
    assert first.result, "\n".join(first.job.tail)
    proxy.count_matching, proxy.bytes_matching = "checkpoints", 0
    again = train_attempt(prof, "ddp", uri, attempt=2)
    assert again.result and again.result.start_step == 4, "\n".join(again.job.tail)
    read, proxy.count_matching = proxy.bytes_matching, None
    found, _ = latest_valid(RunPaths(prof.store.root, "ddp").checkpoints, prof.store.storage_options)
    return {"ddp_checkpoint_mb": found.size_bytes / 1e6, "ddp_resume_read_ratio": read / found.size_bytes}


def shard_figures(store_root: str, so: dict, corpus: Path, fs, repeat: int) -> dict:
    from trainpipe.trainer.config import DataConfig, StoreConfig
    from trainpipe.trainer.data.shard import shard_dataset
    from trainpipe.trainer.data.tokens import TokenStream

    info = shard_dataset(DataConfig(source=f"{corpus}/**/*.py"), StoreConfig(root=store_root, storage_options=so))
    ours, raw = [], []
    for _ in range(repeat):
        stream = TokenStream(info.uri, "train", so)
        ours.append(timed(lambda s=stream: [s.shard(i) for i in range(len(s.shards))]))
        files = [f"{info.uri}/{s['file']}".removeprefix("s3://") for s in stream.shards]
        raw.append(timed(lambda fl=files: [fs.cat_file(p) for p in fl]))
    size = sum(s["tokens"] * stream.dtype.itemsize for s in stream.shards)
    return {
        "shards_mb": size / 1e6,
        "shard_read_mb_s": size / 1e6 / statistics.median(ours),
        "raw_get_mb_s": size / 1e6 / statistics.median(raw),
        "shard_read_ratio": statistics.median(raw) / statistics.median(ours),
    }


def make_corpus(folder: Path, size_mb: int) -> None:
    from trainpipe.trainer.data.sources import list_source

    _, files = list_source("stdlib", None)
    written, copy = 0, 0
    while written < size_mb << 20:
        for f in files:
            text = Path(f.path).read_bytes()
            target = folder / str(copy) / Path(f.name)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(f"# copy {copy}\n".encode() + text)
            written += len(text)
            if written >= size_mb << 20:
                return
        copy += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-embd", type=int, default=512)
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--corpus-mb", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    import s3fs

    from tests.fault_proxy import FaultProxy

    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    moto, port = start_moto()
    tmp = Path(tempfile.mkdtemp(prefix="tp-store-bench-"))
    try:
        with FaultProxy(port) as proxy:
            so = {"endpoint_url": proxy.url}
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            fs = s3fs.S3FileSystem(**so)
            fs.mkdir(bucket)
            _, state = model_state(args.n_embd, args.n_layer)
            figures = save_figures(f"s3://{bucket}/ckpt", so, state, fs, args.repeat)
            figures |= resume_figures(f"s3://{bucket}/ckpt", so, state, proxy)
            figures |= ddp_resume_figures(bucket, proxy, args.n_embd, args.n_layer)
            make_corpus(tmp / "corpus", args.corpus_mb)
            figures |= shard_figures(f"s3://{bucket}/store", so, tmp / "corpus", fs, args.repeat)
    finally:
        moto.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({k: round(v, 3) for k, v in figures.items()}, indent=2))
    print(
        f"checkpoint save {figures['save_mb_s']:.0f} MB/s vs raw put {figures['raw_put_mb_s']:.0f} MB/s: "
        f"ratio {figures['save_ratio']:.2f} (target >= 0.8)\n"
        f"shard read {figures['shard_read_mb_s']:.0f} MB/s vs raw get {figures['raw_get_mb_s']:.0f} MB/s: "
        f"ratio {figures['shard_read_ratio']:.2f} (target >= 0.8)\n"
        f"bytes read per resume, one rank: {figures['resume_read_ratio']:.2f}x the checkpoint "
        f"(before: {figures['resume_read_ratio_before']:.2f}x; target <= 1.1)\n"
        f"bytes read per resume, two DDP ranks together: {figures['ddp_resume_read_ratio']:.2f}x the checkpoint "
        "(target <= 1.0)\n"
        f"async stall {figures['async_stall_s'] * 1000:.0f} ms vs sync save {figures['sync_save_s'] * 1000:.0f} ms: "
        f"ratio {figures['stall_ratio']:.3f} (target <= 0.10)"
    )


if __name__ == "__main__":
    main()
