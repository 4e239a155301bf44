"""Recovery figures, goodput and the run summary (trainer/orchestrate/summary.py) from recorded attempts: pure logic."""

from __future__ import annotations

import pytest

from tests.conftest import SUMMARY_FIELDS, train_result
from trainpipe.trainer.incidents import AttemptRecord, Incident
from trainpipe.trainer.orchestrate.badput import BUCKETS, Badput
from trainpipe.trainer.orchestrate.summary import (
    Recovery,
    Trained,
    badput_line,
    badput_markdown,
    build_summary,
    chains_markdown,
    failed_attempts,
    incident_chains,
    recovery,
    resumes_verified,
)
from trainpipe.trainer.profile_files import load_profile


def failed(attempt: int, start: int, first_at: float, last_step: int, at: float, kind: str = "crash") -> AttemptRecord:
    return AttemptRecord(
        attempt=attempt,
        start_step=start,
        first_step_at=first_at,
        last_step=last_step,
        incident=Incident(kind=kind, detail=kind, rank=1, at=at, attempt=attempt),
    )


def test_two_faults_then_success():
    # attempt 1: steps 1-17 begun, died at t=100; attempt 2 resumed at 10 (first step t=104), reached 23, hung,
    # declared at t=130;
    # attempt 3 resumed at 20 with its first step at t=137.
    one, two = failed(1, 0, 50.0, 17, 100.0), failed(2, 10, 104.0, 23, 130.0, "hang")
    ok = AttemptRecord(attempt=3, start_step=20, first_step_at=137.0, last_step=40)
    r = recovery([one, two], ok, final_step=40, step_s=0.5)
    assert r.recoveries == 2 and r.lost_steps == (17 - 10) + (23 - 20)
    assert r.recovery_s == pytest.approx(7.0)  # the last fault: detected at 130, training again at 137
    assert r.wasted_s == {one.incident.id: pytest.approx(7 * 0.5 + 4.0), two.incident.id: pytest.approx(3 * 0.5 + 7.0)}
    assert r.steps_this_run == 40  # this pipeline run began at step 0


def test_no_fault_no_recovery():
    ok = AttemptRecord(attempt=1, start_step=30, first_step_at=10.0, last_step=60)
    r = recovery([], ok, final_step=60, step_s=0.1)
    assert (r.recoveries, r.lost_steps, r.recovery_s, r.wasted_s, r.steps_this_run) == (0, 0, 0.0, {}, 30)


def test_this_runs_failed_attempts_are_the_records_just_before_the_current_one():
    earlier_run = [failed(1, 0, 1.0, 5, 2.0), AttemptRecord(attempt=2, start_step=0, first_step_at=3.0, last_step=8)]
    this_run = [failed(1, 8, 10.0, 12, 11.0), failed(2, 10, 12.0, 14, 13.0), AttemptRecord(attempt=3, start_step=10)]
    records = earlier_run + this_run
    assert failed_attempts(records, 3) == this_run[:2]
    assert failed_attempts([*records[:-2], AttemptRecord(attempt=1, start_step=8)], 1) == []


def test_the_summary_says_where_the_time_went_for_the_run_and_each_attempt():
    buckets = {**dict.fromkeys(BUCKETS, 0.0), "startup": 12.0, "orchestration": 8.0, "wasted_progress": 5.0}
    attempts = [{"attempt": 1.0, "startup": 6.0, "wasted_progress": 5.0}, {"attempt": 2.0, "startup": 6.0}]
    s = {"badput": Badput(100.0, 75.0, buckets, attempts).as_dict()}
    assert badput_line(s) == "productive 75%, startup 12%, orchestration 8%, wasted progress 5%"
    md = badput_markdown(s)
    assert "| | run | share | attempt 1 | attempt 2 |" in md and "| startup | 12.0 s | 12% | 6.0 s | 6.0 s |" in md
    assert "| wasted progress | 5.0 s | 5% | 5.0 s | |" in md and "| other |" not in md  # nothing: no row


