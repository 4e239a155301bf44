"""A cluster job outliving its orchestrator is found and stopped before a resume starts a second writer.

The run's lease covers orchestrators, not jobs: a SIGKILLed orchestrator leaves its Slurm job or TrainJob running
until train.timeout_s. So each cluster job is recorded in ``{store}/runs/{run}/jobs.json`` while it may run, and
``stop_left_jobs`` (before each attempt, and at a takeover) stops the recorded jobs of the run that still run. The
records come from the store, which others can write: one that names anything but a job (a Slurm job id of digits, a
TrainJob by namespace and name, DNS labels) stops the run before any command runs, and a job is stopped only when
the cluster says it is this run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests import kube_api, netns, slurm_cluster
from tests.conftest import ROOT, TINY
from trainpipe.trainer.errors import LaunchError, StoreError
from trainpipe.trainer.launch import jobs, kubernetes, launch_attempt, slurm
from trainpipe.trainer.launch.jobs import LiveJob, recorded, stop_left_jobs
from trainpipe.trainer.profile_files import load_profile
from trainpipe.trainer.store_paths import store_tag

SLURM = ["tracking.enabled=false", "launcher.kind=slurm", "launcher.poll_s=0.3", "preflight.enabled=false"]
K8S = ["tracking.enabled=false", "launcher.kind=kubernetes", "launcher.kubernetes.image=registry.example/trainpipe:1"]
K8S += ["launcher.poll_s=0.3", "preflight.enabled=false"]


def plant(home: Path, run: str, records: object) -> Path:
    path = home / "store" / "runs" / run / "jobs.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records))
    return path


def slurm_record(job_id: object = "4242", attempt: int = 2, **fields) -> dict:
    return {"launcher": "slurm", "job_id": job_id, "attempt": attempt, "host": "orch-1", "pid": 77, **fields}


def kube_record(namespace: object = "team-a", name: object = "tp-r1-a1-ab12", **fields) -> dict:
    return {"launcher": "kubernetes", "namespace": namespace, "name": name, "attempt": 1, "host": "orch-1", **fields}


# ---------------------------------------------------------------- fake Slurm tools: every call logged, no shell

FAKE_TOOL = """#!{python}
import json, os, sys
state = os.environ["FAKE_SLURM"]
tool = os.path.basename(sys.argv[0])
with open(os.path.join(state, "calls.jsonl"), "a") as log:
    log.write(json.dumps([tool, *sys.argv[1:]]) + "\\n")
if os.path.exists(os.path.join(state, "down")):
    sys.exit("squeue: error: Unable to contact slurm controller (connect failure)")
if tool == "squeue":
    job = sys.argv[sys.argv.index("-j") + 1]
    path = os.path.join(state, "job-" + job)
    if not os.path.exists(path):
        sys.exit("slurm_load_jobs error: Invalid job id specified")
    status, name = open(path).read().split("|")
    print(status if sys.argv[-1] == "%T" else status + "|" + name)
elif tool == "sbatch":  # the job named as its script names it, queued as 4242
    name = next(line for line in open(sys.argv[-1]) if "--job-name=" in line).split("=", 1)[1].strip()
    open(os.path.join(state, "job-4242"), "w").write("RUNNING|" + name)
    print("4242")
elif tool == "scancel":
    path = os.path.join(state, "job-" + sys.argv[1])
    if os.path.exists(path) and not os.path.exists(path + ".stuck"):
        os.unlink(path)
