"""The local Prefect and MLflow servers behind ``trainpipe up | down | status``, and the local S3 endpoint
behind ``trainpipe store up | down``.

Each server is a detached process group with its pid, port and log recorded in
``{TRAINPIPE_HOME}/servers/{name}.json``; a server counts as up only while that
process lives and its health endpoint answers. ``trainpipe run`` looks here to
use running servers instead of Prefect's embedded one and MLflow's direct
SQLite access. Both keep their data under ``TRAINPIPE_HOME``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from trainer.config import Profile, trainpipe_home
from trainer.errors import TrainpipeError
from trainer.proc import pid_alive

PREFECT_PORT = 4200
MLFLOW_PORT = 5000
START_TIMEOUT_S = 240.0  # a first Prefect start migrates its database: minutes on a small machine


class ServerError(TrainpipeError):
    """A local server cannot start, or is not what it should be."""


@dataclass
class ServerState:
    name: str
    pid: int
    port: int
    url: str  # what a person opens
    api: str  # what a client uses
    health: str
    log: str
    backend: str = ""  # MLflow: the backend store it serves

    def alive(self) -> bool:
        return pid_alive(self.pid)

    def healthy(self, timeout: float = 2.0) -> bool:
        return self.alive() and _answers(self.health, timeout)


def servers_dir() -> Path:
    return Path(trainpipe_home()) / "servers"


def state_of(name: str) -> ServerState | None:
    path = servers_dir() / f"{name}.json"
    try:
        return ServerState(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def running(name: str) -> ServerState | None:
    """The server ``name`` if it is up and answering, else None."""
    state = state_of(name)
    return state if state is not None and state.healthy() else None


def tracking_uri_for(profile: Profile) -> str:
    """The running MLflow server's URL when it serves the profile's tracking store, else the profile's URI."""
    state = running("mlflow")
    if state is not None and state.backend == profile.tracking.tracking_uri:
        return state.api
    return profile.tracking.tracking_uri


def up(profile: Profile, prefect_port: int = PREFECT_PORT, mlflow_port: int = MLFLOW_PORT) -> list[ServerState]:
    """Start whichever of the two servers is not up yet and wait until each answers."""
    servers_dir().mkdir(parents=True, exist_ok=True)
    specs = {"prefect": lambda: _prefect_spec(prefect_port), "mlflow": lambda: _mlflow_spec(profile, mlflow_port)}
    up = {name: running(name) for name in specs}
    todo = {name: spec() for name, spec in specs.items() if up[name] is None}
    for spec in todo.values():  # every port is checked before anything starts
        if _port_in_use(spec.state.port):
            raise ServerError(
                f"port {spec.state.port} for the {spec.state.name} server is in use by another process; "
                f"stop it or pick another port (trainpipe up --{spec.state.name}-port N)"
            )
    starting = {name: _launch(spec) for name, spec in todo.items()}  # both start at once
    try:
        for name, (state, proc) in starting.items():
            up[name] = _wait_healthy(state, proc)
    except ServerError:
        for _, proc in starting.values():
            if proc.poll() is None:
                _stop_group(proc.pid)
        raise
    return [up["prefect"], up["mlflow"]]


def down() -> list[str]:
    """Stop the servers this home started; return what was stopped."""
    states = {name: state for name in ("prefect", "mlflow") if (state := state_of(name)) is not None}
    stopped = [name for name, state in states.items() if state.alive()]
    _stop_groups([states[name].pid for name in stopped])  # both at once: each takes seconds to shut down
    for name in states:
        (servers_dir() / f"{name}.json").unlink(missing_ok=True)
    return stopped


STORE_BUCKET = "trainpipe"
# moto_server accepts any credentials; these are what `trainpipe store up` prints for the AWS chain to use.
STORE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def store_up(port: int = 0) -> ServerState:
    """A local S3 endpoint (moto_server, data in memory) on a free loopback port, with the bucket created."""
    servers_dir().mkdir(parents=True, exist_ok=True)
    state = running("store")
    if state is None:
        moto = _bin("moto_server")
        if not os.path.exists(moto):
            raise ServerError("trainpipe store up needs moto_server: pip install 'moto[server]'")
        port = port or _free_port()
        if _port_in_use(port):
            raise ServerError(f"port {port} for the store is in use by another process; pick another (--port N)")
        url = f"http://127.0.0.1:{port}"
        spec = _Spec(
            ServerState("store", 0, port, url, url, f"{url}/moto-api/data.json", _log("store")),
            [moto, "-H", "127.0.0.1", "-p", str(port)],
            {},
        )
        state = _wait_healthy(*_launch(spec))
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=state.api, key="testing", secret="testing", skip_instance_cache=True)
    if not fs.exists(STORE_BUCKET):
        fs.mkdir(STORE_BUCKET)
    return state


