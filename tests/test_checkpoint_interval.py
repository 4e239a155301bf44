"""The checkpoint interval by the numbers: Young/Daly from measured costs (``checkpoint.every_steps: auto``), the
run's own failure history, and what an interval cost against twice and half of it."""

from __future__ import annotations

import math
import re

import pytest

from tests.conftest import train_result
from trainpipe.trainer.checkpoint.interval import expected_cost_s, young_daly_s
from trainpipe.trainer.errors import ProfileError
from trainpipe.trainer.incidents import AttemptRecord, Incident
from trainpipe.trainer.loop.checkpoint_schedule import PROBE_STEPS, CheckpointSchedule
from trainpipe.trainer.orchestrate.badput import BUCKETS, Badput
from trainpipe.trainer.orchestrate.policy import for_attempt, observed_mtbf
from trainpipe.trainer.orchestrate.summary import interval_costs, interval_markdown
from trainpipe.trainer.profile_files import load_profile

pytestmark = pytest.mark.usefixtures("warm_module")  # its attempts fork their agents (conftest)


def test_young_daly_balances_the_saves_against_the_work_a_failure_loses():
    assert young_daly_s(1.0, 3600) == pytest.approx(math.sqrt(7200) - 1)
    assert young_daly_s(5000, 2000) == 2000  # saves dearer than failures: once per MTBF
    best = young_daly_s(0.5, 600)
    costs = [expected_cost_s(best * f, 0.5, failures=10, training_s=6000) for f in (0.5, 1, 2)]
    assert costs[1] < costs[0] and costs[1] < costs[2]  # with failures at the MTBF, it is the cheapest
    assert expected_cost_s(100, 1, 4, 1000) == pytest.approx(10 + 200)


def test_a_fixed_interval_saves_at_its_multiples():
    schedule = CheckpointSchedule(10, 3600, 0, agree=lambda v: v)
    assert [s for s in range(1, 41) if schedule.due(s)] == [10, 20, 30, 40]


def test_auto_decides_after_a_probe_and_again_after_each_measured_save():
    """Every rank takes the agreed (maximum) figures: here the other rank's save blocked 0.2 s."""
    agreed: list[list[float]] = []

    def agree(values: list[float]) -> list[float]:
        agreed.append(values)
        return [max(values[0], 0.2), *values[1:]]

    schedule = CheckpointSchedule("auto", 1.0, 100, agree=agree)  # a failure a second: saves every few steps
    step_times, stalls, saved = [0.01] * 4, [], []
    for step in range(101, 600):
        if schedule.due(step):
            saved.append(step)
            stalls.append(0.05)
        schedule.observe(step, step_times, stalls)
    first = max(1, round(young_daly_s(0.2, 1.0) / 0.01))  # before a save: one step's time, agreed up to 0.2
    assert agreed[0] == [0.01, 0.01, 0.0] and saved[0] == 100 + PROBE_STEPS + first
    assert saved[1] - saved[0] == first and len(agreed) == len(saved) + 1  # one agreement per decision


def test_a_saves_cost_beyond_its_blocking_sets_the_interval_when_given():
    """A memory-tier snapshot on a CPU blocks for a copy, but its writing and hashing take training's cores: the
    schedule takes the cost it is given (any number of saves seen committed), decides when a save was measured
    (the blocking times, as many on every rank), and falls back to the blocking times before any commit."""
    agreed: list[list[float]] = []

    def agree(values: list[float]) -> list[float]:
        agreed.append(values)
        return values

    schedule = CheckpointSchedule("auto", 60.0, 0, agree=agree)
    step_times = [0.1] * 4
    for step in range(1, PROBE_STEPS + 1):
        schedule.observe(step, step_times, [], [])
    assert agreed[-1] == [0.1, 0.1, 0.0]  # nothing measured yet: one step's time
    schedule.observe(schedule._next, step_times, [0.005], [0.2])  # type: ignore[arg-type]
    assert agreed[-1] == [0.2, 0.1, 0.0] and schedule.every_steps == round(young_daly_s(0.2, 60.0) / 0.1)
    decisions = len(agreed)
    schedule.observe(schedule._next, step_times, [0.005], [0.2, 0.3])  # type: ignore[arg-type]
    assert len(agreed) == decisions  # no new save blocked the loop since: no new decision


