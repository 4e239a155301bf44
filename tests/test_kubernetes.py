"""launcher.kind=kubernetes: the TrainJob checked against Kubeflow Trainer's API models, and an attempt created,
followed, cancelled and deleted through the Kubernetes API (``tests/kube_api.py``: a scripted API server whose
pods are real host supervisors on two network-namespace "nodes")."""

from __future__ import annotations

import copy
import json
import time

import pytest

from tests import kube_api, netns
from tests.conftest import DRILL, TINY
from trainpipe.trainer.checkpoint.catalog import list_checkpoints
from trainpipe.trainer.config import PRIVATE_ENV
from trainpipe.trainer.data.shard import shard_dataset
from trainpipe.trainer.errors import LaunchError, ProfileError, RunCancelled
from trainpipe.trainer.launch import launch_attempt, warm_attempts
from trainpipe.trainer.launch.jobs import recorded
from trainpipe.trainer.launch.kubernetes import check_train_job, job_name, job_secrets, train_job
from trainpipe.trainer.orchestrate.policy import without_excluded
from trainpipe.trainer.profile_files import load_profile
from trainpipe.trainer.store_paths import RunPaths

K8S = ["launcher.kind=kubernetes", "launcher.kubernetes.image=registry.example/trainpipe:1", "launcher.poll_s=0.3"]
TWO_NODES = ["cluster.nodes=2", "cluster.procs_per_node=1", "tracking.enabled=false"]


def manifest(sets: list[str] = ()) -> dict:
    prof = load_profile("local", [*K8S, *sets])
    return train_job(prof, "nightly $(HOME)", "file:///d", 2, job_name("nightly", 2, "ab12"), "file:///s/j", None)


