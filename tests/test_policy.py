"""Run policy (trainer/orchestrate/policy.py) and how an attempt ended (trainer/supervise/attempt.py), on recorded
incidents and files: pure logic, no processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainpipe.trainer.errors import ProfileError
from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.launch.slurm import sbatch_script
from trainpipe.trainer.orchestrate.policy import (
    after_attempt,
    after_preflight,
    for_attempt,
    needs_link_probe,
    with_link_probe,
    with_rollbacks,
    without_excluded,
)
from trainpipe.trainer.orchestrate.records import RunRecords
from trainpipe.trainer.profile_files import can_shrink, load_profile, with_nodes
from trainpipe.trainer.supervise.attempt import AttemptFiles, conclude, ending_incident
from trainpipe.trainer.supervise.job import JobOutcome


@pytest.fixture
def profile(home):
    return load_profile("local")


def nodes(profile, n: int, min_nodes: int = 1, **watchdog):
    body = profile.model_dump(mode="json", by_alias=True)
    body["cluster"].update(nodes=n, min_nodes=min_nodes, procs_per_node=1, simulate_nodes=True)
    body["train"].update(global_batch=12, micro_batch=1)
    body["watchdog"].update(watchdog)
    from trainpipe.trainer.profile_files import build_profile

    return build_profile(body)


# ---------------------------------------------------------------- after an attempt


@pytest.mark.parametrize("kind", ["crash", "hang", "desync", "timeout", "exit", "straggler"])
def test_faults_of_the_cluster_are_retried(profile, kind):
    decision = after_attempt(Incident(kind=kind, detail="x", rank=1), [], profile)
    assert decision.action == "retry" and decision.exclude_node is None


@pytest.mark.parametrize("error", ["DataError", "CheckpointError", "ProfileError"])
def test_a_ranks_own_expected_error_stops_with_its_message(profile, error):
    incident = Incident(
        kind="error", error=error, detail="shard train-000001.bin is missing; re-run `trainpipe shard`", rank=1
    )
    decision = after_attempt(incident, [], profile)
    assert decision.action == "stop"
    assert decision.reason == f"{error} on rank 1: shard train-000001.bin is missing; re-run `trainpipe shard`"


def test_a_store_error_on_a_rank_is_transient_and_retried(profile):
    decision = after_attempt(Incident(kind="error", error="StoreError", detail="connection reset", rank=0), [], profile)
    assert decision.action == "retry"


def test_a_nan_rolls_back_past_its_data_once_and_stops_when_it_recurs_at_the_same_step(profile):
    nan6 = Incident(kind="nan", detail="loss is nan at step 6", step=6)
    first = after_attempt(nan6, [], profile)
    assert first.action == "retry" and first.rollback_before == 6
    stop = after_attempt(nan6, [nan6], with_rollbacks(profile, [6]))
    assert stop.action == "stop" and "step 6 again after resuming" in stop.reason and "train.lr" in stop.reason
    assert after_attempt(nan6, [], load_profile("local", ["watchdog.on_loss_spike=stop"])).action == "stop"


def test_under_warn_a_nan_is_retried_once_and_stops_when_it_recurs_at_the_same_step(profile):
    profile = load_profile("local", ["watchdog.on_loss_spike=warn"])
    nan6 = Incident(kind="nan", detail="loss is nan at step 6", step=6)
    assert after_attempt(nan6, [], profile).action == "retry"
    assert after_attempt(nan6, [], profile).rollback_before is None
    assert (
        after_attempt(nan6, [Incident(kind="nan", detail="loss is nan at step 4", step=4)], profile).action == "retry"
    )
    warning = Incident(kind="straggler", detail="slow", rank=1, fatal=False)
    stop = after_attempt(nan6, [Incident(kind="nan", detail="loss is nan at step 6", step=6), warning], profile)
    assert stop.action == "stop" and "step 6 again after resuming" in stop.reason and "train.lr" in stop.reason


def test_a_straggler_under_exclude_is_retried_without_its_node_when_one_can_go(profile):
    straggler = Incident(kind="straggler", detail="slow", rank=1, node="host-node1")
    decision = after_attempt(straggler, [], nodes(profile, 2, on_straggler="exclude"))
    assert decision.action == "retry" and decision.exclude_node == "host-node1"
    assert after_attempt(straggler, [], nodes(profile, 2, min_nodes=2, on_straggler="exclude")).exclude_node is None
    assert after_attempt(straggler, [], nodes(profile, 2, on_straggler="abort")).exclude_node is None


def test_a_network_incident_makes_the_retry_probe_the_links_and_a_blamed_host_is_left_out_when_one_can_go(profile):
    slow = Incident(kind="network", detail="collectives 13x", node="host0, host1, host2", phase="collective")
    assert after_attempt(slow, [], nodes(profile, 3)).action == "retry"
    assert needs_link_probe([slow]) and not needs_link_probe([])
    assert not needs_link_probe([slow, Incident(kind="crash", detail="x")])  # only the last failure decides
    assert not needs_link_probe([slow.model_copy(update={"fatal": False})])  # a warning ended no attempt
    assert with_link_probe(profile).watchdog.probe_links and not profile.watchdog.probe_links

    probed = Incident(kind="network", detail="host2's links slow", node="host2", rank=2, ranks=[2], phase="probe")
    out = after_attempt(probed, [slow], nodes(profile, 3, min_nodes=2, probe_links=True))
    assert out.action == "retry" and out.exclude_node == "host2"
    assert needs_link_probe([slow, probed])  # the retry without host2 measures again
    # a probe verdict from an attempt that did not probe (a forged host part) excludes nobody
    assert after_attempt(probed, [slow], nodes(profile, 3, min_nodes=2)).exclude_node is None
    kept = after_attempt(probed, [slow], nodes(profile, 3, min_nodes=3, probe_links=True))
    assert kept.action == "stop" and "cluster.min_nodes=3" in kept.reason and "fix the link" in kept.reason
    a_link = probed.model_copy(update={"node": None, "rank": None, "detail": "the link host1<->host2 slow"})
    stop = after_attempt(a_link, [slow], nodes(profile, 3, min_nodes=2, probe_links=True))
    assert stop.action == "stop" and "no single host to leave out" in stop.reason


def test_the_next_attempt_reads_the_run_records_leaves_out_excluded_hosts_skips_spiked_data_and_probes_links(profile):
    """What train_model runs on a retry: the run's records in the store decide, one warning line per change."""
    three = nodes(profile, 3, min_nodes=2)
    records = RunRecords(three.store, "retry-prep")
    assert for_attempt(three, records) == (three, [])  # a first attempt runs the profile as given
    records.add_incidents(Incident(kind="network", detail="collectives 13x", node="host0, host1", phase="collective"))
    records.exclude_node("host2")
    records.roll_back(25)
    nxt, changes = for_attempt(three, records)
    assert (nxt.cluster.nodes, nxt.launcher.excluded_nodes, nxt.train.rollbacks) == (2, ["host2"], [25])
    assert nxt.watchdog.probe_links and not three.watchdog.probe_links
    assert len(changes) == 3 and "measures the links between hosts first" in changes[2], changes
    one = nodes(profile, 1)
    assert not for_attempt(one, RunRecords(one.store, "retry-prep"))[0].watchdog.probe_links  # no link to probe


