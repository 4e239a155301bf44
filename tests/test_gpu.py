"""The GPU path where CUDA exists: NCCL, bf16 autocast, CUDA RNG states in checkpoints, CUDA-event compute times
and step splits, perf/mfu against the device's known peak; DDP and FSDP2 resume bit-exactly after a SIGKILL.
Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY
from trainpipe.trainer.data.shard import shard_dataset
from trainpipe.trainer.profile_files import load_profile
from trainpipe.trainer.supervise.attempt import train_attempt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


def gpu_profile(*more: str):
    gpus = max(torch.cuda.device_count(), 1)
    return load_profile(
        "local",
        [
            *TINY,
            "tracking.enabled=false",
            "cluster.device=cuda",
            "cluster.backend=nccl",
            f"cluster.procs_per_node={gpus}",
            f"train.global_batch={8 * gpus}",
            "train.precision=bf16",
            "train.steps=12",
            "checkpoint.every_steps=4",
            "checkpoint.async=false",
            "watchdog.straggler_window=3",
            *more,
        ],
    )


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_nccl_bf16_training_reports_mfu_and_resumes_bit_exactly_after_a_sigkill(home, strategy):
    prof = gpu_profile(f"train.strategy={strategy}")
    dataset_uri = shard_dataset(prof.data, prof.store).uri
    reference = train_attempt(prof, "reference", dataset_uri)
    assert reference.result is not None, "\n".join(reference.job.tail)
    assert reference.result.mfu is None or 0 < reference.result.mfu < 1  # None: a GPU without a known peak
    assert reference.scores  # compute times from CUDA events reached the watchdog
    # ... and each step's split, its collective waits timed by CUDA events, reached the data-stall and network checks
    assert any(w.get("comm_ms") for w in reference.scores), reference.scores

    kill = ["faults.kind=crash", "faults.step=10", f"faults.rank={prof.cluster.world_size - 1}", "faults.attempts=1"]
    killed_prof = gpu_profile(f"train.strategy={strategy}", *kill)
    killed = train_attempt(killed_prof, "killed", dataset_uri)
    assert killed.result is None and killed.incident.kind == "crash"
    resumed = train_attempt(killed_prof, "killed", dataset_uri, attempt=2)
    assert resumed.result is not None, "\n".join(resumed.job.tail)
    assert resumed.result.start_step == 8
    assert resumed.result.model_digest == reference.result.model_digest
