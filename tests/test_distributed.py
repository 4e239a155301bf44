"""World size 2, gloo, real torchrun worker processes: training, commit, determinism, resume, preflight."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

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


def test_truncated_newest_checkpoint_falls_back_to_the_previous_one(prof, dataset_uri):
    full = train(prof, "trunc", dataset_uri)
    root = ckpt.checkpoints_uri(prof.store.root, "trunc")
    newest = ckpt.step_uri(root, 8)
    victim = sorted(Path(newest).glob("*.distcp"))[-1]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    resumed = train(prof, "trunc", dataset_uri)
    assert resumed["resumed_from"].endswith("step-00000004")
    assert [s["uri"] for s in resumed["skipped_checkpoints"]] == [newest]
    assert victim.name in resumed["skipped_checkpoints"][0]["reason"]
    assert resumed["model_digest"] == full["model_digest"]
    assert ckpt.inspect_checkpoint(newest).valid  # rewritten by the resumed attempt, with a warning


def _trace(folder: Path) -> dict[int, list[int]]:
    """step -> sample ids consumed by all ranks together, in rank order."""
    per_step: dict[int, list[tuple[int, list[int]]]] = {}
    for f in sorted(folder.glob("rank-*.jsonl")):
        rank = int(f.stem.split("-")[1])
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            per_step.setdefault(rec["step"], []).append((rank, rec["ids"]))
    return {s: [i for _, ids in sorted(v) for i in ids] for s, v in per_step.items()}


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_elastic_resume_continues_the_same_sample_sequence(tiny_profile, dataset_uri, tmp_path, before, after):
    profile = lambda n: tiny_profile("tracking.enabled=false", f"cluster.procs_per_node={n}")  # noqa: E731
    (tmp_path / "ref").mkdir()
    ref = train_attempt(profile(before), "ref", dataset_uri, env={"TRAINPIPE_TRACE_SAMPLES": str(tmp_path / "ref")}).result
    (tmp_path / "el").mkdir()
    first = train_attempt(profile(before), "el", dataset_uri).result
    assert first["final_step"] == 8
    shutil.rmtree(ckpt.step_uri(ckpt.checkpoints_uri(profile(before).store.root, "el"), 8))
    resumed = train_attempt(profile(after), "el", dataset_uri, env={"TRAINPIPE_TRACE_SAMPLES": str(tmp_path / "el")})
    assert resumed.result is not None, "\n".join(resumed.outcome.tail)
    res = resumed.result
    assert res["world_size"] == after and res["start_step"] == 4
    ref_ids, el_ids = _trace(tmp_path / "ref"), _trace(tmp_path / "el")
    assert sorted(el_ids) == [5, 6, 7, 8]
    for step in el_ids:
        assert el_ids[step] == ref_ids[step], f"step {step} consumed different samples"
    for step, loss in res["losses"].items():
        assert abs(loss - ref["losses"][step]) <= 1e-4 * abs(ref["losses"][step]), step
