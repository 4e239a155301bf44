"""The local Prefect and MLflow servers behind ``trainpipe up | down | status``, and the local S3 endpoint
behind ``trainpipe store up | down``.

Each server is a detached process group with its pid, port and log recorded in
``{TRAINPIPE_HOME}/servers/{name}.json``; a server counts as up only while that
process lives and its health endpoint answers. ``trainpipe run`` looks here to
use running servers instead of Prefect's embedded one and MLflow's direct
SQLite access. Both keep their data under ``TRAINPIPE_HOME``.

Both require credentials: other local processes are not trusted, and whoever can
reach the Prefect API can start a run. They are made on the first ``up``
(``servers/credentials.json``, mode 0600), reused by later starts, and read by
the CLI, which puts them in its environment for Prefect's and MLflow's clients
(and so for everything it starts). They never go on a command line or into a log.
"""

from __future__ import annotations

import base64
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from trainpipe.trainer.config import Profile
from trainpipe.trainer.errors import TrainpipeError
from trainpipe.trainer.private import own_folder
from trainpipe.trainer.proc import pid_alive
from trainpipe.trainer.profile_files import private_home, trainpipe_home

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
    auth: bool = False  # started with the credentials of credentials.json (a server of an older trainpipe was not)

    def alive(self) -> bool:
        return pid_alive(self.pid)

    def healthy(self, timeout: float = 2.0) -> bool:
        return self.alive() and _answers(self.health, timeout)


def servers_dir() -> Path:
    return Path(trainpipe_home()) / "servers"


def _make_servers_dir() -> None:
    """Owner only: it holds the credentials, the MLflow users and the servers' logs. One another user made (in a
    TRAINPIPE_HOME they could write before it was narrowed) is refused: they could read or swap what goes in."""
    private_home()
    if problem := own_folder(str(servers_dir()), follow_links=False):
        raise ServerError(f"{servers_dir()} {problem}, not a folder of this user's: remove it, then start again")


CREDENTIALS_FILE = "credentials.json"
USERNAME = "trainpipe"


@dataclass(frozen=True)
class Credentials:
    """What the servers of ``trainpipe up`` require. Secrets stay out of repr (tracebacks, logs)."""

    prefect_auth_string: str = field(repr=False)  # "user:password": Prefect's server compares it, clients send it
    mlflow_username: str
    mlflow_password: str = field(repr=False)
    mlflow_secret_key: str = field(repr=False)  # Flask's CSRF key of MLflow's auth app: the same across restarts

    def client_env(self) -> dict[str, str]:
        """The variables Prefect's and MLflow's clients read."""
        return {
            "PREFECT_API_AUTH_STRING": self.prefect_auth_string,
            "MLFLOW_TRACKING_USERNAME": self.mlflow_username,
            "MLFLOW_TRACKING_PASSWORD": self.mlflow_password,
        }

    def prefect_header(self) -> str:
        return "Basic " + base64.b64encode(self.prefect_auth_string.encode()).decode()

    def mlflow_header(self) -> str:
        return "Basic " + base64.b64encode(f"{self.mlflow_username}:{self.mlflow_password}".encode()).decode()


def credentials_path() -> Path:
    return servers_dir() / CREDENTIALS_FILE


def load_credentials() -> Credentials | None:
    """The servers' credentials, or None before the first ``up``. A file others could read or replace is refused."""
    path = credentials_path()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ServerError(f"cannot read the servers' credentials {path}: {exc.strerror}") from None
    with os.fdopen(fd) as fh:
        st = os.fstat(fh.fileno())
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ServerError(
                f"the servers' credentials {path} are readable by others (mode {st.st_mode & 0o777:o}); "
                "remove the file and restart the servers (trainpipe down; trainpipe up) for new ones"
            )
        try:
            data = json.loads(fh.read(65536))
            names = {f.name for f in fields(Credentials)}
            if not isinstance(data, dict) or set(data) != names or not all(isinstance(v, str) for v in data.values()):
                raise ValueError
        except ValueError:
            raise ServerError(
                f"{path} is not trainpipe's credentials file; remove it and restart the servers "
                "(trainpipe down; trainpipe up) for new ones"
            ) from None
    return Credentials(**data)


