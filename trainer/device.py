"""One place that picks the device and the process-group backend, for training and preflight ranks."""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from trainpipe.trainer.config import ClusterConfig, Profile


@dataclass(frozen=True)
class Distributed:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def pick_device(cluster: ClusterConfig, local_rank: int) -> tuple[torch.device, str]:
    """(device, backend): CUDA with NCCL when asked for or available (``auto``), else CPU with gloo."""
    cuda = cluster.device == "cuda" or (cluster.device == "auto" and torch.cuda.is_available())
    backend = cluster.backend if cluster.backend != "auto" else ("nccl" if cuda else "gloo")
    return (torch.device("cuda", local_rank) if cuda else torch.device("cpu")), backend


def init_distributed(profile: Profile) -> Distributed:
    """Join torchrun's process group on the profile's device, with its collective timeout."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device, backend = pick_device(profile.cluster, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # Defaults wait 10-30 min in a stuck collective; the profile bounds it.
    dist.init_process_group(backend, timeout=dt.timedelta(seconds=profile.watchdog.pg_timeout_s))
    return Distributed(dist.get_rank(), dist.get_world_size(), local_rank, device)


# Dense bf16 peak FLOP/s of one device, by a name torch.cuda.get_device_name contains (vendor data sheets, SXM).
PEAK_BF16_FLOPS = {"B200": 2250e12, "H200": 989e12, "H100": 989e12, "A100": 312e12}


def peak_flops(cluster: ClusterConfig, device: torch.device) -> float | None:
    """One device's peak FLOP/s for MFU: the profile's, else a known GPU's, else None (no MFU)."""
    if cluster.peak_tflops:
        return cluster.peak_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)
    return None


def new_group(ranks: list[int] | None = None, **options: Any) -> dist.ProcessGroup:
    """``dist.new_group``, typed as the group every caller gets: its declared ``int`` is the answer to a rank
    outside ``ranks``, which only a call that every rank makes with all ranks, or a caller in ``ranks``, uses."""
    return cast(dist.ProcessGroup, dist.new_group(ranks, **options))
