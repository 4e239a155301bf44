"""The shard stage's engines, for real: `trainpipe shard` against the session's Prefect server, its pieces mapped
over Prefect's process pool and over a dask.distributed scheduler with its workers (flows/shard.py). Whatever runs
them, the dataset has the bytes of one process's build."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests import netns
from tests.conftest import BIN, SERVERS, free_port, prefect_api, prefect_client, run_cli
from tests.fault_proxy import FaultProxy
from tests.test_pipeline import last_json
from tests.test_shard_pieces import make_files, stored_files
from trainpipe.trainer.config import DataConfig, StoreConfig
from trainpipe.trainer.data.shard import shard_dataset
from trainpipe.trainer.data.sources import SETTLED_NS

pytestmark = pytest.mark.integration


def shard_args(store: Path, source: Path, *sets: str) -> list[str]:
    base = [f"store.root={store}", f"data.source={source}", "data.shard_tokens=4096", "data.max_bytes=null"]
    return ["shard", "--json", *[a for s in (*base, *sets) for a in ("--set", s)]]


def shard(home: Path, store: Path, source: Path, *sets: str) -> subprocess.CompletedProcess:
    return run_cli(*shard_args(store, source, *sets), env={"TRAINPIPE_HOME": str(home)}, timeout=300)


@contextlib.contextmanager
def dask_cluster(tmp: Path, workers: int, env: dict | None = None):
    """A dask.distributed scheduler and ``workers`` workers (one process, one thread each), each in a session of
    its own, so that one may be killed whole (its nanny with it)."""
    port = free_port()
    log = open(tmp / "dask.log", "ab")  # noqa: SIM115 - open while the cluster runs
    env = {**os.environ, **(env or {})}
    common = {"stdout": log, "stderr": subprocess.STDOUT, "start_new_session": True, "env": env}
    address = f"tcp://127.0.0.1:{port}"
    scheduler = [str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"]
    worker = [str(BIN / "dask"), "worker", address, "--nthreads", "1", "--nworkers", "1", "--no-dashboard"]
    procs = [subprocess.Popen(scheduler, **common)]
    procs += [subprocess.Popen([*worker, "--local-directory", str(tmp)], **common) for _ in range(workers)]
    SERVERS.update(p.pid for p in procs)
    try:
        from distributed import Client

        with Client(address, timeout=60) as client:
            client.wait_for_workers(workers, timeout=60)
        yield address, procs
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        log.close()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """About 1.5 MB of text files and the dataset one process makes of it, in pieces of 0.1 MB."""
    tmp = tmp_path_factory.mktemp("engines")
    make_files(tmp / "src", 600, seed=4, lo=1000, hi=4000)
    data = DataConfig(source=str(tmp / "src"), shard_tokens=4096, piece_mb=0.1, max_bytes=None)
    reference = shard_dataset(data, StoreConfig(root=str(tmp / "reference")))
    assert reference.work.pieces >= 10
    # Settled: files written longer ago than this are known by their stat to the find pass's hash cache.
    time.sleep(max(0.0, SETTLED_NS / 1e9 - (time.time() - (tmp / "src").stat().st_mtime)))
    return tmp, reference


def same_dataset(out: subprocess.CompletedProcess, reference) -> dict:
    assert out.returncode == 0, out.stderr[-3000:]
    got = last_json(out.stdout)
    assert got["dataset_id"] == reference.dataset_id and not got["cache_hit"]
    from trainpipe.trainer.data.format import load_manifest
    from trainpipe.trainer.data.shard import DatasetInfo

    info = DatasetInfo(got["dataset_id"], got["uri"], load_manifest(got["uri"]), False)
    assert info.manifest == reference.manifest and stored_files(info) == stored_files(reference)
    return got


def test_the_process_pool_makes_the_bytes_of_one_process_and_shows_each_piece(corpus, tmp_path):
    tmp, reference = corpus
    out = shard(tmp_path / "home", tmp_path / "store", tmp / "src", "data.piece_mb=0.1", "data.workers=2")
    got = same_dataset(out, reference)
    assert got["work"]["pieces"] == reference.work.pieces and got["work"]["reused"] == 0
    # The Prefect UI lists each piece as a task run of the flow run, and the progress artifact ends at 100%.
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with prefect_client(prefect_api()) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_="shard-")), limit=50)
        names = set()
        for run in runs:
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [run.id]}))
            if any(t.name == "plan-shards" for t in tasks):
                names = {t.name for t in tasks if t.state and t.state.is_completed()}
                if names >= {f"piece-{i}" for i in range(reference.work.pieces)}:
                    break
        assert {f"piece-{i}" for i in range(reference.work.pieces)} <= names
        assert {"plan-shards", "find-pieces", "assemble-dataset"} <= names
    # Run again: every piece is found in the store before any worker process starts, and nothing is tokenized.
    again = shard(tmp_path / "home", tmp_path / "store", tmp / "src", "data.piece_mb=0.1")
    assert again.returncode == 0, again.stderr[-2000:]
    work = last_json(again.stdout)["work"]
    assert last_json(again.stdout)["cache_hit"] and work["reused"] == work["pieces"] and work["tokenized_bytes"] == 0
    # ... and no file was read to find them: the first run left their hashes in TRAINPIPE_HOME, by their stat.
    assert "600 unchanged file(s)/range(s) known by their stat" in again.stdout + again.stderr


def shard_and_kill(
    tmp_path: Path, source: Path, address: str, worker: subprocess.Popen, *overrides: str
) -> subprocess.Popen:
    """`trainpipe shard` on the Dask cluster at ``address`` into ``tmp_path/store``, started; ``worker`` (with its
    nanny) SIGKILLed once the first piece is stored."""
    store = tmp_path / "store"
    cli = subprocess.Popen(
        [str(BIN / "trainpipe"), *shard_args(store, source, "data.piece_mb=0.1", f"data.engine={address}", *overrides)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PREFECT_API_URL": prefect_api(), "TRAINPIPE_HOME": str(tmp_path / "home")},
    )
    deadline = time.monotonic() + 120
    while not list(store.glob("datasets/pieces/*/piece.json")) and time.monotonic() < deadline:
        assert cli.poll() is None, cli.communicate()
        time.sleep(0.02)
    os.killpg(worker.pid, signal.SIGKILL)
    return cli


def test_dask_workers_make_the_same_bytes_and_a_killed_worker_s_pieces_are_redone(corpus, tmp_path):
    """Two workers; one is killed (its nanny with it) once the first piece is stored: its pieces run on the
    other, and the dataset is still the one-process build's."""
    tmp, reference = corpus
    store = tmp_path / "store"
    with dask_cluster(tmp_path, 2) as (address, procs):
        cli = shard_and_kill(tmp_path, tmp / "src", address, procs[1])
        stored_at_kill = len(list(store.glob("datasets/pieces/*/piece.json")))
        stdout, stderr = cli.communicate(timeout=240)
    done = subprocess.CompletedProcess(cli.args, cli.returncode, stdout, stderr)
    got = same_dataset(done, reference)
    assert got["work"]["pieces"] == reference.work.pieces and stored_at_kill < reference.work.pieces / 2
    assert "Remove worker addr" in (tmp_path / "dask.log").read_text()  # the scheduler saw it go


