"""MLflow on a real store (SQLite): the run lifecycle (trainer/tracking.py: one run per run name, ending FINISHED,
FAILED on an error, KILLED on an interrupt) and the two ways per-step metrics reach it (rank 0 itself, or its
metrics file relayed by the supervisor)."""

from __future__ import annotations

import json
import time

import pytest

from trainpipe.trainer.config import TrackingConfig
from trainpipe.trainer.loop.metrics import MetricFile
from trainpipe.trainer.supervise.metric_relay import MetricRelay
from trainpipe.trainer.tracking import RUN_NAME_TAG, MetricLogger, TrackedRun, client, metric_history, tracked_run

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> TrackingConfig:
    db = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    return TrackingConfig(tracking_uri=f"sqlite:///{db}", experiment="lifecycle")


def status(cfg: TrackingConfig, run_id: str) -> str:
    return client(cfg.tracking_uri).get_run(run_id).info.status


def test_a_run_that_completes_is_finished_with_its_params_and_texts(cfg):
    with tracked_run(cfg, "ok", {"k": "v"}, params={"train.steps": 8}, texts={"profile.yaml": "a: 1\n"}) as run:
        assert status(cfg, run.id) == "RUNNING"
    data = client(cfg.tracking_uri).get_run(run.id).data
    assert status(cfg, run.id) == "FINISHED"
    assert data.params["train.steps"] == "8" and data.tags["k"] == "v" and data.tags[RUN_NAME_TAG] == "ok"
    assert [a.path for a in client(cfg.tracking_uri).list_artifacts(run.id)] == ["profile.yaml"]


def test_an_error_ends_the_run_failed_and_the_same_name_continues_it(cfg):
    with pytest.raises(RuntimeError), tracked_run(cfg, "broken") as run:
        raise RuntimeError("boom")
    assert status(cfg, run.id) == "FAILED"
    with tracked_run(cfg, "broken", params={"train.steps": 9}) as again:
        assert again.id == run.id and status(cfg, run.id) == "RUNNING"
    assert status(cfg, run.id) == "FINISHED"


def test_an_interrupt_ends_the_run_killed(cfg):
    with pytest.raises(KeyboardInterrupt), tracked_run(cfg, "interrupted") as run:
        raise KeyboardInterrupt
    assert status(cfg, run.id) == "KILLED"


def test_metrics_of_many_steps_go_in_a_few_requests(cfg, monkeypatch):
    """The watchdog's windows of a long attempt (hundreds of steps × ranks × figures) reach MLflow in requests of
    1,000 metrics: a tracking server behind basic auth spends ~0.1 s hashing the password of each request, and one
    request per window made the end of a 2,000-step run 30 s longer."""
    with tracked_run(cfg, "many-steps") as run:
        mlflow_client = client(cfg.tracking_uri)
        requests = []
        real = mlflow_client.log_batch
        monkeypatch.setattr(mlflow_client, "log_batch", lambda *a, **k: requests.append(1) or real(*a, **k))
        run.log_steps([(step, {f"watchdog/compute_ms/rank_{r}": step + r for r in range(5)}) for step in range(300)])
        monkeypatch.undo()
    assert len(requests) == 2  # 1,500 metrics
    history = metric_history(cfg.tracking_uri, run.id, "watchdog/compute_ms/rank_3")
    assert sorted(history) == [(step, step + 3.0) for step in range(300)]


def test_tracking_off_gives_a_run_that_logs_nothing(cfg):
    off = cfg.model_copy(update={"enabled": False})
    with tracked_run(off, "off") as run:
        run.log_metrics({"x": 1.0}, 1)
        run.log_dict({"a": 1}, "a.json")
    assert run.id is None


