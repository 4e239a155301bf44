"""Operating trainpipe the way its users do: `trainpipe up`, deployments served against a real Prefect server,
runs triggered and cancelled through the API as the UI does, an MLflow tracking server, and `trainpipe compare`."""

from __future__ import annotations

import base64
import contextlib
import datetime
import http.server
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import psutil
import pytest

from tests.conftest import BIN, ROOT, SERVERS, TINY, free_port, prefect_client, start_servers_up, stop_servers_up
from tests.other_user import needs_root, run_as_other_user

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# A run long enough to be cancelled mid-training: rank 1 sleeps, the numbers stay those of TINY.
LONG = [*TINY, "train.steps=400", "train.eval_every=20", "checkpoint.every_steps=10", "faults.kind=slow"]
LONG = [*LONG, "faults.factor=30", "faults.rank=1", "faults.attempts=0", "preflight.enabled=false"]


@dataclass
class Ops:
    home: Path
    env: dict[str, str]  # without the credentials: the CLI reads them from TRAINPIPE_HOME itself
    prefect_api: str
    mlflow_url: str
    ports: tuple[int, int]
    creds: dict[str, str]  # servers/credentials.json, for the test's own clients
    up_output: str  # what `trainpipe up` printed


def trainpipe(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "trainpipe"), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


@pytest.fixture(scope="module")
def ops():
    """`trainpipe up` in a fresh TRAINPIPE_HOME on free ports (conftest starts it once the tests are collected);
    `trainpipe down` afterwards, which must stop both."""
    started = start_servers_up()
    home, env, ports = started["home"], started["env"], started["ports"]
    out, err = started["proc"].communicate(timeout=300)
    assert started["proc"].returncode == 0, err[-3000:]
    states = {n: json.loads((home / "servers" / f"{n}.json").read_text()) for n in ("prefect", "mlflow")}
    creds = json.loads((home / "servers" / "credentials.json").read_text())
    AUTH.append(creds["prefect_auth_string"])
    API.append(states["prefect"]["api"])
    yield Ops(home, env, states["prefect"]["api"], states["mlflow"]["url"], ports, creds, out + err)
    down = stop_servers_up()
    assert down.returncode == 0 and "prefect" in down.stdout and "mlflow" in down.stdout, down.stdout
    for state in states.values():
        assert not psutil.pid_exists(state["pid"]) or psutil.Process(state["pid"]).status() == psutil.STATUS_ZOMBIE
    assert trainpipe("status", env=env).returncode == 1


@pytest.fixture(scope="module")
def served(ops):
    """`trainpipe serve` against the `up` servers, until the module ends."""
    log = open(ops.home / "serve.log", "w")  # noqa: SIM115 - open as long as the serve process runs
    proc = subprocess.Popen(
        [str(BIN / "trainpipe"), "serve"],
        env={**ops.env, "PREFECT_RUNNER_POLL_FREQUENCY": "1"},
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    SERVERS.add(proc.pid)  # its flow-run processes are checked by the tests themselves
    API.append(ops.prefect_api)
    try:
        deadline = time.monotonic() + 180
        # ready once it has said where its runs go: that line comes after its deployments share their slot
        while not _deployments(ops) or "its runs in MLflow" not in _read(ops.home / "serve.log"):
            assert proc.poll() is None and time.monotonic() < deadline, (ops.home / "serve.log").read_text()[-3000:]
            time.sleep(1)
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # no flow run is left: a graceful shutdown has nothing to wait for
            try:
                proc.wait(3)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def test_serve_prints_the_pages_it_serves(ops, served):
    """Where to go: each deployment's page in Prefect's UI, and the MLflow server its runs go to."""
    text = (ops.home / "serve.log").read_text()
    pages = re.findall(r"serving trainpipe/(\S+): (http://\S+/deployments/deployment/[0-9a-f-]{36})$", text, re.M)
    assert {name for name, _ in pages} == {d.name for d in _deployments(ops)} and len(pages) == 2, text[-2000:]
    assert all(page.startswith(ops.prefect_api.removesuffix("/api")) for _, page in pages)
    assert f"its runs in MLflow: {ops.mlflow_url}" in text, text[-2000:]


def _deployments(ops: Ops) -> list:
    with _client() as client:
        found = [d for d in client.read_deployments() if d.name in ("on-demand", "nightly")]
    return found if len(found) == 2 else []


API: list[str] = []  # the `trainpipe up` Prefect server of this module
AUTH: list[str] = []  # and the basic-auth string it requires


def _client():
    return prefect_client(API[-1], AUTH[-1])


@contextlib.contextmanager
def _mlflow(ops: Ops):
    """An MLflow client of the `trainpipe up` server, with its user (MLflow's client reads them from the
    environment at each request)."""
    from mlflow.tracking import MlflowClient

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_USERNAME", ops.creds["mlflow_username"])
        mp.setenv("MLFLOW_TRACKING_PASSWORD", ops.creds["mlflow_password"])
        yield MlflowClient(ops.mlflow_url)


def _http(url: str, method: str = "GET", body: dict | None = None, auth: str | None = None) -> int:
    """The status code of one plain HTTP request, as any local process could send it."""
    headers = {"Content-Type": "application/json"}
    if auth is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _params(run_name: str, overrides: list[str]) -> dict:
    return {"params": {"run_name": run_name, "overrides": overrides}}


def _trigger(name: str, parameters: dict, timeout: float, flow_run_name: str | None = None):
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: API[-1], PREFECT_API_AUTH_STRING: AUTH[-1]}):
        return run_deployment(
            f"trainpipe/{name}", parameters=parameters, timeout=timeout, poll_interval=1, flow_run_name=flow_run_name
        )


def test_the_servers_answer_and_a_second_up_changes_nothing(ops):
    import urllib.request

    status = trainpipe("status", env=ops.env)
    assert status.returncode == 0 and f"127.0.0.1:{ops.ports[0]}" in status.stdout, status.stdout
    with urllib.request.urlopen(ops.mlflow_url + "/health", timeout=5) as r:
        assert r.status == 200
    with urllib.request.urlopen(ops.prefect_api.removesuffix("/api") + "/", timeout=5) as r:  # the UI is served
        assert r.status == 200 and b"<html" in r.read(2000).lower()
    before = (ops.home / "servers" / "prefect.json").read_text()
    credentials = (ops.home / "servers" / "credentials.json").read_text()
    again = trainpipe("up", "--prefect-port", str(ops.ports[0]), "--mlflow-port", str(ops.ports[1]), env=ops.env)
    assert again.returncode == 0 and (ops.home / "servers" / "prefect.json").read_text() == before
    assert (ops.home / "servers" / "credentials.json").read_text() == credentials  # kept, not made anew


def _secrets(ops: Ops) -> list[str]:
    return [ops.creds["prefect_auth_string"].split(":", 1)[1], ops.creds["mlflow_password"]]