def test_a_cluster_whose_last_worker_dies_for_good_is_one_line_not_a_wait_without_end(corpus, tmp_path):
    tmp, _ = corpus
    store = tmp_path / "store"
    with dask_cluster(tmp_path, 1) as (address, procs):
        # The operator's wait, shorter than its default of 30 s.
        cli = shard_and_kill(tmp_path, tmp / "src", address, procs[1], "data.engine_no_worker_s=4")
        killed = time.monotonic()
        _, stderr = cli.communicate(timeout=180)
    assert cli.returncode != 0 and 4 <= time.monotonic() - killed < 90
    last = stderr.strip().splitlines()[-1]
    assert f"data.engine {address}: no Dask worker for 4 s with " in last, stderr[-2000:]
    assert f"pieces left; start workers (`dask worker {address}`)" in last
    assert not list(store.rglob("manifest.json"))  # nothing partial published; the pieces done are kept
    assert list(store.glob("datasets/pieces/*/piece.json"))


def test_an_engine_that_does_not_answer_is_one_line(corpus, tmp_path):
    tmp, _ = corpus
    address = f"tcp://127.0.0.1:{free_port()}"
    overrides = (f"data.engine={address}", "data.engine_connect_s=1.5")
    out = shard(tmp_path / "home", tmp_path / "store", tmp / "src", *overrides)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert f"data.engine {address}: no Dask scheduler answered within 1.5 s" in last, out.stderr[-2000:]
    assert not list((tmp_path / "store").rglob("manifest.json"))


