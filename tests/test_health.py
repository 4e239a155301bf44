"""The watchdog's checks for the quiet faults (trainer/supervise/watchdog.py, trainer/loss_health.py), on
recorded step figures: pure logic, milliseconds. The drills that produce the same faults in real ranks are in
tests/test_quiet_faults.py."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from trainpipe.trainer.config import WatchdogConfig
from trainpipe.trainer.data.sampler import DataSkip, data_index
from trainpipe.trainer.errors import ProfileError
from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.loop.links import LinkTimes, Verdict, judge, ring_links, verdict_of
from trainpipe.trainer.loop.step_clock import CudaStamps, StepClock
from trainpipe.trainer.loss_health import EvalTrend, LossHealth, checked_by_ranks, checked_by_watchdog
from trainpipe.trainer.orchestrate.policy import after_attempt, with_rollbacks
from trainpipe.trainer.profile_files import load_profile
from trainpipe.trainer.supervise.beacons import BeaconServer, StepReport
from trainpipe.trainer.supervise.gpu_use import GpuIdle
from trainpipe.trainer.supervise.time_split import TimeSplit
from trainpipe.trainer.supervise.watchdog import Watchdog

HEALTHY = Path(__file__).parent / "fixtures" / "healthy_local_3000.json"
HEALTHY_EVAL = Path(__file__).parent / "fixtures" / "healthy_local_3000_eval.json"  # (step, eval loss)


def healthy_losses(steps: int = 3000) -> list[tuple[float, float]]:
    """(loss, grad norm) of the first ``steps`` steps of a healthy run of the local profile, as recorded here
    (3,000 steps of 2 ranks, cosine schedule over 3,000 steps, three epochs of its data)."""
    return [tuple(row) for row in json.loads(HEALTHY.read_text())[:steps]]


def feed(health: LossHealth, series, first: int = 1) -> list[Incident]:
    found = []
    for i, (loss, grad) in enumerate(series):
        if (f := health.observe(first + i, loss, grad, "node0")) is not None:
            found.append(f)
    return found


def test_a_loss_spike_is_found_at_its_step_and_a_healthy_run_has_none():
    cfg = WatchdogConfig(health_window=20)
    series = healthy_losses(3000)
    assert feed(LossHealth(cfg), series) == []
    spiked = list(series)
    spiked[99] = (spiked[99][0] * 6, spiked[99][1] * 40)  # step 100
    found = feed(LossHealth(cfg), spiked)
    assert [(f.kind, f.step, f.fatal) for f in found] == [("loss_spike", 100, True)]
    assert "policy rollback: the run resumes from the newest checkpoint before step 100" in found[0].detail


def test_a_gradient_norm_spike_alone_is_a_loss_spike_and_warn_goes_on():
    cfg = WatchdogConfig(health_window=20, on_loss_spike="warn")
    series = healthy_losses(200)
    series[149] = (series[149][0], series[149][1] * 30)
    found = feed(LossHealth(cfg), series)
    assert [(f.kind, f.step, f.fatal) for f in found] == [("loss_spike", 150, False)]
    assert "gradient norm" in found[0].detail and "training goes on" in found[0].detail


def test_a_flat_loss_is_a_flatline_within_its_window_and_a_falling_one_is_not():
    rng = random.Random(1)
    flat = [(5.4 + rng.gauss(0, 0.02), 0.5) for _ in range(300)]  # what train.lr=1e-9 trains
    found = feed(LossHealth(WatchdogConfig(flatline_steps=100)), flat)
    assert [f.kind for f in found] == ["flatline"] and found[0].step <= 130 and not found[0].fatal
    assert feed(LossHealth(WatchdogConfig()), healthy_losses()) == []  # the default window: 500 steps
    stop = feed(LossHealth(WatchdogConfig(flatline_steps=100, on_flatline="stop")), flat)
    assert stop[0].fatal and "the run stops" in stop[0].detail


def test_an_eval_loss_that_stops_falling_across_evaluations_is_a_flatline_at_phase_eval():
    def evals(trend, every: int = 100, steps: int = 3000):
        trainer = EvalTrend(WatchdogConfig(flatline_steps=500))
        return [f for s in range(every, steps + 1, every) if (f := trainer.observe(s, trend(s)))]

    assert evals(lambda s: 5.4)[0].step == 600  # the first whole window: steps 100-600, 6 evaluations
    rising = evals(lambda s: 1.5 + s / 1e4 if s > 1200 else 2.0 - s / 4e3)  # overfitting from step 1200
    assert [(f.kind, f.phase, f.step) for f in rising] == [("flatline", "eval", 1700)]
    assert "overfitting" in rising[0].detail and not rising[0].fatal
    assert evals(lambda s: 1.5 + 3 / (1 + s / 100)) == []  # falling more slowly each time, but falling
    healthy = EvalTrend(WatchdogConfig())  # the local profile's evaluations every 100 steps, recorded here
    assert [f for s, v in json.loads(HEALTHY_EVAL.read_text()) if (f := healthy.observe(s, v))] == []
    assert evals(lambda s: 5.4, every=200) == []  # three evaluations a window: too few to see noise
    stop = EvalTrend(WatchdogConfig(flatline_steps=500, on_flatline="stop"))
    assert [f.fatal for s in range(100, 700, 100) if (f := stop.observe(s, 5.4))] == [True]


def test_gpus_near_idle_while_the_steps_slowed_down_are_a_gpu_idle_warning_naming_their_hosts():
    cfg = WatchdogConfig()  # straggler_factor 2, gpu_idle_pct 10
    hosts = {0: "node0", 1: "node0", 2: "node1", 3: "node1"}
    fast, slow, busy = [0.1] * 20, [0.35] * 20, {r: 90.0 for r in hosts}
    idle = {0: 2.0, 1: 3.0, 2: 4.0, 3: 96.0}
    dog = GpuIdle(cfg)
    assert dog.check(fast[:19], busy, hosts) is None  # 20 steps make the baseline
    assert dog.check(fast, busy, hosts) is None and (dog.baseline_s, dog.baseline_use) == (0.1, 90.0)
    assert dog.check(fast, idle, hosts) is None  # idle GPUs at full speed: nothing slowed down
    assert dog.check(slow, {0: 95.0, 1: 97.0, 2: 4.0, 3: 96.0}, hosts) is None  # busy GPUs: slower kernels
    assert [dog.check(slow, idle, hosts, quiet_phase=True) for _ in range(5)] == [None] * 5  # a checkpoint
    assert [dog.check(slow, idle, hosts) for _ in range(2)] == [None, None]  # three checks in a row
    found = dog.check(slow, idle, hosts)
    assert (found.kind, found.node, found.ranks, found.fatal) == ("gpu_idle", "node0, node1", [0, 1, 2], False)
    assert "3% busy" in found.detail and "against 90%" in found.detail and "3.5x their first 20" in found.detail
    assert dog.check(slow, idle, hosts) is None  # said once an attempt
    light = GpuIdle(cfg)  # a model that never kept its GPUs busy: idle GPUs say nothing about a slowdown
    light.check(fast, {0: 5.0, 1: 6.0}, hosts)
    assert [light.check(slow, {0: 2.0, 1: 3.0}, hosts) for _ in range(5)] == [None] * 5


def split_reports(step: int, figures: dict[int, tuple[float, float, float]], hosts: dict[int, str]) -> list:
    return [StepReport(r, step, hosts[r], None, None, *f) for r, f in figures.items()]


def run_split(cfg: WatchdogConfig, steps: int, figures, hosts) -> list[Incident]:
    """``figures(step, rank) -> (data, compute, comm)``; every rank reports every step."""
    split, found = TimeSplit(cfg, len(hosts)), []
    for s in range(1, steps + 1):
        for report in split_reports(s, {r: figures(s, r) for r in hosts}, hosts):
            split.observe(report)
        found += split.check()
    return found


HOSTS4 = {0: "node0", 1: "node0", 2: "node1", 3: "node1"}


def jitter(s: int, r: int) -> float:
    return 1 + 0.05 * random.Random(s * 7 + r).random()


def test_a_rank_waiting_for_its_data_is_a_data_stall_naming_it():
    cfg = WatchdogConfig(straggler_window=5)

    def figures(s, r):
        data = 0.3 if r == 2 and s > 20 else 0.001
        return data, 0.1 * jitter(s, r), 0.01 if r == 2 else 0.01 + (0.3 if s > 20 else 0)

    found = run_split(cfg, 40, figures, HOSTS4)
    assert [(f.kind, f.rank, f.node) for f in found] == [("data_stall", 2, "node1")]
    assert "waits for its data" in found[0].detail and found[0].step <= 35  # within 2 windows after the fault
    assert "100% the rest of the read (slicing batches and copying them to the device), 0% fetching" in found[0].detail


def test_a_data_stall_says_where_the_wait_went_over_its_last_window():
    """A shard load is one step's event: the window's sums, not its medians, say what the wait was spent on."""

    def figures(s, r):
        if r != 2 or s <= 20:
            return 0.001, 0.1, 0.01
        if s % 5 == 1:  # a shard per window: 1 s from the store, 0.2 s for its sha256
            return 1.3, 0.1, 0.01, 1.0, 0.2
        return 0.3, 0.1, 0.01

    found = run_split(WatchdogConfig(straggler_window=5), 40, figures, HOSTS4)
    assert [(f.kind, f.rank) for f in found] == [("data_stall", 2)]
    parts = "52% the rest of the read (slicing batches and copying them to the device), 40% fetching shards from "
    parts += "the store, 8% checking their sha256"
    assert f"in the last window: {parts}" in found[0].detail, found[0].detail  # of 1.3 + 4 x 0.3 s


def test_slow_collectives_on_every_rank_with_flat_compute_are_a_network_incident():
    cfg = WatchdogConfig(straggler_window=5)

    def figures(s, r):
        return 0.001, 0.1 * jitter(s, r), (0.2 if s > 20 else 0.01) * jitter(s, r)

    found = run_split(cfg, 40, figures, HOSTS4)
    assert [(f.kind, f.node, f.ranks) for f in found] == [("network", "node0, node1", [0, 1, 2, 3])]
    assert "a slow fabric" in found[0].detail and found[0].step <= 35


def test_slow_collectives_on_the_ranks_of_one_host_name_that_host():
    cfg = WatchdogConfig(straggler_window=5)

    def figures(s, r):
        return 0.001, 0.1 * jitter(s, r), (0.2 if s > 20 and HOSTS4[r] == "node1" else 0.01) * jitter(s, r)

    found = run_split(cfg, 40, figures, HOSTS4)
    assert [(f.kind, f.node, f.ranks) for f in found] == [("network", "node1", [2, 3])]


def test_a_slow_rank_makes_the_others_wait_but_that_is_no_network_incident():
    """The others' collectives grow because one rank computes slower: a straggler's doing, not the link's."""
    cfg = WatchdogConfig(straggler_window=5)

    def figures(s, r):
        slow = s > 20 and r == 3
        return 0.001, 0.4 if slow else 0.1 * jitter(s, r), 0.01 if r == 3 else 0.01 + (0.3 if s > 20 else 0)

    assert run_split(cfg, 40, figures, HOSTS4) == []


