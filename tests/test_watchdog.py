"""The watchdog's decisions, fed by real beacons over a real socket (no torch processes)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest

from trainpipe.trainer.config import WatchdogConfig
from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.loop.beacon import Beacon
from trainpipe.trainer.parallel_dims import Layout
from trainpipe.trainer.supervise.beacons import BeaconServer
from trainpipe.trainer.supervise.checks.base import Check, CheckSpec, Poll, Watch, finding
from trainpipe.trainer.supervise.checks.hang import allowance_s
from trainpipe.trainer.supervise.checks.straggler import leave_one_out_medians
from trainpipe.trainer.supervise.watchdog import Watchdog


@pytest.fixture
def server():
    srv = BeaconServer()
    yield srv
    srv.close()


def settle(server: BeaconServer, ranks: int, phase: str | None = None, step: int | None = None) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        snap = server.snapshot()
        if len(snap) == ranks and all(
            (phase is None or p.phase == phase) and (step is None or p.step == step) for p in snap.values()
        ):
            return
        time.sleep(0.01)
    raise AssertionError(f"beacons did not arrive: {server.snapshot()}")


def senders(server: BeaconServer, n: int = 2) -> list[Beacon]:
    # pid 0 is never a live process of ours: "unknown host" keeps liveness checks out of these tests.
    beacons = [Beacon(r, server.address, server.token) for r in range(n)]
    for b in beacons:
        b(-1, "start", pid=0, host="elsewhere")
    return beacons


def test_a_rank_that_never_reaches_the_collective_is_the_culprit(server):
    b0, b1 = senders(server)
    for step in (1, 2, 3):
        for b in (b0, b1):
            b(step, "data")
            b(step, "collective", n=step, c="grads", cs=0.01)
    b0(4, "data")
    b0(4, "collective", n=4, c="grads")
    b1(4, "data")
    b1(4, "forward")
    settle(server, 2, step=4)
    dog = Watchdog(WatchdogConfig(hang_timeout_s=0.2), server, world_size=2)
    assert dog.check() is None  # not yet past the allowance
    time.sleep(0.3)
    finding = dog.check()
    assert finding.kind == "hang" and finding.rank == 1 and finding.step == 4 and finding.phase == "forward"
    assert "never reached collective #4 (grads) of step 4" in finding.detail
    assert finding.detected_after_s >= 0.2


class DataLag(Check):
    """A toy detector, in this file alone: a rank reading data while another is steps ahead warns at 2 steps
    and ends the attempt at 4."""

    def __init__(self, watch: Watch):
        super().__init__(watch)
        self.warned: set[int] = set()

    def observe(self, poll: Poll) -> Incident | None:
        ahead = max(p.step for p in poll.ranks.values())
        for r, p in sorted(poll.ranks.items()):
            lag = ahead - p.step
            if p.phase == "data" and lag >= 4:
                return finding("data_stall", r, p, f"rank {r} reads data {lag} steps behind", 0.0)
            if p.phase == "data" and lag >= 2 and r not in self.warned:
                self.warned.add(r)
                poll.keep(finding("data_stall", r, p, f"rank {r} reads data {lag} steps behind", 0.0, fatal=False))
        return None


def test_a_check_is_one_class_the_watchdog_asks_in_its_order_with_the_shipped_ones(server):
    """A detector needs no line of the watchdog: its Check (here, this file's toy) gets each poll, its warning is
    kept and placed in the mesh like any other, and its fatal finding ends the attempt before the hang check,
    which comes later in a poll."""
    from trainpipe.trainer.supervise.checks import check_specs

    shipped = check_specs()
    assert [s.name for s in shipped] == [
        "straggler", "loss_health", "time_split", "crash", "off_the_mesh", "lost_host", "hang", "gpu_idle",
    ]  # fmt: skip
    layout = Layout(tp=2, fsdp=True)  # two ranks, each half of every layer
    dog = Watchdog(
        WatchdogConfig(hang_timeout_s=0.2),
        server,
        2,
        layout=layout,
        specs=[*shipped, CheckSpec("data_lag", 55, DataLag)],
    )
    b0, b1 = senders(server)
    b1(1, "data")
    for step in (1, 2, 3):
        b0(step, "data")
    steps = lambda: {r: p.step for r, p in server.snapshot().items()}  # noqa: E731
    deadline = time.monotonic() + 5
    while steps() != {0: 3, 1: 1} and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dog.check() is None
    assert [(f.kind, f.rank, f.fatal) for f in dog.findings] == [("data_stall", 1, False)]
    assert dog.findings[0].mesh == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "tp": 1}
    for step in (4, 5):
        b0(step, "data")
    while steps() != {0: 5, 1: 1} and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # past the hang allowance too: the toy, asked first, names it
    found = dog.check()
    assert (found.kind, found.rank, found.detail) == (
        "data_stall",
        1,
        "rank 1 reads data 4 steps behind [rank 1: tp 1 of 2]",
    )


def test_ranks_in_different_collectives_are_a_desync(server):
    dog = Watchdog(WatchdogConfig(hang_timeout_s=0.2), server, world_size=2)
    b0, b1 = senders(server)
    b0(7, "collective", n=12, c="loss")
    b1(8, "collective", n=12, c="grads")
    settle(server, 2, phase="collective")
    time.sleep(0.25)
    finding = dog.check()
    assert finding.kind == "desync" and finding.ranks == [0, 1]
    assert "rank 0 is in collective #12 (loss) of step 7" in finding.detail
    assert "rank 1 is in collective #12 (grads) of step 8" in finding.detail


def test_same_collective_everywhere_is_not_a_desync(server):
    dog = Watchdog(WatchdogConfig(hang_timeout_s=0.2), server, world_size=2)
    b0, b1 = senders(server)
    b0(7, "collective", n=12, c="loss")
    b1(7, "collective", n=12, c="loss")
    settle(server, 2, phase="collective")
    time.sleep(0.25)
    finding = dog.check()
    assert finding.kind == "hang"  # stuck together, e.g. a network partition: not an ordering bug


def test_allowance_is_adaptive_and_longer_at_startup_and_checkpoints(server):
    b0, b1 = senders(server)
    cfg = WatchdogConfig(hang_floor_s=0.5, hang_factor=10, startup_timeout_s=99, slow_phase_timeout_s=42)
    dog = Watchdog(cfg, server, world_size=2)
    settle(server, 2, phase="start")
    assert allowance_s(dog.watch, server.snapshot()) == 99
    for step in range(1, 6):
        for b in (b0, b1):
            b(step, "data")
        time.sleep(0.02)
    settle(server, 2, phase="data", step=5)
    allowance = allowance_s(dog.watch, server.snapshot())
    assert 0.5 <= allowance < 2.0  # max(floor, 10 × ~20 ms)
    b0(5, "checkpoint")
    settle(server, 2)
    time.sleep(0.05)
    assert allowance_s(dog.watch, server.snapshot()) == 42


SPIN = [sys.executable, "-c", "while True: pass"]


@pytest.mark.parametrize(
    "case", ["stopped", "idle", "busy", "idle reading data", "idle before a median step", "idle, one peer computes"]
)
def test_a_stopped_or_idle_rank_the_others_wait_for_is_a_hang_at_once(server, case):
    """A rank the others wait for in the step's collective is named once no rank advanced for stopped_after_s
    plus three median steps, with the allowance (30 s here) far off, when its process is stopped, or idle (no
    CPU between two polls) in its step's compute. A rank that computes (a busy process), one idle while reading
    its data (a slow store), one idle before the run has a median step, and one waited for only by some of the
    others (the rest compute) wait for the allowance."""
    victim = subprocess.Popen(SPIN if case == "busy" else ["sleep", "60"])
    world = 3 if "peer" in case else 2
    try:
        beacons = [Beacon(r, server.address, server.token) for r in range(world)]
        for r, b in enumerate(beacons):
            b(-1, "start", pid=victim.pid if r == 1 else 0, host=socket.gethostname() if r == 1 else "elsewhere")
        first = 6 if "before" in case else 1
        for step in range(first, 6):
            for b in beacons:
                b(step, "data")
                b(step, "collective", n=step, c="grads", cs=0.01)
            time.sleep(0.05)
        for r, b in enumerate(beacons):
            b(6, "data")
            if r == 1:
                b(6, "data" if "data" in case else "forward")
            elif r == 2:
                b(6, "forward")  # still computing: not waiting for rank 1
            else:
                b(6, "collective", n=6, c="grads")
        settle(server, world, step=6)
        if case == "stopped":
            victim.send_signal(signal.SIGSTOP)
        dog = Watchdog(WatchdogConfig(hang_floor_s=30, stopped_after_s=0.3), server, world_size=world)
        assert dog.check() is None
        time.sleep(0.3 + 3 * 0.05 + 0.1)
        finding = dog.check()
        if finding is None and case != "stopped":
            time.sleep(0.3)  # the first look at an idle rank starts its CPU clock
            finding = dog.check()
        if case not in ("stopped", "idle"):
            assert (
                finding is None and allowance_s(dog.watch, server.snapshot()) >= 30
            )  # before a median step: startup_timeout_s
            return
        assert finding.kind == "hang" and finding.rank == 1 and finding.step == 6 and finding.phase == "forward"
        if case == "stopped":
            assert "rank 1 is stopped (SIGSTOP) at step 6 phase forward" in finding.detail
        else:
            assert finding.detail == (
                "rank 1 sits idle at step 6 phase forward (no CPU used) while rank(s) [0] wait in collective #6 "
                "(grads) of step 6"
            )
        assert 0.45 <= finding.detected_after_s < 2, finding.detected_after_s
    finally:
        victim.kill()
        victim.wait()


def _windows(b0, b1, steps: range, slow: float) -> None:
    for step in steps:
        b0(step, "collective", n=step, c="grads", cs=0.100)
        b1(step, "collective", n=step, c="grads", cs=0.100 * slow)


def test_a_slow_rank_is_flagged_after_patience_windows_and_only_it(server):
    b0, b1 = senders(server)
    dog = Watchdog(WatchdogConfig(straggler_window=5, straggler_factor=1.3, straggler_patience=2), server, world_size=2)
    _windows(b0, b1, range(1, 21), slow=2.0)
    settle(server, 2, step=20)
    time.sleep(0.05)
    assert dog.check() is None  # policy warn: not fatal
    [finding] = dog.findings
    assert finding.kind == "straggler" and finding.rank == 1 and not finding.fatal
    assert len(dog.windows()) == 3  # steps 6-10, 11-15, 16-20 (the warm-up window 1-5 is skipped)
    assert dog.windows()[0]["score"][1] > 1.3 > dog.windows()[0]["score"][0]


def test_a_healthy_run_raises_no_straggler(server):
    b0, b1 = senders(server)
    dog = Watchdog(WatchdogConfig(straggler_window=5), server, world_size=2)
    _windows(b0, b1, range(1, 31), slow=1.1)
    settle(server, 2, step=30)
    time.sleep(0.05)
    dog.check()
    assert dog.findings == [] and len(dog.windows()) == 5


def test_a_few_slow_steps_in_every_window_are_not_a_straggler(server):
    """One step in five at 5x (a checkpoint commit beside it, say) would be 1.8x on the mean; the median stays 1x."""
    b0, b1 = senders(server)
    dog = Watchdog(WatchdogConfig(straggler_window=5, straggler_factor=1.3, straggler_patience=2), server, world_size=2)
    for step in range(1, 21):
        b0(step, "collective", n=step, c="grads", cs=0.100 * (5 if step % 5 == 1 else 1))
        b1(step, "collective", n=step, c="grads", cs=0.100)
    settle(server, 2, step=20)
    time.sleep(0.05)
    dog.check()
    assert dog.findings == [] and len(dog.windows()) == 3
    assert all(window["score"][0] == 1.0 for window in dog.windows())


def test_abort_policy_makes_a_straggler_fatal(server):
    b0, b1 = senders(server)
    dog = Watchdog(WatchdogConfig(straggler_window=5, straggler_patience=1, on_straggler="abort"), server, world_size=2)
    _windows(b0, b1, range(1, 11), slow=3.0)
    settle(server, 2, step=10)
    time.sleep(0.05)
    finding = dog.check()
    assert finding is not None and finding.kind == "straggler" and finding.fatal and finding.rank == 1


def test_a_host_whose_link_closes_before_the_job_starts_ends_the_attempt_at_once(server):
    """Another host's supervisor gave up before the rendezvous (its link to node 0 closed): node 0 says so at its
    next look instead of waiting watchdog.startup_timeout_s, and names no node of its own."""
    from trainpipe.trainer.supervise.beacons import WatchdogLink

    dog = Watchdog(WatchdogConfig(startup_timeout_s=300), server, world_size=2)
    link = WatchdogLink(server.address, server.token, within_s=5, states=dict)  # a host with no rank yet
    deadline = time.monotonic() + 5
    while not link.connected and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.6)  # one status line read: the connection is a host's link
    assert dog.check() is None
    link.close()  # that host's part ended before its ranks ever started
    deadline = time.monotonic() + 5
    while (found := dog.check()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert found is not None and found.kind == "crash" and found.node is None, found
    assert "ended before the job started" in found.detail and found.ranks == [0, 1]


# pp 2 × dp_shard 2 × tp 2 over 8 ranks: rank = pp·4 + dp_shard·2 + tp.
MESH = Layout(pp=2, dp_replicate=1, dp_shard=2, tp=2, fsdp=True)


def test_under_a_layout_ranks_are_compared_with_their_data_parallel_peers_and_a_tp_group_is_named_together(
    server,
):
    """The last pipeline stage computes more than the first (it holds the head): compared with every rank, its
    healthy ranks would be stragglers. Compared with their data-parallel peers (same stage, same tp index), only
    the slowed tensor-parallel group stands out, named as a group: its two ranks wait on each other."""
    beacons = senders(server, 8)
    dog = Watchdog(WatchdogConfig(straggler_window=5, straggler_patience=2), server, world_size=8, layout=MESH)
    for step in range(1, 21):
        for r, b in enumerate(beacons):
            stage_cost = 0.100 if r < 4 else 0.180  # stage 1 works 1.8x stage 0
            slow = 2.0 if r in (6, 7) else 1.0  # the tp group of stage 1, replica 1
            b(step, "collective", n=step, c="grads", cs=stage_cost * slow)
    settle(server, 8, step=20)
    time.sleep(0.05)
    dog.check()
    [finding] = dog.findings
    assert finding.kind == "straggler" and finding.ranks == [6, 7] and finding.rank == 6
    assert "ranks [6, 7] of one data-parallel replica" in finding.detail and "data-parallel peers" in finding.detail
    assert finding.mesh == {"pp": 1, "dp_replicate": 0, "dp_shard": 1, "tp": 0}
    assert finding.detail.endswith("[rank 6: pipeline stage 1 of 2, dp_shard 1 of 2, tp 0 of 2]")

    typical = {r: m / 1000 for r, m in dog.windows()[-1]["compute_ms"].items()}
    everyone = leave_one_out_medians(typical)  # compared with every rank, as without the layout
    assert all(typical[r] / everyone[r] > 1.3 for r in (4, 5))  # the healthy last stage would look slow


def test_a_hang_under_a_layout_names_the_pipeline_stage_of_the_rank_that_stopped(server):
    beacons = senders(server, 8)
    for step in (1, 2):
        for b in beacons:
            b(step, "collective", n=step, c="grads", cs=0.01)
    for r, b in enumerate(beacons):
        b(3, "forward" if r == 5 else "collective", n=3, c="grads")
    settle(server, 8, step=3)
    dog = Watchdog(WatchdogConfig(hang_timeout_s=0.2), server, world_size=8, layout=MESH)
    time.sleep(0.3)
    finding = dog.check()
    assert finding.kind == "hang" and finding.rank == 5
    assert finding.detail.endswith("[rank 5: pipeline stage 1 of 2, dp_shard 0 of 2, tp 1 of 2]")
    assert finding.mesh == {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "tp": 1}


def test_a_rank_that_built_another_mesh_than_the_layout_is_a_desync_naming_its_place(server):
    """Its host read another profile: its collectives will never meet the others'. Its first step's beacon says
    where it put itself (``m``); the watchdog stops the attempt at once instead of waiting for the hang."""
    beacons = senders(server, 8)
    for r, b in enumerate(beacons):
        b(1, "data", m="0.0.0.0" if r == 5 else MESH.place(r))
    settle(server, 8, step=1)
    dog = Watchdog(WatchdogConfig(), server, world_size=8, layout=MESH)
    finding = dog.check()
    assert finding.kind == "desync" and finding.rank == 5
    assert "rank 5 built its mesh at 0.0.0.0" in finding.detail and "puts it at 1.0.0.1" in finding.detail
