"""Where a run's wall time went (trainer/orchestrate/badput.py): pure logic over marks, records and a result."""

from __future__ import annotations

import pytest

from trainpipe.trainer.incidents import AttemptRecord, Incident
from trainpipe.trainer.orchestrate.badput import BUCKETS, Badput, Marks, account, invoked_at, mark_invoked
from trainpipe.trainer.protocol import TrainResult

T0 = 1_000_000.0


def result(**kw) -> TrainResult:
    base = dict(
        run_name="r",
        start_step=0,
        final_step=10,
        checkpoint_uri="file:///x",
        model_digest=None,
        val_loss=1.0,
        resumed_from=None,
        world_size=2,
        rank=0,
        attempt_s=14.0,  # rank start + 14 s: the final commit
        step_s_median=1.0,
        mfu=None,
        step_starts_s=[3.0 + i for i in range(10)],  # first step 3 s after the rank started
        checkpoint_stalls_s=[0.5, 0.5],
        started_at=T0 + 12.0,
        restore_s=1.0,
        data_wait_s=2.0,
        eval_s=1.5,
    )
    return TrainResult(**{**base, **kw})


def flow_marks(train_end: float) -> Marks:
    marks = Marks(T0)
    marks.close("orchestration", T0 + 5)  # the embedded server, the flow's start, the MLflow run
    marks.close("shard", T0 + 7)
    marks.close("preflight", T0 + 8)
    marks.close("orchestration", T0 + 9)
    marks.close("train", train_end)
    marks.close("validate", train_end + 2)
    return marks


def test_a_run_without_faults_is_split_into_its_stages_and_the_final_attempts_parts():
    rec = AttemptRecord(attempt=1, start_step=0, launched_at=T0 + 10, first_step_at=T0 + 15, ended_at=T0 + 28)
    b = account(flow_marks(T0 + 30), T0 + 33, [rec], result(), [], 1.0)
    assert b.wall_s == 33 and b.closure() == pytest.approx(1.0)
    assert set(b.buckets) == set(BUCKETS) and min(b.buckets.values()) >= 0
    # 5 + 1 s of marks, 1 s before the launch, 2 s after the attempt's end (the task returning), the report's 1 s
    assert b.buckets["orchestration"] == pytest.approx(5 + 1 + 1 + 2 + 1)
    assert (b.buckets["shard"], b.buckets["preflight"], b.buckets["validate"]) == (2, 1, 2)
    # launched at +10, the rank's first step at +15 (started_at + 3), 1 s of it restoring
    assert b.buckets["startup"] == pytest.approx(4) and b.buckets["restore"] == pytest.approx(1)
    # steps from +15 to the commit at +26: 11 s, of which data 2, saves 1, evaluation 1.5
    assert (b.buckets["data_wait"], b.buckets["checkpoint"], b.buckets["evaluation"]) == (2, 1, 1.5)
    assert b.productive_s == pytest.approx(11 - 4.5) and b.buckets["teardown"] == pytest.approx(2)
    assert b.buckets["other"] == 0 and b.goodput == pytest.approx(6.5 / 33)
    assert [a["attempt"] for a in b.attempts] == [1.0]


def test_a_failed_attempt_costs_startup_wasted_steps_detection_and_teardown():
    crash = Incident(kind="crash", rank=1, detail="rank 1 died", at=T0 + 20)
    failed = AttemptRecord(
        attempt=1,
        launched_at=T0 + 10,
        first_step_at=T0 + 13,
        last_step=6,
        fault_at=T0 + 19,
        ended_at=T0 + 21,
        incident=crash,
    )
    final = AttemptRecord(attempt=2, start_step=4, launched_at=T0 + 23, first_step_at=T0 + 27, ended_at=T0 + 40)
    r = result(started_at=T0 + 24, start_step=4)  # first step at +27, commit at +38
    b = account(flow_marks(T0 + 41), T0 + 44, [failed, final], r, [2], 1.0)  # steps 5 and 6 trained again
    first = b.attempts[0]
    assert first["startup"] == 3 and first["wasted_progress"] == 2 and first["productive"] == 4
    assert first["detection"] == 1 and first["teardown"] == 1
    assert b.buckets["orchestration"] == pytest.approx(5 + 1 + 1 + 2 + 1 + 1)  # 2: the retry's delay
    assert b.buckets["wasted_progress"] == 2 and b.buckets["detection"] == 1 and b.buckets["teardown"] == 1 + 2
    assert b.closure() == pytest.approx(1.0) and b.buckets["other"] == 0


