"""The kubernetes launcher: each training attempt is one Kubeflow Trainer TrainJob; each of its pods runs one host
supervisor.

The train task renders the TrainJob (``train_job``) on the cluster's torch
runtime (``launcher.kubernetes.runtime``, ``torch-distributed`` by default), checks it
against Kubeflow Trainer's API models (``check_train_job``: the CRD's OpenAPI
schema, from the ``kubeflow-trainer-api`` package), creates a Secret with the
job's secrets and then the TrainJob through the Kubernetes Python client,
follows the TrainJob's conditions and streams its pods' logs, and deletes it
(its JobSet and pods with it) when the run is cancelled, the attempt runs past
``train.timeout_s`` or the follower itself is stopped.

Every pod runs ``python -m trainpipe.trainer.supervise.host``. The runtime's torch
policy gives it ``PET_NODE_RANK`` (the pod's completion index) and
``PET_MASTER_ADDR``/``PET_MASTER_PORT`` (node 0's pod, by its DNS name);
Kubernetes expands ``$(NAME)`` in the arguments, so node 0 hosts the c10d
rendezvous and the job's watchdog. The pods share no file system with the
orchestrator: each host writes its part's outcome, and node 0 its progress, to
``{store}/runs/{run}/jobs/attempt-{n}-{tag}/`` in the run's store, where the
train task reads them. The profile travels in the pod's environment (public
values only); the beacon token and the store's settings in the Secret, which
is owned by the TrainJob, so Kubernetes deletes it with the job.

A TrainJob outlives its orchestrator when that is SIGKILLed: each is recorded
in the run's records (``trainer.launch.jobs``) before it is created, until it
is deleted, and ``stop_left`` deletes one a dead orchestrator left running once
its ``trainpipe/run`` annotation says it is this run's.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import math
import os
import posixpath
import re
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from trainpipe.trainer import grammar
from trainpipe.trainer.config import PRIVATE_ENV, Profile
from trainpipe.trainer.errors import LaunchError, TrainpipeError
from trainpipe.trainer.launch import held, jobs
from trainpipe.trainer.launch.jobs import LiveJob
from trainpipe.trainer.launch.outcome import PART_NAME, HostParts, LiveView, forked_warm, hosts_outcome, read_host_parts
from trainpipe.trainer.launcher import (
    AttemptOutcome,
    LauncherOptions,
    LauncherSpec,
    LaunchRequest,
    Watch,
    register_launcher,
    stage_timeout,
)
from trainpipe.trainer.protocol import BEACON_TOKEN_ENV
from trainpipe.trainer.store import filesystem, write_text
from trainpipe.trainer.store_paths import RUN_PROFILE, RunPaths, join, store_tag
from trainpipe.trainer.supervise import allocation
from trainpipe.trainer.supervise.allocation import LOOK_S, AttemptRequest, request_name

log = logging.getLogger("trainpipe.kubernetes")

GROUP, VERSION, PLURAL = "trainer.kubeflow.org", "v1alpha1", "trainjobs"
PROFILE_ENV = "TRAINPIPE_PROFILE_YAML"
POD_IP_ENV = "TRAINPIPE_POD_IP"
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"  # on every pod of the TrainJob's JobSet
SECRET_KEYS = (BEACON_TOKEN_ENV, PRIVATE_ENV)  # always in the Secret; credentials may join them
UNREACHABLE_FOR_S = 300.0  # how long the follower waits for the API server to answer again
STOP_WAIT_S = 60.0  # how long stopping a TrainJob left running waits for it and its pods to be gone
RUN_ANNOTATION = "trainpipe/run"  # the run a TrainJob trains: a recorded job is deleted only when it says ours
STORE_ANNOTATION = "trainpipe/store"  # and the store that run lives in (``layout.store_tag``)
MANAGED_BY = {"app.kubernetes.io/managed-by": "trainpipe"}
TIMEOUT = (10, 30)  # (connect, read) seconds for each API call: a server may accept and never answer


class KubernetesOptions(LauncherOptions):
    """``launcher.kubernetes``: the TrainJob's image, namespace, runtime and resources. Each value goes into the
    manifest, checked against Kubernetes' grammar for its place (trainer/grammar.py)."""

    kind: ClassVar[str] = "kubernetes"
    image: str | None = Field(default=None, description="The container image with trainpipe installed (required).")
    namespace: str = Field(default="default", description="The namespace of the TrainJobs and their Secrets.")
    runtime: str = Field(
        default="torch-distributed",
        description="The ClusterTrainingRuntime the TrainJob references (its Jobs should not restart failed pods: "
        "trainpipe's retry resumes from the last checkpoint instead).",
    )
    resources: dict[Literal["requests", "limits"], dict[str, str | int]] = Field(
        default_factory=dict,
        description="resourcesPerNode, e.g. {limits: {nvidia.com/gpu: 8}} (empty: CPUs for the ranks).",
    )
    kube_context: str | None = Field(
        default=None, description="The kubeconfig context to use (None: in-cluster config, else the current one)."
    )

    @field_validator("image")
    @classmethod
    def _image(cls, value: str | None) -> str | None:
        return _checked(value, grammar.IMAGE_REF, "a container image reference like registry.example/trainpipe:1")

    @field_validator("runtime")
    @classmethod
    def _runtime(cls, value: str) -> str:
        return _checked(value, grammar.DNS_SUBDOMAIN, "a ClusterTrainingRuntime's name (a DNS subdomain)")

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        return _checked(value, grammar.DNS_LABEL, "a Kubernetes namespace name (lower-case letters, digits and '-')")

    @field_validator("resources")
    @classmethod
    def _quantities(cls, value: dict[str, dict[str, str | int]]) -> dict[str, dict[str, str | int]]:
        for kind, amounts in value.items():
            for name, amount in amounts.items():
                _checked(name, grammar.QUALIFIED_NAME, f"a Kubernetes resource name ({kind})")
                if not re.fullmatch(r"[+]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|[KMGTPE]i|[mkMGTPE])?", str(amount)):
                    raise ValueError(f"{kind}.{name}={amount!r} is not a Kubernetes quantity (e.g. 8, 500m, 64Gi)")
        return value

    def check(self, profile: Profile) -> None:
        if not self.image:
            raise ValueError(
                "launcher.kind=kubernetes needs launcher.kubernetes.image: an image with trainpipe installed"
            )


