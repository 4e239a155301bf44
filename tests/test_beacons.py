"""The beacon channel takes only what this attempt's ranks send (trainer/supervise/beacons.py, trainer/protocol.py):
real sockets, forged and malformed input from a process that is not a rank."""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from trainpipe.trainer.config import WatchdogConfig
from trainpipe.trainer.loop.beacon import Beacon
from trainpipe.trainer.proc import node_name
from trainpipe.trainer.supervise.beacons import BeaconServer, RankProgress
from trainpipe.trainer.supervise.watchdog import Watchdog


@pytest.fixture
def server():
    srv = BeaconServer(world_size=2)
    yield srv
    srv.close()


def connect(server: BeaconServer, token: str | None = None) -> socket.socket:
    host, port = server.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    if token is not None:
        sock.sendall(token.encode() + b"\n")
    return sock


def line(**msg) -> bytes:
    return json.dumps({"s": 1, "p": "data", "t": time.time(), **msg}).encode() + b"\n"


def eventually(predicate, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_connection_without_the_attempts_token_is_refused(server):
    for token in (None, "guess"):
        sock = connect(server, token)
        sock.sendall(line(r=0) if token else b"not the token\n" + line(r=0))
        assert closed_by_peer(sock)
        sock.close()
    assert server.snapshot() == {} and server.dropped == 2


@pytest.mark.parametrize(
    "forged",
    [
        {"r": "0"},  # a rank that is not an integer
        {"r": 2},  # beyond the world size
        {"r": -1},
        {"r": 0, "s": 1.5},
        {"r": 0, "p": "dancing"},
        {"r": 0, "t": "now"},
        {"r": 0, "cs": "fast"},  # would have killed the reader thread
        {"r": 0, "cs": -1.0},
        {"r": 0, "pid": "1"},
        {"r": 0, "host": "h" * 1000},
        {"r": 0, "surprise": 1},  # unknown fields too: nothing unchecked reaches the watchdog
    ],
)
def test_a_malformed_beacon_is_dropped_and_the_connection_goes_on(server, forged):
    sock = connect(server, server.token)
    sock.sendall(line(**forged) + b"[1, 2]\n" + line(r=0, s=3))
    eventually(lambda: 0 in server.snapshot(), "the valid beacon")
    assert server.snapshot()[0].step == 3 and set(server.snapshot()) == {0}
    assert server.dropped == 2 and server.drain_compute() == []
    sock.close()


def test_a_connection_speaks_for_one_rank_and_a_rank_for_one_connection(server):
    first = connect(server, server.token)
    first.sendall(line(r=0, s=1) + line(r=1, s=9))  # a second rank on the same connection: dropped
    eventually(lambda: 0 in server.snapshot(), "rank 0")
    second = connect(server, server.token)
    second.sendall(line(r=0, s=99))  # rank 0 again, from elsewhere: the connection is closed
    assert closed_by_peer(second)
    assert set(server.snapshot()) == {0} and server.snapshot()[0].step == 1
    first.close()


def test_a_pid_that_is_not_a_process_of_this_job_is_never_taken(server):
    child_process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        # Each Beacon first sends this process's own pid: not a descendant of itself, so dropped.
        here = node_name()  # a claim to be a process of this host
        ours = Beacon(0, server.address, server.token)
        ours(-1, "start", pid=os.getppid(), host=here)
        child = Beacon(1, server.address, server.token)
        child(-1, "start", pid=child_process.pid, host=here)  # a descendant: accepted
        eventually(lambda: "pid" in server.snapshot().get(1, RankProgress(1)).extra, "rank 1's pid")
        eventually(lambda: server.dropped == 3, "the three refused claims")
        assert "pid" not in server.snapshot()[0].extra and server.snapshot()[1].extra["pid"] == child_process.pid
        child(-1, "start", pid=os.getpid())  # the rank's pid cannot be changed afterwards
        eventually(lambda: server.dropped == 4, "the second claim")
        assert server.snapshot()[1].extra["pid"] == child_process.pid
    finally:
        child_process.kill()
        child_process.wait()
    # With its pid dropped, a forged rank 0 cannot fake a death that would burn a retry; rank 1's real one counts.
    dog = Watchdog(WatchdogConfig(hang_timeout_s=60), server, world_size=2)
    found = dog.check()
    assert found is not None and found.kind == "crash" and found.rank == 1


def test_an_unterminated_huge_line_and_too_many_connections_cost_a_bounded_amount(server):
    flood = connect(server, server.token)
    with pytest.raises(OSError):  # the server closes the connection once the line passes the cap
        for _ in range(64):
            flood.sendall(b"x" * (1 << 16))
    flood.close()
    socks = [connect(server) for _ in range(server.max_connections + 3)]
    eventually(lambda: server.dropped >= 4, "the refused connections")
    for s in socks:
        s.close()
    rank = Beacon(0, server.address, server.token)  # the server still serves the real ranks
    rank(5, "data")
    eventually(lambda: 0 in server.snapshot(), "rank 0")


@pytest.mark.parametrize(
    "status",
    [
        {"ranks": {"1": "running"}},  # not a process state
        {"ranks": {"2": "stopped"}},  # no such rank in a world of 2
        {"ranks": {"-1": "dead"}},
        {"ranks": {"1": "stopped"}, "pid": 4},  # anything more
        {"ranks": ["stopped"]},
        {"ranks": {"\u00b2": "dead"}},  # a digit to str.isdigit, not to int()
        {"ranks": {"1" * 5000: "dead"}},  # past int()'s digit limit
    ],
)
def test_another_hosts_word_on_its_ranks_is_taken_only_in_its_exact_form(server, status):
    sock = connect(server, server.token)
    sock.sendall(json.dumps(status).encode() + b"\n")
    eventually(lambda: server.dropped >= 1, "the status to be dropped")
    assert all("state" not in p.extra for p in server.snapshot().values())
    sock.close()


def test_a_rank_another_host_reports_stopped_is_the_hang_culprit_and_its_link_closes_with_the_server():
    """Node 0's watchdog cannot see host1's processes: host1's supervisor says rank 1 is stopped."""
    from trainpipe.trainer.supervise.beacons import WatchdogLink

    srv = BeaconServer(world_size=2)
    b0, b1 = Beacon(0, srv.address, srv.token), Beacon(1, srv.address, srv.token)
    for b, host in ((b0, "host0"), (b1, "host1")):
        b(-1, "start", pid=0, host=host)
        b(1, "data")
    b0(1, "collective", n=1, c="grads")
    states = {1: "alive"}
    link = WatchdogLink(srv.address, srv.token, within_s=5, states=lambda: dict(states))
    try:
        eventually(lambda: link.connected, "the link to connect")
        states[1] = "stopped"
        eventually(lambda: srv.snapshot().get(1, RankProgress(1)).extra.get("state") == "stopped", "host1's word")
        dog = Watchdog(WatchdogConfig(hang_timeout_s=0.1), srv, world_size=2)
        time.sleep(0.2)
        found = dog.check()
        assert (found.kind, found.rank, found.node) == ("hang", 1, "host1") and "stopped (SIGSTOP)" in found.detail
        assert link.ended_at is None
    finally:
        srv.close()
    eventually(lambda: link.ended_at is not None, "the link to see node 0's part end")
    link.close()


def test_a_rank_another_host_reports_idle_while_the_others_wait_is_named_before_the_allowance():
    """host1's supervisor looks at its ranks' processes (named trainpipe-r{RANK}) and says which used no CPU since
    its last look; node 0 names such a rank, in its step's forward while rank 0 waits in the collective, after
    stopped_after_s plus three median steps, not the 30 s allowance. A computing rank is not named."""
    from trainpipe.trainer.supervise.beacons import WatchdogLink
    from trainpipe.trainer.supervise.rank_states import CpuUse, local_rank_states

    def rank(r: int, body: str) -> subprocess.Popen:
        code = f"from trainpipe.trainer.proc import name_process\nname_process('trainpipe-r{r}')\n{body}"
        return subprocess.Popen([sys.executable, "-c", code])

    procs = [rank(1, "import time; time.sleep(60)"), rank(2, "while True: pass")]
    srv = BeaconServer(world_size=3)
    link = WatchdogLink(srv.address, srv.token, within_s=5, states=functools.partial(local_rank_states, CpuUse()))
    try:
        beacons = [Beacon(r, srv.address, srv.token) for r in range(3)]
        for r, b in enumerate(beacons):
            b(-1, "start", pid=0, host="host0" if r == 0 else "host1")
        for step in range(1, 6):
            for b in beacons:
                b(step, "data")
                b(step, "collective", n=step, c="grads", cs=0.01)
            time.sleep(0.02)
        for r, b in enumerate(beacons):
            b(6, "data")
            if r == 0:
                b(6, "collective", n=6, c="grads")
            else:
                b(6, "forward")

        def states() -> dict[int, str | None]:
            return {r: p.extra.get("state") for r, p in srv.snapshot().items()}

        eventually(lambda: states() == {0: None, 1: "idle", 2: "alive"}, "host1's word")
        dog = Watchdog(WatchdogConfig(hang_floor_s=30, stopped_after_s=0.1), srv, world_size=3)
        assert dog.check() is None  # rank 2 computes: a slow rank is no hang before the allowance
        spinner = procs.pop()
        spinner.kill()
        spinner.wait()
        beacons[2](6, "collective", n=6, c="grads")  # rank 2 got there; rank 1 is the one they wait for
        eventually(lambda: srv.snapshot()[2].phase == "collective", "rank 2 in the collective")
        time.sleep(0.5)
        found = dog.check()
        assert (found.kind, found.rank, found.node, found.ranks) == ("hang", 1, "host1", [1]), found
        assert "rank 1 sits idle at step 6 phase forward" in found.detail
        assert found.detected_after_s < 30
    finally:
        srv.close()
        link.close()
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.parametrize(
    "use",
    [
        {"gpu": {"1": 101}},  # not a share
        {"gpu": {"1": float("nan")}},
        {"gpu": {"1": "3"}},
        {"gpu": {"2": 3}},  # no such rank in a world of 2
        {"gpu": {"1": 3}, "ranks": {}},  # anything more
        {"gpu": [3]},
        {"gpu": {"\u00b2": 3}},
        {"gpu": {"1" * 5000: 3}},
    ],
)
def test_another_hosts_gpu_use_is_taken_only_in_its_exact_form(server, use):
    sock = connect(server, server.token)
    sock.sendall(json.dumps(use).encode() + b"\n")
    eventually(lambda: server.dropped >= 1, "the figures to be dropped")
    assert server.gpu_use() == {}
    sock.close()


def test_another_hosts_gpu_use_reaches_node_0_over_its_link():
    from trainpipe.trainer.supervise.beacons import WatchdogLink

    srv = BeaconServer(world_size=2)
    link = WatchdogLink(srv.address, srv.token, within_s=5, states=lambda: {1: "alive"}, gpu_use=lambda: {1: 3.5})
    try:
        eventually(lambda: srv.gpu_use() == {1: 3.5}, "host1's GPU use")
        assert srv.dropped == 0
    finally:
        srv.close()
        link.close()


def test_another_hosts_rank_pid_is_never_taken_nor_counted_as_forged():
    srv = BeaconServer(world_size=2)
    try:
        sock = connect(srv, srv.token)
        sock.sendall(line(r=1, s=-1, p="start", pid=os.getppid(), host="another-host"))  # some process here
        sock.sendall(line(r=1, s=1, p="data"))
        eventually(lambda: srv.snapshot().get(1, RankProgress(1)).step == 1, "rank 1's beacons")
        assert "pid" not in srv.snapshot()[1].extra and srv.dropped == 0
        sock.close()
    finally:
        srv.close()