def test_one_ranks_noisy_collectives_are_no_network_incident():
    cfg = WatchdogConfig(straggler_window=5)

    def figures(s, r):
        return 0.001, 0.1, 0.2 if r == 1 and s > 20 else 0.01

    assert run_split(cfg, 40, figures, HOSTS4) == []


def test_the_watchdog_reads_the_figures_from_real_beacons_and_reports_a_spike_under_warn():
    from trainpipe.trainer.loop.beacon import Beacon

    server = BeaconServer(world_size=1)
    try:
        dog = Watchdog(WatchdogConfig(health_window=10, on_loss_spike="warn"), server, world_size=1)
        b = Beacon(0, server.address, server.token)
        for s, (loss, grad) in enumerate(healthy_losses(30), start=1):
            b(s + 1, "data", l=loss * (8 if s == 25 else 1), g=grad, dw=0.001, cp=0.1, cw=0.01)
        deadline = time.monotonic() + 5
        while not dog.findings and time.monotonic() < deadline:
            assert dog.check() is None  # a warning: the attempt goes on
            time.sleep(0.01)
        assert [(f.kind, f.step, f.fatal) for f in dog.findings] == [("loss_spike", 25, False)]
        b.close()
    finally:
        server.close()


def test_each_loss_check_runs_in_one_place_the_ranks_for_what_ends_an_attempt_the_watchdog_for_warnings():
    default = WatchdogConfig()  # rollback on a spike, warn on a flatline
    ranks, dog = checked_by_ranks(default), checked_by_watchdog(default)
    assert (ranks.spikes, ranks.flatlines, dog.spikes, dog.flatlines) == (True, False, False, True)
    assert checked_by_ranks(WatchdogConfig(on_loss_spike="warn")) is None
    assert checked_by_watchdog(WatchdogConfig(on_flatline="stop", on_loss_spike="stop")) is None


