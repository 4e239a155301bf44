"""Task run names (tasks/): each stage's named after the run, never after a path or a profile."""

from __future__ import annotations

import types

import pytest

import trainpipe.tasks.validate as validate_task
from trainpipe.trainer.config import load_profile


@pytest.mark.parametrize(
    "run_name,uri,expected",
    [
        ("nightly-3", "s3://bucket/store/runs/other/checkpoints/step-00000010", "validate-nightly-3"),
        (None, "/store/runs/my-run/checkpoints/step-00000010", "validate-my-run"),
        (None, "s3://bucket/runs/$(reboot)/checkpoints/step-00000001", "validate-checkpoint"),  # no run name
        (None, "", "validate-checkpoint"),
    ],
)
def test_validate_is_named_after_the_run(monkeypatch, run_name, uri, expected):
    profile = load_profile("local", [])
    profile.train.run_name = run_name
    monkeypatch.setattr(validate_task, "task_run", types.SimpleNamespace(parameters={"uri": uri, "profile": profile}))
    assert validate_task.validate_run_name() == expected
