"""World size 2, gloo, real torchrun worker processes: training, commit, determinism, resume, preflight."""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.conftest import TINY
from trainpipe.trainer.checkpoint import catalog
from trainpipe.trainer.checkpoint.chain import verify_run
from trainpipe.trainer.data.shard import shard_dataset
from trainpipe.trainer.orchestrate.policy import after_attempt
from trainpipe.trainer.profile_files import load_profile
from trainpipe.trainer.store_paths import RunPaths
from trainpipe.trainer.supervise.attempt import preflight_job, train_attempt

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("warm_module")]


def train(prof, run_name, dataset_uri, **kw):
    run = train_attempt(prof, run_name, dataset_uri, **kw)
    assert run.result is not None, "\n".join(run.job.tail)
    return run.result


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run "a" of the tiny profile: (profile, dataset URI, result). Tests copy it to change it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRAINPIPE_HOME", str(tmp_path_factory.mktemp("distributed") / "home"))
        prof = load_profile("local", [*TINY, "tracking.enabled=false"])
        dataset_uri = shard_dataset(prof.data, prof.store).uri
        yield prof, dataset_uri, train(prof, "a", dataset_uri)


def copy_run(prof, src: str, dst: str) -> RunPaths:
    shutil.copytree(RunPaths(prof.store.root, src).dir, RunPaths(prof.store.root, dst).dir)
    return RunPaths(prof.store.root, dst)


def test_two_ranks_train_commit_and_reproduce(reference):
    prof, dataset_uri, first = reference
    assert first.world_size == 2 and first.final_step == 8 and first.start_step == 0
    assert 0 < first.val_loss < math.log(256)  # learned something beyond uniform guessing
    infos = catalog.list_checkpoints(RunPaths(prof.store.root, "a").checkpoints)
    assert [(i.step, i.valid) for i in infos] == [(4, True), (8, True)]
    assert infos[-1].manifest["model_digest"] == first.model_digest
    assert infos[-1].manifest["world_size"] == 2
    assert infos[-1].manifest["config_hash"] == prof.config_hash()
    assert {"rank-00000.pt", "rank-00001.pt"} <= {f.rsplit("/", 1)[-1] for f in infos[-1].manifest["files"]}

    second = train(prof, "b", dataset_uri)
    assert second.model_digest == first.model_digest, "same profile and seed must give the same weights"


def test_a_retry_after_the_final_commit_finishes_without_training_or_a_false_hang(reference):
    """The end of an attempt (flush, barrier, teardown) has its own allowance: a 1 s hang allowance must not fire."""
    prof, dataset_uri, first = reference
    copy_run(prof, "a", "done")
    strict = prof.model_copy(update={"watchdog": prof.watchdog.model_copy(update={"hang_timeout_s": 1.0})})
    run = train_attempt(strict, "done", dataset_uri)
    assert run.result is not None and run.incident is None and run.findings == [], run.findings
    assert run.result.start_step == 8 and run.result.final_step == 8 and run.result.step_starts_s == []
    assert run.result.model_digest == first.model_digest


def test_resume_from_last_commit_is_bit_exact(reference):
    prof, dataset_uri, full = reference
    run = copy_run(prof, "a", "full")
    shutil.rmtree(run.checkpoint(8))  # as if the attempt died between the two commits
    resumed = train(prof, "full", dataset_uri)
    assert resumed.start_step == 4
    assert resumed.resumed_from.endswith("step-00000004")
    assert resumed.model_digest == full.model_digest


def test_a_ranks_own_error_ends_the_attempt_as_data_and_is_not_retried(reference, tmp_path, monkeypatch):
    prof, dataset_uri, _ = reference
    broken = tmp_path / "dataset"
    shutil.copytree(dataset_uri, broken)  # its manifest alone: the pieces it names are not beside it
    assert not (tmp_path / "pieces").exists()
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    run = train_attempt(prof, "broken", str(broken))
    # torchrun's log folder held the ranks' error files read below, and went with the agent
    assert not list((tmp_path / "tmp").glob("*torchelastic*")), list((tmp_path / "tmp").iterdir())
    assert run.result is None
    incident = run.incident
    assert (incident.kind, incident.error, incident.ranks) == ("error", "DataError", [0, 1]), incident
    assert re.match(r"shard pieces/[0-9a-f]{32}/train-0000", incident.detail), incident.detail
    assert "is missing; re-run `trainpipe shard`" in incident.detail
    decision = after_attempt(incident, [], prof)
    assert decision.action == "stop" and decision.reason == f"DataError on rank 0: {incident.detail}"


def test_torchruns_log_folder_lies_in_the_attempts_job_folder_which_the_supervisor_removes(tmp_path, monkeypatch):
    """An agent killed before its own cleanup (SIGKILL, its process group torn down) leaves its log folder in the
    job folder, which the supervisor's attempt removes; a bare agent makes one in the temporary folder."""
    from trainpipe.trainer.protocol import AGENT_REPORT_ENV
    from trainpipe.trainer.supervise.agent import torchelastic_logs

    (tmp_path / "job").mkdir()
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    monkeypatch.setenv(AGENT_REPORT_ENV, str(tmp_path / "job"))
    assert Path(torchelastic_logs()).parent == tmp_path / "job"
    monkeypatch.delenv(AGENT_REPORT_ENV)
    assert Path(torchelastic_logs()).parent == tmp_path / "tmp"