def test_the_servers_refuse_a_request_without_their_credentials(ops):
    """Any local process could reach both servers: the Prefect API and MLflow answer only with the credentials of
    the 0600 file (their health endpoints, which `trainpipe status` asks, stay open)."""
    path = ops.home / "servers" / "credentials.json"
    assert path.stat().st_mode & 0o777 == 0o600
    auth = ops.creds["prefect_auth_string"]
    runs = ops.prefect_api + "/flow_runs/filter"
    assert _http(runs, "POST", {}) == 401
    assert _http(runs, "POST", {}, auth=auth.split(":")[0] + ":guess") == 401
    assert _http(runs, "POST", {}, auth=auth) == 200
    assert _http(ops.prefect_api + "/health") == 200
    search = ops.mlflow_url + "/api/2.0/mlflow/experiments/search?max_results=5"
    user, password = ops.creds["mlflow_username"], ops.creds["mlflow_password"]
    assert _http(search) == 401
    assert _http(ops.mlflow_url + "/api/2.0/mlflow/runs/create", "POST", {"experiment_id": "0"}) == 401
    assert _http(search, auth=f"{user}:guess") == 401
    assert _http(search, auth=f"{user}:{password}") == 200
    assert _http(ops.mlflow_url + "/health") == 200
    # The credentials never appear where others or logs see them: `up`'s output, the servers' logs, command lines.
    seen = [ops.up_output, *(p.read_text(errors="replace") for p in (ops.home / "servers").glob("*.log"))]
    for name in ("prefect", "mlflow"):
        pid = json.loads((ops.home / "servers" / f"{name}.json").read_text())["pid"]
        for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                seen.append(" ".join(p.cmdline()))
    assert str(path) in ops.up_output
    assert not [s for s in _secrets(ops) if any(s in text for text in seen)]


@needs_root
def test_another_local_user_reads_none_of_the_servers_files(ops):
    """`trainpipe up` under the usual umask (022) made TRAINPIPE_HOME: another user, who may enter the folder it lies
    in, reads neither the MLflow and Prefect databases nor MLflow's users nor the credentials (what the APIs
    refuse them)."""
    os.chmod(ops.home.parent, 0o755)  # as a checkout's folder is: others may enter it
    try:
        wanted = ["mlflow.db", "prefect/prefect.db", "servers/mlflow-auth.db", "servers/credentials.json"]
        assert all((ops.home / rel).exists() for rel in wanted), sorted(str(p) for p in ops.home.rglob("*"))
        attack = run_as_other_user(
            "import os\n"
            f"for rel in {wanted!r} + ['.', 'servers', 'prefect']:\n"
            f"    path = os.path.join({str(ops.home)!r}, rel)\n"
            "    try:\n"
            "        os.listdir(path) if os.path.isdir(path) else open(path, 'rb').read(1)\n"
            "        print('read', rel)\n"
            "    except PermissionError:\n"
            "        pass\n"
        )
    finally:
        os.chmod(ops.home.parent, 0o700)
    assert attack.returncode == 0 and attack.stdout == "", attack.stdout + attack.stderr