def test_the_train_job_is_valid_by_kubeflow_trainers_models_and_carries_no_secret(home, monkeypatch):
    monkeypatch.setenv("TP_STORE_KEY", "s3cr3t-store-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-aws-key")
    sets = ["cluster.nodes=2", "launcher.excluded_nodes=[gpu-7]"]
    # ${VAR} is expanded in the operator's profile file only (an override is data)
    (home.parent / "k8s.yaml").write_text("store:\n  storage_options: {secret: '${TP_STORE_KEY}'}\n")
    prof = load_profile(str(home.parent / "k8s.yaml"), [*K8S, *sets])
    values = job_secrets(prof)
    name = job_name("nightly", 2, "ab12")
    job = train_job(prof, "nightly $(HOME)", "file:///d", 2, name, "file:///j", None, sorted(values))
    check_train_job(job)
    text = json.dumps(job)
    assert "s3cr3t" not in text and "s3cr3t-store-key" in values[PRIVATE_ENV]  # secrets only in the Secret
    assert values["AWS_SECRET_ACCESS_KEY"] == "s3cr3t-aws-key"  # the store's credentials reach the pods
    trainer = job["spec"]["trainer"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"]["key"] for e in trainer["env"] if "secretKeyRef" in str(e)}
    assert refs == {k: k for k in values}  # each pod variable refers to its key in the Secret
    assert (trainer["numNodes"], job["spec"]["runtimeRef"]["name"]) == (2, "torch-distributed")
    assert "nightly $$(HOME)" in trainer["args"]  # Kubernetes would expand $(HOME) in a run name: escaped
    assert "cluster.master_addr=$(PET_MASTER_ADDR)" in trainer["args"]  # node 0's pod, from the torch runtime
    assert "gpu-7" in str(job["spec"]["runtimePatches"])  # the run's excluded nodes: a node affinity


@pytest.mark.parametrize(
    ("spoil", "says"),
    [
        (lambda j: j["spec"]["trainer"].update(numNode=2), "spec.trainer.numNode is not a field"),
        (lambda j: j["spec"]["trainer"].update(numNodes="2"), "numNodes: Input should be a valid integer"),
        (lambda j: j["spec"]["trainer"]["env"].append({"name": "PET_NNODES", "value": "1"}), "reserves PET_*"),
        (lambda j: j["metadata"].update(name="Not_A_Label"), "not a DNS label"),
    ],
)
def test_a_train_job_the_schema_refuses_is_one_line_before_anything_is_created(home, spoil, says):
    job = copy.deepcopy(manifest())
    spoil(job)
    with pytest.raises(LaunchError, match=says) as caught:
        check_train_job(job)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("amount", ["[8]", "eight", "8 GPUs", "-1"])
def test_resources_that_are_not_kubernetes_quantities_are_a_profile_error(home, amount):
    from trainpipe.trainer.launch.kubernetes import KubernetesOptions

    bad = load_profile("local", [f'launcher.kubernetes.resources={{"limits": {{"nvidia.com/gpu": {amount}}}}}'])
    with pytest.raises(ProfileError, match=r"^launcher\.kubernetes\.resources"):
        KubernetesOptions.checked(bad.launcher.section("kubernetes"))
    good = load_profile("local", ['launcher.kubernetes.resources={"limits": {"nvidia.com/gpu": 8, "memory": "64Gi"}}'])
    assert KubernetesOptions.checked(good.launcher.section("kubernetes")).resources["limits"]["memory"] == "64Gi"


def test_kubernetes_without_an_image_is_one_line_where_the_run_is_resolved(home):
    from trainpipe.trainer.orchestrate.resolve import resolve

    with pytest.raises(ProfileError, match=r"^launcher.kind=kubernetes needs launcher\.kubernetes\.image: "):
        resolve("local", ["launcher.kind=kubernetes", "preflight.enabled=false"], "r")


def test_an_unreachable_api_server_is_one_line(home, tmp_path, monkeypatch):
    kube = kube_api.KubeCluster([], tmp_path)
    config = kube.kubeconfig(tmp_path / "kubeconfig")
    kube.close()  # nothing answers at its address any more
    monkeypatch.setenv("KUBECONFIG", str(config))
    prof = load_profile("local", [*TINY, *K8S])
    with pytest.raises(LaunchError, match="did not answer") as caught:
        launch_attempt(prof, "gone", "file:///nowhere")
    assert "\n" not in str(caught.value)


def test_a_pod_that_cannot_start_ends_the_attempt_with_its_reason_and_the_job_is_deleted(home, tmp_path, monkeypatch):
    kube = kube_api.KubeCluster([netns.Host("none", "none", "10.0.0.1", "host0")], tmp_path)
    monkeypatch.setenv("KUBECONFIG", str(kube.kubeconfig(tmp_path / "kubeconfig")))
    prof = load_profile("local", [*TINY, *K8S, "launcher.kubernetes.image=unpullable/trainpipe:typo"])
    try:
        with pytest.raises(LaunchError, match=r"cannot start: ErrImagePull: .*unpullable/trainpipe:typo"):
            launch_attempt(prof, "typo", "file:///d")
        assert not kube.jobs and not kube.secrets
    finally:
        kube.close()


def test_pods_that_cannot_be_scheduled_are_said_once_and_the_attempt_times_out_and_is_deleted(
    home, tmp_path, monkeypatch
):
    """Both nodes excluded: the scheduler places no pod; the follower says why, and at train.timeout_s the
    attempt is a timeout (retried by the policy) and the TrainJob is gone."""
    kube = kube_api.KubeCluster([netns.Host("none", "none", "10.0.0.1", "host0")], tmp_path)
    monkeypatch.setenv("KUBECONFIG", str(kube.kubeconfig(tmp_path / "kubeconfig")))
    prof = load_profile("local", [*TINY, *K8S, "launcher.excluded_nodes=[host0]", "train.timeout_s=2"])
    lines: list[str] = []
    try:
        outcome = launch_attempt(prof, "nowhere", "file:///d", on_line=lines.append)
        assert outcome.incident.kind == "timeout" and outcome.result is None, outcome.incident
        said = [line for line in lines if "cannot be scheduled yet" in line]
        assert len(said) == 1 and "node affinity" in said[0], lines  # one pod, said once
        assert not kube.jobs and not kube.secrets
    finally:
        kube.close()


WHY_NOT = netns.available()
needs_nodes = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")


@pytest.fixture
def kube(home, tmp_path, monkeypatch):
    with kube_api.cluster(tmp_path) as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path / "kubeconfig")))
        yield cluster