# ---------------------------------------------------------------- policy and the data skipped


def test_a_loss_spike_rolls_back_once_per_step_and_stop_stops(home):
    profile = load_profile("local")
    spike = Incident(kind="loss_spike", detail="loss 47 is 15x its median", step=30)
    first = after_attempt(spike, [], profile)
    assert first.action == "retry" and first.rollback_before == 30
    again = after_attempt(spike, [spike], with_rollbacks(profile, [30]))
    assert again.action == "stop" and "spiked again at step 30 after rolling back" in again.reason
    stop = after_attempt(spike, [], load_profile("local", ["watchdog.on_loss_spike=stop"]))
    assert stop.action == "stop" and stop.rollback_before is None
    flat = Incident(kind="flatline", detail="the training loss did not improve", step=300)
    assert after_attempt(flat, [], profile).action == "stop"


def test_a_replica_mismatch_is_retried_and_the_same_node_twice_is_excluded(home):
    from tests.test_policy import nodes

    sdc = Incident(kind="sdc", detail="rank 1's weights differ", rank=1, node="gpu-007", ranks=[1])
    three = nodes(load_profile("local"), 3, min_nodes=2)
    assert after_attempt(sdc, [], three).action == "retry" and after_attempt(sdc, [], three).exclude_node is None
    assert after_attempt(sdc, [sdc], three).exclude_node == "gpu-007"


