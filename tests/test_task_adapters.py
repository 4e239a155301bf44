"""The task adapters' own logic (tasks/), in-process: task run names, the progress artifact."""

from __future__ import annotations

import types

import pytest

import trainpipe.tasks.validate as validate_task
from trainpipe.trainer.profile_files import load_profile


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


def test_the_progress_artifact_ends_with_the_final_steps_loss(monkeypatch):
    """While training it shows the last polled beacon's loss; at the end, the final step's own, as the log's
    last step line does, not the last poll's (a few steps older)."""
    from trainpipe.tasks import train

    said: list[tuple[float, str]] = []

    def create(share: float, key: str, description: str) -> str:
        said.append((share, description))
        return "artifact-id"

    monkeypatch.setattr(train, "create_progress_artifact", create)
    monkeypatch.setattr(train, "update_progress_artifact", lambda _, share, description: create(share, "", description))
    follow = train.FollowAttempt("run", 8, types.SimpleNamespace(debug=lambda *a: None), every_s=3600)
    follow.progress = {0: {"step": 6, "l": 2.25}, 1: {"step": 7, "l": 2.5}}
    follow.publish()
    follow.publish(8, 1.875)
    follow.publish(8, None)  # a retry after the final commit trained no step: no loss to show
    assert said == [(87.5, "step 7/8, loss 2.2500"), (100.0, "step 8/8, loss 1.8750"), (100.0, "step 8/8")]


def test_serve_names_its_mlflow_server_without_the_credentials_a_tracking_uri_carries():
    from trainpipe.flows.deployments import mlflow_line

    line = mlflow_line("https://ops:s3cret-passw0rd@mlflow.example:5000")
    assert line is not None and "s3cret-passw0rd" not in line and "ops" not in line, line
    assert line.startswith("its runs in MLflow: https://") and line.endswith("mlflow.example:5000")
    assert mlflow_line("sqlite:////tmp/mlflow.db") is None


def test_a_sigterm_whose_exception_a_finalizer_swallowed_still_stops_the_attempt_at_its_next_poll():
    """Python runs a signal's handler wherever the main thread is; inside a ``__del__`` its exception is only
    printed ("Exception ignored in …") and a terminated ``trainpipe run`` trained on to its end (seen once in CI).
    The train task's poll asks the termination latch, which the interpreter wrote the signal into."""
    import gc
    import os
    import signal

    from prefect.exceptions import TerminationSignal

    from trainpipe.tasks import train
    from trainpipe.trainer.orchestrate import termination

    def handler(signum, frame):
        raise TerminationSignal(signum)  # as Prefect's own handler does during a flow run

    class Collected:
        def __del__(self):  # the garbage collector runs it wherever the main thread is
            os.kill(os.getpid(), signal.SIGTERM)
            sum(range(10_000))  # the handler runs here, and its exception goes nowhere

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        termination.arm()
        termination.forget()  # whatever an earlier test of this process left
        follow = train.FollowAttempt("run", 8, types.SimpleNamespace(debug=lambda *a: None), every_s=3600)
        follow._last = float("inf")  # no progress artifact: nothing here talks to a server
        follow({0: {"step": 1}})  # no signal yet: the attempt goes on
        cycle = Collected()
        cycle.self = cycle
        del cycle
        gc.collect()  # the signal arrived and its exception was lost: without the latch, nothing more happens
        with pytest.raises(TerminationSignal):
            follow({0: {"step": 2}})
        termination.arm()  # the next attempt of this process: the lost signal still stops it
        with pytest.raises(TerminationSignal):
            follow({0: {"step": 3}})
        termination.forget()  # dealt with (a person's cancel, returned as Cancelled): the process goes on
        follow({0: {"step": 4}})
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_latch_takes_the_wakeup_fd_back_after_an_event_loop_reset_it_and_leaves_a_loops_own_alone():
    """An asyncio loop in the main thread that added and removed a signal handler leaves no wakeup fd: the next
    attempt's ``arm`` takes it again. One a running loop holds stays that loop's."""
    import asyncio
    import signal

    from trainpipe.trainer.orchestrate import termination

    def current() -> int:
        fd = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(fd)
        return fd

    termination.arm()
    assert termination._pipe is not None and current() == termination._pipe[1]

    async def add_and_remove() -> int:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR2, lambda: None)
        ours = current()
        assert not termination.latch()  # the loop's fd stays the loop's
        assert current() == ours
        loop.remove_signal_handler(signal.SIGUSR2)
        return ours

    asyncio.run(add_and_remove())
    assert current() == -1  # the loop reset it
    termination.arm()
    assert current() == termination._pipe[1]


def test_without_a_watchdog_the_caller_still_hears_every_poll():
    """watchdog.enabled: false leaves no watchdog, and the train task must still see a cancel or a lost stop."""
    from trainpipe.trainer.supervise.attempt import _watch

    heard: list[dict] = []
    assert _watch(None, None, None, heard.append) is None
    assert heard == [{}]