def test_an_attempt_that_failed_before_its_first_step_is_all_startup_and_teardown():
    hang = Incident(kind="hang", detail="rendezvous timed out", at=T0 + 15)
    failed = AttemptRecord(attempt=1, launched_at=T0 + 10, ended_at=T0 + 16, incident=hang)
    final = AttemptRecord(attempt=2, launched_at=T0 + 17, first_step_at=T0 + 20, ended_at=T0 + 28)
    b = account(flow_marks(T0 + 30), T0 + 33, [failed, final], result(started_at=T0 + 12), [0], 1.0)
    assert b.attempts[0] == {"attempt": 1.0, "queue": 0.0, "startup": 5.0, "teardown": 1.0}
    assert b.closure() == pytest.approx(1.0)


def test_a_cluster_jobs_wait_for_its_hosts_is_queue_not_startup():
    """Launched at +10, the last host's supervisor started at +12 (Slurm's allocation, pods scheduled): 2 s of
    queue, then 2 s of startup to the first step. A forged start time after the first step is cut at it."""
    rec = AttemptRecord(attempt=1, launched_at=T0 + 10, started_at=T0 + 12, first_step_at=T0 + 15, ended_at=T0 + 28)
    b = account(flow_marks(T0 + 30), T0 + 33, [rec], result(), [], 1.0)
    assert b.buckets["queue"] == pytest.approx(2) and b.buckets["startup"] == pytest.approx(2)
    assert b.buckets["restore"] == pytest.approx(1) and b.closure() == pytest.approx(1.0)
    crash = Incident(kind="crash", detail="x", at=T0 + 20)
    late = AttemptRecord(attempt=1, launched_at=T0 + 10, started_at=T0 + 99, first_step_at=T0 + 13, ended_at=T0 + 21,
                         fault_at=T0 + 19, incident=crash)  # fmt: skip
    final = AttemptRecord(attempt=2, launched_at=T0 + 23, ended_at=T0 + 40)
    b = account(flow_marks(T0 + 41), T0 + 44, [late, final], result(started_at=T0 + 24), [2], 1.0)
    assert b.attempts[0]["queue"] == 3 and b.attempts[0]["startup"] == 0 and b.closure() == pytest.approx(1.0)


def test_an_attempt_recorded_without_its_launch_time_is_other_not_orchestration():
    """A record of an older version: the seconds it spanned are not called anything they may not be."""
    crash = Incident(kind="crash", detail="x", at=T0 + 15)
    old = AttemptRecord(attempt=1, first_step_at=T0 + 12, ended_at=T0 + 16, incident=crash)
    final = AttemptRecord(attempt=2, launched_at=T0 + 18, first_step_at=T0 + 20, ended_at=T0 + 28)
    b = account(flow_marks(T0 + 30), T0 + 33, [old, final], result(started_at=T0 + 17), [0], 1.0)
    assert b.buckets["other"] == pytest.approx(9)  # from the train task's start to the next launch
    assert b.closure() == pytest.approx(1.0) and len(b.attempts) == 1


def test_measures_larger_than_the_steps_span_are_scaled_into_it():
    """Rank clocks or overlapping measures never make productive time negative."""
    rec = AttemptRecord(attempt=1, launched_at=T0 + 10, ended_at=T0 + 28)
    b = account(flow_marks(T0 + 30), T0 + 33, [rec], result(data_wait_s=50.0, eval_s=30.0), [], 1.0)
    assert b.productive_s >= 0 and min(b.buckets.values()) >= 0 and b.closure() == pytest.approx(1.0)


def test_marks_past_the_runs_end_are_cut_at_it():
    rec = AttemptRecord(attempt=1, launched_at=T0 + 10, first_step_at=T0 + 15, ended_at=T0 + 28)
    b = account(flow_marks(T0 + 30), T0 + 31, [rec], result(), [], 1.0)  # validate's mark ends at +32
    assert b.wall_s == 31 and b.buckets["validate"] == 1 and b.closure() == pytest.approx(1.0)


def test_the_commands_start_counts_only_when_it_is_plausible():
    mark_invoked(T0 - 4)
    try:
        assert invoked_at(T0) == T0 - 4
        assert invoked_at(T0 - 10) == T0 - 10  # after the flow's own start: ignored
        assert invoked_at(T0 + 7200) == T0 + 7200  # more than an hour before: another command's
    finally:
        mark_invoked(None)