def test_a_port_in_use_is_one_line(ops, tmp_path):
    env = {**ops.env, "TRAINPIPE_HOME": str(tmp_path / "other")}
    proc = trainpipe("up", "--prefect-port", str(ops.ports[0]), "--mlflow-port", str(free_port()), env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"port {ops.ports[0]} for the prefect server is in use" in lines[0]


def test_serve_registers_both_deployments_with_the_nightly_schedule_and_the_typed_form(served):
    with _client() as client:
        on_demand = client.read_deployment_by_name("trainpipe/on-demand")
        nightly = client.read_deployment_by_name("trainpipe/nightly")
    assert [s.schedule.cron for s in nightly.schedules] == ["0 2 * * *"] and not on_demand.schedules
    assert on_demand.global_concurrency_limit.limit == 1  # one slot for the pair: one training run at a time
    assert nightly.global_concurrency_limit.id == on_demand.global_concurrency_limit.id
    assert on_demand.concurrency_options.collision_strategy == "ENQUEUE"
    assert nightly.concurrency_options.collision_strategy == "CANCEL_NEW"
    assert on_demand.enforce_parameter_schema
    form = on_demand.parameter_openapi_schema["definitions"]["PipelineParameters"]["properties"]
    profiles = ["llama-tiny", "local", "local-s3", "multi-node-local", "tp-pp-local"]
    assert form["profile"]["enum"] == profiles  # profiles/*.yaml: a drop-down
    assert (form["steps"]["type"], form["steps"]["minimum"], form["steps"]["default"]) == ("integer", 1, 600)
    assert list(form)[-1] == "overrides" and "description" in form["run_name"]
    assert on_demand.parameters["params"]["lr"] == 0.003  # the served profile's values prefill the form


@pytest.mark.parametrize("bad", [{"steps": 0}, {"profile": "no-such-profile"}, {"run_name": "../x"}])
def test_a_bad_parameter_is_refused_before_a_run_exists(served, bad):
    with _client() as client:
        on_demand = client.read_deployment_by_name("trainpipe/on-demand").id
        before = [r.id for r in client.read_flow_runs() if r.deployment_id == on_demand]
    with pytest.raises(Exception, match=r"(?i)validation"):
        _trigger("on-demand", {"params": bad}, timeout=0)
    with _client() as client:  # (the scheduler adds nightly runs meanwhile: those are not counted)
        assert [r.id for r in client.read_flow_runs() if r.deployment_id == on_demand] == before


def test_a_process_without_the_credentials_cannot_start_a_run(ops, served):
    """The attack: create a flow run of the on-demand deployment through the API, with an override of the
    attacker's choice. Refused before a flow run exists."""
    with _client() as client:
        on_demand = client.read_deployment_by_name("trainpipe/on-demand").id
        before = [r.id for r in client.read_flow_runs() if r.deployment_id == on_demand]
    body = {"parameters": _params("intruder", [*TINY, "preflight.enabled=false"])}
    assert _http(f"{ops.prefect_api}/deployments/{on_demand}/create_flow_run", "POST", body) == 401
    with _client() as client:
        assert [r.id for r in client.read_flow_runs() if r.deployment_id == on_demand] == before
    serve_log = (ops.home / "serve.log").read_text(errors="replace")  # serve read them from the 0600 file, silently
    assert "using the Prefect server" in serve_log and not [s for s in _secrets(ops) if s in serve_log]


class _Hook(http.server.BaseHTTPRequestHandler):
    """A webhook endpoint, as Slack's would be: it keeps what it is sent."""

    received: ClassVar[list[dict]] = []

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        _Hook.received.append({"path": self.path, **json.loads(self.rfile.read(length) or b"{}")})
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture(scope="module")
def webhook():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook?token=hook-secret-7f3a"
    server.shutdown()


def _notified(about: str, timeout: float = 60) -> list[dict]:
    """The webhook's notifications whose text names ``about``, waited for."""
    deadline = time.monotonic() + timeout
    while not (found := [n for n in _Hook.received if about in n.get("text", "")]):
        assert time.monotonic() < deadline, f"no notification about {about!r}: {_Hook.received}"
        time.sleep(0.5)
    return found


def test_automations_are_created_with_a_webhook_whose_token_is_never_shown(ops, webhook):
    """`trainpipe up` created the silent-run automation and said how to add notifications; `trainpipe
    automations` with TRAINPIPE_NOTIFY_URL adds them. The URL's token is on no output, and the API shows it to
    no one who does not ask for secrets."""
    assert "automations: 'trainpipe: silent flow run is Crashed' (no notifications: set TRAINPIPE_NOTIFY_URL" in (
        ops.up_output
    )
    done = trainpipe("automations", env={**ops.env, "TRAINPIPE_NOTIFY_URL": webhook})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "'trainpipe: run failed or crashed', 'trainpipe: quiet fault', 'trainpipe: silent flow run is Crashed'" in (
        done.stdout
    )
    assert "notifications to the webhook in TRAINPIPE_NOTIFY_URL" in done.stdout
    for bad, said in (
        (["--silent-after", "60"], "--silent-after 60 is too short: give at least 90 seconds (three heartbeats"),
        (["--silent-after", "nan"], "--silent-after nan is too short"),
    ):
        refused = trainpipe("automations", *bad, env=ops.env)
        assert refused.returncode != 0 and said in refused.stderr and len(refused.stderr.splitlines()) == 1, refused
    refused = trainpipe("automations", env={**ops.env, "TRAINPIPE_NOTIFY_URL": "file:///etc/passwd"})
    assert refused.returncode != 0 and "TRAINPIPE_NOTIFY_URL is not an http(s) URL" in refused.stderr, refused
    assert "/etc/passwd" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    again = trainpipe("automations", env=ops.env)  # without the URL: the notifications stay as they are
    assert again.returncode == 0 and "(notifications to the webhook" in again.stdout, again.stdout
    with _client() as client:
        counts = {n: len(client.read_automations_by_name(n)) for n in _AUTOMATIONS}
        assert set(counts.values()) == {1}, counts  # replaced, never added again
        blocks = client.request("POST", "/block_documents/filter", json={}).text
    assert "trainpipe-notify" in blocks and "hook-secret-7f3a" not in blocks
    assert not [out for out in (done.stdout, done.stderr, again.stdout) if "hook-secret-7f3a" in out]


_AUTOMATIONS = ("trainpipe: run failed or crashed", "trainpipe: quiet fault", "trainpipe: silent flow run is Crashed")


def test_a_flow_run_that_stops_sending_heartbeats_is_marked_crashed(ops, served, webhook):
    """The silent-run automation, with a 10 s window (its least), against the server: a trainpipe flow run that sent a
    heartbeat (the event shape the flow engine sends, checked on a served run below) and then nothing is marked
    Crashed, which the failure notification then tells. Restored to 90 s after."""
    from prefect import flow
    from prefect.states import Running

    from trainpipe.flows.automations import ensure_automations

    @flow(name="trainpipe")
    def silent():  # only its name: the flow run is created through the API, as a runner would
        pass

    with _settings():
        ensure_automations(None, silent_after_s=10)
    try:
        with _client() as client:
            run = client.create_flow_run(silent, name="silent-run", state=Running())
            time.sleep(1)  # the proactive trigger's buckets start from events it has seen after it was created
            beat = {
                "id": str(uuid.uuid4()),
                "occurred": datetime.datetime.now(datetime.UTC).isoformat(),
                "event": "prefect.flow-run.heartbeat",
                "resource": {"prefect.resource.id": f"prefect.flow-run.{run.id}", "prefect.resource.name": run.name},
                "related": [{"prefect.resource.id": f"prefect.flow.{run.flow_id}", "prefect.resource.role": "flow",
                             "prefect.resource.name": "trainpipe"}],
            }  # fmt: skip
            assert client.request("POST", "/events", json=[beat]).status_code == 204
            deadline = time.monotonic() + 60
            while not (state := client.read_flow_run(run.id).state).is_crashed():
                assert time.monotonic() < deadline, state
                time.sleep(0.5)
        assert "no heartbeat for 10 s" in state.message and "resumes from its last commit" in state.message
        (told,) = _notified("silent-run")
        assert "ended Crashed: no heartbeat for 10 s" in told["text"] and f"/runs/flow-run/{run.id}" in told["text"]
    finally:
        with _settings():
            ensure_automations(None)


@contextlib.contextmanager
def _settings():
    """This process's Prefect client settings for the module's server."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: API[-1], PREFECT_API_AUTH_STRING: AUTH[-1]}):
        yield


def test_a_run_form_override_the_operator_did_not_allow_fails_the_run_in_one_line(ops, served, tmp_path):
    """The attack from the form: a store of the user's choice (where other runs' records could be read or
    overwritten). The flow run fails in its first second, saying why, and writes nothing there."""
    elsewhere = tmp_path / "elsewhere"
    run = _trigger("on-demand", _params("form-attack", [*TINY, f"store.root={elsewhere}"]), timeout=120)
    assert run.state.is_failed(), run.state
    assert "store.root cannot be set from the run form" in run.state.message and "\n" not in run.state.message
    assert not elsewhere.exists() and not (ops.home / "store" / "runs" / "form-attack").exists()


def test_a_run_triggered_through_the_api_completes_and_is_tracked(ops, served):
    """Named through Prefect's own flow-run name (the form's Run Name box): that is the trainpipe run's name."""
    params = {"params": {"overrides": [*TINY, "preflight.enabled=false"]}}
    run = _trigger("on-demand", params, timeout=300, flow_run_name="ui-run")
    assert run.state.is_completed(), run.state
    assert run.name == "ui-run" and {"profile:local", "world-size:2", "run:ui-run"} <= set(run.tags)
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with _client() as client:  # each stage's task run named after the run, never a path or a profile
        mine = FlowRunFilter(id=FlowRunFilterId(any_=[run.id]))
        names = {t.name for t in client.read_task_runs(flow_run_filter=mine)}
    assert {"train-ui-run", "validate-ui-run", "report-ui-run"} <= names, names
    with _mlflow(ops) as mlflow:
        found = mlflow.search_runs(
            [mlflow.get_experiment_by_name("trainpipe-local").experiment_id], "tags.`trainpipe.run_name` = 'ui-run'"
        )
        artifacts = {a.path for a in mlflow.list_artifacts(found[0].info.run_id)} if found else set()
    assert len(found) == 1 and found[0].info.status == "FINISHED"
    tags = found[0].data.tags
    assert tags["prefect.flow_run_id"] == str(run.id) and tags["prefect.deployment"] == "on-demand"
    assert tags["prefect.flow_run_name"] == "ui-run"
    assert f"({ops.prefect_api.removesuffix('/api')}/runs/flow-run/{run.id})" in tags["mlflow.note.content"]
    assert {"loss_curve.png", "summary.md", "profile.yaml"} <= artifacts
    assert found[0].info.artifact_uri.startswith(f"file://{ops.home}/mlartifacts")
    host = f"system/{socket.gethostname()}/cpu_utilization_percentage"  # MLflow's node_id: one series per host
    assert host in found[0].data.metrics, sorted(found[0].data.metrics)  # sampled while it trained
    with _mlflow(ops) as mlflow:
        cpu = [m.value for m in mlflow.get_metric_history(found[0].info.run_id, host)]
    assert cpu and cpu[0] > 0, cpu  # the first sample measures the CPU too (tests/test_tracking.py: the interval)
    with _client() as client:
        kinds = {a.key: a for a in client.read_artifacts() if a.flow_run_id == run.id}
    progress = kinds["training-progress"]  # ends with the final step's own loss (the log's last step line's)
    assert progress.data == 100.0 and re.fullmatch(r"step 8/8, loss \d+\.\d{4}", progress.description), progress
    assert kinds["mlflow-run"].type == "markdown" and ops.mlflow_url in kinds["mlflow-run"].data
    assert "/model-metrics?workflowType=machine_learning" in kinds["mlflow-run"].data  # the ML view's charts
    assert "Incidents (0)" in kinds["run-summary"].data