"""


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """sbatch, squeue and scancel on PATH, answering from files: ``job-{id}`` holds 'STATE|NAME' while queued."""
    state, tools = tmp_path / "fake-slurm", tmp_path / "fake-bin"
    state.mkdir()
    tools.mkdir()
    for tool in ("sbatch", "squeue", "scancel"):
        (tools / tool).write_text(FAKE_TOOL.format(python=sys.executable))
        (tools / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM", str(state))

    class Fake:
        def queue(self, job_id: str, name: str, status: str = "RUNNING", stuck: bool = False) -> None:
            (state / f"job-{job_id}").write_text(f"{status}|{name}")
            if stuck:
                (state / f"job-{job_id}.stuck").write_text("")

        def queued(self, job_id: str) -> bool:
            return (state / f"job-{job_id}").exists()

        def calls(self) -> list[list[str]]:
            log = state / "calls.jsonl"
            return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

        def down(self) -> None:
            (state / "down").write_text("")

    return Fake()


@pytest.mark.parametrize(
    "records",
    [
        [slurm_record("1; touch {pwned} #")],  # a shell's command separator
        [slurm_record("4242\ntouch {pwned}")],  # a second line
        [slurm_record("$(touch {pwned})")],
        [slurm_record("-1")],  # an option, not a job
        [slurm_record("--me")],
        [slurm_record(4242)],  # a number, not the text sbatch printed
        [slurm_record("4242", namespace="default")],  # a Slurm job with a Kubernetes name
        [kube_record(name="Not_A_Label")],
        [kube_record(name="tp-x/../../secrets/y")],  # a path in the API's URL
        [kube_record(namespace="kube system")],
        [kube_record(name="a" * 64)],
        [kube_record(namespace=None)],
        [slurm_record(), {**slurm_record("4243"), "script": "touch {pwned}"}],  # an unknown field, beside a good one
        [slurm_record(owner="flow\nERROR: forged line")],
        [slurm_record(attempt=0)],
        {"launcher": "slurm", "job_id": "4242"},  # not a list
        "not json",
    ],
)
def test_a_planted_job_record_stops_the_run_in_one_line_before_any_command_runs(
    home, tiny_profile, fake_slurm, tmp_path, records
):
    pwned = tmp_path / "pwned"
    body = json.loads(json.dumps(records).replace("{pwned}", str(pwned)))
    path = plant(home, "r1", body) if records != "not json" else plant(home, "r1", None)
    if records == "not json":
        path.write_text("[{not json")
    prof = tiny_profile(*SLURM)
    with pytest.raises(StoreError) as caught:
        stop_left_jobs(prof, "r1")
    message = str(caught.value)
    assert "\n" not in message and "jobs.json is not a list of job records" in message, message
    assert "move it aside" in message, message
    assert fake_slurm.calls() == [] and not pwned.exists()
    assert path.exists()  # kept for a person to look at: it may name a job that runs


def test_job_records_hold_what_the_launchers_write():
    good = [LiveJob.model_validate(slurm_record()), LiveJob.model_validate(kube_record())]
    assert [j.line() for j in good] == ["slurm job 4242 (attempt 2)", "TrainJob team-a/tp-r1-a1-ab12 (attempt 1)"]
    assert (
        kubernetes.job_name("a" * 80, 12, "ab12")
        == LiveJob.model_validate(kube_record(name=kubernetes.job_name("a" * 80, 12, "ab12"))).name
    )  # the longest run name still makes a valid record


def test_a_slurm_job_its_orchestrator_left_running_is_cancelled_and_said(home, tiny_profile, fake_slurm):
    prof = tiny_profile(*SLURM)
    assert stop_left_jobs(prof, "r1") == ([], [])  # no records: nothing to do, nothing called
    assert fake_slurm.calls() == []
    fake_slurm.queue("4242", slurm.job_name("r1", 2, prof.store.root))
    path = plant(home, "r1", [slurm_record(owner="flow-dead")])
    fence = stop_left_jobs(prof, "r1")
    assert not fake_slurm.queued("4242") and ["scancel", "4242"] in fake_slurm.calls()
    (incident,) = fence.stopped
    assert incident.kind == "takeover" and not incident.fatal, incident
    assert "cancelled slurm job 4242 (attempt 2, RUNNING)" in incident.detail, incident.detail
    assert "pid 77 on orch-1, owner flow-dead" in incident.detail and "\n" not in incident.detail
    assert fence.left_alone == [] and json.loads(path.read_text()) == []  # dealt with, forgotten


def test_a_recorded_id_of_another_runs_job_is_left_alone(home, tiny_profile, fake_slurm):
    """A planted (or stale: Slurm reuses ids) record naming a job that is not this run's: never cancelled."""
    prof = tiny_profile(*SLURM)
    extra = slurm.job_name("r1-extra", 2, prof.store.root)  # run r1-extra's attempt 2; a prefix of this one's name
    fake_slurm.queue("4242", extra)
    fake_slurm.queue("4343", "someone-elses-job")
    fake_slurm.queue("4444", slurm.job_name("r1", 2, "s3://another-teams-bucket/store"))  # r1 of another store
    records = [slurm_record("4242"), slurm_record("4343", attempt=1), slurm_record("4444")]
    path = plant(home, "r1", records)
    fence = stop_left_jobs(prof, "r1")
    assert fence.stopped == [] and len(fence.left_alone) == 3
    assert "slurm job 4242 recorded in run r1's jobs is not one of its jobs" in fence.left_alone[0]
    assert f"named {extra!r}" in fence.left_alone[0] and "left alone" in fence.left_alone[0]
    assert not any(call[0] == "scancel" for call in fake_slurm.calls())
    assert all(fake_slurm.queued(i) for i in ("4242", "4343", "4444")) and json.loads(path.read_text()) == []


