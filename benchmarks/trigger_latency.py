"""How long a run triggered from the Prefect UI or API waits before it starts, against Prefect's own floor.

In one invocation, in a fresh TRAINPIPE_HOME: `trainpipe up` (not timed), then two runners against that server,
both polling every second as `trainpipe serve` does:
1. trainpipe: `trainpipe serve` (the on-demand deployment of the training pipeline);
2. baseline: Prefect's stock `serve()` of a flow that does nothing, from a module that imports nothing else.

Rounds alternate between the two. Each round creates a flow run of the deployment through the API (what the UI's
Run button does) and reads the time from the run's creation to its Pending state (the runner's poll found it) and
to its Running state (the flow-run process started), stamped by the server and the runner's processes. The
trainpipe run is given an override it refuses in one line right after it starts, so a round costs seconds, not a
training run. Printed: per-runner medians and worst, the ratio of trainpipe's median to the baseline's, and
trainpipe's median against the 2 s target of issue 26.

    .venv/bin/python benchmarks/trigger_latency.py [--rounds 8] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TARGET_S = 2.0

BARE_FLOW = """
from prefect import flow, serve

@flow(name="bare")
def bare() -> None:
    return None

if __name__ == "__main__":
    bare.serve(name="bare", limit=1)  # registers the flow object: no `python -m prefect.engine` per run
"""


class Timing(NamedTuple):
    running_s: float  # creation to Running: what a person waits
    picked_s: float  # creation to Pending: the runner's poll found it and is starting its process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_runner(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def wait_deployment(client, name: str, runner: subprocess.Popen, log: Path, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if runner.poll() is not None:
            raise SystemExit(f"the runner for {name} exited: {log.read_text()[-2000:]}")
        try:
            return client.read_deployment_by_name(name)
        except Exception:  # noqa: BLE001 - not registered yet
            time.sleep(0.5)
    raise SystemExit(f"{name} was never served: {log.read_text()[-2000:]}")


def one_round(client, deployment, parameters: dict) -> Timing:
    """Seconds from the flow run's creation to its Pending and Running states; waits for the run to end."""
    run = client.create_flow_run_from_deployment(deployment.id, parameters=parameters)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        current = client.read_flow_run(run.id)
        if current.state is not None and current.state.is_final():
            break
        time.sleep(0.2)
    else:
        raise SystemExit(f"flow run {run.id} did not end: {current.state}")
    states = client.read_flow_run_states(run.id)
    first = {t: min((s.timestamp for s in states if s.type.value == t), default=None) for t in ("PENDING", "RUNNING")}
    if first["RUNNING"] is None or first["PENDING"] is None:
        raise SystemExit(f"flow run {run.id} never ran: {current.state}")
    return Timing(
        (first["RUNNING"] - current.created).total_seconds(), (first["PENDING"] - current.created).total_seconds()
    )


def report(times: dict[str, list[Timing]]) -> None:
    rounds = len(times["trainpipe"])
    print(f"\ntrigger to Running, {rounds} interleaved rounds (server and runner timestamps)")
    medians = {name: statistics.median(t.running_s for t in values) for name, values in times.items()}
    for name, values in times.items():
        picked = statistics.median(t.picked_s for t in values)
        print(
            f"  {name:9s} median {medians[name]:.2f} s (poll {picked:.2f} s, then the process start), "
            f"worst {max(t.running_s for t in values):.2f} s"
        )
    print(f"  ratio trainpipe/baseline: {medians['trainpipe'] / medians['baseline']:.2f}")
    verdict = "meets" if medians["trainpipe"] <= TARGET_S else "misses"
    print(f"  trainpipe median {medians['trainpipe']:.2f} s {verdict} the {TARGET_S:.0f} s target")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--keep", action="store_true", help="keep the temporary TRAINPIPE_HOME")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="tp-trigger-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(TRAINPIPE_HOME=str(tmp / "home"), PREFECT_HOME=str(tmp / "prefect"), PREFECT_RUNNER_POLL_FREQUENCY="1")
    cli = [str(BIN / "trainpipe")]
    runners: list[subprocess.Popen] = []
    times: dict[str, list[Timing]] = {"trainpipe": [], "baseline": []}
    try:
        ports = ["--prefect-port", str(free_port()), "--mlflow-port", str(free_port())]
        up = subprocess.run([*cli, "up", *ports], capture_output=True, text=True, env=env, cwd=ROOT)
        if up.returncode:
            raise SystemExit(f"trainpipe up failed: {up.stderr[-2000:]}")
        servers = tmp / "home" / "servers"
        api = json.loads((servers / "prefect.json").read_text())["api"]
        auth = json.loads((servers / "credentials.json").read_text())["prefect_auth_string"]
        (tmp / "bare_flow.py").write_text(BARE_FLOW)
        runners.append(start_runner([*cli, "serve"], env, tmp / "serve.log"))
        bare_env = {**env, "PREFECT_API_URL": api, "PREFECT_API_AUTH_STRING": auth}
        runners.append(start_runner([sys.executable, str(tmp / "bare_flow.py")], bare_env, tmp / "bare.log"))

        os.environ.update(PREFECT_API_URL=api, PREFECT_API_AUTH_STRING=auth)  # read once, at prefect's import
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            trainpipe = wait_deployment(client, "trainpipe/on-demand", runners[0], tmp / "serve.log")
            bare = wait_deployment(client, "bare/bare", runners[1], tmp / "bare.log")
            refused = {"params": {"overrides": ["train.steps=-1"]}}  # refused right after the flow starts
            one_round(client, trainpipe, refused)  # warm both: a runner's first run pays one-off imports
            one_round(client, bare, {})
            for i in range(args.rounds):
                order = [("trainpipe", trainpipe, refused), ("baseline", bare, {})]
                for name, deployment, parameters in order if i % 2 == 0 else reversed(order):
                    times[name].append(one_round(client, deployment, parameters))
                print(
                    f"round {i + 1}: trainpipe {times['trainpipe'][-1].running_s:.2f} s, "
                    f"baseline {times['baseline'][-1].running_s:.2f} s",
                    flush=True,
                )
    finally:
        for runner in runners:
            if runner.poll() is None:
                os.killpg(runner.pid, signal.SIGINT)
                try:
                    runner.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(runner.pid, signal.SIGKILL)
        subprocess.run([*cli, "down"], capture_output=True, env=env, cwd=ROOT)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    report(times)


if __name__ == "__main__":
    main()