def test_a_node_that_crashes_or_hangs_a_second_time_is_excluded_when_the_cluster_can_shrink(profile):
    crash = Incident(kind="crash", detail="rank 3 killed by SIGKILL", rank=3, node="gpu-007")
    hang = Incident(kind="hang", detail="rank 2 is stopped", rank=2, node="gpu-007")
    elsewhere = Incident(kind="crash", detail="rank 0 exited", rank=0, node="gpu-001")
    three = nodes(profile, 3, min_nodes=2)
    assert after_attempt(crash, [elsewhere], three).exclude_node is None  # the first on gpu-007
    second = after_attempt(crash, [hang, elsewhere], three)
    assert second.action == "retry" and second.exclude_node == "gpu-007" and "crashed or hung 2 times" in second.reason
    assert after_attempt(crash, [hang], nodes(profile, 2, min_nodes=2)).exclude_node is None  # none to spare
    warning = hang.model_copy(update={"fatal": False})
    assert after_attempt(crash, [warning], three).exclude_node is None  # only faults that ended an attempt count


def test_a_host_whose_gpu_fails_its_health_check_after_a_fault_is_left_out_at_once_or_the_run_stops(profile):
    broken = Incident(
        kind="crash", detail="rank 3 exited with code 1", rank=3, node="gpu-007", host_health="GPU 2: fell off the bus"
    )
    first = after_attempt(broken, [], nodes(profile, 3, min_nodes=2))
    assert first.action == "retry" and first.exclude_node == "gpu-007"
    assert "node gpu-007 fails its GPU health check after it (GPU 2: fell off the bus)" in first.reason
    stuck = after_attempt(broken, [], nodes(profile, 2, min_nodes=2))
    assert stuck.action == "stop" and "cannot shrink below cluster.min_nodes=2" in stuck.reason
    assert "drain or repair it, then rerun with the same --run-name" in stuck.reason
    assert after_attempt(broken, [], profile).action == "stop"  # the only node
    # a rank's own error or a NaN says nothing about its host, whatever the record claims
    error = broken.model_copy(update={"kind": "error", "error": "StoreError"})
    assert after_attempt(error, [], nodes(profile, 3, min_nodes=2)).exclude_node is None