def test_metric_logger_sends_what_a_plain_torchrun_rank_logs(cfg):
    with tracked_run(cfg, "direct") as run:
        logger = MetricLogger(cfg.tracking_uri, run.id, flush_every_s=0.1)
        logger.wait_ready()
        for step in (1, 2, 3):
            logger.log({"train/loss": 4.0 - step, "perf/step_ms": 10.0}, step)
        logger.close()
    assert logger.failures == 0
    assert metric_history(cfg.tracking_uri, run.id, "train/loss") == [(1, 3.0), (2, 2.0), (3, 1.0)]


def test_the_supervisor_relays_rank_0s_metric_file_line_by_line(cfg, tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    with tracked_run(cfg, "relayed") as run:
        relay = MetricRelay(path, cfg.tracking_uri, run.id, every_s=0.05)
        rank0 = MetricFile(path)  # created after the relay, as the rank starts after its supervisor
        rank0.log({"train/loss": 3.0}, 1)
        with open(path, "a") as f:  # junk, and a line the rank is still writing when the relay reads
            f.write("not json\n")
            f.write('{"step": 2, "time_ms": 5, "metrics": {"train/loss"')
        time.sleep(0.3)
        assert metric_history(cfg.tracking_uri, run.id, "train/loss") == [(1, 3.0)]
        with open(path, "a") as f:
            f.write(": 2.0}}\n")
        rank0.log({"train/loss": 1.0, "eval/loss": 1.5}, 3)
        rank0.close()
        relay.close()  # the end of the attempt: what is left is sent before it returns
    assert sorted(metric_history(cfg.tracking_uri, run.id, "train/loss")) == [(1, 3.0), (2, 2.0), (3, 1.0)]
    assert metric_history(cfg.tracking_uri, run.id, "eval/loss") == [(3, 1.5)]
    assert relay.skipped == 1 and relay.failures == 0


def test_a_resumed_attempt_does_not_log_the_steps_it_trains_again(cfg, tmp_path):
    """Attempt 1 logged steps 1-3 and died; attempt 2 resumed from step 1's checkpoint and trains 2 and 3 again:
    each series keeps one point per step. A loss that differs from the run's (a resume that was not exact) is
    counted, not logged a second time; a metric the run never had at that step (an eval) is sent."""
    first, second = str(tmp_path / "attempt-1.jsonl"), str(tmp_path / "attempt-2.jsonl")
    with tracked_run(cfg, "resumed") as run:
        relay = MetricRelay(first, cfg.tracking_uri, run.id, every_s=0.05)
        rank0 = MetricFile(first)
        for step, loss in ((1, 3.0), (2, 2.0), (3, 1.0)):
            rank0.log({"loss/train": loss, "perf/step_ms": 10.0}, step)
        rank0.close()
        relay.close()
        assert (relay.replayed, relay.mismatched) == (0, 0)
        relay = MetricRelay(second, cfg.tracking_uri, run.id, every_s=0.05)
        rank0 = MetricFile(second)
        rank0.log({"loss/train": 2.0, "perf/step_ms": 12.0}, 2)  # the same loss; another step time
        rank0.log({"loss/train": 1.5, "perf/step_ms": 11.0, "loss/eval": 1.7}, 3)  # a loss that differs
        rank0.log({"loss/train": 0.5, "perf/step_ms": 9.0}, 4)
        rank0.close()
        relay.close()
        tracked = TrackedRun(cfg.tracking_uri, run.id)  # the watchdog's windows of both attempts, from the task
        tracked.log_steps([(2, {"watchdog/straggler_score/rank_0": 1.0})])
        tracked.log_steps(
            [(2, {"watchdog/straggler_score/rank_0": 1.1}), (4, {"watchdog/straggler_score/rank_0": 1.2})]
        )
    assert metric_history(cfg.tracking_uri, run.id, "loss/train") == [(1, 3.0), (2, 2.0), (3, 1.0), (4, 0.5)]
    assert [s for s, _ in metric_history(cfg.tracking_uri, run.id, "perf/step_ms")] == [1, 2, 3, 4]
    assert metric_history(cfg.tracking_uri, run.id, "loss/eval") == [(3, 1.7)]
    assert metric_history(cfg.tracking_uri, run.id, "watchdog/straggler_score/rank_0") == [(2, 1.0), (4, 1.2)]
    assert (relay.replayed, relay.mismatched, relay.failures) == (4, 1, 0)  # a step time may differ


def test_a_metric_file_that_cannot_be_written_never_stops_the_rank(tmp_path):
    rank0 = MetricFile(str(tmp_path / "metrics.jsonl"))
    rank0.close()  # e.g. the disk went away: every write fails
    rank0.log({"train/loss": 1.0}, 1)
    assert rank0.failures == 1


def test_system_metrics_sample_at_the_profiles_interval_and_the_first_one_measures(cfg, monkeypatch):
    """Every ``every_s`` (the profile's, over MLflow's own variable), named by node; psutil's first CPU reading of
    a thread is 0% unless primed."""
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "30")
    with tracked_run(cfg, "sampled") as run:
        with run.system_metrics(True, "node7", every_s=0.5):
            busy_until = time.monotonic() + 1.5  # load the host, so an unprimed first reading (0.0) is told apart
            while time.monotonic() < busy_until:
                pass
            time.sleep(2.5)
        with run.system_metrics(True, "node8", every_s=60):  # an attempt shorter than the interval
            time.sleep(3)
        cpu = metric_history(cfg.tracking_uri, run.id, "system/node7/cpu_utilization_percentage")
        short = metric_history(cfg.tracking_uri, run.id, "system/node8/cpu_utilization_percentage")
    assert len(cpu) >= 3 and cpu[0][1] > 0, cpu
    assert len(short) == 1, short  # still one point: the sample taken before it ended