def test_skipped_data_moves_the_steps_after_the_checkpoint_past_the_spike():
    skip = DataSkip(after_step=20, steps=10, spike_step=30)
    assert [data_index(s, [skip]) for s in (1, 20, 21, 30, 31)] == [0, 19, 30, 39, 40]
    assert skip.covers(30) and skip.covers(21) and not skip.covers(20) and not skip.covers(31)


@pytest.mark.parametrize(
    "override, says",
    [
        ("watchdog.health_window=1", "watchdog.health_window: Input should be greater than or equal to 2"),
        ("watchdog.loss_spike_factor=1", "watchdog.loss_spike_factor: Input should be greater than 1"),
        ("watchdog.grad_spike_factor=0.5", "watchdog.grad_spike_factor: Input should be greater than 1"),
        ("watchdog.network_factor=1", "watchdog.network_factor: Input should be greater than 1"),
        ("watchdog.sdc_every=0", "watchdog.sdc_every: Input should be greater than or equal to 1"),
        ("watchdog.flatline_steps=2", "watchdog.flatline_steps: Input should be greater than or equal to 3"),
        ("watchdog.data_stall_share=1", "watchdog.data_stall_share: Input should be less than 1"),
        ("train.rollbacks=[0]", "train.rollbacks holds 1-based steps"),
    ],
)
def test_thresholds_that_cannot_work_are_one_line_before_anything_starts(home, override, says):
    with pytest.raises(ProfileError) as err:
        load_profile("local", [override])
    assert says in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "planted", [["../etc"], [0], list(range(1, 100)), {"steps": [5]}, [True], [2.5]], ids=lambda v: str(v)[:20]
)
def test_a_planted_rollbacks_file_is_one_line_naming_it(home, planted):
    """Who may write the bucket may plant the run's rollbacks (docs/security.md): steps only, bounded."""
    from trainpipe.trainer.errors import StoreError
    from trainpipe.trainer.orchestrate.records import RunRecords

    profile = load_profile("local")
    records = RunRecords(profile.store, "planted")
    target = Path(records.paths.rollbacks)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(planted))
    with pytest.raises(StoreError) as err:
        records.rollbacks()
    assert "rollbacks.json is not a list of at most 32 steps" in str(err.value) and "\n" not in str(err.value)


