"""A host's part that lasts as long as its cluster job: one training attempt per request, forked warm.

    python -m trainpipe.trainer.supervise.host --serve FOLDER --run-name NAME [--idle-s S] [--profile-env V] [--set …]

What every node of a Slurm job and every pod of a TrainJob runs (docs/architecture.md §4). FOLDER is the job's
folder (a path in ``launcher.shared_dir`` under Slurm, a URI in the run's store under Kubernetes). The train
task's follower asks for an attempt by writing the attempt's ``profile.yaml`` into a folder beside FOLDER,
then ``FOLDER/request-{attempt}.json`` (an ``AttemptRequest``). Every host runs its part of that attempt
(``trainer.supervise.attempt.train_attempt``) with that profile, writes ``host-{node rank}.json`` into the
attempt's folder, and waits for the next request. The first attempt's part starts the host's warm host
(``trainer.supervise.warm_host``), so every later attempt's torchrun agent is forked from an interpreter that
has torch, DCP and the model's module loaded, and opens the host's memory tier (``checkpoint.memory_every_steps``:
``trainer.checkpoint.memory_tier``), whose snapshots a retry resumes from and which is removed when the part
ends. A host's part ends when ``FOLDER/stop`` appears, when no request
came for ``--idle-s`` seconds (its orchestrator died), or on SIGTERM (scancel, the pod's deletion).

A store may be written by others (docs/security.md): a request is signed with the job's secret token (HMAC-SHA256
over its fields, the profile's SHA-256 among them), which only the follower and the job's hosts hold; a request
that is not signed by it, or whose profile is not the one it names, is left alone. Every field is parsed by its
grammar and no field reaches a shell.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import posixpath
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsspec.implementations.local import LocalFileSystem
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainpipe.trainer import grammar
from trainpipe.trainer.checkpoint.memory_tier import keep_memory, leave_behind, run_key
from trainpipe.trainer.config import Profile
from trainpipe.trainer.data.sources import NotRegularFile, read_bounded
from trainpipe.trainer.errors import TrainpipeError
from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.proc import node_name, process_started_at
from trainpipe.trainer.profile_files import load_profile, with_private_env
from trainpipe.trainer.store import filesystem, write_text
from trainpipe.trainer.store_paths import RUN_PROFILE, join
from trainpipe.trainer.supervise.warm_host import keep_warm

log = logging.getLogger("trainpipe.allocation")
REQUEST = re.compile(r"request-([1-9][0-9]{0,5})\.json")
ATTEMPT_FOLDER = r"attempt-[1-9][0-9]{0,5}-[0-9a-f]{4,6}"
STOP = "stop"
REPLACED = b"replaced"  # a stop's text when a job of the run takes this one's place
REQUEST_LIMIT_BYTES = 64 * 1024
PROFILE_LIMIT_BYTES = 1024 * 1024
LOOK_S = 0.05  # how often an idle host looks for the next request in a folder: part of every retry's start
LOOK_REMOTE_S = 0.5  # in an object store, where each look is a request


class AttemptRequest(BaseModel):
    """One attempt a host's part is asked to run: its folder (a sibling of the job's), its inputs, the SHA-256 of
    the profile in its folder, and the HMAC of all of them under the job's token."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    attempt: int = Field(ge=1, le=999_999)
    folder: str = Field(pattern=rf"^{ATTEMPT_FOLDER}$")
    dataset_uri: str = Field(min_length=1, max_length=4096)
    mlflow_run_id: str | None = Field(default=None, pattern=rf"^{grammar.MLFLOW_RUN_ID}$")
    profile_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    mac: str = Field(default="", pattern=r"^([0-9a-f]{64})?$")

    @classmethod
    def signed(cls, key: str, profile_text: str, **fields: Any) -> AttemptRequest:
        digest = hashlib.sha256(profile_text.encode("utf-8")).hexdigest()
        unsigned = cls(profile_sha256=digest, **fields)
        return unsigned.model_copy(update={"mac": unsigned._mac(key)})

    def _mac(self, key: str) -> str:
        body = self.model_dump_json(exclude={"mac"}).encode("utf-8")
        return hmac.new(key.encode("utf-8"), body, hashlib.sha256).hexdigest()

    def checked(self, key: str) -> AttemptRequest:
        if not key or not hmac.compare_digest(self.mac, self._mac(key)):
            raise ValueError("not signed with this job's token")
        if problem := grammar.control_problem([self.dataset_uri]):
            raise ValueError(problem)
        return self


