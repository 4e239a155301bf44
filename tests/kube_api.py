"""A scripted Kubernetes API server for the kubernetes launcher's tests, with the controllers it stands for.

No Kubernetes API server can run here (none is packaged for this machine's
registries), so this one serves the few REST calls the launcher makes, the way
the real one answers them (paths, status codes, ``Status`` bodies, chunked
log streams), and records every request. Behind it, it plays Kubeflow
Trainer's torch runtime, JobSet and the kubelet for real processes: a created
TrainJob is parsed with Kubeflow Trainer's API models (a 422 if they refuse
it), and each of its ``numNodes`` pods runs its container's command on one of
the "nodes" (``tests/netns.py`` hosts), with the environment Kubernetes would
give it (the runtime's ``PET_*`` variables, ``fieldRef`` and ``secretKeyRef``
values, ``$(NAME)`` expanded in arguments and values), the pod's host name
(its own UTS namespace) and the headless service's DNS names (an
``/etc/netns/…/hosts`` file, which ``ip netns exec`` mounts over
``/etc/hosts``). A failed pod fails the TrainJob and the JobSet stops the other
pods (SIGTERM, then SIGKILL after the grace period), as a JobSet with no
restarts does; deleting the TrainJob stops its pods the same way. The "image"
is this checkout and its Python.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import psutil

from tests import netns
from tests.conftest import BIN, ROOT

TRAINJOBS = re.compile(r"/apis/trainer\.kubeflow\.org/v1alpha1/namespaces/([^/]+)/trainjobs(?:/([^/]+))?")
SECRETS = re.compile(r"/api/v1/namespaces/([^/]+)/secrets(?:/([^/]+))?")
PODS = re.compile(r"/api/v1/namespaces/([^/]+)/pods(?:/([^/]+)(/log)?)?")
MASTER_PORT = 29500  # Kubeflow Trainer's ContainerTrainerPort
GRACE_S = 10.0  # Kubernetes' default is 30 s


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion: ``$(NAME)`` of a defined variable, ``$$`` is ``$``, anything else as written."""

    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", one, text)