def test_the_run_remembers_each_rollback_once(home):
    from trainpipe.trainer.orchestrate.records import RunRecords

    records = RunRecords(load_profile("local").store, "spiky")
    assert records.rollbacks() == []
    records.roll_back(30)
    records.roll_back(30)
    records.roll_back(70)
    assert records.rollbacks() == [30, 70]


@pytest.mark.parametrize(
    "skips",
    [
        "all",
        [{"after_step": 0, "steps": 10**12, "spike_step": 5}],
        [{"after_step": 0, "steps": 5, "spike_step": 5, "run": "rm -rf /"}],
        [{"after_step": -1, "steps": 5, "spike_step": 5}],
        [{"after_step": "7", "steps": 5, "spike_step": 5}],
        [{"after_step": 0, "steps": 1, "spike_step": 5}] * 65,
    ],
    ids=["not-a-list", "huge", "extra-key", "negative", "a-string", "too-many"],
)
def test_planted_data_skips_in_a_manifest_are_refused(skips):
    from trainpipe.trainer.checkpoint.catalog import CheckpointInfo
    from trainpipe.trainer.loop.trainer import _recorded_skips

    info = CheckpointInfo("file:///x/step-00000010", 10, True, True, "", {"data_position": {"skips": skips}})
    with pytest.raises(ValueError):
        _recorded_skips(info)


def test_leave_one_out_medians_match_the_plain_definition_at_any_size():
    """The straggler score's baseline, in O(n log n): thousands of ranks are scored within a poll."""
    import statistics

    from trainpipe.trainer.supervise.checks.straggler import leave_one_out_medians

    rng = random.Random(3)
    for n in (1, 2, 3, 4, 7, 10, 64):
        values = {r: rng.choice([0.1, 0.2, rng.random()]) for r in range(n)}
        plain = {r: statistics.median([v for q, v in values.items() if q != r] or [values[r]]) for r in values}
        assert leave_one_out_medians(values) == pytest.approx(plain)


def test_a_list_of_thousands_of_ranks_is_one_readable_line():
    from trainpipe.trainer.incidents import ranks_text

    assert ranks_text([0, 1]) == "[0, 1]"
    assert ranks_text(list(range(4095))) == "[0, 1, 2, 3, 4, 5, 6, … 4094] (4,095 ranks)"


def test_two_spikes_rolled_back_from_the_same_checkpoint_skip_past_the_later_ones_data():
    """Checkpoint 200, a spike at 250 (skip 200→250); before another commit, a spike at 290, fed by position
    289 + 50 = 339. Resumed from 200 again, step 201 must read position 340, just past it."""
    from trainpipe.trainer.data.sampler import skips_after

    first = skips_after([], [250], 200)
    assert data_index(290, first) == 339  # what fed the second spike
    both = skips_after([], [250, 290], 200)
    assert data_index(201, both) == 340
    from_recorded = skips_after(first, [250, 290], 260)  # a checkpoint at 260 recorded the first skip
    assert data_index(261, from_recorded) == 340  # the same position: the run reads the same data either way