def test_compare_names_both_losses_for_what_they_are_and_its_json_carries_numbers(cfg):
    from trainpipe.trainer.checkpoint.validate import EVAL_WINDOWS
    from trainpipe.trainer.orchestrate.compare import compare_runs

    for name, (evals, validated) in {"cmp-a": ([3.1, 2.9], 2.95), "cmp-b": ([3.0], None)}.items():
        with tracked_run(cfg, name, params={"train.lr": len(name + str(validated))}) as run:
            for step, loss in enumerate(evals, 1):
                run.log_metrics({"loss/eval": loss, "perf/tokens_per_s": 9016.0}, step * 10)
            if validated is not None:  # the validate stage ran (cmp-b stopped before it)
                run.set_tags({"summary.validated_loss": validated, "summary.goodput": 0.35, "summary.incidents": 2})
                run.set_tags({"summary.incidents.crash": 2, "summary.incidents.junk": "not a number"})
    with tracked_run(cfg, "cmp-older") as run:  # logged before the summary tags: one-point metrics
        run.log_metrics({"eval/loss": 3.3, "eval/final_val_loss": 3.2, "run/goodput": 0.5, "run/incidents/hang": 1}, 9)
        run.log_metrics({"run/incidents": float("nan"), "run/incidents/crash": float("nan")}, 9)  # hostile
    comparison = compare_runs(cfg.tracking_uri, cfg.experiment, ["cmp-a", "cmp-b", "cmp-older"])
    assert comparison.table().splitlines()[0].split()[:6] == ["run", "status", "validated", "best", "eval", "tokens/s"]
    assert f"({EVAL_WINDOWS} windows" in comparison.legend() and "in-loop" in comparison.legend()
    a, b, older = comparison.as_dict()["runs"]
    assert (a["validated_loss"], a["best_eval_loss"], a["tokens_per_s"], a["goodput"]) == (2.95, 2.9, 9016.0, 0.35)
    assert a["incidents"] == 2 and a["incidents_by_kind"] == {"crash": 2} and isinstance(a["wall_s"], float)
    assert (older["validated_loss"], older["best_eval_loss"], older["goodput"]) == (3.2, 3.3, 0.5)
    assert older["incidents_by_kind"] == {"hang": 1} and older["incidents"] is None
    assert b["validated_loss"] is None and b["best_eval_loss"] == 3.0  # never the in-loop figure in its place