def test_a_prefect_run_name_that_names_an_existing_run_is_refused_in_one_line(ops, served):
    """Prefect fills its Run Name box with a random name: a repeat must not continue a stranger's run. Continuing
    one is asked for by name (Resume run)."""
    params = {"params": {"overrides": [*TINY, "preflight.enabled=false"]}}
    run = _trigger("on-demand", params, timeout=120, flow_run_name="ui-run")  # the run the test above trained
    assert run.state.is_failed(), run.state
    assert "run 'ui-run' already exists" in run.state.message and "Resume run" in run.state.message
    assert "\n" not in run.state.message


def _descendants(pid: int) -> list[psutil.Process]:
    """The live processes under ``pid`` (zombies and processes that exit while we look are not)."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    alive = []
    for p in children:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def _wait_for_commit(ops: Ops, run_name: str, timeout: float = 180) -> None:
    checkpoints = ops.home / "store" / "runs" / run_name / "checkpoints"
    deadline = time.monotonic() + timeout
    while not list(checkpoints.glob("step-*/trainpipe.json")):
        assert time.monotonic() < deadline, "no checkpoint was committed"
        time.sleep(0.5)


def _states_for(client, flow_run_id, seconds: float) -> list[str]:
    """The names of the states a flow run shows over ``seconds``, as the UI polls them (repeats dropped)."""
    names: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        name = client.read_flow_run(flow_run_id).state.name
        if not names or names[-1] != name:
            names.append(name)
        time.sleep(0.5)
    return names


def _of_flow_run(flow_run_id):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    return FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))


def _log_lines(client, flow_run_id, min_level: int) -> list[str]:
    """The flow run's log lines (its tasks' too) at ``min_level`` or above, as its page in the UI lists them."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterLevel

    found = client.read_logs(
        LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]), level=LogFilterLevel(ge_=min_level))
    )
    return [f"{log.level} {log.message[:200]}" for log in found]


