"""A single-host job's own network: its torchrun agent and ranks in a network namespace of their own.

torchrun's c10d rendezvous store, the ranks' process-group store and their gloo (or NCCL bootstrap) sockets
listen on ports every local user can reach, with no authentication, and torch unpickles the rendezvous state
it reads from that store and the plans DCP gathers over the process group: whoever reaches them runs code as
the operator. A single-host job needs none of them reachable from outside, so its agent enters a network
namespace with only a loopback interface before torch is imported (docs/security.md, docs/architecture.md §4):
what listens there is reachable by the job's own processes only.

What the ranks must reach outside goes through Unix sockets in a folder only this user can enter, which the
supervisor serves from the host's network: the beacon channel is one (``trainer.supervise.beacons``); each
TCP port of the store's endpoint on this host's loopback (a local S3 such as ``moto_server``) is forwarded
(inside, the agent listens on that port of its own loopback and splices each connection to the supervisor's
socket, which connects to the real port); and an https endpoint elsewhere (S3 itself, by name) is reached
through a CONNECT tunnel (``HTTPS_PROXY`` inside, which botocore reads) that the supervisor opens to that
endpoint only. A plain-http endpoint on another host cannot be reached from inside, so a job that needs one
is not isolated (``cluster.isolate``).

Without privileges the namespace is made inside a user namespace of its own that maps this user to itself;
as root a network namespace alone. Nothing here imports torch: the agent enters before its first import.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import ipaddress
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

ISOLATE_ENV = "TRAINPIPE_ISOLATE"  # JSON {"forwards": [[address, port, unix socket]]}: the agent enters one
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
ENDPOINT_ENVS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")  # botocore's own: where an S3 store may be
EGRESS_PORT = 3128  # the CONNECT tunnel's port inside the namespace, whose ports are all free when it is made
LOOPBACK_NAMES = "localhost,127.0.0.1,::1"
_CHUNK = 1 << 16


class IsolationError(OSError):
    """The host does not let this process make a network namespace (no user namespaces, a seccomp filter)."""


def _unshare(flags: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(ctypes.c_int(flags)) != 0:
        err = ctypes.get_errno()
        raise IsolationError(err, os.strerror(err))


def _write(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


def enter_namespace() -> None:
    """Move this (single-threaded) process into a new network namespace whose loopback is up. IsolationError
    when the host does not allow it."""
    uid, gid = os.geteuid(), os.getegid()
    try:
        _unshare(CLONE_NEWNET)  # root (CAP_SYS_ADMIN): the network alone
    except IsolationError:
        _unshare(CLONE_NEWUSER | CLONE_NEWNET)  # anyone, where user namespaces are allowed: this user as itself
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, struct.pack("16sH14x", b"lo", 0))
        flags = struct.unpack("16sH14x", ifr)[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def probe() -> str | None:
    """None when this host lets a process make a network namespace, else why not (one line); tried once per
    process, in a fresh interpreter (a fork of this one, which has threads, could deadlock in the loader)."""
    if "result" not in _PROBED:
        code = "from trainpipe.trainer.supervise.isolation import enter_namespace; enter_namespace()"
        try:
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
            lines = done.stderr.strip().splitlines()
            _PROBED["result"] = None if done.returncode == 0 else (lines[-1][:200] if lines else "it failed")
        except (OSError, subprocess.TimeoutExpired) as exc:
            _PROBED["result"] = f"{type(exc).__name__}: {exc}"[:200]
    return _PROBED["result"]


_PROBED: dict[str, str | None] = {}


def loopback_port(url: str) -> tuple[str, int] | None:
    """(address, port) of ``url`` when its host is this host's loopback (127.0.0.0/8, ::1, localhost), else None."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return None
    if host is None or port is None:
        return None
    if host == "localhost":
        return "127.0.0.1", port
    try:
        return (host, port) if ipaddress.ip_address(host).is_loopback else None
    except ValueError:
        return None