def test_a_form_cannot_set_the_runs_rollbacks_and_bounds_hold(home):
    from trainpipe.trainer.orchestrate.run_form import check_form_overrides

    profile = load_profile("local")
    with pytest.raises(ProfileError, match=r"train\.rollbacks cannot be set from the run form"):
        check_form_overrides(profile, ["train.rollbacks=[1]"])
    with pytest.raises(ProfileError, match=r"watchdog\.probe_links cannot be set from the run form"):
        check_form_overrides(profile, ["watchdog.probe_links=true"])  # its verdict excludes nodes
    check_form_overrides(profile, ["train.steps=10", "watchdog.straggler_window=5"])  # tighter: allowed
    with pytest.raises(ProfileError, match=r"it feeds watchdog\.on_loss_spike=rollback"):  # the default rolls back
        check_form_overrides(profile, ["watchdog.health_window=20"])
    for override in ("train.rollbacks=[1000000001]", "watchdog.health_window=100000", "watchdog.network_factor=1e9"):
        with pytest.raises(ProfileError):
            load_profile("local", [override])


def test_a_replay_record_is_used_only_when_finite_and_saved_under_the_same_settings():
    from trainpipe.trainer.loop.replicas import Replay, ReplayMismatch

    context = {"world_size": 2, "micro_batch": 8, "torch": "2.13.0"}
    record = {"step": 21, "loss": 2.5, "context": context}
    with pytest.raises(ReplayMismatch):
        Replay(20, record, context).check(21, 2.5000000000000004)
    Replay(20, record, context).check(21, 2.5)
    Replay(20, record, {**context, "micro_batch": 2}).check(21, 9.9)  # other settings: other bits, no replay
    Replay(20, {**record, "loss": float("nan")}, context).check(21, 9.9)  # planted: ignored
    Replay(20, {**record, "step": True}, context).check(21, 9.9)