def test_excluded_nodes_shrink_the_cluster_but_never_below_min_nodes(profile):
    assert without_excluded(nodes(profile, 3), ["b"]).cluster.nodes == 2
    assert without_excluded(nodes(profile, 3, min_nodes=2), ["b", "c"]).cluster.nodes == 2
    p = nodes(profile, 2)
    assert without_excluded(p, []) is p
    on_slurm = nodes(profile, 3)
    on_slurm.launcher.kind, on_slurm.preflight.enabled = "slurm", False
    smaller = without_excluded(on_slurm, ["gpu-007", "gpu-012"])
    assert smaller.cluster.nodes == 1 and smaller.launcher.excluded_nodes == ["gpu-007", "gpu-012"]
    script = sbatch_script(smaller, "run", 2, Path("/shared/jobs"))
    assert "#SBATCH --exclude=gpu-007,gpu-012\n" in script  # Slurm allocates the retry elsewhere


def test_a_run_with_virtual_ranks_shrinks_to_a_world_size_that_divides_them(profile):
    """Four nodes, 4 virtual ranks: one node left out leaves 3, which does not divide 4; the retry runs on 2."""
    four = nodes(profile, 4, min_nodes=1)
    four.train.virtual_ranks = 4
    assert without_excluded(four, ["gpu-003"]).cluster.nodes == 2
    assert without_excluded(four, ["gpu-003", "gpu-001"]).cluster.nodes == 2
    four.cluster.min_nodes = 3  # 3 is all it may shrink to, and 3 does not divide 4: one line, before anything
    with pytest.raises(ProfileError, match=r"no count from there down to cluster\.min_nodes=3 divides"):
        without_excluded(four, ["gpu-003"])


# ---------------------------------------------------------------- after preflight


def report(checks: list[dict], failing_nodes: list[str] | None = None) -> dict:
    ranks = [{"rank": 0, "host": "a"}, {"rank": 1, "host": "b"}]
    return {"checks": checks, "ranks": ranks, "failing_nodes": failing_nodes or []}


def test_a_clean_preflight_proceeds_unchanged(profile):
    decision = after_preflight(report([{"name": "compute.gemm", "status": "pass", "detail": "ok"}]), profile)
    assert decision.action == "proceed" and decision.profile is profile


def test_a_failing_check_stops_with_the_line_naming_node_and_rank(profile):
    failing = {"name": "compute.gemm", "status": "fail", "detail": "slow", "ranks": [1], "nodes": ["b"]}
    decision = after_preflight(report([failing], ["b"]), profile)
    assert decision.action == "stop" and decision.reason == "preflight check compute.gemm failed on node b rank 1: slow"


