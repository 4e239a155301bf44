"""Shared fixtures: an isolated TRAINPIPE_HOME, a tiny profile, and real servers started here."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

# Small enough for 2 CPU cores, big enough to learn: a step takes a few ms.
TINY = [
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "train.steps=8",
    "train.global_batch=8",
    "train.micro_batch=2",
    "train.warmup_steps=2",
    "train.eval_every=4",
    "train.eval_batches=2",
    "train.max_retries=0",
    "train.retry_delay_s=0",
    "train.timeout_s=240",
    "checkpoint.every_steps=4",
    "checkpoint.keep_last=5",
    "data.max_bytes=200000",
    "data.shard_tokens=65536",
    "watchdog.pg_timeout_s=60",
    "preflight.allreduce_mb=0.5",
    # Tests share 2 cores with the servers they start: a rank flagged for being 1.3x slower is load, not a fault.
    # The drills that slow a rank on purpose slow it 4x.
    "preflight.max_compute_slowdown=1",
]

# The run summary's contract (docs/architecture.md §6): `trainpipe run --json` prints at least these.
SUMMARY_FIELDS = {
    "run_name",
    "mlflow_run_id",
    "checkpoint_uri",
    "final_step",
    "val_loss",
    "model_digest",
    "recoveries",
    "incidents",
    "goodput",
    "wall_s",
    "badput",
    "published",
}

# A pipeline run whose subject is not the publish stage leaves it out: exporting, checking and logging the model
# cost ~7 s of CPU per run. tests/test_publish.py and tests/test_pipeline.py's end-to-end runs publish.
NO_PUBLISH = "publish.enabled=false"

# Long enough to be hit mid-run: rank 1 is slowed (a sleep: the numbers are unchanged).
DRILL = [
    *TINY,
    "train.steps=60",
    "train.eval_every=20",
    "checkpoint.every_steps=10",
    "model.n_embd=64",
    "model.n_layer=2",
    "faults.kind=slow",
    "faults.rank=1",
    "faults.factor=4",
    "faults.attempts=0",
    "preflight.enabled=false",  # it would rightly fail the slowed rank's compute check
    NO_PUBLISH,
]


_MADE: list[Path] = []  # folders this session made outside pytest's own temp folders: removed at its end


def pytest_configure(config):
    # Prefect's server and settings live in a throwaway folder, never in ~/.prefect. A pytest-xdist worker makes
    # its own rather than share the controller's: each worker's server has a SQLite database of its own there.
    if os.environ.get("PYTEST_XDIST_WORKER") and "PYTEST_PREFECT_HOME" not in os.environ:
        os.environ.pop("PREFECT_HOME", None)
    prefect_home = Path(os.environ.get("PYTEST_PREFECT_HOME", f"/tmp/trainpipe-tests-prefect-{os.getpid()}"))
    if "PYTEST_PREFECT_HOME" not in os.environ and "PREFECT_HOME" not in os.environ:
        _MADE.append(prefect_home)
    prefect_home.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(prefect_home))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_ENABLED", "true")
    os.environ.pop("PREFECT_API_URL", None)
    # Whatever no test gives a home of its own writes here: never into the checkout (checked at the session's end)
    # nor into a developer's own TRAINPIPE_HOME.
    os.environ["TRAINPIPE_HOME"] = tempfile.mkdtemp(prefix="trainpipe-tests-home-")
    _MADE.append(Path(os.environ["TRAINPIPE_HOME"]))


def _checkout_state() -> set[tuple[str, int]]:
    """What git sees in the checkout, file by file with each one's mtime (ignored files included, less the caches
    any run of Python or pytest makes)."""
    out = subprocess.run(
        ["git", "status", "--porcelain", "--ignored=matching", "--untracked-files=all"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,  # a git that cannot read the checkout must not pass the check below by seeing nothing
    )
    caches = ("__pycache__/", ".pytest_cache/", ".ruff_cache/", ".venv/", ".egg-info/")
    state = set()
    for line in out.stdout.splitlines():
        if not any(c in line for c in caches):
            path = ROOT / line[3:]
            state.add((line, path.stat().st_mtime_ns if path.exists() else 0))
    return state


_CHECKOUT: dict = {}


def pytest_sessionstart(session):
    if (ROOT / ".git").exists():
        _CHECKOUT["before"] = _checkout_state()


def _check_the_checkout(session) -> None:
    """The suite writes nothing into the repository's working tree (no ./mlruns, no .trainpipe, no stray file),
    servers it started included: checked once they have stopped."""
    if "before" not in _CHECKOUT:
        return
    added = sorted(_checkout_state() - _CHECKOUT["before"])
    if added:
        print(f"\nerror: the test session wrote into the checkout: {[line for line, _ in added]}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("TRAINPIPE_HOME", str(h))
    return h


@pytest.fixture
def tiny_profile(home):
    from trainpipe.trainer.profile_files import load_profile

    def make(*extra: str):
        return load_profile("local", [*TINY, *extra])

    return make


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on {port}")


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 API on loopback: moto_server, as s3fs's own tests use."""
    port = free_port()
    proc = subprocess.Popen(
        [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    SERVERS.add(proc.pid)
    try:
        wait_port(port, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


@pytest.fixture
def s3_bucket(s3_endpoint, monkeypatch):
    """A fresh bucket and the storage options that reach it."""
    import uuid

    import s3fs

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)  # botocore's standard variable: no endpoint in profiles
    options = {"endpoint_url": s3_endpoint, "key": "testing", "secret": "testing"}
    bucket = f"tp-{uuid.uuid4().hex[:10]}"
    s3fs.S3FileSystem(**options).mkdir(bucket)
    s3fs.S3FileSystem.clear_instance_cache()
    return bucket, options


SERVERS: set[int] = set()  # servers started once per test run are not leftovers


def _is_server(p: psutil.Process) -> bool:
    return p.pid in SERVERS or any(parent.pid in SERVERS for parent in p.parents())


def _warm_hosts() -> set[int]:
    """The warm hosts of a ``warm_module`` scope: kept for the module's next test (what they fork is checked)."""
    from trainpipe.trainer.supervise import warm_host

    scope = warm_host._scope  # the scope a test module opened
    return {host.proc.pid for host in scope.hosts.values()} if scope is not None else set()


def _leftovers(before: set[int], marker: str) -> list[psutil.Process]:
    """Our new descendants, plus any process anywhere naming this test's folder (orphans re-parented to init)."""
    kept = _warm_hosts()
    found = {p.pid: p for p in psutil.Process().children(recursive=True) if p.pid not in before | kept}
    for p in psutil.process_iter(["cmdline"]):
        if marker in " ".join(p.info["cmdline"] or []) and p.pid != os.getpid():
            found[p.pid] = p
    alive = []
    for p in found.values():
        try:
            if _is_server(p) or p.status() == psutil.STATUS_ZOMBIE:
                continue
            alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.fixture(scope="module")
def warm_module():
    """The module's attempts fork their torchrun agents from a warm host (trainer/supervise/warm_host.py), as a
    run's retries do, instead of starting them cold: a cold agent imports torch and the rank programs, about two
    seconds of CPU each. The warm path's own tests are tests/test_warm_host.py; other modules start cold."""
    from trainpipe.trainer.supervise.warm_host import keep_warm

    with keep_warm():
        yield


@pytest.fixture(autouse=True)
def no_leftover_processes(tmp_path):
    """Every test leaves no process behind (torchrun workers included)."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    deadline = time.monotonic() + 5
    while (left := _leftovers(before, str(tmp_path))) and time.monotonic() < deadline:
        time.sleep(0.1)
    described = [_describe(p) for p in left]
    for p in left:
        p.kill()
    assert not left, f"processes left behind: {described}"


def _describe(p: psutil.Process) -> tuple:
    try:
        parent = p.parent()
        return (
            p.pid,
            p.cmdline()[:5],
            p.status(),
            parent and (parent.pid, parent.cmdline()[:4]),
            p.name(),
        )
    except psutil.Error as exc:
        return p.pid, repr(exc)


_PREFECT: dict = {}


def _start_prefect() -> None:
    if "proc" in _PREFECT:
        return
    port = free_port()
    log = open(Path(os.environ["PREFECT_HOME"]) / "server.log", "ab")  # noqa: SIM115 - open as long as the server runs
    proc = subprocess.Popen(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "PREFECT_UI_ENABLED": "false"},
    )
    SERVERS.add(proc.pid)
    _PREFECT.update(proc=proc, log=log, port=port)


def prefect_api() -> str:
    """A real Prefect server for the whole test run: the CLI runs its flows against it instead of starting an
    embedded server each time. It starts once the tests are collected (its database migration, ~20 s, overlaps
    the unit tests) when any selected test may need it, else on first use."""
    if "url" not in _PREFECT:
        _start_prefect()
        url = f"http://127.0.0.1:{_PREFECT['port']}/api"
        wait_http(f"{url}/health", _PREFECT["proc"], timeout=180)
        _PREFECT["url"] = url
    return _PREFECT["url"]


# `make test` runs two pytest-xdist workers. Each test module is one unit of work, so its module fixtures (trained
# references, servers) are built once. These share what one machine has once (network namespaces on fixed
# subnets, a Slurm cluster's munge and ports): one unit, on one worker, one module after another.
ONE_AT_A_TIME = {"test_multihost", "test_kubernetes", "test_shard_engines", "test_slurm", "test_slurm_nodes",
                 "test_orphan_jobs"}  # fmt: skip
# The longest units first, so that neither worker is left with a long one at the end.
FIRST = ("hosts", "test_operations", "test_pipeline")


def _unit(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
    return "hosts" if module in ONE_AT_A_TIME else module


@pytest.hookimpl(optionalhook=True)  # xdist's hook: a run with `-p no:xdist` has no such hook to call
def pytest_xdist_make_scheduler(config, log):
    # xdist's own "loadgroup" names a group by rewriting each test's node id, which pytest 9.2 no longer reads:
    # this is its "loadscope" with the units above for scopes.
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return ByUnit(config, log)


# TRAINPIPE_TEST_CPU=FILE: each test's CPU seconds (its worker and the children it reaped, setup and teardown
# included) as JSON lines appended to FILE. The suite is CPU-bound on 2 cores (Makefile), so CPU, not wall time,
# is what a change to it must save; `python -m tests.cpu_report FILE` sums it per test and module.
_CPU_REPORT = os.environ.get("TRAINPIPE_TEST_CPU")


def _cpu_used() -> float:
    import resource

    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _CPU_REPORT:
        yield
        return
    import json

    cpu, wall = _cpu_used(), time.monotonic()
    yield
    line = {"test": item.nodeid, "cpu_s": round(_cpu_used() - cpu, 2), "wall_s": round(time.monotonic() - wall, 2)}
    with open(_CPU_REPORT, "a") as report:  # one short append per test: the workers' lines do not interleave
        report.write(json.dumps(line) + "\n")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: FIRST.index(_unit(item.nodeid)) if _unit(item.nodeid) in FIRST else len(FIRST))


def pytest_collection_finish(session):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # every worker collects every test: each starts what it needs on first use, not both of everything
    # Only with the integration tests: a server migrating its database beside a drill alone would load the
    # machine the drill times.
    if any(item.get_closest_marker("integration") for item in session.items):
        _start_prefect()
    if any(item.module.__name__.endswith("test_operations") for item in session.items):
        start_servers_up()


_UP: dict = {}


def start_servers_up() -> dict:
    """`trainpipe up` for tests/test_operations.py, in a fresh TRAINPIPE_HOME on free ports, started in the
    background once the tests are collected (two server starts, ~20 s, overlap the tests before it)."""
    if "proc" not in _UP:
        home = Path(tempfile.mkdtemp(prefix="trainpipe-ops-")) / "home"
        # Not the credentials of an embedded server that an earlier test in this process guarded (they stay in
        # os.environ): `up` would keep them for its own clients, and its servers would refuse them.
        theirs = ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "PREFECT_SERVER_API_AUTH_STRING",
                  "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k not in theirs}
        env["TRAINPIPE_HOME"] = str(home)
        ports = (free_port(), free_port())
        cmd = [str(BIN / "trainpipe"), "up", "--prefect-port", str(ports[0]), "--mlflow-port", str(ports[1])]
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        SERVERS.add(proc.pid)  # the servers it starts are its children until it exits: not a test's leftovers
        _UP.update(proc=proc, home=home, env=env, ports=ports, down=False)
    return _UP


def stop_servers_up() -> subprocess.CompletedProcess:
    """`trainpipe down` for the servers of ``start_servers_up``."""
    _UP["down"] = True
    return subprocess.run(
        [str(BIN / "trainpipe"), "down"], capture_output=True, text=True, timeout=120, env=_UP["env"], cwd=ROOT
    )


def wait_http(url: str, proc: subprocess.Popen, timeout: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer")


def pytest_sessionfinish(session, exitstatus):
    if proc := _PREFECT.get("proc"):
        stop(proc)
        _PREFECT["log"].close()
    if "proc" in _UP:  # a run that ended before tests/test_operations.py's own teardown
        _UP["proc"].wait(timeout=300)
        if not _UP["down"]:
            stop_servers_up()
        shutil.rmtree(_UP["home"].parent, ignore_errors=True)
    for folder in _MADE:
        shutil.rmtree(folder, ignore_errors=True)
    _check_the_checkout(session)


def cli_env(env: dict | None = None) -> dict:
    return {**os.environ, "PREFECT_API_URL": prefect_api(), **(env or {})}


def run_cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "trainpipe"), *args], capture_output=True, text=True, timeout=timeout, env=cli_env(env), cwd=ROOT
    )


@pytest.fixture
def cli(capsys):
    """``trainpipe ARGS`` in this process, for commands that end before Prefect starts (bad input, a catalog
    listing): what ``main`` runs, without a second of interpreter start-up. Returns (exit code, stdout, stderr)."""
    from trainpipe.flows.cli import run_command

    def call(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = run_command(list(args))
        out = capsys.readouterr()
        return code, out.out, out.err

    return call


@pytest.fixture(scope="session")
def drill_reference(tmp_path_factory):
    """One attempt of the DRILL profile without a fault (its slowed rank only sleeps: left out)."""
    from trainpipe.trainer.data.shard import shard_dataset
    from trainpipe.trainer.profile_files import load_profile
    from trainpipe.trainer.supervise.attempt import train_attempt

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRAINPIPE_HOME", str(tmp_path_factory.mktemp("drill-reference") / "home"))
        prof = load_profile("local", [*DRILL, "tracking.enabled=false", "faults.kind=none"])
        run = train_attempt(prof, "reference", shard_dataset(prof.data, prof.store).uri)
    assert run.result is not None, "\n".join(run.job.tail)
    return run


@pytest.fixture(scope="session")
def drill_digest(drill_reference) -> str:
    """The final weights of the DRILL profile trained without a fault."""
    return drill_reference.result.model_digest


@contextlib.contextmanager
def prefect_client(api_url: str, auth_string: str | None = None):
    """A sync Prefect client of the server at ``api_url`` (with the basic-auth string a `trainpipe up` server
    requires). Prefect reads PREFECT_API_URL once, at import: a change of the variable afterwards would silently
    start an embedded server instead."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    with (
        temporary_settings({PREFECT_API_URL: api_url, PREFECT_API_AUTH_STRING: auth_string}),
        get_client(sync_client=True) as client,
    ):
        yield client


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory):
    """A real one-node Slurm cluster (``tests/slurm_cluster.py``) for a test module, SLURM_CONF pointing at it;
    its daemons are this run's servers, not a test's leftovers."""
    from tests import slurm_cluster

    with slurm_cluster.cluster(tmp_path_factory.mktemp("slurm")) as found:
        SERVERS.update(found.pids)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SLURM_CONF", found.env["SLURM_CONF"])
            yield found.env


@pytest.fixture(scope="module")
def slurm_nodes(tmp_path_factory):
    """A real two-node Slurm cluster (``tests/slurm_cluster.py``): node0 and node1, each slurmd in a host of its
    own (network, UTS and mount namespaces), SLURM_CONF pointing at it."""
    from tests import slurm_cluster

    with slurm_cluster.cluster(tmp_path_factory.mktemp("slurm2"), nodes=2) as found:
        SERVERS.update(found.pids)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SLURM_CONF", found.env["SLURM_CONF"])
            yield found


def train_result(**fields):
    """A training attempt's result as rank 0 reports it (``TrainResult``), with ``fields`` changed."""
    from trainpipe.trainer.protocol import TrainResult

    base = {
        "run_name": "r",
        "start_step": 0,
        "final_step": 8,
        "checkpoint_uri": "/store/runs/r/checkpoints/step-00000008",
        "model_digest": "d0",
        "val_loss": 4.5,
        "resumed_from": None,
        "world_size": 2,
        "rank": 0,
        "attempt_s": 3.0,
        "step_s_median": 0.1,
        "mfu": None,
        "step_starts_s": [1.0, 1.1],
    }
    return TrainResult(**{**base, **fields})