def test_cancelling_a_flow_run_stops_every_process_and_releases_the_run(ops, served):
    """A person cancels a training run, while a second one waits its turn: every process stops, the run and its
    train task end Cancelled (at INFO), and the waiting one said all along that it waits for the slot."""
    from prefect.states import Cancelled, Cancelling

    # serve's own children, its forkserver (flows/warm_start.py) and that one's resource tracker, stay up; a flow run
    # is the forkserver's child, never serve's
    helpers = {p.pid for p in psutil.Process(served.pid).children()}
    run = _trigger("on-demand", _params("cancel-me", LONG), timeout=0)
    _wait_for_commit(ops, "cancel-me")
    assert any("trainer" in " ".join(p.cmdline()) for p in _descendants(served.pid)), "no rank is running"
    # A second on-demand run waits for the deployment's one slot, and says so: never "Late" while it waits.
    queued = _trigger("on-demand", _params("queued", LONG), timeout=0)
    with _client() as client:
        seen = _states_for(client, queued.id, seconds=6)
        client.set_flow_run_state(queued.id, Cancelled(), force=True)  # as the UI cancels a run not started
        client.set_flow_run_state(run.id, Cancelling(), force=True)
        deadline = time.monotonic() + 60
        while not (state := client.read_flow_run(run.id).state).is_final():
            assert time.monotonic() < deadline, state
            time.sleep(0.5)
        tasks = {t.name: t.state for t in client.read_task_runs(flow_run_filter=_of_flow_run(run.id))}
        errors = _log_lines(client, run.id, min_level=logging.ERROR)
    assert seen[-1] == "AwaitingConcurrencySlot" and "Late" not in seen, seen
    assert state.is_cancelled(), state
    # Cancelled everywhere, at INFO: the train task too, not Crashed by the stop's signal, and no ERROR line
    assert tasks["train-cancel-me"].is_cancelled(), tasks
    assert not errors, errors
    serve_log = (ops.home / "serve.log").read_text()
    assert "Finished in state Running()" not in serve_log, serve_log[-3000:]
    deadline = time.monotonic() + 10
    while (left := [p for p in _descendants(served.pid) if p.pid not in helpers]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, [p.cmdline()[:4] for p in left]

    incidents = json.loads((ops.home / "store" / "runs" / "cancel-me" / "incidents.json").read_text())
    assert [i["kind"] for i in incidents if i["fatal"]] == ["cancelled"], incidents  # and a straggler warning
    with _mlflow(ops) as mlflow:
        exp = mlflow.get_experiment_by_name("trainpipe-local").experiment_id
        (tracked,) = mlflow.search_runs([exp], "tags.`trainpipe.run_name` = 'cancel-me'")
    assert tracked.info.status == "KILLED"
    listed = trainpipe("ckpt", "list", "cancel-me", "--json", env=ops.env)
    checkpoints = json.loads(listed.stdout.splitlines()[-1])
    committed = [c for c in checkpoints if c["committed"]]  # a save the cancel cut short is listed, uncommitted
    assert listed.returncode == 0 and committed and all(c["valid"] for c in committed), checkpoints
    assert all("an interrupted save" in c["reason"] for c in checkpoints if not c["committed"]), checkpoints
    lease = ops.home / "store" / "runs" / "cancel-me" / "lease.json"
    assert not lease.exists()  # released: the same run name starts (and resumes: tests/test_pipeline.py) at once


def test_the_drills_fired_trainpipe_events_and_their_notifications(ops, served, webhook, tmp_path):
    """Each incident is a `trainpipe.incident.KIND` event of the run, related to its flow run: the straggler of
    the cancelled run above was notified as a quiet fault, the refused form run as a failed run; a served run's
    heartbeats have the shape the silent-run automation matches."""
    told = _notified("cancel-me")
    assert any(n["subject"] == "trainpipe: cancel-me" and "straggler on rank 1" in n["text"] for n in told), told
    assert not [n for n in told if "cancelled" in n["text"]]  # a person's cancel is not a fault
    failed = _notified("form-attack")
    assert any("ended Failed: " in n["text"] and "store.root cannot be set" in n["text"] for n in failed), failed
    with _client() as client:
        # the cancel's own event comes in the flow run's last moments, a few seconds before this test
        events = _events(client, "trainpipe.incident.", "trainpipe.run.cancel-me", until="trainpipe.incident.cancelled")
        (run,) = [r for r in _flow_runs_named("ui-run") if r.state.is_completed()]  # (a second was refused)
        beats = _events(client, "prefect.flow-run.heartbeat", f"prefect.flow-run.{run.id}")
        outcomes = _events(client, "trainpipe.attempt.", "trainpipe.run.ui-run")
    kinds = {e["event"]: e for e in events}
    assert "trainpipe.incident.straggler" in kinds, sorted(kinds)
    cancelled = kinds.get("trainpipe.incident.cancelled")  # the cancel's own, sent in the flow run's last moments
    assert cancelled and cancelled["resource"]["trainpipe.fatal"] == "true", sorted(kinds)
    assert cancelled["resource"]["trainpipe.quiet"] == "false", cancelled
    straggled = kinds["trainpipe.incident.straggler"]
    assert straggled["resource"]["trainpipe.quiet"] == "true" and straggled["payload"]["node"]
    assert any(r["prefect.resource.role"] == "flow-run" for r in straggled["related"]), straggled["related"]
    assert [e["event"] for e in outcomes] == ["trainpipe.attempt.succeeded"]
    # What reaches the team's channel is text: markup from outside (a forged host part's line) cannot ping it
    forged = {
        "id": str(uuid.uuid4()),
        "occurred": datetime.datetime.now(datetime.UTC).isoformat(),
        "event": "trainpipe.incident.straggler",
        "resource": {"prefect.resource.id": "trainpipe.run.forged", "prefect.resource.name": "forged",
                     "trainpipe.quiet": "true"},
        "payload": {"line": "straggler: <!channel> see <https://evil.example|the logs>", "node": "n" * 500},
    }  # fmt: skip
    with _client() as client:
        assert client.request("POST", "/events", json=[forged]).status_code == 204
    (told,) = _notified("trainpipe run forged")
    assert "&lt;!channel&gt; see &lt;https://evil.example|the logs&gt;" in told["text"], told
    assert "<!channel>" not in told["text"] and "n" * 301 not in told["text"], told
    if shutil.which("chromium"):  # the event as a person finds it in Prefect's event feed
        stored = base64.b64encode(ops.creds["prefect_auth_string"].encode()).decode()
        day = straggled["occurred"][:10]
        page_url = f"{ops.prefect_api.removesuffix('/api')}/events/event/{day}/{straggled['id']}"
        with _Browser(tmp_path / "chromium-event", local_storage={"prefect-password": stored}) as page:
            text = page.open(page_url, ["trainpipe.incident.straggler", "cancel-me"])
            _shot(page, tmp_path, "prefect-incident-event")
        assert "trainpipe.incident.straggler" in text and "cancel-me" in text, text[-2000:]
    assert beats and all(
        {"prefect.resource.role": "flow", "prefect.resource.name": "trainpipe"}.items() <= r.items()
        for r in beats[0]["related"]
        if r["prefect.resource.role"] == "flow"
    )


def _events(client, prefix: str, resource_id: str, until: str | None = None) -> list[dict]:
    """The server's events whose name starts with ``prefix``, of the resource ``resource_id``; with ``until``, once
    an event of that name is among them (at most 20 s): Prefect's server stores the events it accepted in batches,
    every 5 s (its event persister's ``flush_every``), so one sent a moment ago is not listed yet."""
    body = {"filter": {"event": {"prefix": [prefix]}, "resource": {"id": [resource_id]}}, "limit": 50}
    deadline = time.monotonic() + 20
    while True:
        events = client.request("POST", "/events/filter", json=body).json()["events"]
        if until is None or any(e["event"] == until for e in events) or time.monotonic() > deadline:
            return events
        time.sleep(0.5)


def test_compare_prints_the_differing_params_and_writes_a_png(ops, served, tmp_path):
    """The table to a person; with --json the JSON alone on stdout (``| jq`` reads it) and the table on stderr;
    a PNG only where one is asked for."""
    out = tmp_path / "compare.png"
    proc = trainpipe("compare", "ui-run", "cancel-me", "-o", str(out), "--json", env=ops.env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stderr.split("\n\nloss curves:")[0].splitlines()  # after any warning a library logged
    table = lines[next(i for i, line in enumerate(lines) if line.split()[:2] == ["run", "status"]) :]
    header = table[0].split()
    assert "train.steps" in header and "model.n_layer" not in header
    assert any("ui-run" in line for line in table) and any("cancel-me" in line for line in table)
    result = json.loads(proc.stdout)
    plain = trainpipe("compare", "ui-run", "cancel-me", env=ops.env)
    assert plain.returncode == 0 and plain.stdout.startswith(table[0]) and "-o FILE.png draws them" in plain.stdout
    assert not (ops.home / "compare.png").exists()  # none asked for, none written (it was the default)
    assert [r["run"] for r in result["runs"]] == ["ui-run", "cancel-me"]
    from PIL import Image

    with Image.open(out) as img:
        img.load()
        assert img.size == (800, 450)


# The run form's fields as the page shows them: label -> the value in its box.
FORM_FIELDS = """[...document.querySelectorAll('input, textarea, select')].map(box => {
  const label = box.closest('.p-label, label');
  return [label ? label.innerText.split('\\n')[0].replace(' (Optional)', '') : '', box.value];
})"""
# Types into the boxes the way a person does (the page's own input events), then turns the Preflight switch off.
FILL_FORM = """((values) => {
  const box = (label) => [...document.querySelectorAll('input, textarea')].find(
    b => ((b.closest('.p-label, label') || {}).innerText || '').split('\\n')[0].replace(' (Optional)', '') === label);
  for (const [label, value] of Object.entries(values)) {
    const b = box(label), proto = b.tagName === 'TEXTAREA' ? HTMLTextAreaElement : HTMLInputElement;
    Object.getOwnPropertyDescriptor(proto.prototype, 'value').set.call(b, value);
    for (const kind of ['input', 'change', 'blur']) b.dispatchEvent(new Event(kind, {bubbles: true}));
  }
  const preflight = [...document.querySelectorAll('.p-label')].find(l => l.innerText.startsWith('Preflight'));
  preflight.querySelector('[role=switch]').click();
  return true;
})(%s)"""
CLOSE_TOASTS = (
    "[...document.querySelectorAll('button')].filter(b => b.innerText.trim() === 'Close').forEach(b => b.click())"
    " || true"
)
VIEW_RUN = (
    "(b => (b ? (b.click(), true) : false))([...document.querySelectorAll('button')]"
    ".find(b => b.innerText.trim() === 'View run'))"
)
BODY_TEXT = "document.body ? document.body.innerText : ''"
SUBMIT = "[...document.querySelectorAll('button')].find(b => b.innerText.trim() === 'Submit').click() || true"
# The chart sections of an MLflow run page, in the order shown, and whether the first chart is on the first screen.
SECTIONS = r"[...document.body.innerText.matchAll(/\n([^\n]+)\n\((\d+)\)\nAdd chart/g)].map(m => m[1])"
FIRST_CHART_TOP = """(() => { const t = [...document.querySelectorAll('span, div')].find(e => e.innerText === 'train');
  return t ? t.getBoundingClientRect().top : 1e9; })()"""


@pytest.mark.skipif(not shutil.which("chromium"), reason="Debian chromium is not installed (apt-get install chromium)")
def test_a_person_runs_from_the_prefect_form_and_follows_the_link_to_the_loss_curves_in_mlflow(ops, served, tmp_path):
    """Headless Chromium, as a person uses the UIs. The Prefect UI asks for its auth string; given it (as its login
    page stores it), the on-demand run form shows typed boxes prefilled with the served profile's values. A run
    submitted with a name typed in Prefect's own Run Name box trains under that name; its MLflow link opens the
    Model training view on the run's charts, the loss curves first and on the first screen; MLflow opened without
    a link starts in Model training too. Screenshots are kept in the test's folder."""
    with _client() as client:
        dep = client.read_deployment_by_name("trainpipe/on-demand")
    form = f"{ops.prefect_api.removesuffix('/api')}/deployments/deployment/{dep.id}/run"
    login = _browse(form, tmp_path / "prefect-login.png", ["Login"])
    assert "Login" in login and "Learning rate" not in login, login[-2000:]

    stored = base64.b64encode(ops.creds["prefect_auth_string"].encode()).decode()
    with _Browser(tmp_path / "chromium-form", local_storage={"prefect-password": stored}) as page:
        text = page.open(form, ["Learning rate", "Other overrides"])
        fields = dict(page.evaluate(FORM_FIELDS))
        assert (fields["Steps"], fields["Learning rate"], fields["Global batch"]) == ("600", "0.003", "32"), fields
        assert 'Property is type "None"' not in text and "Allowed: 1 to 100,000,000." in text
        _shot(page, tmp_path, "prefect-form")
        typed = {"Run Name": "form-run", "Steps": "4", "Checkpoint every": "2"}
        # as a person does: type once the form has filled in its own values (the run name it generates among
        # them), then look at what the boxes say before pressing Submit
        page.wait_for(lambda: dict(page.evaluate(FORM_FIELDS)).get("Run Name"), "the form's generated run name")
        page.evaluate(FILL_FORM % json.dumps(typed))
        page.wait_for(lambda: typed.items() <= dict(page.evaluate(FORM_FIELDS)).items(), f"the boxes to show {typed}")
        _submit(page, ops, "form-run")
        _check_submitted("form-run", steps=4)
        # Prefect's UI returns to the deployment's page, whose runs list catches up on its own schedule (it can
        # show Scheduled for a while); the toast's "View run" opens the run's own page, which follows it live
        page.wait_for(lambda: page.evaluate(VIEW_RUN), "the toast's View run button")
        page.wait_for(lambda: "/runs/flow-run/" in page.evaluate("location.href"), "the flow run's page")
        live = ("Running", "Completed", "Pending")
        page.wait_for(lambda: any(s in page.evaluate(BODY_TEXT) for s in live), "the run's state on its page", 30)
        _shot(page, tmp_path, "prefect-flow-run")
        page.call("Page.navigate", url="about:blank")  # the run's page polls the server while it is open
        run = _finished_flow_run("form-run", timeout=240, log=ops.home / "serve.log")
    assert run.state.is_completed(), run.state
    with _client() as client:
        kinds = {a.key: a for a in client.read_artifacts() if a.flow_run_id == run.id}
    assert "# trainpipe run form-run" in kinds["run-summary"].data
    link = kinds["mlflow-run"].data.split("](", 1)[1].rstrip(")")

    user = base64.b64encode(f"{ops.creds['mlflow_username']}:{ops.creds['mlflow_password']}".encode()).decode()
    with _Browser(tmp_path / "chromium-mlflow", basic=user) as page:
        text = page.open(link, ["Model metrics", "Add chart"])
        time.sleep(2)  # the charts draw after their section headers
        sections, top = page.evaluate(SECTIONS), page.evaluate(FIRST_CHART_TOP)
        _shot(page, tmp_path, "mlflow-run")
        assert "Observability" not in text and "Model registry" in text, text[:500]  # not the GenAI view
        assert sections[:1] == ["loss"], sections
        assert top < page.evaluate("window.innerHeight"), top
        exp = link.split("#/experiments/", 1)[1].split("/", 1)[0]
        text = page.open(f"{ops.mlflow_url}/#/experiments/{exp}", ["form-run"], fresh=True)
        assert "workflowType=machine_learning" in page.evaluate("location.href"), page.evaluate("location.href")
        _shot(page, tmp_path, "mlflow-experiment")
        # the run's overview: a few summary tags, the params a person changes, the two ranked metrics
        overview = link.split("/model-metrics", 1)[0].split("?", 1)[0]
        text = page.open(overview, ["summary.validated_loss", "train.lr"], fresh=True)
        assert "summary.badput" not in text and "summary.incidents." not in text, text[-3000:]
        _shot(page, tmp_path, "mlflow-run-overview")
    for name in ("prefect-login", "prefect-form", "prefect-flow-run", "mlflow-run", "mlflow-experiment"):
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000


def _shot(page: _Browser, folder: Path, name: str) -> None:
    """A screenshot ``name``.png in ``folder``; with TRAINPIPE_SCREENSHOTS set, a copy there too (for a person)."""
    page.screenshot(folder / f"{name}.png")
    if keep := os.environ.get("TRAINPIPE_SCREENSHOTS"):
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(folder / f"{name}.png", Path(keep) / f"{name}.png")


def _submit(page: _Browser, ops: Ops, name: str) -> None:
    """Press the form's Submit and wait for the form to close. Prefect's UI answers a failed API call with an
    "Oops. Something went wrong." toast and keeps the form; a person presses Submit again. So does this, once, when
    no run of that name exists (the call may fail after the server made the run: then that run is the one); the
    Prefect server's error lines are printed, so a CI log keeps what the server said."""
    for attempt in (1, 2):
        page.evaluate(SUBMIT)
        deadline = time.monotonic() + 60
        while page.evaluate("location.href").endswith("/run"):
            text = page.evaluate("document.body ? document.body.innerText : ''")
            if "Something went wrong" in text:
                if _flow_runs_named(name):
                    return
                server_log = (ops.home / "servers" / "prefect.log").read_text(errors="replace").splitlines()
                print("Prefect's UI said 'Something went wrong' after Submit; its server logged:")
                print("\n".join(line for line in server_log[-400:] if "ERROR" in line or "Error" in line)[-4000:])
                if attempt == 1:
                    page.evaluate(CLOSE_TOASTS)
                    break
            assert time.monotonic() < deadline, f"waited 60 s for the form to close after Submit: {text[-1500:]}"
            time.sleep(0.5)
        else:
            return


def _check_submitted(name: str, steps: int) -> None:
    """The run the form made asks for the steps typed: a form that sent its prefilled values instead (seen once
    under load: the boxes showed 4, the run trained the profile's 600 for minutes) fails here, its run cancelled."""
    from prefect.states import Cancelled

    deadline = time.monotonic() + 30
    while not (runs := _flow_runs_named(name)):
        assert time.monotonic() < deadline, f"no flow run named {name} 30 s after Submit"
        time.sleep(0.5)
    asked = ((runs[0].parameters or {}).get("params") or {}).get("steps")
    if asked != steps:
        with _client() as client:
            client.set_flow_run_state(runs[0].id, Cancelled(), force=True)
        raise AssertionError(f"the form sent steps={asked}, not the {steps} its box showed: {runs[0].parameters}")


def _flow_runs_named(name: str) -> list:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with _client() as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))