def _checked(value: Any, pattern: str, what: str) -> Any:
    if value is not None and not grammar.matches(pattern, value):
        raise ValueError(f"not {what}")
    return value


def job_name(run_name: str, attempt: int, tag: str) -> str:
    """A DNS-1035 label short enough for the pods' host names (``{job}-node-0-{i}``, at most 63 characters)."""
    slug = re.sub(r"[^a-z0-9]+", "-", run_name.lower()).strip("-")[:24].strip("-") or "run"
    return f"tp-{slug}-a{attempt}-{tag}"


def _literal(text: str) -> str:
    """``text`` as Kubernetes passes it: it expands ``$(NAME)`` in commands, arguments and values, ``$$`` is ``$``."""
    return text.replace("$", "$$")


def train_job(
    profile: Profile,
    run_name: str,
    dataset_uri: str | None,
    attempt: int,
    name: str,
    folder: str,
    mlflow_run_id: str | None,
    secret_keys: tuple[str, ...] | list[str] = SECRET_KEYS,
    stage: str = "train",
    attempts: int = 1,
) -> dict[str, Any]:
    """The TrainJob of ``stage`` created at ``attempt``: ``cluster.nodes`` pods, each a host supervisor. A train
    job's pods serve the attempts asked of them in ``folder`` (each attempt's dataset and MLflow run come with its
    request, not in the job); a preflight job's pods probe once and write their parts there."""
    c, la, options = profile.cluster, profile.launcher, KubernetesOptions.of(profile)
    args = ["--profile-env", PROFILE_ENV, "--run-name", _literal(run_name)]
    if stage == "train":  # each pod serves the attempts asked of its job (trainer/supervise/allocation.py)
        args += ["--serve", _literal(folder), "--idle-s", f"{held.idle_s(profile):g}"]
    else:
        args += ["--stage", stage, "--attempt", str(attempt), "--outcome-dir", _literal(folder)]
    # node 0's pod by its DNS name (the runtime's torch policy); each pod advertises its own address
    args += ["--set", "cluster.master_addr=$(PET_MASTER_ADDR)", "--set", "cluster.master_port=$(PET_MASTER_PORT)"]
    args += ["--set", f"cluster.local_addr=$({POD_IP_ENV})"]
    secret = f"{name}-secrets"
    env = [
        {"name": PROFILE_ENV, "value": _literal(profile.public_yaml())},
        {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        # a host is the machine the pod runs on: what a repeated failure and an exclusion are about
        {"name": "TRAINPIPE_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        *({"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}} for key in secret_keys),
    ]
    resources = options.resources or {"requests": {"cpu": str(c.procs_per_node * c.threads_per_proc)}}
    if not options.resources and c.device == "cuda":
        resources = {**resources, "limits": {"nvidia.com/gpu": str(c.procs_per_node)}}
    spec: dict[str, Any] = {
        "runtimeRef": {"name": options.runtime},
        # Kubernetes' own limit backs up the train task's: a train job may serve every attempt of the run
        "activeDeadlineSeconds": math.ceil(_limit_s(profile, stage, attempts)) + 60,
        "trainer": {
            "image": options.image,
            "command": [la.python or "python", "-m", "trainpipe.trainer.supervise.host"],
            "args": args,
            "env": env,
            "numNodes": c.nodes,
            "numProcPerNode": c.procs_per_node,
            "resourcesPerNode": {k: {r: str(q) for r, q in v.items()} for k, v in resources.items()},
        },
    }
    if la.excluded_nodes:  # the pods go elsewhere than the run's excluded nodes
        spec["runtimePatches"] = [_avoid(la.excluded_nodes)]
    labels = {**MANAGED_BY, "trainpipe/attempt": str(attempt)}
    # annotations: a run name may be longer than a label value
    annotations = {RUN_ANNOTATION: run_name, STORE_ANNOTATION: store_tag(profile.store.root)}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainJob",
        "metadata": {"name": name, "namespace": options.namespace, "labels": labels, "annotations": annotations},
        "spec": spec,
    }


