"""World size 2, gloo, real torchrun worker processes: training, commit, determinism, resume, preflight."""

from __future__ import annotations

import math
import shutil

import pytest

from trainer import checkpoint as ckpt
from trainer.data import shard_dataset
from trainer.supervisor import preflight_job, train_attempt

pytestmark = pytest.mark.distributed


@pytest.fixture
def prof(tiny_profile):
    return tiny_profile("tracking.enabled=false")


@pytest.fixture
def dataset_uri(prof):
    return shard_dataset(prof.data, prof.store).uri


def train(prof, run_name, dataset_uri):
    run = train_attempt(prof, run_name, dataset_uri)
    assert run.result is not None, "\n".join(run.outcome.tail)
    return run.result


def test_two_ranks_train_commit_and_reproduce(prof, dataset_uri):
    first = train(prof, "a", dataset_uri)
    assert first["world_size"] == 2 and first["final_step"] == 8 and first["start_step"] == 0
    assert 0 < first["val_loss"] < math.log(256)  # learned something beyond uniform guessing
    infos = ckpt.list_checkpoints(ckpt.checkpoints_uri(prof.store.root, "a"))
    assert [(i.step, i.valid) for i in infos] == [(4, True), (8, True)]
    assert infos[-1].manifest["model_digest"] == first["model_digest"]
    assert infos[-1].manifest["world_size"] == 2
    assert infos[-1].manifest["config_hash"] == prof.config_hash()
    assert {"rank-00000.pt", "rank-00001.pt"} <= {f.rsplit("/", 1)[-1] for f in infos[-1].manifest["files"]}

    second = train(prof, "b", dataset_uri)
    assert second["model_digest"] == first["model_digest"], "same profile and seed must give the same weights"


def test_resume_from_last_commit_is_bit_exact(prof, dataset_uri):
    full = train(prof, "full", dataset_uri)
    root = ckpt.checkpoints_uri(prof.store.root, "full")
    shutil.rmtree(ckpt.step_uri(root, 8))  # as if the attempt died between the two commits
    resumed = train(prof, "full", dataset_uri)
    assert resumed["start_step"] == 4
    assert resumed["resumed_from"].endswith("step-00000004")
    assert resumed["model_digest"] == full["model_digest"]


def test_different_seed_gives_different_weights(tiny_profile, prof, dataset_uri):
    base = train(prof, "s1", dataset_uri)
    other = train(tiny_profile("tracking.enabled=false", "train.seed=7"), "s2", dataset_uri)
    assert other["model_digest"] != base["model_digest"]


def test_preflight_reports_every_check_from_real_ranks(prof):
    job = preflight_job(prof)
    report = job.result
    assert report is not None, "\n".join(job.outcome.tail)
    assert report["ok"] and report["world_size"] == 2
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    checks = {c["name"]: c for c in report["checks"]}
    assert {"versions.python", "versions.torch", "collective.allreduce", "store.roundtrip", "store.free_disk"} <= set(checks)
    assert checks["collective.allreduce"]["busbw_gbps"] > 0


def test_preflight_fails_a_slow_collective(tiny_profile):
    job = preflight_job(tiny_profile("preflight.max_allreduce_ms=0.000001"))
    assert job.result is not None and not job.result["ok"]
    failed = [c["name"] for c in job.result["checks"] if c["status"] == "fail"]
    assert failed == ["collective.allreduce"]