@needs_nodes
@pytest.mark.distributed
def test_a_rank_killed_in_a_train_job_is_named_from_the_hosts_parts_and_the_job_is_deleted(home, kube):
    """A TrainJob of 2 pods × 1 rank whose rank 1 SIGKILLs itself: the follower names it (rank, signal, the
    Kubernetes node) from the hosts' parts in the store, streams the pods' logs, and deletes the job and its
    Secret; the Secret went first and was the job's."""
    kill = ["faults.kind=crash", "faults.rank=1", "faults.step=5", "faults.attempts=1"]
    prof = load_profile("local", [*TINY, *K8S, *TWO_NODES, *kill])
    dataset_uri = shard_dataset(prof.data, prof.store).uri
    lines: list[str] = []
    killed = launch_attempt(prof, "kube", dataset_uri, on_line=lines.append)
    assert killed.result is None and killed.incident.kind == "crash", killed.incident
    assert (killed.incident.rank, killed.incident.error, killed.incident.node) == (1, "SIGKILL", "host1")
    assert any("[node0]" in line for line in lines)  # the pods' logs reached the follower's log
    posts = [path.rsplit("/", 1)[-1] for method, path in kube.requests if method == "POST"]
    assert posts[:2] == ["secrets", "trainjobs"]  # the Secret first: the pods read it as they start
    assert not kube.jobs and not kube.secrets  # the job and its Secret are gone
    patches = [body for method, path, body in kube.bodies if method == "PATCH" and "/secrets/" in path]
    assert patches[0]["metadata"]["ownerReferences"][0]["kind"] == "TrainJob"  # Kubernetes deletes it with the job
    deletes = [body for method, path, body in kube.bodies if method == "DELETE" and "/trainjobs/" in path]
    assert deletes[0]["propagationPolicy"] == "Foreground"  # the pods go before the call returns
    (job,) = (home / "store/runs/kube/jobs").glob("attempt-1-*")
    assert sorted(p.name for p in job.glob("host-*.json")) == ["host-0.json", "host-1.json"]  # both hosts said


@needs_nodes
@pytest.mark.distributed
def test_the_retry_runs_in_the_same_train_job_whose_pods_fork_it_warm_and_the_job_ends_with_the_run(home, kube):
    """Inside the run's block (``warm_attempts``) the TrainJob outlives its failed attempt: rank 1 SIGKILLs
    itself, and the retry is asked of the same pods through a signed request in the store; both pods fork its
    agent from their warm hosts and it resumes to the end. No new pod is started; when the block ends, the job,
    its Secret and every pod are gone and its record is forgotten."""
    kill = ["faults.kind=crash", "faults.rank=1", "faults.step=5", "faults.attempts=1", "checkpoint.every_steps=2"]
    prof = load_profile("local", [*TINY, *K8S, *TWO_NODES, *kill])
    dataset_uri = shard_dataset(prof.data, prof.store).uri
    with warm_attempts(prof):
        killed = launch_attempt(prof, "warm", dataset_uri)
        assert (killed.incident.kind, killed.incident.rank, killed.incident.node) == ("crash", 1, "host1")
        pods = len(kube.scheduled)
        assert len(kube.jobs) == 1 and pods == 2  # held for the next attempt
        resumed = launch_attempt(prof, "warm", dataset_uri, attempt=2)
        assert resumed.incident is None and resumed.result.final_step == 8, resumed.incident
        assert resumed.result.start_step >= 2 and len(kube.scheduled) == pods  # no new pod: the same two
        assert resumed.job.job == killed.job.job and resumed.job.job.endswith("its pods' agents forked warm")
    assert not kube.jobs and not kube.secrets
    assert not any(p.proc.poll() is None for ps in kube.pods.values() for p in ps)
    assert recorded(prof.store, "warm") == []
    folders = sorted(p.name.split("-")[1] for p in (home / "store/runs/warm/jobs").glob("attempt-*"))
    assert folders == ["1", "2"]  # each attempt's parts in a folder of its own


@needs_nodes
@pytest.mark.distributed
def test_the_preflight_runs_on_every_node_of_one_train_job_and_a_failing_node_is_left_out(home, kube):
    """The preflight stage through the launcher: one TrainJob whose pods each probe their own node and join the
    cross-node tests; the report comes back through the hosts' parts in the store and names both Kubernetes
    nodes. A recorded ECC fault on node 1 (the NVML seam) makes it fail there, and on_fail: exclude turns it
    into the next TrainJob's node affinity."""
    from trainpipe.trainer.launch import launch
    from trainpipe.trainer.launcher import LaunchRequest, Watch
    from trainpipe.trainer.orchestrate.policy import after_preflight

    prof = load_profile("local", [*TINY, *K8S, *TWO_NODES, "cluster.min_nodes=1", "preflight.on_fail=exclude"])
    outcome = launch(LaunchRequest("preflight", prof, "pf"), Watch())
    assert outcome.report is not None, outcome.incident
    report = outcome.report
    assert sorted(report["nodes"]) == ["host0", "host1"] and report["world_size"] == 2, report["nodes"]
    assert not kube.jobs and not kube.secrets  # deleted at its end, as a training attempt's
    (job,) = (home / "store/runs/pf/jobs").glob("attempt-0-*")  # the preflight: attempt 0
    assert sorted(p.name for p in job.glob("host-*.json")) == ["host-0.json", "host-1.json"]
    report["failing_nodes"] = ["host1"]  # as a failing gpu.ecc check on host1 reads (tests/test_policy.py)
    report["checks"].append({"name": "gpu.ecc", "status": "fail", "detail": "volatile uncorrected", "node": "host1"})
    decision = after_preflight(report, prof)
    assert decision.action == "exclude" and decision.profile.cluster.nodes == 1
    job_spec = train_job(decision.profile, "pf", "file:///d", 1, job_name("pf", 1, "ab12"), "file:///j", None)
    assert "host1" in str(job_spec["spec"]["runtimePatches"])  # the next TrainJob's pods go elsewhere


