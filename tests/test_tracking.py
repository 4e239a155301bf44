"""The MLflow run lifecycle (trainer/tracking.py) on a real MLflow store (SQLite): one run per run name, and the
status it ends with: FINISHED, FAILED on an error, KILLED on an interrupt."""

from __future__ import annotations

import pytest

from trainer.config import TrackingConfig
from trainer.tracking import RUN_NAME_TAG, client, tracked_run

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


def test_tracking_off_gives_a_run_that_logs_nothing(cfg):
    off = cfg.model_copy(update={"enabled": False})
    with tracked_run(off, "off") as run:
        run.log_metrics({"x": 1.0}, 1)
        run.log_dict({"a": 1}, "a.json")
    assert run.id is None