def test_a_recorded_job_that_ended_is_forgotten_quietly(home, tiny_profile, fake_slurm):
    prof = tiny_profile(*SLURM)
    path = plant(home, "r1", [slurm_record("4242")])  # not in the queue any more
    assert stop_left_jobs(prof, "r1") == ([], [])
    assert [call[0] for call in fake_slurm.calls()] == ["squeue"] and json.loads(path.read_text()) == []


def test_a_job_that_cannot_be_stopped_or_seen_stops_the_run_in_one_line_and_stays_recorded(
    home, tiny_profile, fake_slurm, monkeypatch
):
    prof = tiny_profile(*SLURM)
    monkeypatch.setattr(slurm, "STOP_WAIT_S", 0.5)
    fake_slurm.queue("4242", slurm.job_name("r1", 2, prof.store.root), stuck=True)
    path = plant(home, "r1", [slurm_record("4242")])
    with pytest.raises(
        LaunchError, match=r"^slurm job 4242 of run r1 \(attempt 2\) is still queued .*\(scancel 4242\)"
    ):
        stop_left_jobs(prof, "r1")
    assert len(json.loads(path.read_text())) == 1  # the next start tries again
    fake_slurm.down()
    with pytest.raises(LaunchError, match="squeue could not say whether slurm job 4242 runs") as caught:
        stop_left_jobs(prof, "r1")
    assert "\n" not in str(caught.value) and len(json.loads(path.read_text())) == 1


def test_a_slurm_job_is_recorded_while_it_is_followed_and_forgotten_once_cancelled(home, fake_slurm):
    from trainpipe.trainer.errors import RunCancelled

    prof = load_profile("local", [*TINY, *SLURM])
    seen: list[list[LiveJob]] = []

    def cancel(progress: dict) -> None:
        seen.append(recorded(prof.store, "r1"))
        raise RunCancelled("cancelled from the UI")

    with pytest.raises(RunCancelled):
        launch_attempt(prof, "r1", "file:///d", attempt=2, on_progress=cancel)
    (job,) = seen[0]
    assert (job.launcher, job.job_id, job.attempt, job.pid) == ("slurm", "4242", 2, os.getpid())
    assert not fake_slurm.queued("4242") and recorded(prof.store, "r1") == []


def test_the_slurm_job_name_that_confirms_a_job_is_the_one_its_script_sets(home, tmp_path):
    prof = load_profile("local", [*TINY, *SLURM])
    script = slurm.sbatch_script(prof, "r1", 2, tmp_path)
    assert f"#SBATCH --job-name={slurm.job_name('r1', 2, prof.store.root)}\n" in script


# ---------------------------------------------------------------- Kubernetes: the scripted API server