def store_env(state: ServerState) -> dict[str, str]:
    """The standard AWS variables that point boto3, s3fs and MLflow at the local store."""
    return {"AWS_ENDPOINT_URL_S3": state.api, **STORE_CREDENTIALS}


def store_down() -> bool:
    """Stop the local store this home started (its data is gone); whether one was running."""
    state = state_of("store")
    alive = state is not None and state.alive()
    if alive:
        _stop_group(state.pid)
    (servers_dir() / "store.json").unlink(missing_ok=True)
    return alive


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status() -> dict[str, ServerState | None]:
    return {name: running(name) for name in ("prefect", "mlflow")}


@dataclass
class _Spec:
    state: ServerState
    cmd: list[str]
    env: dict[str, str]


def _bin(tool: str) -> str:
    return str(Path(sys.executable).parent / tool)


def _prefect_spec(port: int) -> _Spec:
    home = Path(trainpipe_home()) / "prefect"
    home.mkdir(parents=True, exist_ok=True)
    api = f"http://127.0.0.1:{port}/api"
    env = {
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home}/prefect.db",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_API_URL": api,  # the UI asks the API it was told, not a default port
        "PREFECT_UI_API_URL": api,
    }
    state = ServerState("prefect", 0, port, f"http://127.0.0.1:{port}", api, f"{api}/health", _log("prefect"))
    cmd = [_bin("prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    return _Spec(state, cmd, env)


def _mlflow_spec(profile: Profile, port: int) -> _Spec:
    from trainer.tracking import artifact_root

    backend = profile.tracking.tracking_uri
    if not backend.startswith("sqlite:///"):
        raise ServerError(
            f"tracking.tracking_uri={backend} is not a local SQLite store; "
            "`trainpipe up` serves one (that URI already names a server)"
        )
    url = f"http://127.0.0.1:{port}"
    cmd = [
        _bin("mlflow"),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--backend-store-uri",
        backend,
        "--serve-artifacts",
        "--artifacts-destination",
        artifact_root(profile),
        "--workers",
        "1",
    ]
    # Job execution starts a pool of job-runner processes (1.7 GB here) that serve no tracking.
    env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    state = ServerState("mlflow", 0, port, url, url, f"{url}/health", _log("mlflow"), backend=backend)
    return _Spec(state, cmd, env)


def _log(name: str) -> str:
    return str(servers_dir() / f"{name}.log")


def _launch(spec: _Spec) -> tuple[ServerState, subprocess.Popen]:
    state = spec.state
    with open(state.log, "ab") as log:
        proc = subprocess.Popen(
            spec.cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # outlives this command; `trainpipe down` stops its whole group
            env={**os.environ, **spec.env},
        )
    state.pid = proc.pid
    return state, proc


def _wait_healthy(state: ServerState, proc: subprocess.Popen) -> ServerState:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _answers(state.health, 2.0):
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop_group(proc.pid)
            why = f"exited with code {proc.returncode}" if proc.returncode is not None else "did not answer in time"
            raise ServerError(f"the {state.name} server {why}; its log is {state.log}")
        time.sleep(0.3)
    (servers_dir() / f"{state.name}.json").write_text(json.dumps(asdict(state), indent=2))
    return state


def _stop_group(pid: int, grace_s: float = 10.0) -> None:
    _stop_groups([pid], grace_s)


def _stop_groups(pids: list[int], grace_s: float = 10.0) -> None:
    """SIGTERM each process group, wait up to ``grace_s`` for all of them together, then SIGKILL what is left."""
    left = set(pids)
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            left.discard(pid)
    deadline = time.monotonic() + grace_s
    while left and time.monotonic() < deadline:
        for pid in list(left):
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                left.discard(pid)
        time.sleep(0.1)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _answers(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False
