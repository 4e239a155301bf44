"""A TCP proxy on loopback that misbehaves on demand, in front of a real server (moto_server keeps its data
in memory, so the server itself must not be restarted to fake an outage).

Modes, switchable at any time, affecting open keep-alive connections at their next request too:

- ``pass``: forward both ways.
- ``refuse``: nothing listens: a connection attempt is refused.
- ``reset``: a connection is accepted and reset (RST) before a byte is answered.
- ``delay``: each request waits ``delay_s`` before it is forwarded.
- ``503``: each request is answered ``503 Service Unavailable`` (S3's "slow down") and the connection closed.

``fail_matching``: in any mode, a request whose request line (method, path, query) holds this text is reset,
so one object's or one folder's requests fail while the rest pass; ``delay_matching``: such a request waits
``delay_s`` (a slow prefix of the bucket). ``bytes_down``/``bytes_up`` count traffic,
``bytes_matching`` what the server sent for requests holding ``count_matching``.

    with FaultProxy(upstream_port) as proxy:
        proxy.mode = "reset"; …; proxy.mode = "pass"
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time

_BODY = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
_UNAVAILABLE = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\n"
    + f"Content-Length: {len(_BODY)}\r\nConnection: close\r\n\r\n".encode()
)


def _reset(sock: socket.socket) -> None:
    """Close with an RST, as a crashed peer or a middlebox would."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class FaultProxy:
    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1", listen_host: str = "127.0.0.1"):
        self.upstream, self.host = (upstream_host, upstream_port), listen_host
        self.delay_s = 0.0
        self.requests = 0  # requests (first chunks from a client) seen, forwarded or not
        self.bytes_down = 0  # bytes the server sent its clients (what they read, plus HTTP headers)
        self.bytes_up = 0  # bytes the clients sent the server
        self.fail_matching: str | None = None  # reset any request whose request line holds this text
        self.delay_matching: str | None = None  # delay any request whose request line holds this text
        self.count_matching: str | None = None  # count bytes_matching for requests whose line holds this text
        self.bytes_matching = 0
        self._mode = "pass"
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        with socket.socket() as probe:
            probe.bind((listen_host, 0))
            self.port = probe.getsockname()[1]
        self._listen()
        self._thread = threading.Thread(target=self._accept_loop, daemon=True, name="fault-proxy")
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        if mode not in ("pass", "refuse", "reset", "delay", "503"):
            raise ValueError(f"unknown mode {mode!r}")
        with self._lock:
            self._mode = mode
            if mode == "refuse":
                if self._listener is not None:
                    self._listener.close()
                    self._listener = None
                for conn in list(self._conns):  # open connections fail too, as when a host goes away
                    _reset(conn)
            elif self._listener is None:
                self._listen()

    def _listen(self) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(64)
        sock.settimeout(0.1)
        self._listener = sock

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            listener = self._listener
            if listener is None:
                time.sleep(0.05)
                continue
            try:
                client, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            if self._mode == "reset":
                _reset(client)
                continue
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.upstream, timeout=10)
        except OSError:
            _reset(client)
            return
        with self._lock:
            self._conns |= {client, upstream}
        try:
            self._pump(client, upstream)
        finally:
            with self._lock:
                self._conns -= {client, upstream}
            for sock in (client, upstream):
                with contextlib.suppress(OSError):
                    sock.close()

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        awaiting_request = True  # the next chunk from the client starts a request
        counted = False  # the response now coming answers a request count_matching selects
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([client, upstream], [], [], 0.2)
            except (OSError, ValueError):
                return
            for sock in ready:
                try:
                    data = sock.recv(1 << 16)
                except OSError:
                    return
                if not data:
                    return
                if sock is upstream:
                    awaiting_request = True  # a response: the next client bytes are a new request
                    self.bytes_down += len(data)
                    if counted:
                        self.bytes_matching += len(data)
                    client.sendall(data)
                    continue
                if awaiting_request:
                    awaiting_request = False
                    self.requests += 1
                    mode = self._mode
                    line, rule, count = data.split(b"\r\n", 1)[0], self.fail_matching, self.count_matching
                    counted = bool(count) and count.encode() in line
                    if rule and rule.encode() in line:
                        mode = "reset"
                    if mode in ("reset", "refuse"):
                        _reset(client)
                        return
                    if mode == "503":  # a HEAD's response has no body
                        client.sendall(_UNAVAILABLE + (b"" if data.startswith(b"HEAD ") else _BODY))
                        return
                    if mode == "delay" or (self.delay_matching and self.delay_matching.encode() in line):
                        time.sleep(self.delay_s)
                self.bytes_up += len(data)
                upstream.sendall(data)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            for conn in list(self._conns):
                _reset(conn)
        self._thread.join(5)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