def store_endpoints(root: str, storage_options: dict[str, Any], env: dict[str, str]) -> list[str] | None:
    """The endpoint URLs the ranks reach the store ``root`` through: [] for a local folder, ``[AWS]`` for S3's own
    endpoints, None for a file system whose endpoints this module cannot tell."""
    if "://" not in root or root.startswith("file://"):
        return []
    if root.split("://", 1)[0] not in ("s3", "s3a"):
        return None
    options = storage_options or {}
    url = options.get("endpoint_url") or (options.get("client_kwargs") or {}).get("endpoint_url")
    url = url or next((env[k] for k in ENDPOINT_ENVS if env.get(k)), None)
    return [url if isinstance(url, str) else AWS]


AWS = "https://*.amazonaws.com:443"  # S3's own endpoints, regional and virtual-hosted alike, by name


@dataclass(frozen=True)
class Route:
    """How the namespace reaches the store: ports of this host's loopback forwarded as they are, and the https
    destinations (host or ``*.suffix``, port) a CONNECT tunnel may open to."""

    forwards: tuple[tuple[str, int], ...] = ()
    egress: tuple[tuple[str, int], ...] = ()


def route(endpoints: list[str]) -> Route | None:
    """The route to ``endpoints`` (``store_endpoints``), or None when one of them cannot be reached from inside (a
    plain-http endpoint beyond this host: a proxy would have to rewrite its requests)."""
    forwards, egress = [], []
    for url in endpoints:
        if (local := loopback_port(url)) is not None:
            forwards.append(local)
            continue
        try:
            parts = urlsplit(url.replace("*.", "wildcard.", 1))
            host, port = parts.hostname, parts.port or 443
        except ValueError:
            return None
        if parts.scheme != "https" or not host:
            return None
        egress.append((host.replace("wildcard.", "*.", 1), port))
    return Route(tuple(sorted(set(forwards))), tuple(sorted(set(egress))))


@dataclass
class Forwards:
    """The supervisor's side of the namespace's ports: for each (address, port) of this host's loopback the ranks
    need, a Unix socket in a folder of this user's only (0700), each connection to it spliced to that port."""

    ports: list[tuple[str, int]]
    egress: list[tuple[str, int]] = field(default_factory=list)  # https destinations a CONNECT tunnel may reach
    folder: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="trainpipe-net-"))
    _servers: list[socket.socket] = field(default_factory=list)
    _live: set[socket.socket] = field(default_factory=set)
    _closed: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        for n, (host, port) in enumerate(self.ports):
            srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            srv.bind(os.path.join(self.folder, f"forward-{n}.sock"))
            srv.listen(64)
            self._servers.append(srv)
            args = (srv, host, port)
            threading.Thread(target=self._accept, args=args, name="isolation-forward", daemon=True).start()
        if self.egress:
            srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            srv.bind(os.path.join(self.folder, "egress.sock"))
            srv.listen(64)
            self._servers.append(srv)
            threading.Thread(target=self._accept_egress, args=(srv,), name="isolation-egress", daemon=True).start()

    def proxy_env(self) -> dict[str, str]:
        """What the ranks' HTTP clients read to reach the egress (botocore for an S3 store): the tunnel's port
        inside, loopback excepted (forwarded as it is)."""
        if not self.egress:
            return {}
        proxy = f"http://127.0.0.1:{EGRESS_PORT}"
        return {"HTTPS_PROXY": proxy, "https_proxy": proxy, "NO_PROXY": LOOPBACK_NAMES, "no_proxy": LOOPBACK_NAMES}

    def spec(self) -> str:
        """What the agent reads from ISOLATE_ENV: [address, port, the Unix socket] for each forward."""
        forwards = [[h, p, os.path.join(self.folder, f"forward-{n}.sock")] for n, (h, p) in enumerate(self.ports)]
        if self.egress:
            forwards.append(["127.0.0.1", EGRESS_PORT, os.path.join(self.folder, "egress.sock")])
        return json.dumps({"forwards": forwards})

    def _accept(self, srv: socket.socket, host: str, port: int) -> None:
        while not self._closed.is_set():
            try:
                inner, _ = srv.accept()
            except OSError:
                return
            try:
                outer = socket.create_connection((host, port), timeout=10)
                outer.settimeout(None)
            except OSError:
                inner.close()  # the ranks see a refused connection, as without the namespace
                continue
            self._live.update((inner, outer))
            splice(inner, outer, self._live.discard)

    def _accept_egress(self, srv: socket.socket) -> None:
        while not self._closed.is_set():
            try:
                inner, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=self._tunnel, args=(inner,), name="isolation-tunnel", daemon=True).start()

    def _tunnel(self, inner: socket.socket) -> None:
        """One CONNECT request from inside: to an allowed https destination, a tunnel; to anything else, 403."""
        try:
            inner.settimeout(10)
            head = b""
            while b"\r\n\r\n" not in head and len(head) < 8192:
                if not (chunk := inner.recv(8192)):
                    raise OSError("closed before its request")
                head += chunk
            target = _connect_target(head.split(b"\r\n", 1)[0])
            if target is None or not _allowed(target, self.egress):
                inner.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
                inner.close()
                return
            outer = socket.create_connection(target, timeout=10)
            outer.settimeout(None)
            inner.settimeout(None)
            inner.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        except OSError:
            inner.close()
            return
        self._live.update((inner, outer))
        splice(inner, outer, self._live.discard)

    def close(self) -> None:
        """Stop forwarding: the listeners and every connection still open (the attempt is over)."""
        self._closed.set()
        for sock in [*self._servers, *list(self._live)]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def _connect_target(line: bytes) -> tuple[str, int] | None:
    """(host, port) of ``CONNECT host:port HTTP/1.x``; None for any other request line."""
    parts = line.decode("latin-1").split(" ")
    if len(parts) != 3 or parts[0] != "CONNECT" or not parts[2].startswith("HTTP/1."):
        return None
    host, _, port = parts[1].rpartition(":")
    host = host.strip("[]")
    return (host, int(port)) if host and port.isdigit() and 0 < int(port) < 65536 else None


