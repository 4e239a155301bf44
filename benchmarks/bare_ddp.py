"""Baseline for step_overhead.py: the same model, data, batch and optimizer in a bare torchrun + DDP loop.

No tracking, no checkpoints, no per-step loss all-reduce: only the math every
training loop must do. Run under torchrun; rank 0 writes the step timeline.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainpipe.trainer.data.sampler import rank_samples
from trainpipe.trainer.data.tokens import TokenStream
from trainpipe.trainer.loop.optim import build_optimizer, build_scheduler
from trainpipe.trainer.model import GPT
from trainpipe.trainer.profile_files import load_resolved_profile
from trainpipe.trainer.protocol import write_file


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--profile", required=True)
    p.add_argument("--dataset-uri", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--starts-file", required=True, help="Where rank 0 writes its step start times (JSON).")
    args = p.parse_args()
    profile = load_resolved_profile(args.profile)
    t = profile.train
    torch.set_num_threads(profile.cluster.threads_per_proc)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(t.seed)
    model = GPT(profile.model)
    ddp = DDP(model)
    optimizer = build_optimizer(model, t)
    scheduler = build_scheduler(optimizer, t)
    data = TokenStream(args.dataset_uri, "train")
    block, mb, accum = profile.model.block_size, t.micro_batch, profile.grad_accum
    n_samples = data.windows(block)
    start = time.time()
    starts = []
    for step in range(t.steps):
        starts.append(time.time() - start)
        ids = rank_samples(step, t.global_batch, t.seed, n_samples, rank, world)
        for micro in range(accum):
            x, y = data.batch(ids[micro * mb : (micro + 1) * mb], block, torch.device("cpu"))
            with ddp.no_sync() if micro < accum - 1 else contextlib.nullcontext():
                _, loss = ddp(x, y)
                (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    if rank == 0:
        # Not a training result (a supervisor reads result.json as one): its own file, that the benchmark reads.
        write_file(args.starts_file, {"step_starts_s": starts})
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