def test_auto_never_asks_for_a_save_before_the_previous_one_can_have_committed():
    """A slow store: saves block the loop for milliseconds but take 2.5 s to commit. Young/Daly alone would save
    every step, and every save asked for while the previous one uploads is skipped after waiting up to a second
    (``Checkpointer.save``); the interval is at least a commit's time, agreed as the maximum over the ranks."""
    agreed: list[list[float]] = []

    def agree(values: list[float]) -> list[float]:
        agreed.append(values)
        return [values[0], values[1], max(values[2], 2.5)]  # another rank's saves take 2.5 s

    schedule = CheckpointSchedule("auto", 2.0, 0, agree=agree)  # a failure every 2 s: Young/Daly says every step
    step_times = [1.0] * 4
    for step in range(1, PROBE_STEPS + 1):
        schedule.observe(step, step_times, [], durations_s=[])
    assert schedule.every_steps == 3  # nothing committed yet: the other rank's 2.5 s, in whole steps
    schedule.observe(schedule._next, step_times, [0.001], durations_s=[1.9, 2.1, 4.4])  # type: ignore[arg-type]
    assert agreed[-1][2] == 2.1 and schedule.every_steps == 3  # the median
    fast = CheckpointSchedule("auto", 2.0, 0, agree=lambda v: v)
    for step in range(1, PROBE_STEPS + 1):
        fast.observe(step, step_times, [], durations_s=[])
    fast.observe(fast._next, step_times, [0.001], durations_s=[0.2])  # type: ignore[arg-type]
    assert fast.every_steps == 1  # a store that keeps up: Young/Daly's interval stands


def test_auto_and_a_bad_interval_or_mtbf_are_one_line_before_anything_starts():
    assert load_profile("local", ["checkpoint.every_steps=auto"]).checkpoint.every_steps == "auto"
    for bad, says in [
        ("checkpoint.every_steps=often", "checkpoint.every_steps: a number of steps (1 or more) or auto"),
        ("checkpoint.every_steps=0", "checkpoint.every_steps: a number of steps (1 or more) or auto"),
        ("checkpoint.mtbf_hours=0", "checkpoint.mtbf_hours: Input should be greater than 0"),
        ("checkpoint.mtbf_hours=-2", "checkpoint.mtbf_hours: Input should be greater than 0"),
    ]:
        with pytest.raises(ProfileError, match=re.escape(says)) as raised:
            load_profile("local", [bad])
        assert "\n" not in str(raised.value)


def attempt(n: int, first: float, ended: float, kind: str | None) -> AttemptRecord:
    incident = Incident(kind=kind, detail=kind) if kind else None
    return AttemptRecord(attempt=n, first_step_at=first, ended_at=ended, incident=incident)