def test_the_engine_is_the_operator_s_never_a_run_form_s(home):
    from trainpipe.trainer.errors import ProfileError
    from trainpipe.trainer.orchestrate.run_form import check_form_overrides
    from trainpipe.trainer.profile_files import load_profile

    prof = load_profile("local", [f"deploy.overridable={json.dumps(['data.*'])}"])
    check_form_overrides(prof, ["data.piece_mb=1"])
    with pytest.raises(ProfileError, match=r"data\.engine cannot be set from the run form"):
        check_form_overrides(prof, ["data.engine=tcp://attacker.example:8786"])
    # Nor how long its stage waits on the operator's cluster.
    for key in ("data.engine_connect_s", "data.engine_no_worker_s"):
        with pytest.raises(ProfileError, match=re.escape(f"{key} cannot be set from the run form")):
            check_form_overrides(prof, [f"{key}=86400"])


def test_dask_workers_on_two_hosts_make_the_bytes_of_one_process(corpus, tmp_path):
    """A scheduler on this machine and one worker on each of two network-namespace hosts: the workers read the
    source and write the store themselves (the hosts share the file system, as a bucket), report their task
    runs to the Prefect API over the bridge, and make the one-process build's bytes."""
    tmp, reference = corpus
    here, port = "10.237.0.254", free_port()
    prefect_port = int(prefect_api().rsplit(":", 1)[1].split("/")[0])
    logs = [tmp_path / f"worker-{i}.log" for i in range(2)]
    with netns.hosts(2, "10.237.0", reach_from_here=True) as hosts, FaultProxy(prefect_port, listen_host=here) as api:
        scheduler = [str(BIN / "dask"), "scheduler", "--host", here, "--port", str(port), "--no-dashboard"]
        procs = [subprocess.Popen(scheduler, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
        env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), "TOKENIZERS_PARALLELISM": "false"}
        for host, log in zip(hosts, logs, strict=True):
            worker = [str(BIN / "dask"), "worker", f"tcp://{here}:{port}", "--host", host.address, "--nthreads", "1"]
            worker += ["--nworkers", "1", "--no-dashboard", "--local-directory", str(tmp_path)]
            with log.open("wb") as out:
                procs.append(subprocess.Popen(host.command(worker, env), stdout=out, stderr=subprocess.STDOUT))
        SERVERS.update(p.pid for p in procs)
        try:
            from distributed import Client

            with Client(f"tcp://{here}:{port}", timeout=60) as client:
                client.wait_for_workers(2, timeout=60)
                hosts_seen = {w["host"] for w in client.scheduler_info()["workers"].values()}
            assert hosts_seen == {h.address for h in hosts}
            sets = ["data.piece_mb=0.1", f"data.engine=tcp://{here}:{port}"]
            out = subprocess.run(
                [str(BIN / "trainpipe"), *shard_args(tmp_path / "store", tmp / "src", *sets)],
                capture_output=True,
                text=True,
                timeout=300,
                env={**os.environ, "PREFECT_API_URL": f"{api.url}/api", "TRAINPIPE_HOME": str(tmp_path / "home")},
            )
        finally:
            for p in procs:
                p.kill()
                p.wait()
    same_dataset(out, reference)
    for log in logs:  # both hosts tokenized pieces
        assert "Task run 'piece-" in log.read_text(), log.read_text()[-2000:]
