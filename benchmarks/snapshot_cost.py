"""What a memory-tier snapshot costs a rank: a flash snapshot against a DCP one, in one run.

One rank (a gloo world of one) holding the local profile's model and its AdamW state after a step. Each round
takes, interleaved, three snapshots into /dev/shm, each awaited, each from the state dicts on (the trainer's
``Trainer.save`` from its start):
- ``dcp``: the memory tier's ``Checkpointer`` (DCP's async save into reused buffers, the files' sha256, the state
  hash of the staged copy on the upload's thread, the commit), after the loop's comparison of the replicas
  (``ReplicaCheck.check(full=True)``), from ``get_state_dict``;
- ``flash0``: a flash snapshot as the trainer took one before ``PlainStateDicts`` and the round's comparison:
  ``get_state_dict``, the loop's comparison of the replicas, then trainer.checkpoint.flash (the copy into a
  shared-memory slot, an XXH3-64 checksum per tensor and the record on a background thread);
- ``flash``: as the trainer takes one now: ``PlainStateDicts``, and the round on a group of its own (the ranks'
  comparison of the checksums' digest and their word on the round, each an all-reduce, here of one rank).
Per kind, the medians over the rounds of the time the caller was blocked and of the process's CPU time for the
whole snapshot (every thread: on a CPU host that is time taken from training), and each as a ratio of
``flash``'s.

    .venv/bin/python benchmarks/snapshot_cost.py [--rounds 15] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict

from trainpipe.trainer.checkpoint.checkpointer import Checkpointer
from trainpipe.trainer.checkpoint.flash import FlashSnapshots
from trainpipe.trainer.checkpoint.flash_peers import FlashPeers
from trainpipe.trainer.factory import build_model
from trainpipe.trainer.loop.proving import Proving
from trainpipe.trainer.loop.replicas import ReplicaCheck
from trainpipe.trainer.loop.rng import rng_state
from trainpipe.trainer.loop.state_dicts import PlainStateDicts
from trainpipe.trainer.profile_files import load_profile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()
    torch.set_num_threads(1)  # a rank's cluster.threads_per_proc on this machine
    folder = tempfile.mkdtemp(prefix="tp-snapshot-cost-", dir="/dev/shm")
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=0, world_size=1)
    try:
        model = build_model(load_profile("local", args.overrides).model)
        optimizer = torch.optim.AdamW(model.parameters())
        for param in model.parameters():
            param.grad = torch.randn_like(param)
        optimizer.step()  # the moments exist

        plain, replicas = PlainStateDicts(), ReplicaCheck(model)

        def state(renamed: bool = False) -> dict:
            model_sd, optim_sd = plain.get(model, optimizer) if renamed else get_state_dict(model, optimizer)
            return {"model": model_sd, "optim": optim_sd, "progress": {"step": 1, "tokens": 0}}

        proving = Proving(0, 1, None, None)
        dcp_tier = Checkpointer(f"{folder}/dcp", 2, {}, use_async=True, hash_staged=True, grace_s=0.0, tier="memory")
        flash0 = FlashSnapshots(f"{folder}/flash0", 0)
        flash = FlashSnapshots(f"{folder}/flash", 0, FlashPeers(None, dist.new_group(backend="gloo")))
        position = {"seed": 0, "step": 1}

        def dcp_snapshot(step: int) -> float:
            began = time.perf_counter()
            replicas.check(step, full=True)
            rng = rng_state()
            dcp_tier.save(step, state(), {"rng": rng, "step": step}, {"step": step}, proof=proving.part(position, rng))
            stall = time.perf_counter() - began
            dcp_tier.wait()
            return stall

        def flash_snapshot(tier: FlashSnapshots, renamed: bool, step: int) -> float:
            began = time.perf_counter()
            if not renamed:
                replicas.check(step, full=True)
            rng = rng_state()
            snapshot = state(renamed)
            stall = tier.save(
                step, snapshot, {"rng": rng, "step": step}, {"step": step}, proving.flash_part(rng), began
            )
            tier.wait()
            return stall

        kinds = {
            "dcp": dcp_snapshot,
            "flash0": lambda step: flash_snapshot(flash0, False, step),
            "flash": lambda step: flash_snapshot(flash, True, step),
        }
        figures: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
        for step in range(1, args.rounds + 2):
            order = list(kinds)[step % len(kinds) :] + list(kinds)[: step % len(kinds)]  # each kind first in turn
            for name in order:
                cpu = time.process_time()
                stall = kinds[name](step)
                if step > 1:  # the first round maps and fills the buffers
                    figures[name].append((stall, time.process_time() - cpu))
        med = {k: [statistics.median(x[i] for x in v) for i in range(2)] for k, v in figures.items()}
        elements = sum(t.numel() for t in model.parameters()) * 3
        print(f"{'kind':>6s} {'blocked ms':>10s} {'CPU ms':>8s}   ({args.rounds} rounds, ~{elements:,} elements)")
        for name, (stall, cpu) in med.items():
            print(f"{name:>6s} {stall * 1000:10.1f} {cpu * 1000:8.1f}")
        for name in ("dcp", "flash0"):
            blocked, cpu = (med[name][i] / med["flash"][i] for i in range(2))
            print(f"{name} / flash: blocked {blocked:.2f}, CPU {cpu:.2f}")
    finally:
        dist.destroy_process_group()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