def test_a_run_with_failures_on_record_sets_auto_by_its_own_history(tmp_path):
    two = [attempt(1, 0, 1800, "crash"), attempt(2, 2000, 5600, "hang"), attempt(3, 6000, 6600, None)]
    assert observed_mtbf(two) == pytest.approx((6000 / 2 / 3600, 2, 6000 / 3600))
    assert observed_mtbf(two[:1]) is None  # one failure is not a history
    assert observed_mtbf([attempt(1, 0, 100, "cancelled"), attempt(2, 200, 300, "crash")]) is None
    before_training = [
        AttemptRecord(attempt=n, ended_at=n, incident=Incident(kind="crash", detail="x")) for n in (1, 2)
    ]
    assert observed_mtbf([*before_training, attempt(3, 0, 900, None)]) is None  # never trained: not a history
    assert observed_mtbf([attempt(1, 0, 1e-300, "crash"), attempt(2, 0, 1e-300, "hang")]) is None  # forged
    many = [attempt(n, 0, 700 / 999, "crash") for n in range(999)] + [attempt(1000, 0, 600, None)]
    assert observed_mtbf(many)[0] == 0.01  # never below the floor

    class Records:  # the run's records as the train task reads them (trainer.orchestrate.records)
        def excluded_nodes(self):
            return []

        def rollbacks(self):
            return []

        def incidents(self):
            return []

        def attempts(self):
            return two

    auto = load_profile("local", ["checkpoint.every_steps=auto"])
    changed, lines = for_attempt(auto, Records())
    assert changed.checkpoint.mtbf_hours == pytest.approx(6000 / 2 / 3600) and len(lines) == 1
    assert "2 failures in 1.67 h of training, one every 0.83 h (checkpoint.mtbf_hours says 24)" in lines[0]
    fixed = load_profile("local", [])
    assert for_attempt(fixed, Records()) == (fixed, [])  # a fixed interval is left as the profile says


def test_the_summary_prices_the_interval_used_against_twice_and_half():
    prof = load_profile("local", ["checkpoint.every_steps=20", "checkpoint.mtbf_hours=1"])
    result = train_result(step_s_median=0.5, checkpoint_stalls_s=[1.0, 2.0, 1.0], checkpoint_every_steps=None)
    buckets = dict.fromkeys(BUCKETS, 0.0) | {"checkpoint": 4.0, "wasted_progress": 6.0}
    c = interval_costs(prof, result, 2, Badput(1000.0, 990.0, buckets, []))
    assert (c["every_steps"], c["interval_s"], c["save_blocking_s"], c["auto"]) == (20, 10.0, 1.0, False)
    training = 990 + 4 + 6
    assert c["model_s"] == {
        "used": pytest.approx(training / 10 + 2 * 5),
        "twice": pytest.approx(training / 20 + 2 * 10),
        "half": pytest.approx(training / 5 + 2 * 2.5),
    }
    assert c["measured_s"] == 10.0 and c["young_daly_steps"] == round(young_daly_s(1.0, 3600) / 0.5)
    text = interval_markdown({"checkpoint_interval": c})
    assert "Every 20 steps (10.0 s; Young/Daly would take 168)" in text and "at half 205.0 s" in text
    assert interval_costs(prof, train_result(checkpoint_stalls_s=[]), 0, Badput(1.0, 1.0, buckets, [])) is None


@pytest.mark.distributed
def test_auto_saves_on_every_rank_at_the_same_steps_and_leaves_the_bits_alone(drill_reference, tmp_path, monkeypatch):
    """Two ranks under torchrun: both take the agreed figures (a rank that saved alone would hang DCP's save), the
    run commits checkpoints mid-run, and its weights are the fixed interval's."""
    from tests.conftest import DRILL
    from trainpipe.trainer.checkpoint.catalog import list_checkpoints
    from trainpipe.trainer.data.shard import shard_dataset
    from trainpipe.trainer.store_paths import RunPaths
    from trainpipe.trainer.supervise.attempt import train_attempt

    monkeypatch.setenv("TRAINPIPE_HOME", str(tmp_path / "home"))
    sets = [*DRILL, "tracking.enabled=false", "faults.kind=none", "checkpoint.every_steps=auto"]
    prof = load_profile("local", [*sets, "checkpoint.mtbf_hours=0.0002", "checkpoint.keep_last=100"])  # 0.72 s
    run = train_attempt(prof, "auto", shard_dataset(prof.data, prof.store).uri)
    assert run.result is not None, "\n".join(run.job.tail)
    every = run.result.checkpoint_every_steps
    steps = [c.step for c in list_checkpoints(RunPaths(prof.store.root, "auto").checkpoints)]
    assert every is not None and len(steps) >= 2 and steps[-1] == 60, (every, steps)
    assert run.result.model_digest == drill_reference.result.model_digest