def test_summary_costs_each_fatal_incident_and_keeps_the_others(home):
    prof = load_profile("local", ["cost.gpu_hour_usd=3.6"])
    crash = Incident(kind="crash", detail="rank 1 killed by SIGKILL", rank=1)
    warning = Incident(kind="straggler", detail="slow", rank=0, fatal=False)
    trained = Trained(
        result=train_result(step_s_median=0.5),
        attempt=2,
        recovery=Recovery(recoveries=1, lost_steps=4, recovery_s=3.0, wasted_s={crash.id: 5.0}, steps_this_run=100),
    )
    validated = {"uri": "s3://b/runs/r/checkpoints/step-00000100", "step": 100, "val_loss": 1.5, "model_digest": "d"}
    badput = Badput(100.0, 50.0, dict.fromkeys(BUCKETS, 0.0) | {"startup": 50.0}, [])
    s = build_summary(
        prof, trained, validated, [warning, crash], run_name="r", mlflow_run_id="m", dataset_id="d", badput=badput
    )
    assert set(s) >= SUMMARY_FIELDS
    assert [i["kind"] for i in s["incidents"]] == ["straggler", "crash"]
    assert s["incidents"][1]["wasted_s"] == 5.0 and s["incidents"][0]["wasted_s"] is None
    usd = 5.0 * 3.6 * prof.cluster.world_size / 3600
    assert s["incidents"][1]["wasted_usd"] == pytest.approx(usd) and s["wasted_usd"] == pytest.approx(usd)
    assert s["goodput"] == pytest.approx(0.5) and s["wasted_s"] == 5.0


def test_each_failed_attempt_is_a_chain_from_its_fault_to_the_first_resumed_step():
    crash = Incident(kind="crash", detail="rank 1 killed by SIGKILL", rank=1, at=110.0)
    one = AttemptRecord(
        attempt=1,
        launched_at=90.0,
        first_step_at=95.0,
        last_step=17,
        fault_at=109.5,
        ended_at=112.0,
        incident=crash,
        decision="retry",
        decided_at=112.5,
        task_run_id="tr-1",
        job="torchrun pid 42 on h|x",
    )
    two = AttemptRecord(
        attempt=2, start_step=10, launched_at=115.0, first_step_at=118.0, last_step=40, resume_verified=True
    )
    trained = Trained(
        result=train_result(step_s_median=0.5),
        attempt=2,
        recovery=Recovery(recoveries=1, lost_steps=7, recovery_s=8.0, wasted_s={crash.id: 11.5}, steps_this_run=40),
        attempts=[one, two],
    )
    [chain] = incident_chains(trained, usd_per_s=0.01)
    assert (chain["detection_s"], chain["decision_s"], chain["resume_s"], chain["fault_to_resume_s"]) == (
        0.5,
        2.5,
        5.5,
        8.5,
    )
    assert (chain["lost_steps"], chain["lost_s"], chain["lost_usd"]) == (7, 11.5, 0.115)
    assert (chain["task_run_id"], chain["decision"], chain["kind"], chain["rank"]) == ("tr-1", "retry", "crash", 1)
    md = chains_markdown({"incident_chains": [chain]})
    assert (
        "| 1 | crash | +0.50 s | +2.50 s | +5.50 s | 7 steps, 11.5 s | retry | verified | tr-1 "
        "| torchrun pid 42 on h\\|x |" in md
    )
    assert resumes_verified([one, two]) == "1/1" and resumes_verified([one]) is None
    unproven = two.model_copy(update={"resume_verified": False})
    assert resumes_verified([one, unproven]) == "0/1"
    assert incident_chains(trained.model_copy(update={"attempts": [one, unproven]}))[0]["resume"].startswith("not")
    assert incident_chains(trained.model_copy(update={"attempts": [two]})) == []
    forged = {**chain, "decision": "retry\n\n# Validated OK\n[details](https://x)", "task_run_id": "`| a | b"}
    md = chains_markdown({"incident_chains": [forged]})
    assert [line for line in md.splitlines() if line.startswith("#")] == ["## From fault to resumed training"]
    assert "\\[details](https" in md and "\\`\\| a \\| b" in md  # no link, no code span, no extra column
    assert len(md.strip().splitlines()) == 5  # the heading, a blank line, the header, its rule and one row