def request_name(attempt: int) -> str:
    return f"request-{attempt}.json"


class Requests:
    """The job's folder as its hosts read it: the requests, the stop, each attempt's profile and parts."""

    def __init__(self, folder: str, storage_options: dict[str, Any] | None, key: str):
        self.folder, self.options, self.key = folder.rstrip("/"), storage_options or {}, key
        self.fs, self.path = filesystem(self.folder, self.options)
        self.look_s = LOOK_S if isinstance(self.fs, LocalFileSystem) else LOOK_REMOTE_S
        self._refused: set[tuple[str, tuple[str, ...]]] = set()  # (name, version) of files that are not requests

    def stopped(self) -> bool:
        return bool(self.fs.exists(posixpath.join(self.path, STOP)))

    def replaced(self) -> bool:
        """Whether the stop says a job of the run takes this one's place (``stop(replaced=True)``)."""
        with contextlib.suppress(OSError, ValueError, NotRegularFile):  # read as any file of this folder
            return read_bounded(self.fs, posixpath.join(self.path, STOP), len(REPLACED)) == REPLACED
        return False

    def next(self, after: int) -> AttemptRequest | None:
        """The lowest-numbered request above ``after`` that is this job's (signed with its token, for the attempt
        its name says); None when there is none yet. A file that is not one (planted, changed, a FIFO) is said
        once per version and moves nothing: a signed request of any number, before or after it, still runs, and
        a planted file the follower then writes over is read again."""
        listing = self.fs.ls(self.path, detail=True)
        found = []
        for info in listing:
            name = posixpath.basename(str(info.get("name", "")).rstrip("/"))
            if (m := REQUEST.fullmatch(name)) and int(m.group(1)) > after:
                version = tuple(str(info.get(k)) for k in ("size", "mtime", "ino", "ETag", "LastModified"))
                found.append((int(m.group(1)), name, version))
        for number, name, version in sorted(found):
            if (name, version) in self._refused:
                continue
            try:
                return self._read(number, name)
            except (OSError, NotRegularFile, ValidationError, ValueError) as exc:
                why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                log.warning("%s is not an attempt request of this job (%s): left alone", name, why)
                self._refused.add((name, version))
        return None

    def _read(self, number: int, name: str) -> AttemptRequest:
        body = read_bounded(self.fs, posixpath.join(self.path, name), REQUEST_LIMIT_BYTES)
        if body is None:
            raise ValueError(f"larger than {REQUEST_LIMIT_BYTES} bytes")
        request = AttemptRequest.model_validate_json(body).checked(self.key)
        if request.attempt != number:
            raise ValueError(f"it asks for attempt {request.attempt}")
        return request

    def attempt_folder(self, request: AttemptRequest) -> str:
        return join(posixpath.dirname(self.folder), request.folder)

    def profile(self, request: AttemptRequest, settings: list[str]) -> Profile:
        """The attempt's profile, once its bytes are the ones the request names. TrainpipeError when not."""
        fs, path = filesystem(join(self.attempt_folder(request), RUN_PROFILE), self.options)
        try:
            body = read_bounded(fs, path, PROFILE_LIMIT_BYTES)
        except (OSError, NotRegularFile) as exc:
            raise TrainpipeError(f"its profile cannot be read ({type(exc).__name__})") from None
        if body is None or hashlib.sha256(body).hexdigest() != request.profile_sha256:
            raise TrainpipeError("its profile is not the one the request names")
        with tempfile.TemporaryDirectory() as tmp:  # a profile is loaded from a file
            Path(tmp, RUN_PROFILE).write_bytes(body)
            return with_private_env(load_profile(str(Path(tmp, RUN_PROFILE)), settings))


def ask(folder: str, storage_options: dict[str, Any] | None, request: AttemptRequest) -> None:
    """The follower's side: every host of the job in ``folder`` runs ``request`` next."""
    fs, path = filesystem(folder, storage_options)
    write_text(fs, posixpath.join(path, request_name(request.attempt)), request.model_dump_json())