def ensure_credentials() -> Credentials:
    """The servers' credentials, made on the first start: random, written whole with mode 0600 (never readable by
    others, not even while being written), kept across ``down`` and ``up``."""
    if (found := load_credentials()) is not None:
        return found
    _make_servers_dir()
    made = Credentials(
        prefect_auth_string=f"{USERNAME}:{secrets.token_urlsafe(32)}",
        mlflow_username=USERNAME,
        mlflow_password=secrets.token_urlsafe(32),
        mlflow_secret_key=secrets.token_urlsafe(32),
    )
    path = credentials_path()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(asdict(made), fh, indent=2)
        try:
            os.link(tmp, path)  # whole or not at all; never over a file another `up` made meanwhile
        except FileExistsError:
            return load_credentials() or made
    finally:
        tmp.unlink(missing_ok=True)
    # MLflow's user store keeps the admin of earlier credentials, whose password is gone with them.
    _mlflow_auth_db().unlink(missing_ok=True)
    return made


def guard_embedded_server() -> None:
    """Prefect's embedded (ephemeral) server, which a run without ``trainpipe up`` starts on a loopback port named
    on its command line, gets a credential of its own: a random auth string in this process's environment, which
    that server and this process's clients (and what it starts) read there and no other local user can
    (docs/security.md). Its database's folder (PREFECT_HOME) is narrowed to its owner, as TRAINPIPE_HOME is."""
    if not os.environ.get("PREFECT_SERVER_API_AUTH_STRING"):
        secret = f"{USERNAME}:{secrets.token_urlsafe(32)}"
        os.environ["PREFECT_SERVER_API_AUTH_STRING"] = secret
        os.environ["PREFECT_API_AUTH_STRING"] = secret
    home = Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser()
    with contextlib.suppress(OSError):
        home.parent.mkdir(parents=True, exist_ok=True)
        own_folder(str(home))  # one of another user's is Prefect's to refuse: it cannot write its database there


def use_credentials(prefect: bool = True, mlflow: bool = True) -> Credentials | None:
    """Put the servers' credentials in this process's environment for Prefect's and MLflow's clients (and what
    this process starts), unless the environment has its own."""
    creds = load_credentials()
    if creds is None:
        return None
    env = creds.client_env()
    if prefect:
        os.environ.setdefault("PREFECT_API_AUTH_STRING", env["PREFECT_API_AUTH_STRING"])
    if mlflow and not (os.environ.get("MLFLOW_TRACKING_USERNAME") or os.environ.get("MLFLOW_TRACKING_PASSWORD")):
        # both or neither: a user's own name with our password (or the reverse) would only be refused
        os.environ["MLFLOW_TRACKING_USERNAME"] = env["MLFLOW_TRACKING_USERNAME"]
        os.environ["MLFLOW_TRACKING_PASSWORD"] = env["MLFLOW_TRACKING_PASSWORD"]
    return creds


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
    """The running MLflow server's URL when it serves the profile's tracking store, else the profile's URI. With
    the server's URL, its credentials go into this process's environment (a flow run started by a worker, or
    `trainpipe compare`, has not read them yet): MLflow's client reads them there, and the supervisors and rank 0's
    metric relay inherit them."""
    state = running("mlflow")
    if state is not None and state.backend == profile.tracking.tracking_uri:
        if state.auth:
            use_credentials(prefect=False)
        return state.api
    return profile.tracking.tracking_uri


def up(profile: Profile, prefect_port: int = PREFECT_PORT, mlflow_port: int = MLFLOW_PORT) -> list[ServerState]:
    """Start whichever of the two servers is not up yet and wait until each answers; both require the credentials
    of ``credentials.json`` (made on the first start)."""
    _make_servers_dir()
    up = {name: running(name) for name in ("prefect", "mlflow")}
    for state in up.values():
        if state is not None and not state.auth:
            raise ServerError(
                f"the {state.name} server at {state.url} (pid {state.pid}) runs without credentials (an earlier "
                "trainpipe started it); stop it with `trainpipe down`, then `trainpipe up` starts both with them"
            )
    if any(up.values()) and load_credentials() is None:
        raise ServerError(
            f"the running servers' credentials {credentials_path()} are gone; "
            "`trainpipe down`, then `trainpipe up` starts them with new ones"
        )
    creds = ensure_credentials()
    specs = {
        "prefect": lambda: _prefect_spec(prefect_port, creds),
        "mlflow": lambda: _mlflow_spec(profile, mlflow_port, creds),
    }
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
    prefect, mlflow = up["prefect"], up["mlflow"]
    assert prefect is not None and mlflow is not None  # each was running or has just started
    return [prefect, mlflow]


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
    _make_servers_dir()
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
    if state is not None and alive:
        _stop_group(state.pid)
    (servers_dir() / "store.json").unlink(missing_ok=True)
    return alive


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status() -> dict[str, ServerState | None]:
    return {name: running(name) for name in ("prefect", "mlflow")}