@needs_nodes
@pytest.mark.distributed
def test_a_straggler_is_heard_while_the_train_job_runs_and_a_cancelled_run_deletes_it(home, kube):
    """host1's rank computes 4x slower: node 0's watchdog names it, and the finding reaches the caller while the
    TrainJob runs (node 0's progress file in the store); then the run is cancelled: the TrainJob is deleted and no
    rank is left."""
    slow = ["faults.kind=slow", "faults.rank=1", "faults.factor=4", "faults.attempts=0"]
    prof = load_profile("local", [*TINY, *K8S, *TWO_NODES, "train.steps=100000", "train.eval_every=0", *slow])
    dataset_uri = shard_dataset(prof.data, prof.store).uri
    findings: list = []

    def cancel_once_a_straggler_is_heard(progress: dict[int, dict]) -> None:
        if findings and any(p.get("step", 0) > 0 for p in progress.values()):
            raise RunCancelled("cancelled from the UI")

    start = time.monotonic()
    with pytest.raises(RunCancelled):
        launch_attempt(
            prof, "cancel", dataset_uri, on_finding=findings.append, on_progress=cancel_once_a_straggler_is_heard
        )
    assert time.monotonic() - start < 120
    assert (findings[0].kind, findings[0].rank, findings[0].node) == ("straggler", 1, "host1"), findings
    assert not kube.jobs and not any(p.proc.poll() is None for ps in kube.pods.values() for p in ps)
    (job,) = (home / "store/runs/cancel/jobs").glob("attempt-1-*")
    parts = [json.loads(p.read_text()) for p in sorted(job.glob("host-*.json"))]
    # SIGTERM from the pod's deletion: node 0 tore its ranks down and said so before the grace period ended; node 1
    # said so too, or that its rank lost node 0's first
    assert [p["node_rank"] for p in parts] == [0, 1] and parts[1]["incident"]["kind"] in ("aborted", "crash")
    assert parts[0]["incident"]["kind"] == "aborted" and "SIGTERM" in parts[0]["incident"]["detail"], parts[0]


@needs_nodes
@pytest.mark.distributed
def test_after_a_node_is_excluded_the_next_train_job_runs_on_the_nodes_left(home, kube):
    """Elastic shrink across hosts: node host1's rank is killed; the retry without host1 (what the policy decides
    for a node it excludes) is a TrainJob of one pod that Kubernetes keeps off host1, resuming with twice the
    gradient accumulation."""
    kill = ["faults.kind=crash", "faults.rank=1", "faults.step=25", "faults.attempts=1"]
    prof = load_profile("local", [*DRILL, *K8S, *TWO_NODES, "cluster.min_nodes=1", *kill])
    dataset_uri = shard_dataset(prof.data, prof.store).uri
    killed = launch_attempt(prof, "shrink", dataset_uri)
    assert (killed.incident.kind, killed.incident.node) == ("crash", "host1"), killed.incident

    # the newest commit before the kill (the async save of step 20 may still be uploading at step 25 on a busy box)
    committed = [i.step for i in list_checkpoints(RunPaths(prof.store.root, "shrink").checkpoints) if i.valid]
    started = len(kube.scheduled)
    smaller = without_excluded(prof, [killed.incident.node])
    resumed = launch_attempt(smaller, "shrink", dataset_uri, attempt=2)
    assert resumed.incident is None, resumed.incident
    assert [node for _, node in kube.scheduled[started:]] == ["host0"]  # one pod, not on the excluded node
    assert resumed.result.world_size == 1 and resumed.result.start_step == max(committed) >= 10
    assert resumed.result.final_step == 60
