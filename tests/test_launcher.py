"""The launcher contract (trainer/launcher.py): one registry of launchers, one request type, one outcome."""

from __future__ import annotations

import pytest

from trainpipe.trainer.errors import LaunchError
from trainpipe.trainer.launcher import LaunchRequest, launcher_spec
from trainpipe.trainer.profile_files import load_profile


def test_every_launcher_kind_of_the_profile_is_registered_with_the_stages_it_runs(home):
    import trainpipe.trainer.launch  # noqa: F401 - registers the launchers
    from trainpipe.trainer.config import LauncherConfig

    kinds = LauncherConfig.model_fields["kind"].annotation.__args__
    assert {k: sorted(launcher_spec(k, "train").stages) for k in kinds} == {
        "local": ["preflight", "train"],
        "slurm": ["preflight", "train"],
        "kubernetes": ["preflight", "train"],
    }


def test_a_stage_or_kind_no_launcher_runs_is_one_line_before_anything_starts(home):
    import trainpipe.trainer.launch  # noqa: F401 - registers the launchers

    with pytest.raises(LaunchError, match=r"^launcher.kind=slurm cannot run the evaluate stage yet"):
        launcher_spec("slurm", "evaluate")
    with pytest.raises(LaunchError, match=r"^no launcher 'ray' \(registered: kubernetes, local, slurm\)$"):
        launcher_spec("ray", "train")


def test_a_train_request_names_its_dataset(home):
    with pytest.raises(ValueError, match="names its dataset"):
        LaunchRequest("train", load_profile("local"), "r")


def test_a_training_result_must_be_this_runs_and_name_one_of_its_checkpoints(home):
    """A cluster's result comes back through files others may write: one of another run, or naming a checkpoint
    outside the run's folder (which validation would then open with the operator's credentials), is refused."""
    from tests.conftest import train_result
    from trainpipe.trainer.launch import _not_this_runs
    from trainpipe.trainer.store_paths import RunPaths

    prof = load_profile("local")
    request = LaunchRequest("train", prof, "r", 1, "file:///d")
    mine = RunPaths(prof.store.root, "r").checkpoint(8)
    assert _not_this_runs(train_result(checkpoint_uri=mine), request) is None
    assert "run 'other''s" in _not_this_runs(train_result(run_name="other", checkpoint_uri=mine), request)
    for elsewhere in (
        RunPaths(prof.store.root, "other").checkpoint(8),
        "s3://attacker/runs/r/checkpoints/step-00000008",
        f"{RunPaths(prof.store.root, 'r').checkpoints}/../../other/checkpoints/step-00000008",
    ):
        assert "not one under" in _not_this_runs(train_result(checkpoint_uri=elsewhere), request), elsewhere
