"""A warm host: one process per host, kept up across a run's attempts, that forks each attempt's torchrun agent.

A retry would otherwise start a fresh interpreter that imports torch, torchrun's
agent, DCP and the rank programs again: seconds of CPU before the first resumed
step. The warm host (``python -m trainpipe.trainer.supervise.warm_host``) imports
them once, with the model factory's module (docs/architecture.md §4), and then
only forks: each child becomes the attempt's agent (``agent.main``) exactly as
``python -m trainpipe.trainer.supervise.agent`` would, and forks its ranks in
turn. No CUDA is touched before a fork: the factory is built on the meta device
only for CPU profiles, as the agent does.

Its only channel is a private socket pair with the supervisor that started it
(no path another local process could connect to). A request carries the
agent's arguments and environment, and the write end of the pipe that becomes
the agent's stdout and stderr; the warm host answers with the agent's pid and,
when it reaps it, its exit code. Its own environment holds only the settings
that take effect when an interpreter or torch starts (``STARTUP_PREFIXES``), so
no credential sits in its ``/proc`` environment; one whose startup settings
differ from a request's, or whose loaded source files changed on disk since it
imported them, is replaced. It exits when the supervisor closes the socket or
dies, and the agents it forked die with it.

The supervisor side: ``keep_warm()`` opens a scope (a pipeline run's stages);
inside it ``start_agent`` forks the agent from a warm host, or returns ``None``
for the caller's cold start.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import errno
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from trainpipe.trainer.redact import SECRET_NAME

log = logging.getLogger("trainpipe.supervisor")

AGENT = "trainpipe.trainer.supervise.agent"
# Read when an interpreter, torch or a model library (transformers, Hugging Face's hub) starts or is imported
# (``tempfile`` caches TMPDIR, the hub its cache under HOME): a fork keeps the values its warm host started with.
STARTUP_PREFIXES = (
    "PYTHON",
    "OMP_",
    "MKL_",
    "KMP_",
    "GOMP_",
    "OPENBLAS_",
    "LD_",
    "MALLOC_",
    "TORCH",
    "PYTORCH_",
    "HF_",
    "HUGGINGFACE_",
    "TRANSFORMERS_",
    "XDG_",
    "LC_",
    "LANG",
    "TZ",
    "TMPDIR",
    "HOME",
)
KEEP = ("PATH", "USER")  # harmless, and what an interpreter expects to find
MAX_MESSAGE = 1 << 20  # a request's arguments and environment; a larger one starts cold
READY_TIMEOUT_S = 120.0  # importing torch on a loaded host
UNRESPONSIVE_S = 30.0  # an agent was killed and the warm host has not said so: it is stuck


class WarmHostError(RuntimeError):
    """The warm host could not start an agent: the caller starts it cold."""


class TooLarge(WarmHostError):
    """The request does not fit one message on the socket: this attempt starts cold, the warm host stays."""


def startup_env(env: dict[str, str]) -> dict[str, str]:
    """The part of an environment that an interpreter or torch reads when it starts, and a fork cannot change."""
    # A credential is read when it is used, never at start-up: the warm host keeps none (trainer/redact.py's names).
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES) and not SECRET_NAME.search(k)}


def host_env(env: dict[str, str]) -> dict[str, str]:
    """The warm host's own environment: the startup settings and a few harmless ones, no secret."""
    return {**{k: env[k] for k in KEEP if k in env}, **startup_env(env)}


def agent_command(cmd: list[str]) -> list[str] | None:
    """The agent's arguments when ``cmd`` is ``python -m <the agent> …`` with this interpreter, else None."""
    if len(cmd) > 3 and cmd[0] == sys.executable and cmd[1:3] == ["-m", AGENT]:
        return cmd[3:]
    return None


# --- the warm host process -------------------------------------------------------------------------------------


def _send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.send(data)