def test_different_seed_gives_different_weights(reference):
    prof, dataset_uri, base = reference
    other = train(prof.model_copy(update={"train": prof.train.model_copy(update={"seed": 7})}), "s2", dataset_uri)
    assert other.model_digest != base.model_digest


def test_bf16_autocast_trains_to_a_nearby_loss_and_mfu_is_reported_against_the_devices_peak(reference):
    prof, dataset_uri, base = reference
    bf16 = prof.model_copy(
        update={
            "train": prof.train.model_copy(update={"precision": "bf16"}),
            "cluster": prof.cluster.model_copy(update={"peak_tflops": 0.01}),  # a CPU core: ~10 GFLOP/s
        }
    )
    result = train(bf16, "bf16", dataset_uri)
    assert result.model_digest != base.model_digest  # the forward really ran in bfloat16
    assert abs(result.val_loss - base.val_loss) < 0.1  # and learned about as much
    assert 0 < result.mfu < 1 and base.mfu is None  # no peak known for a CPU unless the profile says


def test_preflight_reports_every_check_from_real_ranks(reference):
    prof, _, _ = reference
    job = preflight_job(prof)
    report = job.report
    assert report is not None, "\n".join(job.job.tail)
    assert report["ok"] and report["world_size"] == 2
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    checks = {c["name"]: c for c in report["checks"]}
    assert {"versions.python", "versions.torch", "collective.allreduce", "store.roundtrip", "store.free_disk"} <= set(
        checks
    )
    assert checks["collective.allreduce"]["busbw_gbps"] > 0


def test_preflight_fails_a_slow_collective(tiny_profile):
    job = preflight_job(tiny_profile("preflight.max_allreduce_ms=0.000001"))
    assert job.report is not None and not job.report["ok"]
    failed = [c["name"] for c in job.report["checks"] if c["status"] == "fail"]
    assert failed == ["collective.allreduce"]


def test_truncated_newest_checkpoint_falls_back_to_the_previous_one(reference):
    prof, dataset_uri, full = reference
    run = copy_run(prof, "a", "trunc")
    newest = run.checkpoint(8)
    victim = sorted(Path(newest).glob("*.distcp"))[-1]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    resumed = train(prof, "trunc", dataset_uri)
    assert resumed.resumed_from.endswith("step-00000004")
    assert [s.uri for s in resumed.skipped_checkpoints] == [newest]
    assert victim.name in resumed.skipped_checkpoints[0].reason
    assert resumed.model_digest == full.model_digest
    assert catalog.inspect_checkpoint(newest).valid  # rewritten by the resumed attempt, with a warning


def test_when_no_checkpoint_loads_the_run_starts_over_as_if_fresh(reference):
    """Both checkpoints fail as their last file is read, after the first file's weights went in: the attempt
    starts from the seeded state again, and ends with the uninterrupted run's weights."""
    prof, dataset_uri, full = reference
    run = copy_run(prof, "a", "none-left")
    for step in (4, 8):
        victim = sorted(Path(run.checkpoint(step)).glob("*.distcp"))[-1]
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    again = train(prof, "none-left", dataset_uri)
    assert again.start_step == 0 and again.resumed_from is None
    assert [s.uri for s in again.skipped_checkpoints] == [run.checkpoint(8), run.checkpoint(4)]
    assert again.model_digest == full.model_digest


def _trace(folder: Path) -> tuple[dict[int, list[int]], dict[int, float]]:
    """(step -> sample ids consumed by all ranks together in rank order, step -> global mean loss)."""
    per_step: dict[int, list[tuple[int, list[int]]]] = {}
    losses: dict[int, float] = {}
    for f in sorted(folder.glob("rank-*.jsonl")):
        rank = int(f.stem.split("-")[1])
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            per_step.setdefault(rec["step"], []).append((rank, rec["ids"]))
            losses[rec["step"]] = rec["loss"]
    return {s: [i for _, ids in sorted(v) for i in ids] for s, v in per_step.items()}, losses


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_elastic_resume_continues_the_same_sample_sequence(tiny_profile, tmp_path, before, after):
    def profile(n: int):
        return tiny_profile("tracking.enabled=false", f"cluster.procs_per_node={n}")

    dataset_uri = shard_dataset(profile(before).data, profile(before).store).uri
    (tmp_path / "ref").mkdir()
    first = train(profile(before), "el", dataset_uri, env={"TRAINPIPE_TRACE_SAMPLES": str(tmp_path / "ref")})
    assert first.final_step == 8
    shutil.rmtree(RunPaths(profile(before).store.root, "el").checkpoint(8))
    (tmp_path / "el").mkdir()
    res = train(profile(after), "el", dataset_uri, env={"TRAINPIPE_TRACE_SAMPLES": str(tmp_path / "el")})
    assert res.world_size == after and res.start_step == 4
    # The state hash is the same at either world size, and the ledger of the final checkpoint is the sample order's.
    assert res.resume_verified is True
    store = profile(after).store
    report = verify_run("el", RunPaths(store.root, "el").checkpoints, store.root, store.storage_options, [])
    assert report.holds, report.line()
    assert report.checked[-1].step == 8 and report.checked[-1].samples == 8 * 8, report.as_dict()
    (ref_ids, ref_losses), (el_ids, el_losses) = _trace(tmp_path / "ref"), _trace(tmp_path / "el")
    assert sorted(el_ids) == [5, 6, 7, 8]
    for step in el_ids:
        assert el_ids[step] == ref_ids[step], f"step {step} consumed different samples"
        assert abs(el_losses[step] - ref_losses[step]) <= 1e-4 * abs(ref_losses[step]), step