def stop(folder: str, storage_options: dict[str, Any] | None, replaced: bool = False) -> None:
    """The follower's side: the job's hosts end once the attempt they run (if any) is over; ``replaced``: a job of
    the run takes this one's place, so each host leaves its memory tier for the next job's host there to take up
    (``memory_tier.adopt_orphaned``)."""
    fs, path = filesystem(folder, storage_options)
    write_text(fs, posixpath.join(path, STOP), REPLACED.decode() if replaced else "")


def serve(
    requests: Requests,
    run_name: str,
    settings: list[str],
    node_rank_of: Callable[[int], int],
    run_part: Callable[[Profile, AttemptRequest, str, float], dict[str, Any]],
    write_part: Callable[[str, int, dict[str, Any]], None],
    idle_s: float,
    say: Callable[[str], None],
) -> int:
    """Run every request that comes into the job's folder until it is stopped; 0 when it ended as asked or idle.

    ``node_rank_of(configured)``: this host's node rank given the profile's ``cluster.node_rank``;
    ``run_part(profile, request, attempt folder, started_at)`` runs this host's part and returns its record;
    ``write_part(attempt folder, node rank, record)`` writes it. A request whose profile does not load
    is answered with an ``error`` part, so the follower hears at once what went wrong."""
    last, idle_since, first, warm_started, memory = 0, time.monotonic(), True, False, None
    with contextlib.ExitStack() as warm:
        while not requests.stopped():
            request = requests.next(last)
            if request is None:
                if time.monotonic() - idle_since > idle_s:
                    say(f"no attempt was asked for in {idle_s:g}s: this host's part of the job ends")
                    return 0
                time.sleep(requests.look_s)
                continue
            last = request.attempt
            # The first part's queue ended when this process started; a later one's when its request was seen.
            started_at, first = (process_started_at() or time.time()) if first else time.time(), False
            attempt_dir, rank = requests.attempt_folder(request), node_rank_of(0)
            try:
                profile = requests.profile(request, settings)
                profile.cluster.node_rank = rank = node_rank_of(profile.cluster.node_rank)
                if not warm_started:  # the first attempt starts them; the others fork, and find the snapshots
                    warm.enter_context(keep_warm(profile.cluster.warm_host))
                    # The memory tier lives as long as this host's part of the job, so a retry resumes from it;
                    # a job that replaced one (a host was lost) takes up what this host held for the run.
                    key = run_key(profile.store.root, run_name)
                    memory = warm.enter_context(keep_memory(profile.checkpoint.memory_every_steps != "off", adopt=key))
                    warm_started = True
                say(f"attempt {request.attempt} of run {run_name}")
                record = run_part(profile, request, attempt_dir, started_at)
            except Exception as exc:  # noqa: BLE001 - said in this host's part: the follower must hear at once
                say(f"attempt {request.attempt}: {_why(exc)}")
                record = error_record(rank, request.attempt, exc)
            try:
                write_part(attempt_dir, rank, record)
            except Exception as exc:  # noqa: BLE001 - the store away now: the follower names this host, the next may run
                say(f"attempt {request.attempt}: this host's part could not be written ({type(exc).__name__})")
            idle_since = time.monotonic()
        if memory is not None and requests.replaced():
            leave_behind(memory)
            say("a job of the run takes this one's place: this host's memory tier stays for it")
    say("the job's attempts are over: this host's part ends")
    return 0


def _why(exc: Exception) -> str:
    """One line: a trainpipe error's own message (written for users, credentials left out), else only the type
    (another exception's text may quote what it was given: a store's settings)."""
    text = str(exc).splitlines()[0][:300] if isinstance(exc, TrainpipeError) and str(exc) else ""
    return text or type(exc).__name__


def error_record(node_rank: int, attempt: int, exc: Exception) -> dict[str, Any]:
    """A host's part that could not run its attempt: the launcher reads why."""
    from trainpipe.trainer.supervise.host import incident_record  # the host module runs this one

    detail = f"node {node_rank} could not run attempt {attempt}: {_why(exc)}"
    return incident_record(node_rank, Incident(kind="error", detail=detail, attempt=attempt, node=node_name()))