def _finished_flow_run(name: str, timeout: float, log: Path | None = None):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    deadline = time.monotonic() + timeout
    while True:
        with _client() as client:
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
        if runs and runs[0].state is not None and runs[0].state.is_final():
            return runs[0]
        if time.monotonic() > deadline:
            with _client() as client:
                seen = [(r.name, r.state_name) for r in client.read_flow_runs(limit=20)]
            said = "\n".join(_read(log).splitlines()[-60:]) if log else ""
            raise AssertionError(
                f"flow run {name}: {runs[0].state if runs else 'never created'}; runs seen: {seen}\n{said}"
            )
        time.sleep(1)


def _browse(
    url: str, screenshot: Path, wait_for: list[str], basic: str | None = None, local_storage: dict | None = None
) -> str:
    """Open ``url`` in a fresh headless Chromium, wait for ``wait_for``, screenshot it and return its DOM."""
    with _Browser(screenshot.parent / f"chromium-{screenshot.stem}", basic, local_storage) as page:
        page.open(url, wait_for)
        page.screenshot(screenshot)
        return page.evaluate("document.documentElement.outerHTML")


class _Browser:
    """Headless Chromium driven through its DevTools protocol (the command line's --dump-dom cannot log in):
    ``local_storage`` is set before a page's own scripts run, ``basic`` goes in an Authorization header of every
    request."""

    def __init__(self, profile: Path, basic: str | None = None, local_storage: dict | None = None):
        self.profile, self.basic, self.local_storage = profile, basic, local_storage
        self.ids = iter(range(1, 1_000_000))

    def __enter__(self) -> _Browser:
        from websockets.sync.client import connect

        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"]
        flags += ["--disable-background-networking", "--disable-component-update", "--disable-sync"]
        self.tmp = tempfile.mkdtemp(prefix="tp-chromium-")
        self.proc = subprocess.Popen(
            # port 0: Chromium picks a free one and writes it to DevToolsActivePort in its profile
            [
                "chromium",
                *flags,
                "--remote-debugging-port=0",
                f"--user-data-dir={self.profile}",
                "--window-size=1280,1000",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            # its temporary folders (org.chromium.Chromium.*) in one removed below, not left in /tmp; a short path,
            # as the sockets Chromium makes there need
            env={**os.environ, "TMPDIR": self.tmp},
        )
        try:
            deadline = time.monotonic() + 60
            while len(lines := _read(self.profile / "DevToolsActivePort").splitlines()) < 2:
                assert self.proc.poll() is None and time.monotonic() < deadline, "Chromium did not start"
                time.sleep(0.2)
            with urllib.request.urlopen(f"http://127.0.0.1:{lines[0]}/json/list", timeout=30) as r:
                page = next(t for t in json.load(r) if t["type"] == "page")
            self.ws = connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=30)
            self.call("Page.enable")  # without it, the script below does not run in new documents
            if self.basic:
                self.call("Network.enable")
                self.call("Network.setExtraHTTPHeaders", headers={"Authorization": f"Basic {self.basic}"})
            if self.local_storage:
                script = "".join(
                    f"localStorage.setItem({json.dumps(k)}, {json.dumps(v)});" for k, v in self.local_storage.items()
                )
                self.call("Page.addScriptToEvaluateOnNewDocument", source=script)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def call(self, method: str, **params) -> dict:
        sent = next(self.ids)
        self.ws.send(json.dumps({"id": sent, "method": method, "params": params}))
        while (reply := json.loads(self.ws.recv(timeout=60))).get("id") != sent:
            pass  # an event
        assert "error" not in reply, (method, reply)
        return reply.get("result", {})

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value", "")

    def open(self, url: str, wait_for: list[str], fresh: bool = False) -> str:
        """The page's text once it shows each of ``wait_for`` (or after 60 s); ``fresh``: with the site's local
        storage cleared first, as a browser that never visited it."""
        if fresh:
            self.evaluate("localStorage.clear()")
            self.call("Page.navigate", url="about:blank")
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + 60
        while not all(w in (text := self.evaluate("document.body ? document.body.innerText : ''")) for w in wait_for):
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        time.sleep(1)  # what renders after the awaited text (fonts, icons) for the screenshot
        return text

    def wait_for(self, condition, what: str, timeout: float = 60) -> None:
        """Poll ``condition`` until it holds; otherwise fail naming ``what`` with the end of the page's text."""
        deadline = time.monotonic() + timeout
        while not condition():
            text = self.evaluate("document.body ? document.body.innerText : ''")
            assert time.monotonic() < deadline, f"waited {timeout:.0f} s for {what}; the page shows: {text[-1500:]}"
            time.sleep(0.5)

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