@pytest.fixture
def kube(home, tmp_path, monkeypatch):
    cluster = kube_api.KubeCluster([netns.Host("none", "none", "10.0.0.1", "host0")], tmp_path)
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path / "kubeconfig")))
    try:
        yield cluster
    finally:
        cluster.close()


def running_train_job(kube, namespace: str, name: str, run: str | None, store: str | None = None) -> None:
    """A TrainJob as the cluster holds it (its pods are left out: nothing runs here); ``store``: its run's store
    root (default: this test's)."""
    meta = {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/managed-by": "trainpipe"}}
    if run is not None:
        root = store or load_profile("local").store.root
        meta["annotations"] = {kubernetes.RUN_ANNOTATION: run, kubernetes.STORE_ANNOTATION: store_tag(root)}
    kube.jobs[(namespace, name)] = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": meta}
    kube.jobs[(namespace, name)]["status"] = {"conditions": []}
    kube.pods[(namespace, name)] = []


def test_a_train_job_its_orchestrator_left_running_is_deleted_and_another_runs_is_left_alone(home, kube):
    prof = load_profile("local", [*TINY, *K8S, "launcher.kubernetes.namespace=team-a"])
    running_train_job(kube, "team-a", "tp-r1-a1-ab12", "r1")
    running_train_job(kube, "team-b", "tp-theirs-a1-cd34", "r1")  # another team's namespace, named by a planted record
    running_train_job(kube, "team-a", "tp-plain-a1-ef56", None)  # not made by trainpipe
    running_train_job(kube, "team-a", "tp-r1-a1-0b0b", "r1", "s3://another-store")  # run r1 of another store
    records = [kube_record(), kube_record("team-b", "tp-theirs-a1-cd34"), kube_record("team-a", "tp-plain-a1-ef56")]
    records += [kube_record("team-a", "tp-r1-a1-0b0b")]
    path = plant(home, "r1", [*records, kube_record("team-a", "tp-r1-a1-gone")])
    fence = stop_left_jobs(prof, "r1")
    assert ("team-a", "tp-r1-a1-ab12") not in kube.jobs  # deleted, and waited for
    assert {("team-b", "tp-theirs-a1-cd34"), ("team-a", "tp-plain-a1-ef56")} <= set(kube.jobs)
    (incident,) = fence.stopped
    assert "deleted TrainJob team-a/tp-r1-a1-ab12 (attempt 1), left running by its orchestrator" in incident.detail
    assert fence.left_alone == [
        "TrainJob team-b/tp-theirs-a1-cd34 recorded in run r1's jobs is not in launcher.kubernetes.namespace: "
        "left alone",
        "TrainJob team-a/tp-plain-a1-ef56 recorded in run r1's jobs is not one of its jobs: left alone",
        "TrainJob team-a/tp-r1-a1-0b0b recorded in run r1's jobs is not one of its jobs: left alone",
    ]
    deletes = [(p, b) for m, p, b in kube.bodies if m == "DELETE" and "/trainjobs/" in p]
    assert [p.rsplit("/", 1)[-1] for p, _ in deletes] == ["tp-r1-a1-ab12"] and deletes[0][1]["propagationPolicy"]
    assert json.loads(path.read_text()) == []


def test_a_train_job_is_recorded_before_it_is_created_and_forgotten_once_deleted(home, kube, monkeypatch):
    """The attempt's TrainJob carries its run, and the run's records name it from before its creation until it
    is gone (here: a pod that cannot start ends the attempt)."""
    prof = load_profile("local", [*TINY, *K8S, "launcher.kubernetes.image=unpullable/trainpipe:typo"])
    seen: list[list[LiveJob]] = []
    real_create = kubernetes.KubeJob.create

    def create(self, manifest, values):
        seen.append(recorded(prof.store, "typo"))
        tag = store_tag(prof.store.root)
        assert manifest["metadata"]["annotations"] == {
            kubernetes.RUN_ANNOTATION: "typo",
            kubernetes.STORE_ANNOTATION: tag,
        }
        return real_create(self, manifest, values)

    monkeypatch.setattr(kubernetes.KubeJob, "create", create)
    with pytest.raises(LaunchError, match="cannot start: ErrImagePull"):
        launch_attempt(prof, "typo", "file:///d")
    (job,) = seen[0]
    assert (job.launcher, job.namespace, job.attempt, job.pid) == ("kubernetes", "default", 1, os.getpid())
    assert job.name.startswith("tp-typo-a1-") and not kube.jobs
    assert recorded(prof.store, "typo") == []


def test_a_job_record_that_cannot_be_written_leaves_no_job_behind(home, kube, monkeypatch):
    prof = load_profile("local", [*TINY, *K8S])

    def store_away(*args, **kwargs):
        raise StoreError("the store is away")

    monkeypatch.setattr(jobs, "_write", store_away)
    with pytest.raises(StoreError, match="the store is away"):
        launch_attempt(prof, "away", "file:///d")
    assert not kube.jobs and not kube.secrets
    assert not [p for m, p in kube.requests if m == "POST" and p.endswith("/trainjobs")]  # never created


# ---------------------------------------------------------------- end to end on a real one-node Slurm cluster

WHY_NOT = slurm_cluster.available()

ORCHESTRATOR = textwrap.dedent(
    """
    import json, sys
    from trainpipe.trainer.profile_files import load_profile
    from trainpipe.trainer.launch import launch_attempt
    launch_attempt(load_profile("local", json.loads(sys.argv[1])), "orphan", sys.argv[2], attempt=3)
    """
)


def training_step(prof, run: str) -> int:
    """The step node 0 last saw any rank of the run's Slurm job at (0 before training)."""
    for path in Path(prof.launcher.shared_dir, run).glob("attempt-*/progress.json"):
        try:
            return max((p.get("step", 0) for p in json.loads(path.read_text())["ranks"].values()), default=0)
        except (OSError, ValueError, KeyError):
            pass
    return 0


@pytest.mark.integration
@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
def test_a_slurm_job_outliving_its_sigkilled_orchestrator_is_cancelled_before_a_resume(home, slurm_env):
    """The orchestrator (the train task's process) is SIGKILLed while its Slurm job trains: the job runs on, as
    nothing on the cluster knows its follower died. The run's next start finds it in the run's records, confirms
    by its name that it is this run's, scancels it and waits until it left the queue, before any attempt."""
    from trainpipe.trainer.data.shard import shard_dataset

    sets = [*TINY, *SLURM, "train.steps=100000", "train.eval_every=0"]
    prof = load_profile("local", sets)
    dataset_uri = shard_dataset(prof.data, prof.store).uri
    orchestrator = subprocess.Popen(
        [sys.executable, "-c", ORCHESTRATOR, json.dumps(sets), dataset_uri], cwd=ROOT, start_new_session=True
    )
    deadline, job = time.monotonic() + 90, None
    try:
        while job is None or training_step(prof, "orphan") < 1:  # recorded, and its ranks train
            assert orchestrator.poll() is None and time.monotonic() < deadline, "the job was not recorded training"
            time.sleep(0.3)
            job = next(iter(recorded(prof.store, "orphan")), None)
    finally:
        os.killpg(orchestrator.pid, signal.SIGKILL)  # the orchestrator's process, as the OOM killer would
        orchestrator.wait()
    step = training_step(prof, "orphan")
    time.sleep(2.0)
    assert slurm.SlurmJob(job.job_id, dict(os.environ)).queued_state() == "RUNNING"  # the orphan trains on
    assert training_step(prof, "orphan") > step
    assert (job.launcher, job.attempt) == ("slurm", 3)

    t0 = time.monotonic()
    fence = stop_left_jobs(prof, "orphan")
    stop_s = time.monotonic() - t0
    assert slurm.SlurmJob(job.job_id, dict(os.environ)).queued_state() is None  # gone: no second writer
    (incident,) = fence.stopped
    assert f"cancelled slurm job {job.job_id} (attempt 3" in incident.detail, incident.detail
    assert recorded(prof.store, "orphan") == [] and stop_s < 30, stop_s