def test_exclude_drops_failing_nodes_and_records_an_incident(profile):
    failing = {"name": "compute.gemm", "status": "fail", "detail": "slow", "ranks": [1], "nodes": ["b"]}
    two = nodes(profile, 2).model_copy(
        update={"preflight": profile.preflight.model_copy(update={"on_fail": "exclude"})}
    )
    decision = after_preflight(report([failing], ["b"]), two)
    assert decision.action == "exclude" and decision.profile.cluster.nodes == 1
    assert decision.incident.kind == "exclude" and decision.incident.node == "b" and not decision.incident.fatal


def test_exclude_cannot_help_a_cluster_wide_failure_or_go_below_min_nodes(profile):
    exclude = profile.preflight.model_copy(update={"on_fail": "exclude"})
    wide = {"name": "collective.allreduce", "status": "fail", "detail": "slow"}
    decision = after_preflight(report([wide]), nodes(profile, 2).model_copy(update={"preflight": exclude}))
    assert decision.action == "stop" and "fails cluster-wide" in decision.reason
    one = {"name": "compute.gemm", "status": "fail", "detail": "slow", "ranks": [1], "nodes": ["b"]}
    decision = after_preflight(
        report([one], ["b"]), nodes(profile, 2, min_nodes=2).model_copy(update={"preflight": exclude})
    )
    assert decision.action == "stop" and "below cluster.min_nodes=2" in decision.reason


# ---------------------------------------------------------------- how an attempt ended


def job(returncode=1, timed_out=False, stopped_by=None) -> JobOutcome:
    return JobOutcome(returncode=returncode, wall_s=1.0, timed_out=timed_out, stopped_by=stopped_by)


PROGRESS = {
    0: {"rank": 0, "step": 7, "phase": "collective", "host": "h0", "time": 0.0},
    1: {"rank": 1, "step": 7, "phase": "forward", "host": "h1", "time": 0.0},
}


def test_a_ranks_own_report_wins_over_everything_else():
    files = AttemptFiles(
        rank_incidents=[
            Incident(kind="nan", detail="loss is nan at step 7", step=7, ranks=[1]),
            Incident(kind="nan", detail="loss is nan at step 7", step=7, ranks=[0]),
        ],
        agent_failures=[{"rank": 0, "exitcode": 3, "signal": None, "time": 1.0}],
    )
    found = ending_incident(job(stopped_by=Incident(kind="crash", detail="x", rank=0)), files, PROGRESS, 2, 60)
    assert found.kind == "nan" and found.step == 7 and found.ranks == [0, 1] and found.attempt == 2


def test_a_rank_killed_by_a_signal_outranks_what_the_others_report_next(profile):
    """Rank 1 is SIGKILLed while the ranks load a checkpoint; rank 0's load fails with it and reports an error."""
    files = AttemptFiles(
        rank_incidents=[Incident(kind="error", error="CheckpointError", detail="cannot load: peer closed", rank=0)],
        agent_failures=[
            {"rank": 0, "exitcode": 3, "signal": None, "time": 5.0, "message": None},
            {"rank": 1, "exitcode": -9, "signal": "SIGKILL", "time": 5.0, "message": None},
        ],
    )
    found = ending_incident(job(), files, PROGRESS, 1, 60)
    assert (found.kind, found.rank, found.detail) == ("crash", 1, "rank 1 killed by SIGKILL")
    assert after_attempt(found, [], profile).action == "retry"


def test_torchrun_failures_name_the_first_rank_to_fail_with_its_signal():
    files = AttemptFiles(
        agent_failures=[
            {"rank": 0, "exitcode": 1, "signal": None, "time": 5.0, "message": None},
            {"rank": 1, "exitcode": -9, "signal": "SIGKILL", "time": 4.0, "message": None},
        ]
    )
    found = ending_incident(job(), files, PROGRESS, 1, 60)
    assert (found.kind, found.rank, found.node, found.step, found.phase) == ("crash", 1, "h1", 7, "forward")
    assert found.detail == "rank 1 killed by SIGKILL" and found.ranks == [0, 1]


