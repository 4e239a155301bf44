"""A single-host job's own network (trainer/supervise/isolation.py): which jobs get one, what crosses into it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

import pytest

from trainpipe.trainer.config import load_profile
from trainpipe.trainer.errors import ProfileError
from trainpipe.trainer.supervise.attempt import isolated
from trainpipe.trainer.supervise.isolation import ISOLATE_ENV, Forwards, loopback_port, probe, store_endpoints

needs_namespaces = pytest.mark.skipif(probe() is not None, reason=f"no network namespace here: {probe()}")


@pytest.mark.parametrize(
    "url, port",
    [
        ("http://127.0.0.1:9000", ("127.0.0.1", 9000)),
        ("http://localhost:9000/", ("127.0.0.1", 9000)),
        ("http://[::1]:5000", ("::1", 5000)),
        ("http://127.8.0.2", ("127.8.0.2", 80)),
        ("https://s3.us-east-1.amazonaws.com", None),
        ("http://10.0.0.5:9000", None),
        ("http://127.0.0.1.evil.example:9000", None),
        ("not a url", None),
    ],
)
def test_only_an_endpoint_on_this_hosts_loopback_is_forwarded(url, port):
    assert loopback_port(url) == port


def test_the_stores_endpoint_comes_from_its_options_or_the_aws_variables():
    assert store_endpoints("/data/store", {}, {}) == []
    assert store_endpoints("file:///data/store", {}, {}) == []
    assert store_endpoints("s3://b/x", {"endpoint_url": "http://127.0.0.1:1"}, {}) == ["http://127.0.0.1:1"]
    assert store_endpoints("s3://b/x", {"client_kwargs": {"endpoint_url": "http://h:2"}}, {}) == ["http://h:2"]
    assert store_endpoints("s3://b/x", {}, {"AWS_ENDPOINT_URL": "http://127.0.0.1:3"}) == ["http://127.0.0.1:3"]
    assert store_endpoints("s3://b/x", {}, {}) is None  # AWS itself: beyond the loopback
    assert store_endpoints("gs://b/x", {}, {}) is None


@needs_namespaces
def test_a_job_isolated_only_where_its_store_is_reachable_from_inside(home, caplog):
    env: dict[str, str] = {}
    forwards = isolated(load_profile("local", []), env, None)
    try:
        assert forwards is not None and json.loads(env[ISOLATE_ENV]) == {"forwards": []}
    finally:
        forwards.close()
    said: list[str] = []
    cloud = load_profile("local", ["store.root=s3://bucket/x"])
    for _ in range(2):
        assert isolated(cloud, {}, said.append) is None
    assert len(said) == 1 and "lies beyond this host's loopback" in said[0], said  # said once
    with pytest.raises(ProfileError, match=r"cluster\.isolate=true"):
        isolated(load_profile("local", ["store.root=s3://bucket/x", "cluster.isolate=true"]), {}, None)
    assert isolated(load_profile("local", ["cluster.isolate=false"]), env, None) is None
    assert isolated(load_profile("local", ["cluster.nodes=2", "cluster.simulate_nodes=true"]), {}, None) is None
    with pytest.raises(ProfileError, match="single-host jobs"):
        isolated(
            load_profile("local", ["cluster.nodes=2", "cluster.simulate_nodes=true", "cluster.isolate=true"]), {}, None
        )
    inside = {"NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0"}
    forwards = isolated(load_profile("local", []), inside, None)
    forwards.close()
    assert (inside["NCCL_SOCKET_IFNAME"], inside["GLOO_SOCKET_IFNAME"]) == ("lo", "lo")  # eth0 is not in there


INSIDE = """
import json, os, socket, sys
from trainpipe.trainer.supervise.isolation import enter_from_env
enter_from_env()
out = {}
for port in map(int, sys.argv[1:]):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
            s.sendall(b"ping")
            s.shutdown(socket.SHUT_WR)
            out[port] = s.recv(100).decode()
    except OSError as exc:
        out[port] = type(exc).__name__
print(json.dumps(out))
"""


@needs_namespaces
def test_inside_only_the_forwarded_port_of_the_host_is_there():
    """A process that entered the namespace reaches the store's port through the supervisor's Unix socket, and no
    other port of the host's loopback: the same holds the other way, for whatever it listens on."""

    def echo_server() -> socket.socket:
        srv = socket.create_server(("127.0.0.1", 0))

        def serve() -> None:
            while True:
                try:
                    conn, _ = srv.accept()
                except OSError:
                    return
                with conn:
                    conn.sendall(b"pong:" + conn.recv(100))

        threading.Thread(target=serve, daemon=True).start()
        return srv

    store, other = echo_server(), echo_server()
    forwards = Forwards([("127.0.0.1", store.getsockname()[1])])
    try:
        ports = [str(store.getsockname()[1]), str(other.getsockname()[1])]
        env = {**os.environ, ISOLATE_ENV: forwards.spec()}
        done = subprocess.run([sys.executable, "-c", INSIDE, *ports], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout)
        assert seen == {ports[0]: "pong:ping", ports[1]: "ConnectionRefusedError"}, seen
        assert oct(os.stat(forwards.folder).st_mode & 0o777) == "0o700"
    finally:
        forwards.close()
        store.close()
        other.close()
    assert not os.path.exists(forwards.folder)