def test_the_fault_is_the_culprits_last_beacon_and_never_after_its_detection():
    from trainpipe.trainer.launcher import AttemptOutcome, JobOutcome

    def outcome(rank, at=110.0, progress=None):
        incident = Incident(kind="crash", detail="x", rank=rank, at=at)
        job = JobOutcome(returncode=1, wall_s=1.0, job="torchrun pid 7 on h")
        beacons = progress or {0: {"step": 9, "time": 107.0}, 1: {"step": 8, "time": 105.0}}
        return AttemptOutcome(1, job, None, incident, progress=beacons)

    assert outcome(1).fault_at == 105.0 and outcome(None).fault_at == 107.0  # no culprit: the last sign of life
    assert outcome(1, at=104.0).fault_at == 104.0  # a clock ahead of the detection's: at most the detection
    assert outcome(1, progress={0: {"time": float("nan")}, 1: {"time": "soon"}}).fault_at is None  # forged
    rec = outcome(1).record(launched_at=90.0, task_run_id="tr")
    assert (rec.fault_at, rec.launched_at, rec.task_run_id, rec.job) == (105.0, 90.0, "tr", "torchrun pid 7 on h")


def test_forged_records_and_results_are_refused_or_left_out_never_a_failed_report():
    """What the store says (attempts.json, a host part) may have been written by someone else (docs/security.md)."""
    from pydantic import ValidationError

    from tests.conftest import train_result
    from trainpipe.trainer.orchestrate.summary import interval_costs
    from trainpipe.trainer.profile_files import load_profile

    for forged in ({"attempt": 1, "ended_at": float("nan")}, {"attempt": 1, "last_step": 10**400}):
        with pytest.raises(ValidationError):
            AttemptRecord.model_validate(forged)
    with pytest.raises(ValidationError):
        train_result(step_s_median=float("inf"))
    tiny = train_result(step_s_median=5e-324, checkpoint_stalls_s=[1.0], checkpoint_every_steps=10)
    buckets = dict.fromkeys(BUCKETS, 0.0)
    assert interval_costs(load_profile("local", []), tiny, 0, Badput(1.0, 1.0, buckets, [])) is None


def test_a_process_start_is_read_to_the_kernels_tick_not_the_boot_times_whole_second():
    """The wall time of `trainpipe run` and a cluster host's queue end count from a process's start: a fresh
    interpreter's start lies between the moment it was spawned and the moment it answered."""
    import subprocess
    import sys
    import time

    code = "from trainpipe.trainer.proc import process_started_at; print(repr(process_started_at()))"
    for _ in range(3):
        before = time.time()
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        after = time.time()
        assert before - 0.02 <= float(out.stdout) <= after, (before, out.stdout, after)


def test_a_failed_attempts_data_wait_saves_and_evaluations_come_from_rank_0s_running_totals():
    """6 s trained (2 of them lost): 2 s of data wait, saves and evaluation come out of the 4 kept seconds; more
    than those come out of the lost ones. The totals ride in rank 0's beacons; a forged one is left out."""
    from trainpipe.trainer.launcher import AttemptOutcome, JobOutcome

    crash = Incident(kind="crash", rank=1, detail="rank 1 died", at=T0 + 20)
    beacon = {"step": 6, "td": 1.0, "te": 0.5, "tc": 0.5}
    job = JobOutcome(1, 11.0, False, [])
    out = AttemptOutcome(1, job, None, crash, progress={0: beacon, 1: {"step": 6, "td": -1.0}}, first_step_at=T0 + 13)
    rec = out.record(T0 + 10).model_copy(update={"fault_at": T0 + 19, "ended_at": T0 + 21})
    assert (rec.data_wait_s, rec.eval_s, rec.checkpoint_s) == (1.0, 0.5, 0.5)
    final = AttemptRecord(attempt=2, start_step=4, launched_at=T0 + 23, first_step_at=T0 + 27, ended_at=T0 + 40)
    r = result(started_at=T0 + 24, start_step=4)
    b = account(flow_marks(T0 + 41), T0 + 44, [rec, final], r, [2], 1.0)
    first = b.attempts[0]
    assert (first["data_wait"], first["checkpoint"], first["evaluation"]) == (1.0, 0.5, 0.5)
    assert first["productive"] == 2 and first["wasted_progress"] == 2 and b.closure() == pytest.approx(1.0)
    heavy = rec.model_copy(update={"data_wait_s": 5.0})
    first = account(flow_marks(T0 + 41), T0 + 44, [heavy, final], r, [2], 1.0).attempts[0]
    assert first["productive"] == 0 and first["wasted_progress"] == 0 and first["data_wait"] == pytest.approx(5)
    for forged in (float("nan"), -1.0, 1e12, "1", True):
        bad = AttemptOutcome(1, job, None, crash, progress={0: {"td": forged, "te": 0.5}}).record(T0)
        assert bad.data_wait_s is None and bad.eval_s == 0.5
