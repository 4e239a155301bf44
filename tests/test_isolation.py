"""A single-host job's own network (trainer/supervise/isolation.py): which jobs get one, what crosses into it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

import pytest

from trainpipe.trainer.errors import ProfileError
from trainpipe.trainer.profile_files import load_profile
from trainpipe.trainer.supervise.attempt import isolated
from trainpipe.trainer.supervise.isolation import (
    AWS,
    EGRESS_PORT,
    ISOLATE_ENV,
    Forwards,
    Route,
    loopback_port,
    probe,
    route,
    store_endpoints,
)

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
    assert store_endpoints("s3://b/x", {}, {}) == [AWS]  # S3's own endpoints, by name
    assert store_endpoints("gs://b/x", {}, {}) is None


def test_the_route_forwards_loopback_tunnels_https_and_knows_no_way_to_plain_http_elsewhere():
    assert route([]) == Route()
    assert route(["http://127.0.0.1:9000"]) == Route(forwards=(("127.0.0.1", 9000),))
    assert route([AWS]) == Route(egress=(("*.amazonaws.com", 443),))
    assert route(["https://minio.lan:9443"]) == Route(egress=(("minio.lan", 9443),))
    assert route(["http://minio.lan:9000"]) is None  # a proxy would have to rewrite its requests


@pytest.mark.parametrize(
    "line, target, allowed",
    [
        (b"CONNECT s3.us-east-1.amazonaws.com:443 HTTP/1.1", ("s3.us-east-1.amazonaws.com", 443), True),
        (b"CONNECT bucket.s3.amazonaws.com:443 HTTP/1.1", ("bucket.s3.amazonaws.com", 443), True),
        (b"CONNECT amazonaws.com.evil.example:443 HTTP/1.1", ("amazonaws.com.evil.example", 443), False),
        (b"CONNECT s3.amazonaws.com:22 HTTP/1.1", ("s3.amazonaws.com", 22), False),
        (b"CONNECT 127.0.0.1:29500 HTTP/1.1", ("127.0.0.1", 29500), False),
        (b"GET http://s3.amazonaws.com/ HTTP/1.1", None, False),
        (b"CONNECT s3.amazonaws.com HTTP/1.1", None, False),
    ],
)
def test_the_tunnel_opens_only_to_the_stores_https_endpoints(line, target, allowed):
    from trainpipe.trainer.supervise.isolation import _allowed, _connect_target

    assert _connect_target(line) == target
    assert (target is not None and _allowed(target, [("*.amazonaws.com", 443)])) is allowed


@needs_namespaces
def test_a_job_isolated_only_where_its_store_is_reachable_from_inside(home, caplog):
    env: dict[str, str] = {}
    forwards = isolated(load_profile("local", []), env, None)
    try:
        assert forwards is not None and json.loads(env[ISOLATE_ENV]) == {"forwards": []}
    finally:
        forwards.close()
    cloud, env = load_profile("local", ["store.root=s3://bucket/x"]), {}
    forwards = isolated(cloud, env, None)  # S3 itself: through the tunnel
    try:
        assert json.loads(env[ISOLATE_ENV])["forwards"][0][:2] == ["127.0.0.1", EGRESS_PORT]
        assert env["HTTPS_PROXY"] == f"http://127.0.0.1:{EGRESS_PORT}" and "127.0.0.1" in env["NO_PROXY"]
    finally:
        forwards.close()
    said: list[str] = []
    plain = ["store.root=s3://bucket/x", "cluster.isolate=auto"]
    lan = {"AWS_ENDPOINT_URL_S3": "http://minio.lan:9000"}  # plain http to another host: no way from inside
    for _ in range(2):
        assert isolated(load_profile("local", plain), dict(lan), said.append) is None
    assert len(said) == 1 and "reached neither on this host's loopback nor over https" in said[0], said  # once
    with pytest.raises(ProfileError, match=r"cluster\.isolate=true"):
        isolated(load_profile("local", [*plain, "cluster.isolate=true"]), dict(lan), None)
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


THROUGH_THE_TUNNEL = """
import json, socket, sys, warnings
from trainpipe.trainer.supervise.isolation import enter_from_env
enter_from_env()
import boto3
warnings.simplefilter("ignore")
s3 = boto3.client("s3", endpoint_url=sys.argv[1], verify=False, region_name="us-east-1",
                  aws_access_key_id="testing", aws_secret_access_key="testing")
s3.create_bucket(Bucket="tunnel")
s3.put_object(Bucket="tunnel", Key="k", Body=b"through")
body = s3.get_object(Bucket="tunnel", Key="k")["Body"].read().decode()
import s3fs  # what the ranks use: aiobotocore over aiohttp, which takes the tunnel from the same variables
fs = s3fs.S3FileSystem(endpoint_url=sys.argv[1], key="testing", secret="testing", client_kwargs={"verify": False})
body += "+" + fs.cat_file("tunnel/k").decode()
with socket.create_connection(("127.0.0.1", int(sys.argv[2])), timeout=5) as p:  # the tunnel, asked elsewhere
    p.sendall(b"CONNECT 127.0.0.1:" + sys.argv[3].encode() + b" HTTP/1.1\\r\\n\\r\\n")
    refused = p.recv(100).split(b"\\r\\n")[0].decode()
print(json.dumps([body, refused]))
"""


@needs_namespaces
@pytest.mark.integration
@pytest.mark.timeout(120)
def test_an_https_store_beyond_the_loopback_is_reached_through_the_tunnel_and_nothing_else(tmp_path):
    """A job whose S3 store is reached by name over https (the cloud) gets a namespace too: its S3 client goes
    through a CONNECT tunnel the supervisor opens to that endpoint only. moto_server over TLS stands in for S3,
    named ``localhost`` and left out of NO_PROXY, so the client takes the tunnel: inside the namespace nothing
    listens on that port, so an answer can only come through it."""
    import time

    from tests.conftest import BIN, free_port

    port = free_port()
    moto = subprocess.Popen([str(BIN / "moto_server"), "-s", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and moto.poll() is None, "moto_server did not start"
                time.sleep(0.2)
        endpoint = f"https://localhost:{port}"
        forwards = Forwards([], [("localhost", port)])  # what route() gives an https endpoint by name
        try:
            env = {**os.environ, ISOLATE_ENV: forwards.spec(), **forwards.proxy_env()}
            env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,::1"  # localhost through the tunnel, as a name would
            done = subprocess.run(
                [sys.executable, "-c", THROUGH_THE_TUNNEL, endpoint, str(EGRESS_PORT), str(port)],
                env=env, capture_output=True, text=True, timeout=90,
            )  # fmt: skip
        finally:
            forwards.close()
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout) == ["through+through", "HTTP/1.1 403 Forbidden"]
    finally:
        moto.terminate()
        moto.wait(timeout=30)