def accepts_credentials(state: ServerState, creds: Credentials, timeout: float = 5.0) -> bool:
    """Whether the server answers a request that needs the credentials (its health endpoint does not)."""
    if state.name == "prefect":
        return _answers(f"{state.api}/admin/version", timeout, creds.prefect_header())
    return _answers(f"{state.api}/api/2.0/mlflow/experiments/search?max_results=1", timeout, creds.mlflow_header())


@dataclass
class _Spec:
    state: ServerState
    cmd: list[str]
    env: dict[str, str]


def _bin(tool: str) -> str:
    return str(Path(sys.executable).parent / tool)


def _prefect_spec(port: int, creds: Credentials) -> _Spec:
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
        # Basic auth on every API route but GET /api/health; the UI asks for this string once (browser storage).
        # In the environment, not on the command line: every local user sees command lines.
        "PREFECT_SERVER_API_AUTH_STRING": creds.prefect_auth_string,
        "PREFECT_API_AUTH_STRING": creds.prefect_auth_string,  # for whatever client the server process runs
    }
    url = f"http://127.0.0.1:{port}"
    state = ServerState("prefect", 0, port, url, api, f"{api}/health", _log("prefect"), auth=True)
    cmd = [_bin("prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    return _Spec(state, cmd, env)


def _mlflow_auth_db() -> Path:
    return servers_dir() / "mlflow-auth.db"


def _mlflow_spec(profile: Profile, port: int, creds: Credentials) -> _Spec:
    from trainpipe.trainer.tracking import artifact_root

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
        "--app-name",
        "trainpipe",  # MLflow's basic-auth (every route but /health, /static and server-info needs a user)
    ]
    if importlib.util.find_spec("flask_wtf") is None:  # the auth app's CSRF protection; it would fail at start
        raise ServerError("MLflow's authentication needs Flask-WTF: pip install 'mlflow[auth]'")
    if not importlib.metadata.entry_points(group="mlflow.app", name="trainpipe"):  # an install from before it
        raise ServerError("MLflow does not know trainpipe's server app: reinstall trainpipe (make setup)")
    env = {
        # Job execution starts a pool of job-runner processes (1.7 GB here) that serve no tracking.
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "MLFLOW_AUTH_CONFIG_PATH": _write_mlflow_auth_config(),
        # The admin is made from these on the first start against an empty user store (then kept there, hashed).
        # In the environment, not in a file or on the command line; set here so that the caller's own
        # MLFLOW_AUTH_ADMIN_* (which MLflow prefers to its config file) cannot change them.
        "MLFLOW_AUTH_ADMIN_USERNAME": creds.mlflow_username,
        "MLFLOW_AUTH_ADMIN_PASSWORD": creds.mlflow_password,
        "MLFLOW_FLASK_SERVER_SECRET_KEY": creds.mlflow_secret_key,
    }
    state = ServerState("mlflow", 0, port, url, url, f"{url}/health", _log("mlflow"), backend=backend, auth=True)
    return _Spec(state, cmd, env)


MLFLOW_AUTH_CACHE_S = 60  # a password changed out of band is still accepted this long


def _write_mlflow_auth_config() -> str:
    """MLflow's auth settings: its user store under TRAINPIPE_HOME (not basic_auth.db in the current folder), no
    access for a user other than the admin until granted, and MLflow's own cache of verified credentials."""
    path = servers_dir() / "mlflow-auth.ini"
    text = (
        "[mlflow]\n"
        "default_permission = NO_PERMISSIONS\n"
        f"database_uri = sqlite:///{_mlflow_auth_db()}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        # Without it, every request hashes its password (scrypt, ~75 ms of CPU): a run's metric relay and a UI
        # page's dozens of calls kept a core busy. Only a password that verified is kept, for at most this long,
        # keyed by an HMAC under a per-process key (docs/operating.md, the servers' credentials).
        f"auth_cache_ttl_seconds = {MLFLOW_AUTH_CACHE_S}\n"
    )
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "w") as fh:
        fh.write(text)
    os.replace(tmp, path)
    return str(path)


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


def _answers(url: str, timeout: float, authorization: str | None = None) -> bool:
    request = urllib.request.Request(url, headers={"Authorization": authorization} if authorization else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False