def _limit_s(profile: Profile, stage: str, attempts: int) -> float:
    limit_s = stage_timeout(profile, stage)[1]
    return (limit_s + held.idle_s(profile)) * attempts if stage == "train" and attempts > 1 else limit_s


def job_key(profile: Profile, run_name: str) -> str:
    """What a held TrainJob was made from, less the profile its pods read their store's settings from (each
    attempt brings its own): an attempt whose key differs (another node count, an excluded node, another image)
    needs a job of its own."""
    job = train_job(profile, run_name, None, 1, "key", "key", None)
    for env in job["spec"]["trainer"]["env"]:
        if env["name"] == PROFILE_ENV:
            env["value"] = _literal(profile.store.model_dump_json())
    # the Secret's values less the job's own token: rotated credentials need a job of their own
    values = {k: v for k, v in job_secrets(profile).items() if k != BEACON_TOKEN_ENV}
    return json.dumps(job, sort_keys=True) + hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()


def _avoid(nodes: list[str]) -> dict[str, Any]:
    term = {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": sorted(nodes)}]}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}
    pod = {"template": {"spec": {"template": {"spec": {"affinity": affinity}}}}}
    return {
        "manager": "trainpipe",
        "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [{"name": "node", **pod}]}}},
    }


def check_train_job(manifest: dict[str, Any]) -> None:
    """Raise LaunchError (one line) unless ``manifest`` is a TrainJob by Kubeflow Trainer's API models: every field
    known, every value of its type, the required ones there, and the torch runtime's reserved names left alone."""
    from kubeflow_trainer_api.models.trainer_v1alpha1_train_job import TrainerV1alpha1TrainJob
    from pydantic import ValidationError

    try:
        parsed = TrainerV1alpha1TrainJob.from_dict(manifest)
    except (ValidationError, ValueError, TypeError) as exc:
        first = exc.errors()[0] if isinstance(exc, ValidationError) else {"loc": (), "msg": str(exc)}
        where = ".".join(str(p) for p in first["loc"]) or "the TrainJob"
        raise LaunchError(f"the TrainJob is not valid: {where}: {first['msg']}") from None
    if unknown := _unknown(manifest, parsed.to_dict() if parsed else {}):
        raise LaunchError(f"the TrainJob is not valid: {unknown} is not a field of Kubeflow Trainer's TrainJob")
    name = manifest.get("metadata", {}).get("name", "")
    if not re.fullmatch(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?", name):
        raise LaunchError(f"the TrainJob's name {name!r} is not a DNS label of at most 40 characters")
    trainer = manifest["spec"].get("trainer", {})
    if reserved := sorted(e["name"] for e in trainer.get("env", []) if e["name"].startswith("PET_")):
        raise LaunchError(f"the TrainJob sets {reserved}: the torch runtime reserves PET_* variables")
    if trainer.get("numNodes", 1) < 1 or trainer.get("numProcPerNode", 1) < 1:
        raise LaunchError("the TrainJob needs numNodes and numProcPerNode of at least 1")


def _unknown(given: Any, known: Any, path: str = "") -> str | None:
    """The first path in ``given`` that the models dropped: a field the schema does not have."""
    if isinstance(given, dict):
        for key, value in given.items():
            here = f"{path}.{key}" if path else key
            if not isinstance(known, dict) or key not in known:
                return here
            if found := _unknown(value, known[key], here):
                return found
    elif isinstance(given, list) and isinstance(known, list):
        for i, (a, b) in enumerate(zip(given, known, strict=False)):
            if found := _unknown(a, b, f"{path}[{i}]"):
                return found
    return None


class KubeJob:
    """One TrainJob and its Secret, through the Kubernetes API."""

    def __init__(self, profile: Profile, name: str, namespace: str | None = None):
        from kubernetes import client

        self.name, self.namespace, self.secret = (
            name,
            namespace or KubernetesOptions.of(profile).namespace,
            f"{name}-secrets",
        )
        self.asked = False  # whether the TrainJob's creation was sent: from then on it may exist
        self.api = _api_client(KubernetesOptions.of(profile).kube_context)
        self.core, self.custom = client.CoreV1Api(self.api), client.CustomObjectsApi(self.api)

    def create(self, manifest: dict[str, Any], secret_values: dict[str, str]) -> None:
        """The Secret first (the pods read it when they start), then the TrainJob, then the Secret made the job's
        (Kubernetes deletes it with the TrainJob, however the follower ends). The caller deletes the job when
        this raises: the TrainJob may exist even when its creation did not answer."""
        meta = {"name": self.secret, "namespace": self.namespace, "labels": {**MANAGED_BY}}
        secret = {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "stringData": secret_values}
        _call(self.core.create_namespaced_secret, self.namespace, secret, what=f"Secret {self.secret}")
        # Strict: an API server whose Trainer CRD lacks a field refuses the job instead of dropping the field
        self.asked = True
        made = _call(
            self.custom.create_namespaced_custom_object,
            *self._kind(),
            manifest,
            field_validation="Strict",
            what=f"TrainJob {self.name}",
        )
        owner = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainJob", "name": self.name}
        patch = {"metadata": {"ownerReferences": [{**owner, "uid": made["metadata"]["uid"]}]}}
        _call(self.core.patch_namespaced_secret, self.secret, self.namespace, patch, what=f"Secret {self.secret}")

    def state(self) -> tuple[str, str] | None:
        """("Complete" or "Failed", the condition's message) once the TrainJob ended; None while it runs."""
        job = self._get()
        return ("Deleted", "the TrainJob was deleted") if job is None else _ended(job)

    def pods(self) -> list[Any]:
        """The TrainJob's pods (V1Pod)."""
        selector = f"{JOBSET_LABEL}={self.name}"
        return _call(self.core.list_namespaced_pod, self.namespace, label_selector=selector, what="the pods").items

    def delete(self, wait_s: float = 60.0) -> bool:
        """Delete the TrainJob and, before returning, its pods (foreground deletion: the JobSet and pods go first);
        whether they are gone. Never raises: what it could not delete is a warning naming it."""
        try:
            if not self.asked:
                _call(self.core.delete_namespaced_secret, self.secret, self.namespace, missing=None)
                return True
            _call(self.custom.delete_namespaced_custom_object, *self._kind(), self.name, body=FOREGROUND, missing=None)
            deadline = time.monotonic() + wait_s
            while (left := self._get() is not None or bool(self.pods())) and time.monotonic() < deadline:
                time.sleep(0.2)
            _call(self.core.delete_namespaced_secret, self.secret, self.namespace, missing=None)
            if left:
                log.warning("TrainJob %s/%s is still there %gs after its deletion", self.namespace, self.name, wait_s)
            return not left
        except (ConnectionError, LaunchError) as exc:
            log.warning(
                "TrainJob %s/%s or its Secret may be left: %s; delete them by hand", self.namespace, self.name, exc
            )
            return False
        finally:
            self.api.close()

    def _kind(self) -> tuple[str, str, str, str]:
        return GROUP, VERSION, self.namespace, PLURAL

    def _get(self) -> dict[str, Any] | None:
        return _call(self.custom.get_namespaced_custom_object, *self._kind(), self.name, missing=None)


def _ended(job: dict[str, Any]) -> tuple[str, str] | None:
    """("Complete" or "Failed", the condition's message) of a TrainJob that ended; None while it runs."""
    for condition in job.get("status", {}).get("conditions", []):
        if condition.get("type") in ("Complete", "Failed") and condition.get("status") == "True":
            return condition["type"], condition.get("message") or condition.get("reason", "")
    return None


FOREGROUND = {"propagationPolicy": "Foreground"}
_RAISE = object()


def _call(method: Callable[..., Any], *args: Any, missing: Any = _RAISE, what: str = "", **kwargs: Any) -> Any:
    """One API call with a deadline. A 404 returns ``missing`` when given; a server that does not answer, throttles
    (429) or fails (5xx) raises ConnectionError (worth waiting out); any other refusal is one LaunchError line."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        return method(*args, _request_timeout=TIMEOUT, **kwargs)
    except ApiException as exc:
        if exc.status == 404 and missing is not _RAISE:
            return missing
        if exc.status in (None, 0, 429) or exc.status >= 500:  # None: no HTTP answer at all
            raise ConnectionError(f"{exc.status} {_reason(exc)}") from None
        hint = " (is Kubeflow Trainer installed?)" if exc.status == 404 else ""
        target = what or method.__name__
        raise LaunchError(f"the Kubernetes API refused {target} ({exc.status}): {_reason(exc)}{hint}") from None
    except HTTPError as exc:
        why = re.search(r"\[Errno -?\d+\][^\"')]*", str(exc))
        silent = f"the Kubernetes API server did not answer ({why[0] if why else type(exc).__name__})"
        raise ConnectionError(silent) from None


def _api_client(context: str | None) -> Any:
    from kubernetes import client, config

    try:
        if context is None and os.environ.get("KUBERNETES_SERVICE_HOST"):  # the orchestrator runs in a pod
            config.load_incluster_config()
            return client.ApiClient()
        # the client reads $KUBECONFIG once, when it is imported; a launcher reads it at each attempt
        return config.new_client_from_config(config_file=os.environ.get("KUBECONFIG"), context=context)
    except (config.ConfigException, OSError) as exc:
        raise LaunchError(
            f"no Kubernetes configuration ({exc}): set KUBECONFIG or launcher.kubernetes.kube_context"
        ) from None


def _reason(exc: Any) -> str:
    import json

    try:
        return str(json.loads(exc.body).get("message"))[:300]
    except (TypeError, ValueError, AttributeError):
        return str(exc.reason)


# A pod waiting for one of these will not start by waiting longer: the attempt ends with the pod's reason.
STUCK = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError", "CreateContainerError")


def unschedulable(pods: list[Any]) -> list[str]:
    """A line for each pod the scheduler cannot place now (it may later: nodes free up, a queue admits it)."""
    out = []
    for pod in pods:
        for c in pod.status.conditions or []:
            if (c.type, c.status, c.reason) == ("PodScheduled", "False", "Unschedulable"):
                out.append(f"pod {pod.metadata.name} cannot be scheduled yet: {(c.message or '')[:200]}")
    return out


def stuck_pod(pods: list[Any]) -> str | None:
    """A line naming the first pod that cannot start, and why; None when none is stuck."""
    for pod in pods:
        for status in pod.status.container_statuses or []:
            waiting = status.state.waiting if status.state else None
            if waiting is not None and waiting.reason in STUCK:
                return f"pod {pod.metadata.name} cannot start: {waiting.reason}: {(waiting.message or '')[:200]}"
    return None


class _Logs:
    """Every pod's log, line by line as it is written, from a thread per pod (a follow stream blocks)."""

    def __init__(self, job: KubeJob, on_line: Callable[[str], None] | None):
        self.job, self.on_line = job, on_line
        self.tail: collections.deque[str] = collections.deque(maxlen=80)
        self.lock = threading.Lock()
        self.threads: dict[str, threading.Thread] = {}

    def follow(self, pods: list[Any]) -> None:
        for pod in pods:
            name = pod.metadata.name
            if (pod.status.phase or "Pending") != "Pending" and name not in self.threads:
                self.threads[name] = threading.Thread(
                    target=self._stream, args=(name,), daemon=True, name=f"log-{name}"
                )
                self.threads[name].start()

    def last(self, wait_s: float = 5.0) -> list[str]:
        """The last lines, once the streams of the ended pods closed (at most ``wait_s``)."""
        deadline = time.monotonic() + wait_s
        for thread in self.threads.values():
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        with self.lock:
            return list(self.tail)

    def _stream(self, pod: str) -> None:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            read = self.job.core.read_namespaced_pod_log
            # the container by name: a sidecar (a service mesh's proxy) makes the pod's log ambiguous
            # unparsed (_preload_content=False): urllib3's response, streamed
            resp: Any = read(pod, self.job.namespace, container="node", follow=True, _preload_content=False)
            rest = b""
            for chunk in resp.stream(4096):
                *lines, rest = (rest + chunk).split(b"\n")
                for line in lines:
                    self._line(line.decode(errors="replace"))
            if rest:
                self._line(rest.decode(errors="replace"))
            resp.release_conn()
        except (ApiException, HTTPError, OSError) as exc:  # the pod went away: what it wrote is in the store's records
            log.warning("the log of pod %s ended early: %s", pod, exc)

    def say(self, line: str) -> None:
        """A line of the follower's own, among the pods'."""
        log.warning("%s", line)
        self._line(line)

    def _line(self, line: str) -> None:
        with self.lock:
            self.tail.append(line)
        if self.on_line:
            self.on_line(line)


def job_secrets(profile: Profile) -> dict[str, str]:
    """What the pods get through the Secret: the store's settings, a fresh beacon token, and the store's and
    MLflow's credentials from this environment (pods with their own cloud identity need none of them)."""
    values = {**profile.private_env(), BEACON_TOKEN_ENV: secrets.token_hex(16)}
    return values | {k: v for k, v in os.environ.items() if k in held.CREDENTIAL_ENV and v}


class HeldTrainJob:
    """A TrainJob whose pods stand as long as it does and run each attempt asked of them through its folder in the
    store (``trainer.supervise.allocation``): a retry in it forks its agents from the pods' warm hosts instead of
    waiting for new pods and starting cold interpreters. ``token`` is the job's secret (in its Secret): its
    beacons' token and the key its requests are signed with, since others may write the store."""

    def __init__(self, job: KubeJob, profile: Profile, run_name: str, folder: str, token: str):
        self.job, self.profile, self.run_name, self.folder, self.token = job, profile, run_name, folder, token
        self.key, self.logs = job_key(profile, run_name), _Logs(job, None)
        self.live: LiveJob | None = None  # its record in the run's jobs, once remembered

    @classmethod
    def create(cls, profile: Profile, run_name: str, attempt: int, folder: str, tag: str) -> HeldTrainJob:
        name, values = job_name(run_name, attempt, tag), job_secrets(profile)
        attempts = max(profile.train.max_retries + 2 - attempt, 1) if held.keeping() else 1  # those it may serve
        manifest = train_job(profile, run_name, None, attempt, name, folder, None, sorted(values), attempts=attempts)
        check_train_job(manifest)
        made = cls(KubeJob(profile, name), profile, run_name, folder, values[BEACON_TOKEN_ENV])
        try:  # from the first call on: a job whose creation did not answer may exist all the same
            # Recorded before it is created: should this process be killed, the run's next start deletes the job
            made.live = jobs.remember(profile, run_name, attempt, namespace=made.job.namespace, name=name)
            try:
                made.job.create(manifest, values)
            except ConnectionError as exc:
                raise LaunchError(f"{exc} when creating TrainJob {name}: is KUBECONFIG's cluster up?") from None
        except BaseException:
            made.close()
            raise
        log.info("attempt %d is TrainJob %s/%s", attempt, KubernetesOptions.of(profile).namespace, name)
        return made

    def ask(self, request: LaunchRequest, folder: str) -> None:
        """Every pod of the job runs ``request``'s attempt next, with the attempt's profile written into ``folder``."""
        text = request.profile.public_yaml()
        fs, path = filesystem(join(folder, RUN_PROFILE), self.profile.store.storage_options)
        write_text(fs, path, text)
        tracked = request.profile.tracking.enabled and request.mlflow_run_id  # rank 0's host relays its metrics
        signed = AttemptRequest.signed(
            self.token, text, attempt=request.attempt, folder=posixpath.basename(folder),
            dataset_uri=request.dataset_uri, mlflow_run_id=request.mlflow_run_id if tracked else None,
        )  # fmt: skip
        try:
            signed.checked(self.token)  # what the pods would leave alone is said here, not waited for
        except ValueError as exc:
            raise LaunchError(f"attempt {request.attempt} cannot be asked of TrainJob {self.job.name}: {exc}") from None
        allocation.ask(self.folder, self.profile.store.storage_options, signed)

    def answered(self, attempt: int) -> None:
        """The attempt is over: its request goes, so that no pod runs it again."""
        with contextlib.suppress(OSError, TrainpipeError):
            fs, path = filesystem(join(self.folder, request_name(attempt)), self.profile.store.storage_options)
            fs.rm_file(path)

    def running(self) -> bool:
        try:
            return self.job.state() is None
        except (ConnectionError, LaunchError):
            return False

    def end(self, replaced: bool = False) -> None:
        """Ask the pods to end and wait until the job completed (soon), then delete it and its Secret. A pod's
        memory tier ends with it, whether ``replaced`` or not (the next job's pods are new)."""
        with contextlib.suppress(OSError, TrainpipeError):
            allocation.stop(self.folder, self.profile.store.storage_options)
        deadline = time.monotonic() + END_WAIT_S
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.2)
        self.close()

    def close(self) -> None:
        gone = self.job.delete()  # its records are in the store and its logs streamed; its pods go with it
        if self.live is not None and gone:  # one still there stays recorded: the next attempt deletes it
            jobs.forget_quietly(self.profile.store, self.run_name, self.live)
            self.live = None


END_WAIT_S = 15.0  # how long an ended job's pods get to leave by themselves


def train_attempt(request: LaunchRequest, watch: Watch) -> AttemptOutcome:
    """One attempt of the request's stage (training, or the preflight probes on every node) on Kubernetes,
    followed to its end; the same outcome as the local launcher's. Training: the attempt runs in the TrainJob held
    for the run (``trainer.launch.held``) when that job fits, else in a new one.

    ``watch.on_progress`` gets node 0's latest view of every rank at each look; an exception it raises (the run
    was cancelled) deletes the job and propagates. The pods reach the run's store and the MLflow server themselves.
    """
    if request.stage != "train":
        return _launch_once(request, watch)
    profile, run_name, attempt = request.profile, request.run_name, request.attempt
    tag, timeout = secrets.token_hex(2), stage_timeout(profile, "train")
    folder = RunPaths(profile.store.root, run_name).job(attempt, tag)
    key = job_key(profile, run_name)
    job = held.take(run_name, profile, lambda j: isinstance(j, HeldTrainJob) and j.key == key and j.running())
    reused = isinstance(job, HeldTrainJob)
    train = job if isinstance(job, HeldTrainJob) else HeldTrainJob.create(profile, run_name, attempt, folder, tag)
    train.logs.on_line = watch.on_line
    if reused:
        log.info("attempt %d runs in TrainJob %s, whose pods stayed up", attempt, train.job.name)
    start, kept, final, timed_out, read, followed = time.monotonic(), False, ("Deleted", ""), False, HostParts(), False
    try:
        train.ask(request, folder)
        done = _Parts(profile, folder)
        final, timed_out = _follow(train.job, profile, folder, train.logs, LiveView(watch), start, timeout, done)
        read = _records(profile, folder)
        # every pod answered and the job still stands: the next attempt may run in it
        kept = held.keeping() and final is None and len(read.parts) == profile.cluster.nodes
        followed = True
    finally:
        train.answered(attempt)
        if kept:
            held.put(run_name, train)
        elif followed and final is None and not timed_out and not held.keeping():
            train.end()  # no run holds it: its pods leave by themselves
        else:  # ended, cancelled, timed out, a pod missing, or this follower interrupted: it must not outlive this
            train.close()
    name = f"TrainJob {train.job.name}"
    if final is None:
        node0 = next((p for p in read.parts if p.get("node_rank") == 0), {})
        ended_as, returncode = f"attempt {attempt} in {name} ended", node0.get("returncode")
    else:
        ended_as = f"{name} ended {final[0]} ({final[1] or 'no message'})"
        returncode = {"Complete": 0, "Failed": 1}.get(final[0])
    if forked_warm(read.parts):
        name += ", its pods' agents forked warm"
    return hosts_outcome(
        "train", profile, attempt, name, ended_as, returncode, read.parts, timed_out, time.monotonic() - start,
        train.logs.last(wait_s=0.0 if kept else 5.0), timeout, unreadable=read,
    )  # fmt: skip


class _Parts:
    """Whether every pod wrote its part of an attempt into its folder in the store (or one did,
    ``held.part_wait_s`` ago: a pod that says nothing is lost)."""

    def __init__(self, profile: Profile, folder: str):
        self.fs, self.path = filesystem(folder, profile.store.storage_options)
        self.nodes, self.first_at, self.wait_s = profile.cluster.nodes, None, held.part_wait_s(profile)

    def __call__(self) -> bool:
        try:
            names = [posixpath.basename(str(n)) for n in self.fs.ls(self.path, detail=False)]
        except (FileNotFoundError, OSError):
            return False
        ranks = {int(m.group(1)) for n in names if (m := PART_NAME.fullmatch(n)) and int(m.group(1)) < self.nodes}
        if len(ranks) >= self.nodes:
            return True
        if ranks:
            self.first_at = self.first_at or time.monotonic()
            return time.monotonic() - self.first_at > self.wait_s
        return False


def _launch_once(request: LaunchRequest, watch: Watch) -> AttemptOutcome:
    """The preflight probes on every node as one TrainJob, followed to its end. It writes nothing of the run's:
    it is not recorded in the run's jobs; its activeDeadlineSeconds bounds it."""
    profile, run_name, stage = request.profile, request.run_name, request.stage
    timeout, tag = stage_timeout(profile, stage), secrets.token_hex(2)
    # attempt 0 in the job's name and folder: the run's preflight
    name, folder = job_name(run_name, 0, tag), RunPaths(profile.store.root, run_name).job(0, tag)
    values = job_secrets(profile)
    manifest = train_job(profile, run_name, None, request.attempt, name, folder, None, sorted(values), stage)
    check_train_job(manifest)
    job = KubeJob(profile, name)
    start, logs, timed_out, final = time.monotonic(), _Logs(job, watch.on_line), False, ("Deleted", "")
    try:  # from the first call on: a job whose creation did not answer may exist all the same
        try:
            job.create(manifest, values)
        except ConnectionError as exc:
            raise LaunchError(f"{exc} when creating TrainJob {name}: is KUBECONFIG's cluster up?") from None
        log.info("%s is TrainJob %s/%s", stage, KubernetesOptions.of(profile).namespace, name)
        final, timed_out = _follow(job, profile, folder, logs, LiveView(watch), start, timeout)
    finally:  # ended, cancelled, timed out, or this follower interrupted: the job must not outlive the attempt
        job.delete()  # its records are in the store and its logs streamed; its pods go with it
    read = _records(profile, folder)
    final = final or ("Deleted", "")
    ended_as = f"TrainJob {name} ended {final[0]} ({final[1] or 'no message'})"
    returncode = {"Complete": 0, "Failed": 1}.get(final[0])
    return hosts_outcome(
        stage, profile, request.attempt, f"TrainJob {name}", ended_as, returncode, read.parts, timed_out,
        time.monotonic() - start, logs.last(), timeout, unreadable=read,
    )  # fmt: skip


def stop_left(profile: Profile, run_name: str, job: LiveJob) -> tuple[bool, str] | None:
    """Delete a recorded TrainJob of the run that its orchestrator left running, and wait until it and its pods are
    gone.

    None when it no longer runs (one that ended is deleted quietly); (False, why) when the TrainJob of that name is
    not this run's (a stale or planted record: left alone); (True, what was done) when it was deleted. LaunchError
    when the API cannot say, or the job is still there after ``STOP_WAIT_S``: a new attempt must not start beside
    it."""
    where = f"TrainJob {job.namespace}/{job.name}"
    if job.name is None:  # a record without a name (planted, or another version's): nothing to stop by it
        return False, f"a record of run {run_name}'s jobs names no TrainJob: left alone"
    if job.namespace != KubernetesOptions.of(profile).namespace:  # a planted record naming another team's namespace
        return False, f"{where} recorded in run {run_name}'s jobs is not in launcher.kubernetes.namespace: left alone"
    kube = KubeJob(profile, job.name, namespace=job.namespace)  # both DNS labels (LiveJob checks)
    kube.asked = True
    try:
        found = kube._get()
    except (ConnectionError, LaunchError) as exc:
        kube.api.close()
        raise LaunchError(
            f"could not see whether {where} of run {run_name} still runs ({exc}); delete it by hand if it does "
            f"(kubectl delete trainjob -n {job.namespace} {job.name}), then start the run again"
        ) from None
    if found is None:
        kube.api.close()
        return None
    said = found.get("metadata", {}).get("annotations") or {}
    if said.get(RUN_ANNOTATION) != run_name or said.get(STORE_ANNOTATION) != store_tag(profile.store.root):
        kube.api.close()
        return False, f"{where} recorded in run {run_name}'s jobs is not one of its jobs: left alone"
    ended = _ended(found) is not None
    if not kube.delete(wait_s=STOP_WAIT_S):
        raise LaunchError(
            f"{where} of run {run_name} (attempt {job.attempt}) is still there after its deletion: delete it by "
            f"hand (kubectl delete trainjob -n {job.namespace} {job.name}), then start the run again"
        )
    if ended:  # its pods had stopped writing: cleaned up, nothing to report
        return None
    by = f"pid {job.pid} on {job.host}" + (f", owner {job.owner}" if job.owner else "")
    return True, f"deleted {where} (attempt {job.attempt}), left running by its orchestrator ({by}): one writer per run"


def _follow(
    job: KubeJob,
    profile: Profile,
    folder: str,
    logs: _Logs,
    view: LiveView,
    start: float,
    timeout: tuple[str, float],
    done: Callable[[], bool] | None = None,
) -> tuple[tuple[str, str] | None, bool]:
    """(how the TrainJob ended, or None once ``done()`` says the attempt in it did; whether it ran past its stage's
    ``timeout`` (key, seconds)), streaming its pods' logs meanwhile. The API is asked every ``launcher.poll_s``;
    ``done`` is asked in between."""
    unreachable_since, said = None, set()
    while True:
        if done is not None:
            look_until = time.monotonic() + profile.launcher.poll_s
            while time.monotonic() < look_until:
                if done():
                    return None, False
                time.sleep(LOOK_S)
        try:
            state, pods = job.state(), job.pods()
            logs.follow(pods)  # also after the end: a pod that ran between two looks still has its log read
            unreachable_since = None
        except ConnectionError as exc:
            unreachable_since = unreachable_since or time.monotonic()
            if time.monotonic() - unreachable_since > UNREACHABLE_FOR_S:
                raise LaunchError(f"the Kubernetes API has not answered for {UNREACHABLE_FOR_S:g}s: {exc}") from None
            state, pods = None, []
        if state is not None:
            return state, False
        if stuck := stuck_pod(pods):
            raise LaunchError(f"TrainJob {job.name}: {stuck}")
        for line in set(unschedulable(pods)) - said:  # once each: the attempt waits, up to its timeout
            said.add(line)
            logs.say(line)
        if view.watch.on_progress is not None or view.watch.on_finding is not None:
            view.look(*filesystem(join(folder, "progress.json"), profile.store.storage_options))
        if time.monotonic() - start > timeout[1]:
            return ("Running", f"stopped at {timeout[0]}"), True
        if done is None:
            time.sleep(profile.launcher.poll_s)


def _records(profile: Profile, folder: str) -> HostParts:
    """The hosts' parts in the store (``read_host_parts``: a bucket writer may have written anything there)."""
    fs, path = filesystem(folder, profile.store.storage_options)
    try:
        names = fs.ls(path, detail=False)
    except FileNotFoundError:
        return HostParts()
    return read_host_parts(fs, names, profile.cluster.nodes)


def job_line(job: LiveJob) -> str:
    """A recorded TrainJob, by its namespace and name (each a DNS label): ValueError for any other identity."""
    if job.job_id or not all(grammar.matches(grammar.DNS_LABEL, v or "") for v in (job.namespace, job.name)):
        raise ValueError("a TrainJob is named by a namespace and a name, each a DNS label")
    return f"TrainJob {job.namespace}/{job.name}"


SPEC = register_launcher(
    LauncherSpec(
        "kubernetes",
        train_attempt,
        frozenset({"train", "preflight"}),
        "a Kubeflow Trainer TrainJob whose pods each run one host supervisor",
        options=KubernetesOptions,
        warm=held.keep,
        job_line=job_line,
        stop_left=stop_left,
    )
)