def test_step_reports_are_kept_only_for_a_watchdog_that_drains_them():
    from trainpipe.trainer.loop.beacon import Beacon

    server = BeaconServer(world_size=1)
    try:
        b = Beacon(0, server.address, server.token)
        b(2, "data", l=1.0, g=1.0, dw=0.0, cp=0.1, cw=0.0)
        time.sleep(0.3)
        assert server.drain_reports() == []
        server.keep_reports = True
        b(3, "data", l=1.0, g=1.0, dw=0.0, cp=0.1, cw=0.0)
        deadline = time.monotonic() + 5
        while not (got := server.drain_reports()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [r.step for r in got] == [2]
        b.close()
    finally:
        server.close()


# ---------------------------------------------------------------- the link probe's verdict (trainer/loop/links.py)


def test_the_host_ring_is_measured_in_rounds_where_no_host_is_in_two_links():
    for hosts in range(2, 12):
        rounds = ring_links(hosts)
        links = sorted(i for r in rounds for i in r)
        assert links == ([0] if hosts == 2 else list(range(hosts)))
        for r in rounds:
            ends = [h for i in r for h in (i, (i + 1) % hosts)]
            assert len(ends) == len(set(ends)), (hosts, rounds)
        assert len(rounds) <= 3


def times(*ms: float) -> LinkTimes:
    n = len(ms)
    return LinkTimes([f"h{i}" for i in range(n)], list(range(n)), [m / 1000 for m in ms])


def test_the_probe_blames_the_host_both_slow_links_share_or_the_one_slow_link():
    assert judge(times(1.3, 1095, 1098), 3) == Verdict(["h2"], [])
    assert judge(times(1.0, 1.1, 40, 41, 0.9), 3) == Verdict(["h3"], [])
    assert judge(times(1.0, 1.1, 40, 1.2, 0.9), 3) == Verdict([], ["h2<->h3"])
    assert judge(times(1.0, 1.3, 1.6, 1.1), 3) == Verdict([], [])  # noise
    assert judge(times(0.01, 0.02, 0.05), 3) == Verdict([], [])  # 5x, but 40 µs is not a slow link
    assert judge(times(30, 31, 29), 3) == Verdict([], [])  # every link alike: the fabric, no host to blame
    assert judge(times(1.0, 1.0, 2.5), 1.5) == Verdict([], [])  # a verdict excludes a node: never under 3x
    assert judge(LinkTimes(["a", "b"], [0, 1], [5.0]), 3) == Verdict([], [])  # one link: nothing to compare


def test_each_rail_is_judged_against_the_fastest_link_of_any():
    """Hosts with a NIC per GPU: local rank 1's NIC on h2 is slow, local rank 0's are all fine."""
    hosts = ["h0", "h1", "h10", "h2"]
    rail0 = LinkTimes(hosts, [0, 2, 4, 6], [0.001, 0.0011, 0.0009, 0.001], rail=0)
    rail1 = LinkTimes(hosts, [1, 3, 5, 7], [0.001, 0.001, 0.04, 0.041], rail=1)  # h10<->h2 and h2<->h0
    assert verdict_of([rail0, rail1], 3) == Verdict(["h2"], [])
    one_link = LinkTimes(hosts, [1, 3, 5, 7], [0.001, 0.04, 0.001, 0.001], rail=1)  # h1<->h10 on rail 1 only
    assert verdict_of([rail0, one_link], 3) == Verdict([], ["h1<->h10 (local rank 1)"])
    uniform = LinkTimes(hosts, [1, 3, 5, 7], [0.03, 0.03, 0.03, 0.03], rail=1)  # a whole rail slow
    assert verdict_of([rail0, uniform], 3) == Verdict([], [])  # its fabric: no host to blame


class DeviceClock:
    """A device's clock, moved by the test: CUDA events stamp it when recorded (the seam CudaStamps takes), and
    ``idle`` says whether the device has run out of queued work."""

    def __init__(self):
        self.now_ms, self.synchronized, self.idle = 0.0, 0, True

    def event(self):
        clock = self

        class Event:
            def record(self, stream=None):
                self.at = clock.now_ms

            def synchronize(self):
                clock.synchronized += 1

            def query(self):
                return clock.idle

            def elapsed_time(self, end):
                return end.at - self.at

        return Event()


def test_on_a_gpu_the_step_clock_times_waits_on_the_device_not_by_the_host(monkeypatch):
    """The host queues a step's kernels in no time; the device then waits 30 ms for the gradients' all-reduce and 5 ms
    for the loss's. FSDP2's gather runs on its own stream beside compute: not a wait. Of three 4 ms reads, the
    first (the device idle) and the third (the device ran out of work meanwhile) are data waits; the second, read
    while the device computed, is not. The host's clock is the test's too: this test's own time on a busy host
    (2.6 ms once in CI) is no part of the step."""
    from types import SimpleNamespace

    from trainpipe.trainer.loop import step_clock

    host = SimpleNamespace(perf_counter=lambda: 0.0)
    monkeypatch.setattr(step_clock, "time", host)
    device = DeviceClock()
    clock = StepClock(CudaStamps(event=device.event))
    clock.on_step_start(1)
    for idle in (True, False, True):
        clock.on_data(1)
        device.idle = idle
        clock.on_data_wait(1, 0.004)
    device.now_ms = 10.0
    clock.on_collective(1, "all_gather")
    device.now_ms = 22.0
    clock.on_collective_end(1, "all_gather", waited_s=0.0)
    device.now_ms = 60.0
    clock.on_gradients_ready()
    device.now_ms = 90.0
    clock.on_phase(1, "optimizer")
    device.now_ms = 95.0
    clock.on_collective(1, "loss")
    device.now_ms = 100.0
    host.perf_counter = lambda: 0.112  # the loss's .item() waited for the device: 100 ms plus 12 ms of reads
    data, compute, comm = clock.split()
    assert data == pytest.approx(0.008)
    assert comm == pytest.approx(0.030 + 0.005)
    assert compute == pytest.approx(0.112 - 0.008 - 0.035)
    assert device.synchronized >= 1  # read only once the events completed
    clock.on_step_start(2)  # the next step reuses the events
    assert clock.stamps.used == 0 and len(clock.stamps.pool) == 6


def test_on_a_cpu_the_step_clock_counts_the_collectives_the_host_waited_in():
    clock = StepClock()
    clock.on_step_start(1)
    clock.on_collective(1, "reduce_scatter")
    time.sleep(0.02)
    clock.on_collective_end(1, "reduce_scatter", waited_s=0.02)
    data, compute, comm = clock.split()
    assert data == 0.0 and 0.02 <= comm < 0.2 and compute < 0.01
