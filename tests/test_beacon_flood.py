"""The beacon channel under a flood (issue 23, item 7): connections that never send the token are closed after a
short deadline and cannot take the slots the ranks need (trainer/supervise/beacons.py). Real sockets."""

from __future__ import annotations

import socket
import time

import pytest

from tests.test_beacons import connect, eventually, line
from trainpipe.trainer.loop.beacon import Beacon
from trainpipe.trainer.supervise import beacons
from trainpipe.trainer.supervise.beacons import BeaconServer


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(beacons, "GREETING_S", 1.0)  # the deadline under test, shorter than the default
    srv = BeaconServer(world_size=2)
    yield srv
    srv.close()


def seconds_until_closed(sock: socket.socket, within: float) -> float:
    """How long until the server closes ``sock``; fails past ``within`` seconds."""
    start = time.monotonic()
    sock.settimeout(within)
    try:
        assert sock.recv(1) == b""
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"the server kept a connection without the token open for {within} s") from None
    return time.monotonic() - start


def test_the_greeting_deadline_is_short():
    assert 2 <= beacons.GREETING_S <= 5


@pytest.mark.timeout(30)
def test_a_connection_that_never_sends_the_token_is_closed_after_the_deadline(server):
    idle = connect(server)
    assert 0.8 <= seconds_until_closed(idle, within=4) <= 3
    idle.close()
    assert server.dropped == 1


@pytest.mark.timeout(30)
def test_a_token_sent_a_byte_at_a_time_does_not_extend_the_deadline(server):
    slow = connect(server)
    start = time.monotonic()
    with pytest.raises(OSError):  # the server closes it while it is still "greeting"
        for ch in server.token * 10:
            slow.sendall(ch.encode())
            time.sleep(0.1)
            assert time.monotonic() - start < 4, "the server waited for a greeting past its deadline"
    slow.close()


@pytest.mark.timeout(30)
def test_idle_connections_beyond_every_cap_cannot_keep_a_rank_out(server):
    """What the issue reproduced: idle connections held every slot and rank 0's real beacon was dropped."""
    flood = [connect(server) for _ in range(server.max_connections + beacons.MAX_PENDING + 4)]
    rank0 = Beacon(0, server.address, server.token)
    assert rank0.enabled
    rank0(5, "data")
    eventually(lambda: server.snapshot().get(0) is not None and server.snapshot()[0].step == 5, "rank 0's beacon", 3)
    more = [connect(server) for _ in range(beacons.MAX_PENDING + 4)]  # a flood that goes on after the rank is in
    rank0(6, "data")
    eventually(lambda: server.snapshot()[0].step == 6, "rank 0's next beacon", 3)
    rank1 = connect(server, server.token)  # a rank arriving last, in the middle of the flood, gets in too
    rank1.sendall(line(r=1, s=7))
    eventually(lambda: 1 in server.snapshot(), "rank 1's beacon", 3)
    for sock in [*flood, *more, rank1]:
        sock.close()
    rank0.close()


@pytest.mark.timeout(30)
def test_a_new_connection_closes_the_oldest_ungreeted_one_when_they_are_all_taken(server):
    first = connect(server)
    others = [connect(server) for _ in range(beacons.MAX_PENDING)]
    assert seconds_until_closed(first, within=0.9) < 0.9  # before its deadline: pushed out by a newer one
    for sock in [first, *others]:
        sock.close()


@pytest.mark.timeout(30)
def test_greeted_connections_stay_capped(server):
    greeted = [connect(server, server.token) for _ in range(server.max_connections)]
    eventually(lambda: server.dropped == 0 and server._open == server.max_connections, "the greeted connections")
    extra = connect(server, server.token)
    assert seconds_until_closed(extra, within=3) < 3
    assert server.dropped == 1
    for sock in [*greeted, extra]:
        sock.close()