def test_a_rank_torchrun_terminated_is_not_the_cause_even_when_the_watchdog_guessed_it():
    files = AttemptFiles(
        agent_failures=[
            {"rank": 0, "exitcode": -15, "signal": "SIGTERM", "time": 4.0, "message": None},
            {"rank": 1, "exitcode": -9, "signal": "SIGKILL", "time": 4.0, "message": None},
        ]
    )
    guessed = Incident(kind="crash", detail="rank(s) [0, 1] exited", rank=0)
    found = ending_incident(job(stopped_by=guessed), files, PROGRESS, 1, 60)
    assert found.rank == 1 and found.detail == "rank 1 killed by SIGKILL"


def test_a_rank_killed_between_two_collectives_is_a_crash_not_the_desync_its_beacons_suggest():
    """Rank 1 was SIGKILLed right after a collective: its last beacon is one collective behind rank 0's, and the
    watchdog, seeing a dead rank in another collective, stopped the job for a desync (a CI failure)."""
    files = AttemptFiles(
        agent_failures=[
            {"rank": 0, "exitcode": -15, "signal": "SIGTERM", "time": 4.0, "message": None},
            {"rank": 1, "exitcode": -9, "signal": "SIGKILL", "time": 4.0, "message": None},
        ]
    )
    seen = Incident(kind="desync", detail="rank 0 is in collective #25; rank 1 is in collective #24", rank=1)
    found = ending_incident(job(stopped_by=seen), files, PROGRESS, 1, 60)
    assert (found.kind, found.rank, found.detail) == ("crash", 1, "rank 1 killed by SIGKILL")
    # gloo aborts a rank on mismatched collectives (SIGABRT), or the rank raises: that desync stands.
    for how in ({"exitcode": -6, "signal": "SIGABRT"}, {"exitcode": 1, "signal": None}):
        aborted = AttemptFiles(agent_failures=[{"rank": 1, "time": 4.0, "message": None, **how}])
        assert ending_incident(job(stopped_by=seen), aborted, PROGRESS, 1, 60).kind == "desync", how


def test_an_exception_on_a_rank_carries_its_message():
    files = AttemptFiles(
        agent_failures=[
            {
                "rank": 1,
                "exitcode": 1,
                "signal": None,
                "time": 4.0,
                "message": "RuntimeError: fault drill: exception injected at step 5",
            }
        ]
    )
    found = ending_incident(job(), files, PROGRESS, 1, 60)
    assert found.detail == "rank 1 exited with code 1: RuntimeError: fault drill: exception injected at step 5"


def test_the_watchdog_names_hangs_and_timeouts_are_their_own_kind():
    hang = Incident(kind="hang", detail="rank 1 is stopped", rank=1)
    assert ending_incident(job(stopped_by=hang), AttemptFiles(), PROGRESS, 1, 60).kind == "hang"
    timeout = ending_incident(job(returncode=-15, timed_out=True), AttemptFiles(), PROGRESS, 3, 60)
    assert timeout.kind == "timeout" and "train.timeout_s=60" in timeout.detail


def test_a_result_means_success_even_when_the_teardown_after_it_stalled():
    stall = Incident(kind="exit", detail="did not exit", ranks=[0, 1])
    result, incident, findings = conclude(
        1, job(returncode=-15, stopped_by=stall), AttemptFiles(result={"final_step": 8}), PROGRESS, 60, []
    )
    assert result == {"final_step": 8} and incident is None
    [unclean] = findings
    assert (
        unclean.kind == "exit"
        and not unclean.fatal
        and unclean.detail.startswith("training finished (step 8 committed)")
    )
    result, incident, findings = conclude(
        1, job(returncode=0), AttemptFiles(result={"final_step": 8}), PROGRESS, 60, []
    )
    assert result and incident is None and findings == []


