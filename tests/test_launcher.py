"""The launcher contract (trainer/launcher.py): one registry of launchers, one request type, one outcome."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import ClassVar

import pytest
from pydantic import Field, field_validator

from trainpipe.trainer.config import Profile
from trainpipe.trainer.errors import LaunchError
from trainpipe.trainer.launcher import (
    AttemptOutcome,
    LauncherOptions,
    LauncherSpec,
    LaunchRequest,
    Watch,
    launcher_spec,
    register_launcher,
)
from trainpipe.trainer.profile_files import load_profile


def test_the_shipped_launchers_are_registered_with_the_stages_they_run(home):
    import trainpipe.trainer.launch  # noqa: F401 - registers the launchers
    from trainpipe.trainer.launcher import _LAUNCHERS

    assert {k: sorted(spec.stages) for k, spec in _LAUNCHERS.items()} == {
        "local": ["preflight", "train"],
        "slurm": ["preflight", "train"],
        "kubernetes": ["preflight", "train"],
    }


# ------------------------------------------------------------------ a launcher is one module: a toy one, here alone


class ToyOptions(LauncherOptions):
    """``launcher.toy``: what the toy launcher needs of its own."""

    kind: ClassVar[str] = "toy"
    label: str = Field("toy", description="A word the toy passes to its host (lower-case letters).")

    @field_validator("label")
    @classmethod
    def _word(cls, value: str) -> str:
        if not value.isalpha() or not value.islower():
            raise ValueError("not a word of lower-case letters")
        return value


class Toy:
    """What the toy launcher did, for the test to see."""

    def __init__(self):
        self.labels: list[str] = []
        self.warm: list[str] = []
        self.stopped: list[str] = []

    def launch(self, request: LaunchRequest, watch: Watch) -> AttemptOutcome:
        """Records its job, runs this machine's supervisor with its option in the ranks' environment, forgets
        the job: what a cluster launcher does around its scheduler."""
        from trainpipe.trainer.launch import jobs
        from trainpipe.trainer.supervise.attempt import train_attempt

        options = ToyOptions.of(request.profile)
        self.labels.append(options.label)
        job = jobs.remember(request.profile, request.run_name, request.attempt, job_id=f"toy-{options.label}")
        outcome = train_attempt(
            request.profile,
            request.run_name,
            request.dataset_uri or "",
            on_line=watch.on_line,
            attempt=request.attempt,
            env={**os.environ, **request.profile.private_env(), "TOY_LABEL": options.label},
        )
        jobs.forget(request.profile.store, request.run_name, job)
        return outcome

    @contextlib.contextmanager
    def keep_warm(self, profile: Profile) -> Iterator[None]:
        self.warm.append("opened")
        yield
        self.warm.append("closed")

    @staticmethod
    def job_line(job) -> str:
        if not (job.job_id or "").startswith("toy-") or job.namespace or job.name:
            raise ValueError("a toy job is named toy-WORD")
        return f"toy job {job.job_id}"

    def stop_left(self, profile: Profile, run_name: str, job) -> tuple[bool, str] | None:
        self.stopped.append(job.job_id)
        return True, f"stopped toy job {job.job_id}, left running by pid {job.pid}"


@pytest.fixture
def toy():
    """The toy launcher, registered for one test (the registry is the process's)."""
    from trainpipe.trainer import launcher

    toy = Toy()
    spec = LauncherSpec(
        "toy",
        toy.launch,
        frozenset({"train"}),
        "this machine's supervisor, by way of a toy",
        options=ToyOptions,
        warm=toy.keep_warm,
        job_line=toy.job_line,
        stop_left=toy.stop_left,
    )
    register_launcher(spec)
    yield toy
    launcher._LAUNCHERS.pop("toy", None)


@pytest.mark.distributed
def test_a_launcher_defined_in_one_module_alone_runs_an_attempt_keeps_it_warm_and_stops_its_left_jobs(home, toy):
    """Everything a launcher is (its options, its warm block, its jobs' names and how to stop one left running)
    comes with its spec: this file's toy launcher runs a real training attempt without a line of trainpipe
    naming it, and its options are checked where a run is resolved."""
    from tests.conftest import TINY
    from trainpipe.trainer.data.shard import shard_dataset
    from trainpipe.trainer.errors import ProfileError
    from trainpipe.trainer.launch import check_launcher, launch_attempt, warm_attempts
    from trainpipe.trainer.launch.jobs import LiveJob, recorded, remember, stop_left_jobs
    from trainpipe.trainer.orchestrate.resolve import resolve

    sets = [*TINY, "tracking.enabled=false", "launcher.kind=toy", "launcher.toy.label=hello"]
    prof, name = resolve("local", sets, "toy-run")
    with pytest.raises(ProfileError, match=r"^launcher\.toy\.label: not a word of lower-case letters \(got 'Hi!'\)$"):
        resolve("local", [*sets, "launcher.toy.label=Hi!"], "toy-run-2")
    with pytest.raises(ProfileError, match=r"^unknown key 'launcher\.toy\.colour' \(keys of launcher\.toy: label\)$"):
        check_launcher(load_profile("local", [*sets, "launcher.toy.colour=red"]))

    dataset_uri = shard_dataset(prof.data, prof.store).uri
    with warm_attempts(prof):
        outcome = launch_attempt(prof, name, dataset_uri)
    assert outcome.result is not None and outcome.result.final_step == 8, outcome.incident
    assert toy.labels == ["hello"] and toy.warm == ["opened", "closed"]
    assert recorded(prof.store, name) == []  # its job was recorded while it ran, then forgotten

    # an orchestrator that died left a toy job running: the next attempt's fence stops it through the toy's spec
    remember(prof, name, 2, job_id="toy-left")
    fence = stop_left_jobs(prof, name)
    assert toy.stopped == ["toy-left"] and [i.detail for i in fence.stopped] == [
        f"stopped toy job toy-left, left running by pid {os.getpid()}"
    ]
    with pytest.raises(ValueError, match="a toy job is named toy-WORD"):
        LiveJob(launcher="toy", attempt=1, job_id="12")


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