def test_compare_reads_incidents_and_badput_from_a_runs_summary_json_and_only_a_sane_one(cfg):
    """Since the summary tags were cut to a few, a run's incidents by kind and badput by bucket are in its
    summary.json. Anyone with MLflow access may write that file: a value that is not a kind's name or a finite
    number is left out, and a file that is too large or not an object is not read."""
    from trainpipe.trainer.orchestrate.compare import SUMMARY_FILE_BYTES, compare_runs

    written = {
        "incidents": [{"kind": "crash"}, {"kind": "crash"}, {"kind": "sdc"}, {"kind": "a b; rm"}, {"kind": 7}, 7],
        "badput": {"buckets": {"startup": 4.5, "restart": "NaN", "shard": "3", "checkpoint": [1]}},
    }
    with tracked_run(cfg, "cmp-json") as run:
        run.set_tags({"summary.validated_loss": 2.5, "summary.incidents": 3})
        run.log_dict(written, "summary.json")
    with tracked_run(cfg, "cmp-large") as run:
        run.log_text(json.dumps({"incidents": [{"kind": "crash"}], "pad": "x" * SUMMARY_FILE_BYTES}), "summary.json")
    with tracked_run(cfg, "cmp-list") as run:
        run.log_dict([written], "summary.json")
    read, large, listed = compare_runs(cfg.tracking_uri, cfg.experiment, ["cmp-json", "cmp-large", "cmp-list"]).runs
    assert read.incidents_by_kind == {"crash": 2, "sdc": 1} and read.badput_s == {"startup": 4.5, "shard": 3.0}
    assert "crash 2, sdc 1" in compare_runs(cfg.tracking_uri, cfg.experiment, ["cmp-json"]).table()
    assert (large.incidents_by_kind, large.badput_s) == ({}, {})
    assert (listed.incidents_by_kind, listed.badput_s) == ({}, {})


def test_compare_draws_one_point_per_step_of_a_run_logged_with_duplicates(cfg):
    """Runs logged before each series kept one point per step hold a retrained step twice: the curve keeps the
    first."""
    from mlflow.entities import Metric

    from trainpipe.trainer.orchestrate.compare import run_view

    with tracked_run(cfg, "cmp-doubled") as run:
        points = [(1, 3.0, 100), (2, 2.0, 200), (3, 1.0, 300), (2, 2.5, 400), (3, 1.5, 500), (4, 0.5, 600)]
        client(cfg.tracking_uri).log_batch(run.id, metrics=[Metric("loss/train", v, t, s) for s, v, t in points])
    assert run_view(cfg.tracking_uri, run.id).curves["train"] == [(1, 3.0), (2, 2.0), (3, 1.0), (4, 0.5)]


def test_the_watchdogs_windows_are_a_few_charts_whatever_the_world_size():
    """Per window: each figure's max and median over the ranks and the slowest rank's, not a chart per rank (a
    large job's page would hold hundreds)."""
    from trainpipe.trainer.tracking import watchdog_metrics

    window = {
        "step": 40,
        "score": {r: 1.8 if r == 5 else 1.0 + r / 10_000 for r in range(512)},
        "compute_ms": {r: 180.0 if r == 5 else 100.0 for r in range(512)},
        "comm_ms": {r: 30.0 for r in range(512)},
    }
    got = watchdog_metrics(window)
    assert len(got) == 1 + 3 * 3 and got["watchdog/slowest_rank"] == 5.0
    assert (got["watchdog/compute_ms/max"], got["watchdog/compute_ms/slowest"]) == (180.0, 180.0)
    assert got["watchdog/compute_ms/median"] == 100.0 and got["watchdog/straggler_score/slowest"] == 1.8
    assert got["watchdog/comm_ms/median"] == got["watchdog/comm_ms/slowest"] == 30.0
    assert watchdog_metrics({"step": 1}) == {}