def _receive(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the descriptors it carries; (None, []) at the end of the stream."""
    data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 4)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), fds


def _source_files() -> dict[str, int]:
    """Every loaded module's file (trainpipe, a model plug-in, torch, the standard library: a few thousand
    stats, milliseconds) with its modification time: what a fork would run stale if it changed."""
    files = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str):
            with contextlib.suppress(OSError):
                files[path] = os.stat(path).st_mtime_ns
    return files


def _changed(files: dict[str, int], loading_ns: tuple[int, int]) -> str | None:
    """A loaded file that changed since it was recorded, or was written while the imports ran (``loading_ns``:
    the code in memory may be the older one). A modification time ahead of the clock (another machine's) is not
    a change."""
    began, ended = loading_ns
    for path, mtime in files.items():
        try:
            now = os.stat(path).st_mtime_ns
        except OSError:
            return path
        if now != mtime or began <= mtime <= ended:
            return path
    return None


def preload(profile_path: str | None) -> None:
    """Import what every attempt's agent and ranks import (torch, torchrun, DCP, the rank programs, the model)."""
    import importlib

    from trainpipe.trainer.supervise import agent

    for program in agent.RANK_PROGRAMS.values():
        importlib.import_module(program.split(":")[0])
    if profile_path:
        agent.import_model_factory(["--profile", profile_path])


def _become_agent(request: dict[str, Any], out_fd: int, host: int) -> None:
    """In the forked child: the attempt's torchrun agent, as ``python -m trainpipe.trainer.supervise.agent``."""
    from trainpipe.trainer.proc import die_with_parent, exit_now, name_process
    from trainpipe.trainer.supervise import agent, isolation

    code = 1
    try:
        os.setsid()  # the leader of its own process group, which the supervisor tears down as one
        die_with_parent()  # the warm host, which dies with the supervisor
        if os.getppid() != host:  # it died before the request took effect: nobody would stop this agent
            os._exit(1)
        name_process("trainpipe-agent")
        # What a fresh interpreter has: SIGPIPE and SIGXFSZ ignored (a reset socket is an error, not a death),
        # Ctrl-C as KeyboardInterrupt, the rest the system's default.
        for sig, handler in (
            (signal.SIGPIPE, signal.SIG_IGN),
            (signal.SIGXFSZ, signal.SIG_IGN),
            (signal.SIGINT, signal.default_int_handler),
            (signal.SIGTERM, signal.SIG_DFL),
            (signal.SIGCHLD, signal.SIG_DFL),
        ):
            signal.signal(sig, handler)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(null)
        os.close(out_fd)
        os.environ.clear()
        os.environ.update(request["env"])
        isolation.enter_from_env()  # a forked child has one thread, as a new namespace needs
        sys.argv = [agent.__file__, *request["argv"]]
        code = agent.main(list(request["argv"]))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported like an interpreter's uncaught exception, then the exit code
        import traceback

        traceback.print_exc()
    try:
        exit_now(code)
    finally:
        os._exit(code)  # never back into the warm host's loop


def _await_session(pid: int, timeout_s: float = 2.0) -> None:
    """Answer only once the child leads its own session: a ``killpg`` of its pid before that would find nothing."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if os.getsid(pid) == pid:
                return
        except ProcessLookupError:
            return
        time.sleep(0.0005)


def _exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def serve(sock: socket.socket, parent: int, profile_path: str | None) -> int:
    started_env, began_ns = startup_env(dict(os.environ)), time.time_ns()  # before an import can change either
    preload(profile_path)
    sources = _source_files()
    loading_ns = (began_ns, time.time_ns())
    _send(sock, {"ready": True})
    children: set[int] = set()
    try:
        while os.getppid() == parent:  # the supervisor died: so do we, and our agents with us
            readable, _, _ = select.select([sock], [], [], 0.05)
            while children:  # reap promptly: a zombie keeps the agent's process group looking alive
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                children.discard(pid)
                _send(sock, {"exit": pid, "code": _exit_code(status)})
            if not readable:
                continue
            request, fds = _receive(sock)
            if request is None:
                return 0
            if len(fds) != 1 or not isinstance(request.get("argv"), list) or not isinstance(request.get("env"), dict):
                for fd in fds:
                    os.close(fd)
                _send(sock, {"refused": "a malformed request"})
                continue
            stale = _changed(sources, loading_ns)
            if startup_env(request["env"]) != started_env or stale:
                os.close(fds[0])
                _send(sock, {"refused": f"{stale} changed on disk" if stale else "other startup settings"})
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            host = os.getpid()
            pid = os.fork()
            if pid == 0:
                try:
                    sock.close()
                    _become_agent(request, fds[0], host)
                finally:
                    os._exit(1)
            os.close(fds[0])
            children.add(pid)
            _await_session(pid)
            _send(sock, {"pid": pid})
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A warm host (started by the supervisor; not by hand)")
    p.add_argument("--control", type=int, required=True, help="the inherited socket's descriptor")
    args = p.parse_args(argv)
    sock = socket.socket(fileno=args.control)
    first, _ = _receive(sock)  # what to preload: the first attempt's resolved profile (a local file)
    if first is None:
        return 0
    from trainpipe.trainer.proc import name_process

    name_process("trainpipe-warm")
    return serve(sock, os.getppid(), first.get("profile"))


# --- the supervisor's side -------------------------------------------------------------------------------------


class WarmHost:
    """One warm host process and its socket, from the supervisor's side."""

    def __init__(self, env: dict[str, str], profile_path: str | None):
        self.key = tuple(sorted(startup_env(env).items()))
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__, "--control", str(theirs.fileno())],
            env=host_env(env),
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C in the terminal reaches the supervisor, which tears down
        )
        theirs.close()
        self.exits: dict[int, int] = {}
        self.ready = False
        self.dead = False
        self._lock = threading.Lock()
        _send(self.sock, {"profile": profile_path})

    def _collect(self, timeout_s: float) -> dict[str, Any] | None:
        """Read one message (exit codes are kept); the first other one is returned. Under ``self._lock``."""
        if self.dead:
            return None
        try:
            readable, _, _ = select.select([self.sock], [], [], max(timeout_s, 0.0))
            if not readable:
                return None
            message, fds = _receive(self.sock)
        except (OSError, ValueError):  # closed meanwhile, or not a message of the warm host's
            message, fds = None, []
        for fd in fds:
            os.close(fd)
        if message is None:  # the warm host is gone, and every agent it forked with it
            self.dead = True
            return None
        if "exit" in message:
            self.exits[int(message["exit"])] = int(message["code"])
            return None
        return message

    def _answer(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while not self.dead and time.monotonic() < deadline:
            message = self._collect(deadline - time.monotonic())
            if message is not None:
                return message
        raise WarmHostError("it ended" if self.dead else f"no answer in {timeout_s:.0f} s")

    def start_agent(self, argv: list[str], env: dict[str, str]) -> WarmAgent:
        data = json.dumps({"argv": argv, "env": env}).encode()
        # One message must fit the socket's send buffer (SEQPACKET): about 200 KB by default on Linux.
        if len(data) > min(MAX_MESSAGE, self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 2):
            raise TooLarge(f"the request is too large ({len(data)} bytes)")
        with self._lock:
            if not self.ready:
                if not self._answer(READY_TIMEOUT_S).get("ready"):
                    raise WarmHostError("the warm host did not start")
                self.ready = True
            read_fd, write_fd = os.pipe()
            try:
                try:
                    _send(self.sock, {"argv": argv, "env": env}, [write_fd])
                except OSError as exc:
                    if exc.errno == errno.EMSGSIZE:
                        raise TooLarge(f"the request is too large ({len(data)} bytes)") from exc
                    raise WarmHostError(f"the warm host does not listen: {exc}") from exc
                finally:
                    os.close(write_fd)
                answer = self._answer(10.0)
            except BaseException:
                os.close(read_fd)
                raise
        if "pid" not in answer:
            os.close(read_fd)
            raise WarmHostError(f"the warm host refused: {answer.get('refused', answer)}")
        stdout = os.fdopen(read_fd, "r", encoding="utf-8", errors="replace")
        return WarmAgent(self, int(answer["pid"]), [sys.executable, "-m", AGENT, *argv], stdout)

    def exit_code(self, pid: int, timeout_s: float) -> int | None:
        """``pid``'s exit code once the warm host reaped it, waiting up to ``timeout_s`` (0: what has arrived)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while pid not in self.exits:
                if self.dead:
                    return self.exits.get(pid, -signal.SIGKILL)  # it died with the warm host
                left = deadline - time.monotonic()
                if left <= 0 and not self._pending():
                    return None
                self._collect(min(max(left, 0.0), 0.05))
            return self.exits[pid]

    def _pending(self) -> bool:
        try:
            return bool(select.select([self.sock], [], [], 0)[0])
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.dead = True
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class WarmAgent:
    """An agent forked by a warm host, with what ``run_job`` uses of a ``Popen``."""

    warm = True

    def __init__(self, host: WarmHost, pid: int, args: list[str], stdout: Any):
        self.host, self.pid, self.args, self.stdout = host, pid, args, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.host.exit_code(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.host.exit_code(self.pid, UNRESPONSIVE_S if timeout is None else timeout)
        if self.returncode is None and timeout is None:
            # No word of an agent that was killed: the warm host is stuck (stopped, say). Ending it ends the agent.
            log.warning("the warm host did not report agent %d's end: stopping it", self.pid)
            self.host.proc.kill()
            self.returncode = self.host.exit_code(self.pid, UNRESPONSIVE_S)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:  # reaped already: its pid may be another process's by now
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


class WarmHosts:
    """The warm hosts of one scope (``keep_warm``), one per distinct startup environment."""

    def __init__(self) -> None:
        self.hosts: dict[tuple, WarmHost] = {}
        self.lock = threading.Lock()

    def start_agent(self, cmd: list[str], env: dict[str, str], profile_path: str | None) -> WarmAgent | None:
        argv = agent_command(cmd)
        if argv is None:
            return None
        key = tuple(sorted(startup_env(env).items()))
        with self.lock:
            for other in [k for k in self.hosts if k != key]:  # another start-up setting now: not used again
                self.hosts.pop(other).close()
            host = self.hosts.pop(key, None)
            if host is not None and host.dead:
                host.close()
                host = None
            while True:
                created = host is None
                try:
                    host = host or WarmHost(env, profile_path)
                    agent = host.start_agent(argv, env)
                except TooLarge as exc:
                    assert host is not None  # made above: only its start_agent raises this
                    self.hosts[key] = host
                    log.warning("the warm host cannot take this attempt (%s): it starts cold", exc)
                    return None
                except Exception as exc:  # noqa: BLE001 - whatever went wrong, the attempt can still start cold
                    if host is not None:
                        host.close()
                    host = None
                    if created or not isinstance(exc, WarmHostError):  # a fresh one failed too: start cold
                        log.warning("the warm host could not start this attempt (%s): it starts cold", exc)
                        return None
                    continue  # an older one refused (its sources changed on disk): replace it
                except BaseException:  # interrupted (Ctrl-C, a cancelled run): nothing may outlive this scope
                    if host is not None:
                        host.close()
                    raise
                self.hosts[key] = host
                return agent

    def close(self) -> None:
        with self.lock:
            for host in self.hosts.values():
                host.close()
            self.hosts.clear()


_scope: WarmHosts | None = None


@contextlib.contextmanager
def keep_warm(enabled: bool = True) -> Iterator[None]:
    """Keep warm hosts up for the attempts inside this block (a run's preflight and training with its retries);
    they are closed when it ends. Outside such a block every attempt starts cold."""
    global _scope
    if not enabled or _scope is not None:
        yield
        return
    _scope = WarmHosts()
    try:
        yield
    finally:
        scope, _scope = _scope, None
        scope.close()


def start_agent(cmd: list[str], env: dict[str, str], profile_path: str | None) -> WarmAgent | None:
    """The attempt's agent forked from this scope's warm host, or None (no scope, another command): start it cold."""
    scope = _scope
    return scope.start_agent(cmd, env, profile_path) if scope is not None else None


if __name__ == "__main__":
    sys.exit(main())