class Pod:
    def __init__(self, job: str, index: int, node: netns.Host | None, logs: Path):
        self.job, self.index, self.node = job, index, node
        self.hostname = f"{job}-node-0-{index}"
        self.name = f"{self.hostname}-{secrets.token_hex(3)[:5]}"
        self.log = logs / f"{self.name}.log"
        self.proc: subprocess.Popen | None = None
        self.phase = "Pending"
        self.waiting: tuple[str, str] | None = None
        self.unschedulable: str | None = None  # the scheduler's message for a pod it cannot place

    def start(self, argv: list[str], env: dict[str, str]) -> None:
        uts = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', self.hostname]
        with open(self.log, "wb") as out:  # the process has its own copy
            self.proc = subprocess.Popen(
                self.node.command([*uts, *argv], env), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT
            )
        self.phase = "Running"

    def poll(self) -> str:
        if self.proc is not None and self.phase == "Running" and (code := self.proc.poll()) is not None:
            self.phase = "Succeeded" if code == 0 else "Failed"
        return self.phase

    def stop(self) -> None:
        """A deleted pod: SIGTERM to the container's main process, then, after the grace period, SIGKILL to every
        process left in the container (its PID namespace ends with it)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            tree = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        with contextlib.suppress(subprocess.TimeoutExpired, ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=GRACE_S)
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(tree, timeout=5)
        self.proc.wait()
        self.phase = "Failed" if self.phase == "Running" else self.phase

    def body(self, namespace: str) -> dict[str, Any]:
        labels = {
            "jobset.sigs.k8s.io/jobset-name": self.job,
            "batch.kubernetes.io/job-completion-index": str(self.index),
        }
        spec: dict[str, Any] = {"containers": [{"name": "node"}], "hostname": self.hostname}
        status: dict[str, Any] = {"phase": self.phase}
        if self.node is None:  # not scheduled: no node, no address, no container yet
            reason = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
            status["conditions"] = [{**reason, "message": self.unschedulable}]
        else:
            spec["nodeName"] = self.node.name
            status |= {"podIP": self.node.address, "containerStatuses": [self._container()]}
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": self.name, "namespace": namespace, "labels": labels},
            "spec": spec,
            "status": status,
        }

    def _container(self) -> dict[str, Any]:
        state: dict[str, Any] = {"running": {}}
        if self.waiting:
            state = {"waiting": {"reason": self.waiting[0], "message": self.waiting[1]}}
        elif self.phase in ("Succeeded", "Failed") and self.proc is not None:
            state = {"terminated": {"exitCode": self.proc.returncode}}
        ready = state.keys() == {"running"}
        return {"name": "node", "image": "", "imageID": "", "ready": ready, "restartCount": 0, "state": state}


class KubeCluster:
    """The API server on loopback (``url``) and what runs behind it; ``requests`` lists every call."""

    def __init__(self, nodes: list[netns.Host], folder: Path):
        self.nodes, self.folder = nodes, folder
        self.requests: list[tuple[str, str]] = []
        self.bodies: list[tuple[str, str, Any]] = []  # (method, path, body) of every call that sent one
        self.open = True
        self.secrets: dict[tuple[str, str], dict[str, Any]] = {}
        self.jobs: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], list[Pod]] = {}
        self.scheduled: list[tuple[str, str]] = []  # (pod, node) of every pod ever started
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        threading.Thread(target=self._reconcile, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def kubeconfig(self, path: Path) -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": {"server": self.url}}],
            "users": [{"name": "test", "user": {"token": "test-token"}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
            "current-context": "test",
        }
        path.write_text(json.dumps(config))
        return path

    def close(self) -> None:
        self.open = False
        self.server.shutdown()
        self.server.server_close()
        for pods in list(self.pods.values()):
            for pod in pods:
                pod.stop()
        for node in self.nodes:
            shutil.rmtree(f"/etc/netns/{node.namespace}", ignore_errors=True)

    # ------------------------------------------------------------------ what the controllers do

    def create_job(self, namespace: str, job: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        from kubeflow_trainer_api.models.trainer_v1alpha1_train_job import TrainerV1alpha1TrainJob
        from pydantic import ValidationError

        try:
            TrainerV1alpha1TrainJob.from_dict(job)
        except (ValidationError, ValueError) as exc:
            return 422, _status(422, "Invalid", f"TrainJob.trainer.kubeflow.org is invalid: {exc}".splitlines()[0])
        name = job["metadata"]["name"]
        if (namespace, name) in self.jobs:
            return 409, _status(409, "AlreadyExists", f'trainjobs.trainer.kubeflow.org "{name}" already exists')
        job["metadata"].update(uid=str(uuid.uuid4()), namespace=namespace)
        job["status"] = {"conditions": []}
        self.jobs[(namespace, name)] = job
        self.pods[(namespace, name)] = []
        threading.Thread(target=self._run, args=(namespace, job), daemon=True).start()
        return 201, job

    def _run(self, namespace: str, job: dict[str, Any]) -> None:
        """JobSet and the kubelet: schedule the pods on nodes the job's affinity allows, start their containers."""
        name, trainer = job["metadata"]["name"], job["spec"]["trainer"]
        avoid = _excluded(job["spec"].get("runtimePatches", []))
        nodes = [n for n in self.nodes if n.name not in avoid]
        count = trainer["numNodes"]
        if len(nodes) < count:  # the scheduler cannot place them all: every pod stays Pending, saying why
            pods = [Pod(name, i, None, self.folder) for i in range(count)]
            for pod in pods:
                pod.unschedulable = (
                    f"0/{len(self.nodes)} nodes are available: {len(avoid)} didn't match Pod's node affinity"
                )
            self.pods[(namespace, name)] = pods
            return
        pods = [Pod(name, i, nodes[i], self.folder) for i in range(count)]
        if trainer["image"].startswith("unpullable/"):  # the kubelet cannot pull it: the pods wait, saying why
            for pod in pods:
                pod.waiting = ("ErrImagePull", f'failed to pull image "{trainer["image"]}": not found')
            self.pods[(namespace, name)] = pods
            return
        hosts = ["127.0.0.1 localhost"]
        hosts += [
            f"{p.node.address} {p.hostname}.{name}.{namespace}.svc.cluster.local {p.hostname}.{name}" for p in pods
        ]
        for p in pods:
            os.makedirs(f"/etc/netns/{p.node.namespace}", exist_ok=True)
            own = f"{p.node.address} {p.hostname}"
            Path(f"/etc/netns/{p.node.namespace}/hosts").write_text("\n".join([*hosts, own]) + "\n")
        self.pods[(namespace, name)] = pods
        for pod in pods:
            env = self._env(namespace, job, pod)
            if env is None:
                return  # a missing Secret: CreateContainerConfigError, the pod stays Pending
            argv = [_expand(a, env) for a in [*trainer.get("command", []), *trainer.get("args", [])]]
            pod.start(argv, env)
            self.scheduled.append((pod.name, pod.node.name))

    def _env(self, namespace: str, job: dict[str, Any], pod: Pod) -> dict[str, str] | None:
        name, trainer = job["metadata"]["name"], job["spec"]["trainer"]
        env = {"PATH": f"{BIN}:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "PYTHONPATH": str(ROOT)}  # the image's
        env["HOSTNAME"] = pod.hostname
        env |= {
            "PET_NNODES": str(trainer["numNodes"]),
            "PET_NPROC_PER_NODE": str(trainer.get("numProcPerNode", "auto")),
            "PET_NODE_RANK": str(pod.index),
            "PET_MASTER_ADDR": f"{name}-node-0-0.{name}",
            "PET_MASTER_PORT": str(MASTER_PORT),
        }
        for var in trainer.get("env", []):
            if "value" in var:
                env[var["name"]] = _expand(var["value"], env)
                continue
            source = var["valueFrom"]
            if "fieldRef" in source:
                field = source["fieldRef"]["fieldPath"]
                env[var["name"]] = {"status.podIP": pod.node.address, "spec.nodeName": pod.node.name}[field]
            else:
                ref = source["secretKeyRef"]
                secret = self.secrets.get((namespace, ref["name"]))
                if secret is None or ref["key"] not in secret["data"]:
                    return None
                env[var["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
        return env

    def _reconcile(self) -> None:
        """The TrainJob's conditions from its pods: Complete when all succeeded; Failed at the first failure, and
        the JobSet stops the rest."""
        while self.open:
            time.sleep(0.1)
            for key, job in list(self.jobs.items()):
                pods, conditions = self.pods.get(key, []), job["status"]["conditions"]
                phases = [p.poll() for p in pods]
                if conditions or not pods:
                    continue
                if "Failed" in phases:
                    failed = next(p for p in pods if p.phase == "Failed")
                    message = f"jobset failed: pod {failed.name} failed (exit code {failed.proc.returncode})"
                    conditions.append(
                        {"type": "Failed", "status": "True", "reason": "JobSetFailed", "message": message}
                    )
                    threading.Thread(target=_stop_all, args=(pods,), daemon=True).start()
                elif all(ph == "Succeeded" for ph in phases):
                    conditions.append(
                        {"type": "Complete", "status": "True", "reason": "JobSetCompleted", "message": ""}
                    )

    def delete_job(self, namespace: str, name: str) -> tuple[int, dict[str, Any]]:
        if (namespace, name) not in self.jobs:
            return 404, _status(404, "NotFound", f'trainjobs.trainer.kubeflow.org "{name}" not found')

        def foreground() -> None:
            _stop_all(self.pods.get((namespace, name), []))
            self.pods.pop((namespace, name), None)
            self.jobs.pop((namespace, name), None)

        threading.Thread(target=foreground, daemon=True).start()
        return 200, _status(200, "", "", status="Success")

    def log_stream(self, namespace: str, pod_name: str) -> Iterator[bytes]:
        pod = next((p for ps in self.pods.values() for p in ps if p.name == pod_name), None)
        if pod is None:
            return
        with open(pod.log, "rb") as fh:
            while True:
                chunk = fh.read(65536)
                if chunk:
                    yield chunk
                elif pod.poll() in ("Succeeded", "Failed"):
                    if rest := fh.read():
                        yield rest
                    return
                else:
                    time.sleep(0.05)


def _excluded(patches: list[dict[str, Any]]) -> set[str]:
    """The node names the TrainJob's runtime patches keep the "node" job's pods off (metadata.name NotIn)."""
    out: set[str] = set()
    for patch in patches:
        jobs = patch.get("trainingRuntimeSpec", {}).get("template", {}).get("spec", {}).get("replicatedJobs", [])
        for job in (j for j in jobs if j.get("name") == "node"):
            spec = job["template"]["spec"]["template"]["spec"]
            required = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            for term in required["nodeSelectorTerms"]:
                for field in term.get("matchFields", []):
                    if (field["key"], field["operator"]) == ("metadata.name", "NotIn"):
                        out |= set(field["values"])
    return out


def _stop_all(pods: list[Pod]) -> None:
    """Every pod at once, as the kubelets of their nodes do."""
    threads = [threading.Thread(target=pod.stop) for pod in pods]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _status(code: int, reason: str, message: str, status: str = "Failure") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Status", "status": status, "reason": reason, "message": message, "code": code}


def _handler(cluster: KubeCluster) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            return

        def _body(self) -> Any:
            length = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(length) or b"null")

        def _send(self, code: int, obj: Any) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _route(self, method: str) -> None:
            url = urlparse(self.path)
            cluster.requests.append((method, url.path))
            if self.headers.get("Authorization") != "Bearer test-token":
                return self._send(401, _status(401, "Unauthorized", "Unauthorized"))
            body = self._body() if method in ("POST", "PATCH", "DELETE") else None
            if body is not None:
                cluster.bodies.append((method, url.path, body))
            if (m := PODS.fullmatch(url.path)) and m.group(3):  # a log streams outside the lock, for minutes
                return self._stream(cluster.log_stream(m.group(1), m.group(2)))
            with cluster.lock:
                answer = self._answer(method, url.path, parse_qs(url.query), body)
            self._send(*answer)

        def _answer(self, method: str, path: str, query: dict, body: Any) -> tuple[int, Any]:
            if m := TRAINJOBS.fullmatch(path):
                ns, name = m.groups()
                if method == "POST":
                    return cluster.create_job(ns, body)
                if method == "DELETE":
                    return cluster.delete_job(ns, name)
                job = cluster.jobs.get((ns, name))
                return (200, job) if job else (404, _status(404, "NotFound", f'trainjobs "{name}" not found'))
            if m := SECRETS.fullmatch(path):
                return self._secret(method, *m.groups(), body)
            if m := PODS.fullmatch(path):
                ns = m.group(1)
                selector = query.get("labelSelector", [""])[0]
                job = selector.split("=", 1)[1] if "=" in selector else ""
                items = [p.body(ns) for p in cluster.pods.get((ns, job), [])]
                return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}
            return 404, _status(404, "NotFound", f"the server could not find the requested resource ({path})")

        def _secret(self, method: str, ns: str, name: str | None, body: Any) -> tuple[int, Any]:
            if method == "POST":
                name = body["metadata"]["name"]
                if (ns, name) in cluster.secrets:
                    return 409, _status(409, "AlreadyExists", f'secrets "{name}" already exists')
                data = {k: base64.b64encode(v.encode()).decode() for k, v in body.pop("stringData", {}).items()}
                secret = {**body, "data": data}
                secret["metadata"].update(uid=str(uuid.uuid4()), namespace=ns)
                cluster.secrets[(ns, name)] = secret
                return 201, secret
            secret = cluster.secrets.get((ns, name))
            if secret is None:
                return 404, _status(404, "NotFound", f'secrets "{name}" not found')
            if method == "PATCH":
                secret["metadata"].update(body.get("metadata", {}))
                return 200, secret
            if method == "DELETE":
                del cluster.secrets[(ns, name)]
                return 200, _status(200, "", "", status="Success")
            return 200, secret

        def _stream(self, chunks: Iterator[bytes]) -> None:
            """A follow=true log: chunked, open until the container ended (the pod's log as Kubernetes serves it)."""
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            with contextlib.suppress(OSError):
                for chunk in chunks:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

        def do_GET(self) -> None:
            self._route("GET")

        def do_POST(self) -> None:
            self._route("POST")

        def do_PATCH(self) -> None:
            self._route("PATCH")

        def do_DELETE(self) -> None:
            self._route("DELETE")

    return Handler


@contextlib.contextmanager
def cluster(folder: Path, nodes: int = 2) -> Iterator[KubeCluster]:
    with netns.hosts(nodes) as hosts:
        kube = KubeCluster(hosts, folder)
        try:
            yield kube
        finally:
            kube.close()
