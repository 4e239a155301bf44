"""The quiet faults with real ranks under torchrun (gloo): a loss spike rolled back past its data, a flipped bit on
one replica, a flat loss, a starved data loader, a slow collective. Each is a drill under ``faults``; the pure
decisions are in tests/test_health.py."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from tests.conftest import DRILL, NO_PUBLISH, TINY, run_cli
from tests.fault_proxy import FaultProxy
from trainpipe.trainer.checkpoint import catalog
from trainpipe.trainer.data.sampler import DataSkip
from trainpipe.trainer.data.shard import shard_dataset
from trainpipe.trainer.orchestrate.policy import after_attempt, with_rollbacks
from trainpipe.trainer.profile_files import load_profile
from trainpipe.trainer.store_paths import RunPaths
from trainpipe.trainer.supervise import gpu_use
from trainpipe.trainer.supervise.attempt import train_attempt

pytestmark = [pytest.mark.drill, pytest.mark.usefixtures("warm_module")]


def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def test_a_loss_spike_rolls_back_past_its_data_and_the_run_stays_deterministic(home):
    """The spike at step 25 ends the attempt at that step; the retry resumes from step 20 and reads the data after
    step 25's for steps 21-25. The skip is in the records and every later manifest, so resuming from a checkpoint
    after the rollback trains the same weights."""
    spike = (
        *TINY,
        "train.steps=40",
        "checkpoint.every_steps=10",
        "faults.kind=loss_spike",
        "faults.rank=1",
        "faults.step=25",
        "faults.factor=30",
        "watchdog.health_window=10",
        "train.max_retries=1",
        "preflight.enabled=false",
        NO_PUBLISH,
    )
    proc = run_cli("run", *sets(*spike), "--run-name", "spiky", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = RunPaths(str(home / "store"), "spiky")
    incidents = json.loads((home / "store" / "runs" / "spiky" / "incidents.json").read_text())
    assert [(i["kind"], i["step"], i["fatal"]) for i in incidents] == [("loss_spike", 25, True)]
    assert "15" in incidents[0]["detail"] or "x its median" in incidents[0]["detail"]
    assert json.loads((home / "store" / "runs" / "spiky" / "rollbacks.json").read_text()) == [25]
    assert "skips the data" in proc.stderr
    final = catalog.inspect_checkpoint(run.checkpoint(40))
    skip = {"after_step": 20, "steps": 5, "spike_step": 25}
    assert final.valid and final.manifest["data_position"]["skips"] == [skip]
    assert final.manifest["data_position"]["samples_consumed"] == (40 + 5) * 8

    # Resume from the checkpoint of step 30 (after the rollback): the same final weights.
    shutil.rmtree(run.checkpoint(40))
    prof = with_rollbacks(load_profile("local", [*spike[:-3], "faults.kind=none", "tracking.enabled=false"]), [25])
    again = train_attempt(prof, "spiky", final.manifest["dataset_uri"], attempt=3)
    assert again.result is not None, "\n".join(again.job.tail)
    assert again.result.start_step == 30 and again.result.data_skips == [DataSkip(**skip)]
    assert again.result.model_digest == final.manifest["model_digest"]


def test_a_flipped_bit_on_one_replica_is_sdc_before_any_commit_and_the_retry_trains_the_undisturbed_weights(
    home, drill_digest
):
    prof = load_profile(
        "local",
        [
            *DRILL,
            "tracking.enabled=false",
            "faults.kind=bitflip",
            "faults.rank=1",
            "faults.step=15",
            "faults.attempts=1",
            "watchdog.sdc_every=10",
        ],
    )
    uri = shard_dataset(prof.data, prof.store).uri
    first = train_attempt(prof, "flipped", uri)
    found = first.incident
    assert found is not None and (found.kind, found.step, found.ranks) == ("sdc", 20, [0, 1]), first.job.tail[-20:]
    assert "wte.weight" in found.detail and "rolls back to the newest checkpoint" in found.detail
    steps = [c.step for c in catalog.list_checkpoints(RunPaths(prof.store.root, "flipped").checkpoints)]
    assert steps == [10]  # the checkpoint of step 20 was never written
    decision = after_attempt(found, [], prof)
    assert decision.action == "retry"
    second = train_attempt(prof, "flipped", uri, attempt=2)
    assert second.result is not None and second.result.start_step == 10
    assert second.result.model_digest == drill_digest  # bit for bit the run without the fault


def test_a_flat_loss_is_a_flatline_warning_and_training_goes_on(tiny_profile):
    prof = tiny_profile("train.steps=60", "train.lr=1e-9", "watchdog.flatline_steps=30", "tracking.enabled=false")
    run = train_attempt(prof, "flat", shard_dataset(prof.data, prof.store).uri)
    assert run.result is not None and run.result.final_step == 60
    flat = {f.phase: f for f in run.findings if f.kind == "flatline"}
    assert sorted(flat) == ["eval", "optimizer"] and not any(f.fatal for f in flat.values()), run.findings
    assert 30 <= flat["optimizer"].step <= 45  # the training loss, from rank 0's beacons
    assert flat["eval"].step == 36 and "across the 8 evaluations of steps 8-36" in flat["eval"].detail  # every 4


def test_a_slow_bucket_is_a_data_stall_on_every_rank_saying_the_time_went_to_fetching_shards(
    s3_endpoint, s3_bucket, monkeypatch, tiny_profile
):
    """Real S3 (moto_server) behind the fault proxy, each train shard's GET held 50 ms: with 1,024-token shards
    every step fetches new ones, so both ranks wait for data most of each step, and the incident says where."""
    bucket, _ = s3_bucket
    with FaultProxy(int(s3_endpoint.rsplit(":", 1)[1])) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)  # the ranks reach the store through the proxy
        prof = tiny_profile(
            f"store.root=s3://{bucket}/tp",
            "data.shard_tokens=1024",
            "train.steps=30",
            "train.eval_every=0",
            "checkpoint.every_steps=30",
            "watchdog.straggler_window=5",
            "tracking.enabled=false",
        )
        uri = shard_dataset(prof.data, prof.store).uri
        proxy.delay_s, proxy.delay_matching = 0.05, "/train-"
        run = train_attempt(prof, "slow-bucket", uri)
    assert run.result is not None, "\n".join(run.job.tail)
    stalls = [f for f in run.findings if f.kind == "data_stall"]
    assert sorted(f.rank for f in stalls) == [0, 1] and "network" not in {f.kind for f in run.findings}, run.findings
    for f in stalls:
        assert "in the last window: " in f.detail and "% fetching shards from the store, " in f.detail, f.detail
        shares = f.detail.split("in the last window: ", 1)[1]
        assert shares.split(", ")[0].endswith("fetching shards from the store"), f.detail  # the largest part


def test_gpus_near_idle_while_steps_slow_down_are_a_gpu_idle_warning(tiny_profile, tmp_path, monkeypatch):
    """NVML's stand-in (recorded states, the one seam) says both GPUs are busy, then 3-4% busy once the steps
    slowed down ~10x from step 25 (a rank's data read held): the supervisor's sampler and the watchdog name them.
    (On real GPUs the rank waiting in a collective for the starved one would count as busy: the seam tests the
    sampler, the link and the judgement, not what NVML would say of this drill.)"""
    recorded = tmp_path / "states.json"

    def states(*pcts: int) -> None:
        recorded.write_text(json.dumps([{"index": i, "utilization_pct": p} for i, p in enumerate(pcts)]))

    def on_progress(progress: dict[int, dict]) -> None:
        if progress.get(0, {}).get("step", 0) >= 30:
            states(3, 4)

    states(92, 95)
    monkeypatch.setenv("TRAINPIPE_NVML_STATES", str(recorded))
    monkeypatch.setattr(gpu_use, "SAMPLE_S", 0.2)  # the supervisor runs in this process: its sampler, 10x faster
    monkeypatch.setattr(gpu_use, "WINDOW_S", 1.0)
    prof = tiny_profile(
        "train.steps=60",
        "train.eval_every=0",
        "faults.kind=slow_data",
        "faults.rank=1",
        "faults.step=25",
        "faults.step_delay_s=0.2",
        "tracking.enabled=false",
    )
    run = train_attempt(prof, "idle-gpus", shard_dataset(prof.data, prof.store).uri, on_progress=on_progress)
    assert run.result is not None
    idle = [f for f in run.findings if f.kind == "gpu_idle"]
    assert len(idle) == 1 and idle[0].ranks == [0, 1] and not idle[0].fatal, run.findings
    assert "were 4% busy" in idle[0].detail or "were 3% busy" in idle[0].detail


@pytest.mark.parametrize(
    ("drill", "kind", "ranks", "says"),
    [
        ("slow_data", "data_stall", [1], "waits for its data"),  # the starved rank
        ("slow_network", "network", [0, 1], "while compute and data stay flat"),  # every rank waits in collectives
    ],
)
def test_a_starved_loader_is_a_data_stall_and_a_slow_collective_a_network_incident_never_a_straggler(
    tiny_profile, drill, kind, ranks, says
):
    prof = tiny_profile(
        "train.steps=40",
        f"faults.kind={drill}",
        "faults.rank=1",
        "faults.step=12",
        "faults.step_delay_s=0.15",
        "watchdog.straggler_window=5",
        # The starved rank waits 150 ms a step, 30x this tiny model's ~5 ms of compute: a check that counted that
        # wait as compute would still name it at 8x. Below 8x is a shared 2-core machine's noise: with the other
        # test worker busy, one rank's median compute was 3.1x the other's for two windows (19 ms vs 6 ms).
        "watchdog.straggler_factor=8",
        "tracking.enabled=false",
    )
    run = train_attempt(prof, drill, shard_dataset(prof.data, prof.store).uri)
    assert run.result is not None
    assert [(f.kind, f.ranks) for f in run.findings] == [(kind, ranks)], run.findings
    assert says in run.findings[0].detail and run.findings[0].step <= 30  # within two windows of the fault


def test_the_first_step_after_a_resume_replays_the_saved_loss_and_a_difference_is_sdc(tiny_profile):
    """Each checkpoint records the loss of the step after it; a resume trains that step again and must get the
    same bits. A one-ulp change of the record stands for a device that computed differently."""
    prof = tiny_profile("train.steps=30", "checkpoint.every_steps=10", "tracking.enabled=false")
    uri = shard_dataset(prof.data, prof.store).uri
    assert train_attempt(prof, "replayed", uri).result is not None
    run = RunPaths(prof.store.root, "replayed")
    record = catalog.inspect_checkpoint(run.checkpoint(20)).manifest["replay"]
    assert record["step"] == 21 and isinstance(record["loss"], float)

    shutil.rmtree(run.checkpoint(30))
    again = train_attempt(prof, "replayed", uri, attempt=2)
    assert again.incident is None and again.result.start_step == 20  # replayed: the same loss

    shutil.rmtree(run.checkpoint(30))
    manifest = Path(run.checkpoint(20)) / "trainpipe.json"
    body = json.loads(manifest.read_text())
    body["replay"]["loss"] = math.nextafter(record["loss"], math.inf)
    manifest.write_text(json.dumps(body))
    third = train_attempt(prof, "replayed", uri, attempt=3)
    found = third.incident
    assert found is not None and (found.kind, found.phase, found.step) == ("sdc", "replay", 21), third.job.tail[-20:]
    assert "the first after resuming from step 20" in found.detail
    decision = after_attempt(found, [found], prof)
    assert decision.action == "stop" and "happened again on the retry" in decision.reason