FLOW_RUN_STAND_IN = """
import signal, sys, time
from trainpipe.tasks.common import stop_with_parent

def flow_run(out):
    signal.signal(signal.SIGTERM, lambda *a: (open(out, "a").write("stopped"), sys.exit(0)))
    stop_with_parent(poll_s=0.2)
    open(out, "a").write("ready ")
    time.sleep(60)
"""


def test_a_flow_run_started_by_a_runner_stops_when_the_runner_dies(tmp_path):
    """`trainpipe serve` killed: the flow-run process it forked through its forkserver (flows/warm_start.py) stops
    (SIGTERM) instead of training on unseen. Its parent is the forkserver, which exits when serve does."""
    (tmp_path / "standin.py").write_text(FLOW_RUN_STAND_IN)
    out = tmp_path / "flow-run.out"
    code = (
        f"import multiprocessing, sys, time\nsys.path.insert(0, {str(tmp_path)!r})\nimport standin\n"
        "from trainpipe.flows.warm_start import install_warm_starter\ninstall_warm_starter()\n"
        f"multiprocessing.get_context('forkserver').Process(target=standin.flow_run, args=({str(out)!r},)).start()\n"
        "time.sleep(60)\n"
    )
    serve = subprocess.Popen([str(BIN / "python"), "-c", code], cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + 60
    while "ready" not in _read(out):
        assert serve.poll() is None and time.monotonic() < deadline, "the flow run never started"
        time.sleep(0.1)
    serve.kill()
    serve.wait()
    deadline = time.monotonic() + 5
    while "stopped" not in _read(out):
        assert time.monotonic() < deadline, "the orphaned flow-run process kept running"
        time.sleep(0.1)


def test_deploy_gives_a_work_pool_the_served_form_under_names_of_its_own_and_its_worker_runs_them(
    ops, served, tmp_path
):
    """`trainpipe deploy --pool` creates on-demand-worker and nightly-worker on a process work pool with the
    served deployments' run form (the schema the UI draws: types, prefilled values, bounds) and limits, under
    names of their own: the served ones stay served. A real `prefect worker` of the pool then runs one."""
    from prefect.client.schemas.actions import WorkPoolCreate

    env = {**ops.env, "PREFECT_API_URL": ops.prefect_api, "PREFECT_API_AUTH_STRING": AUTH[-1]}
    with _client() as client:  # what `prefect work-pool create trainpipe --type process` does, without a CLI start
        client.create_work_pool(WorkPoolCreate(name="trainpipe", type="process", concurrency_limit=1))
    deploy = trainpipe("deploy", "--pool", "trainpipe", env=ops.env)
    assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
    assert "deployed trainpipe/on-demand-worker and trainpipe/nightly-worker to work pool trainpipe" in deploy.stdout
    with _client() as client:
        on_demand = client.read_deployment_by_name("trainpipe/on-demand-worker")
        nightly = client.read_deployment_by_name("trainpipe/nightly-worker")
        served_form = client.read_deployment_by_name("trainpipe/on-demand").parameter_openapi_schema
        still_served = _deployments(ops)
    assert on_demand.work_pool_name == nightly.work_pool_name == "trainpipe"
    assert on_demand.parameter_openapi_schema == nightly.parameter_openapi_schema == served_form
    assert [s.schedule.cron for s in nightly.schedules] == ["0 2 * * *"]
    assert on_demand.global_concurrency_limit.limit == 1 and on_demand.enforce_parameter_schema
    assert on_demand.job_variables == {"env": {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"}}  # heartbeats, as served
    assert nightly.global_concurrency_limit.id == on_demand.global_concurrency_limit.id
    assert len(still_served) == 2 and all(d.work_pool_name != "trainpipe" and not d.paused for d in still_served)
    if shutil.which("chromium"):  # the form a person sees for the worker's deployment: typed, prefilled
        stored = base64.b64encode(ops.creds["prefect_auth_string"].encode()).decode()
        form = f"{ops.prefect_api.removesuffix('/api')}/deployments/deployment/{on_demand.id}/run"
        with _Browser(tmp_path / "chromium-worker", local_storage={"prefect-password": stored}) as page:
            text = page.open(form, ["Learning rate", "Other overrides"])
            fields = dict(page.evaluate(FORM_FIELDS))
            _shot(page, tmp_path, "prefect-worker-form")
        assert (fields["Steps"], fields["Learning rate"], fields["Global batch"]) == ("600", "0.003", "32"), fields
        assert 'Property is type "None"' not in text and "Allowed: 1 to 100,000,000." in text
    with open(ops.home / "worker.log", "w") as log:
        worker = subprocess.Popen(
            [str(BIN / "prefect"), "worker", "start", "--pool", "trainpipe"], env=env, cwd=ROOT, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            run = _trigger("on-demand-worker", _params("by-worker", [*TINY, "preflight.enabled=false"]), timeout=300)
        finally:
            os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:  # Prefect's worker once outlived SIGTERM by 60 s, idle: not ours
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
    assert run.state.is_completed(), (run.state, (ops.home / "worker.log").read_text()[-3000:])
    assert run.name == "by-worker" and run.work_pool_name == "trainpipe"


def test_a_stopped_serve_says_its_nightly_is_paused_and_a_new_serve_resumes_it(ops, served):
    """Last in this module: it stops the module's serve. Prefect pauses a served deployment when its process
    stops, and the nightly with it: serve says so as it stops, the work pool's nightly goes on, and the next
    serve resumes both."""
    os.killpg(served.pid, signal.SIGTERM)
    served.wait(60)
    text = (ops.home / "serve.log").read_text()
    assert "stopped serving: Prefect paused trainpipe/on-demand and trainpipe/nightly" in text, text[-2000:]
    names = ("on-demand", "nightly", "nightly-worker")

    def paused() -> dict[str, bool]:
        with _client() as client:
            return {n: client.read_deployment_by_name(f"trainpipe/{n}").paused for n in names}

    assert paused() == {"on-demand": True, "nightly": True, "nightly-worker": False}
    with open(ops.home / "serve-again.log", "w") as log:
        again = subprocess.Popen(
            [str(BIN / "trainpipe"), "serve"], env=ops.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 180
            while any(paused().values()):
                assert again.poll() is None and time.monotonic() < deadline, (ops.home / "serve-again.log").read_text()
                time.sleep(1)
        finally:
            os.killpg(again.pid, signal.SIGTERM)
            again.wait(60)


def test_store_up_serves_the_local_s3_profile_through_the_aws_chain_and_down_stops_it(home, cli, monkeypatch):
    import s3fs

    from trainpipe.trainer.data.shard import shard_dataset
    from trainpipe.trainer.orchestrate import servers
    from trainpipe.trainer.profile_files import load_profile

    env = {"TRAINPIPE_HOME": str(home)}
    up = subprocess.run(
        [str(BIN / "trainpipe"), "store", "up"], capture_output=True, text=True, env={**os.environ, **env}
    )
    state = servers.state_of("store")
    try:
        assert up.returncode == 0 and state is not None and state.healthy(), up.stderr
        export = up.stdout.strip().splitlines()[-1]
        aws = dict(kv.split("=", 1) for kv in export.removeprefix("export ").split())
        assert aws == {"AWS_ENDPOINT_URL_S3": state.url, **servers.STORE_CREDENTIALS}
        assert cli("store", "up")[1].strip().splitlines()[-1] == export  # already up: the same endpoint
        for key, value in aws.items():
            monkeypatch.setenv(key, value)
        s3fs.S3FileSystem.clear_instance_cache()  # an instance cached by an earlier test knows another endpoint
        profile = load_profile("local-s3", ["data.max_bytes=200000"])
        assert profile.store.storage_options == {}  # the endpoint and credentials come from the environment
        info = shard_dataset(profile.data, profile.store, block_size=profile.model.block_size)
        assert info.uri.startswith("s3://trainpipe/store/datasets/")
        assert s3fs.S3FileSystem(skip_instance_cache=True).exists(info.uri + "/manifest.json")
    finally:
        down = subprocess.run(
            [str(BIN / "trainpipe"), "store", "down"], capture_output=True, text=True, env={**os.environ, **env}
        )
        s3fs.S3FileSystem.clear_instance_cache()
    assert "stopped the local store" in down.stdout and not state.alive()
    assert cli("store", "down")[1].strip() == "no local store was running"
