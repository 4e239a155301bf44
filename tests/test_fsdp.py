"""train.strategy=fsdp: FSDP2 shards the weights and the optimizer state over the ranks (gloo on CPU, real torchrun).

It trains, writes sharded checkpoints, resumes bit-exactly after a SIGKILL, resumes on another world size, and the
checkpoint validates in one process.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import TINY
from trainpipe.trainer.checkpoint import catalog
from trainpipe.trainer.checkpoint.validate import validate_checkpoint
from trainpipe.trainer.data.shard import shard_dataset
from trainpipe.trainer.profile_files import load_profile
from trainpipe.trainer.store_paths import RunPaths
from trainpipe.trainer.supervise.attempt import train_attempt

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("warm_module")]

FSDP = [
    *TINY,
    "tracking.enabled=false",
    "train.strategy=fsdp",
    "model.n_layer=2",
    "train.steps=12",
    "checkpoint.every_steps=4",
    "watchdog.straggler_window=3",
    "checkpoint.async=false",  # step 8 is committed before the kill at step 10, whatever the timing
]
KILL = ["faults.kind=crash", "faults.step=10", "faults.rank=1", "faults.attempts=1"]  # SIGKILLs itself


def test_fsdp_trains_sharded_resumes_bit_exactly_after_a_sigkill_and_on_one_rank(home):
    prof = load_profile("local", FSDP)
    dataset_uri = shard_dataset(prof.data, prof.store).uri
    reference = train_attempt(prof, "reference", dataset_uri)
    assert reference.result is not None, "\n".join(reference.job.tail)

    # Sharded: each rank wrote its own half of the weights and optimizer state (DDP's rank 1 writes almost nothing).
    step8 = Path(RunPaths(prof.store.root, "reference").checkpoint(8))
    sizes = sorted(p.stat().st_size for p in step8.glob("*.distcp"))
    assert len(sizes) == 2 and sizes[0] > 0.4 * sum(sizes), sizes
    # Every rank beaconed its compute time with FSDP's collectives left out: straggler windows were scored.
    assert reference.scores and set(reference.scores[-1]["score"]) == {0, 1}

    killed_prof = load_profile("local", [*FSDP, *KILL])
    killed = train_attempt(killed_prof, "killed", dataset_uri)
    assert killed.result is None and killed.incident.kind == "crash" and killed.incident.rank == 1
    assert "SIGKILL" in killed.incident.detail
    shutil.copytree(RunPaths(prof.store.root, "killed").dir, RunPaths(prof.store.root, "one-rank").dir)

    resumed = train_attempt(killed_prof, "killed", dataset_uri, attempt=2)
    assert resumed.result is not None, "\n".join(resumed.job.tail)
    assert resumed.result.start_step == 8 and resumed.result.final_step == 12
    assert resumed.result.model_digest == reference.result.model_digest

    # The sharded checkpoint of two ranks, resharded onto one by DCP.
    one = train_attempt(load_profile("local", [*FSDP, "cluster.procs_per_node=1"]), "one-rank", dataset_uri)
    assert one.result is not None, "\n".join(one.job.tail)
    assert (one.result.start_step, one.result.final_step, one.result.world_size) == (8, 12, 1)

    checked = validate_checkpoint(resumed.result.checkpoint_uri, prof)
    assert checked["model_digest"] == reference.result.model_digest and checked["world_size"] == 2
    assert [i.step for i in catalog.list_checkpoints(RunPaths(prof.store.root, "killed").checkpoints)] == [4, 8, 12]