def test_which_errors_a_stage_retries_is_decided_in_one_place():
    from trainpipe.trainer.errors import (
        CheckpointError,
        DataError,
        StoreError,
        StoreUnavailable,
        TrainingFailed,
        TrainingIncident,
    )
    from trainpipe.trainer.orchestrate.policy import retryable

    retried = {
        "train": [TrainingIncident("crash"), StoreUnavailable("away")],
        "shard": [StoreError("write did not land"), StoreUnavailable("away")],
    }
    stopped = {
        "train": [TrainingFailed("nan again"), DataError("bad"), CheckpointError("corrupt"), StoreError("no bucket")],
        "shard": [DataError("bad"), ValueError("a bug")],
    }
    for stage in ("train", "shard"):
        assert all(retryable(e, stage) for e in retried[stage]), stage
        assert not any(retryable(e, stage) for e in stopped[stage]), stage


def test_a_retry_after_a_fault_of_the_jobs_own_processes_starts_at_once_others_back_off():
    from trainpipe.trainer.orchestrate.policy import RETRY_AT_ONCE, retry_delay_s

    for kind in sorted(RETRY_AT_ONCE):
        assert retry_delay_s([Incident(kind=kind, detail=kind)], 2.0) == 0.0, kind
    store = Incident(kind="error", detail="store away")
    assert [retry_delay_s([store] * n, 2.0) for n in (0, 1, 2, 3)] == [0.0, 2.0, 4.0, 8.0]
    assert retry_delay_s([None], 2.0) == 2.0  # what ended it could not be read: back off
    assert retry_delay_s([Incident(kind="timeout", detail="t")] * 2, 0.0) == 0.0  # train.retry_delay_s: 0
    assert retry_delay_s([store] * 40, 600.0) == 600.0  # capped
    # the doubling counts such failures in a row: a store outage after many crashes waits the first delay
    crash = Incident(kind="crash", detail="rank 1 killed by SIGKILL")
    assert retry_delay_s([crash] * 30 + [store], 2.0) == 2.0
    assert retry_delay_s([store, store, crash, None, store], 2.0) == 4.0


def test_the_retry_reads_what_ended_this_task_runs_earlier_attempts_in_order():
    from trainpipe.trainer.incidents import AttemptRecord
    from trainpipe.trainer.orchestrate.policy import ended_before

    store, crash = Incident(kind="error", detail="store away"), Incident(kind="crash", detail="rank 1")
    runs = [
        AttemptRecord(attempt=2, task_run_id="t", incident=store),
        AttemptRecord(attempt=1, task_run_id="t", incident=crash),
        AttemptRecord(attempt=1, task_run_id="other", incident=store),  # another task run's: not this one's
        AttemptRecord(attempt=3, task_run_id="t", incident=crash),  # not before attempt 3
    ]
    assert ended_before(runs, "t", 1) == []
    assert ended_before(runs, "t", 3) == [crash, store]
    assert ended_before(runs, "t", 4) == [crash, store, crash]
    assert ended_before(runs, "t", 5) == [crash, store, crash, None]  # attempt 4 failed before it recorded
    assert ended_before([], "t", 2) == [None]


def test_a_parallel_layout_shrinks_to_the_most_nodes_its_sizes_fit_and_says_when_none_do(home):
    """pp 4 over 4 nodes of 2: one node left out leaves 6 ranks, which 4 stages do not divide; the retry runs on
    2 nodes (4 ranks, one stage each). With cluster.min_nodes 3 there is no such count: the straggler or host
    fault is not answered by an exclusion, and an exclusion asked for anyway is one line."""
    four = load_profile(
        "local",
        ["cluster.nodes=4", "cluster.min_nodes=2", "cluster.simulate_nodes=true", "train.strategy=fsdp",
         "parallel.pp=4", "train.global_batch=16", "train.micro_batch=2"],
    )  # fmt: skip
    assert can_shrink(four) and without_excluded(four, ["gpu-003"]).cluster.nodes == 2
    stuck = with_nodes(four, 4, "test")
    stuck.cluster.min_nodes = 3
    assert not can_shrink(stuck)
    with pytest.raises(ProfileError, match=r"the profile holds on no count from there down to cluster\.min_nodes=3"):
        without_excluded(stuck, ["gpu-003"])