def _allowed(target: tuple[str, int], egress: list[tuple[str, int]]) -> bool:
    host, port = target[0].lower().rstrip("."), target[1]
    for pattern, allowed_port in egress:
        pattern = pattern.lower()
        if port == allowed_port and (host == pattern or (pattern.startswith("*.") and host.endswith(pattern[1:]))):
            return True
    return False


def splice(a: socket.socket, b: socket.socket, closed: Callable[[socket.socket], None] = lambda s: None) -> None:
    """Copy bytes both ways between two connected sockets until both ends closed (two daemon threads); the last
    direction to end closes both (and tells ``closed`` of each)."""
    left, lock = [2], threading.Lock()

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(_CHUNK):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                for sock in (a, b):
                    sock.close()
                    closed(sock)

    threading.Thread(target=pump, args=(a, b), name="isolation-splice", daemon=True).start()
    threading.Thread(target=pump, args=(b, a), name="isolation-splice", daemon=True).start()


def _serve_inside(srv: socket.socket, path: str) -> None:
    """In the namespace: each connection to ``srv`` (a port of its loopback) goes to the supervisor's Unix socket."""
    while True:
        conn, _ = srv.accept()
        try:
            outer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            outer.connect(path)
        except OSError:
            conn.close()
            continue
        splice(conn, outer)


def enter_from_env() -> None:
    """The agent's first act when the supervisor asked for isolation (ISOLATE_ENV): enter the namespace and serve
    its forwards. A host that refuses is one line on stderr and exit code 3 (the supervisor probed it first)."""
    spec = os.environ.pop(ISOLATE_ENV, None)
    if not spec:
        return
    forwards = [(str(h), int(p), str(path)) for h, p, path in json.loads(spec).get("forwards", [])]
    try:
        enter_namespace()
    except OSError as exc:
        line = f"trainpipe: cannot give this job a network of its own ({exc}); set cluster.isolate: false\n"
        os.write(2, line.encode())
        os._exit(3)
    for host, port, path in forwards:  # bound before the agent goes on: a rank may connect at once
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        srv = socket.create_server((host, port), family=family, backlog=64)
        threading.Thread(target=_serve_inside, args=(srv, path), name="isolation-inside", daemon=True).start()
