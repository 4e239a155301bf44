"""A host's part that lasts as long as its cluster allocation: one training attempt per request, forked warm.

    python -m trainpipe.trainer.supervise.host --serve FOLDER --run-name NAME [--idle-s S] [--set …]

What the Slurm launcher's job script runs on every node (docs/architecture.md §4). The train task's follower
asks for an attempt by writing ``FOLDER/request-{attempt}.json`` (an ``AttemptRequest``) after the attempt's
folder beside FOLDER holds its ``profile.yaml``; every host runs its part of that attempt
(``trainer.supervise.attempt.train_attempt``) with the attempt's profile, writes ``host-{node rank}.json``
into the attempt's folder, and waits for the next request. The first attempt's part starts the host's warm
host (``trainer.supervise.warm_host``), so every later attempt's torchrun agent is forked from an interpreter
that has torch, DCP and the model's module loaded. A host's part ends when ``FOLDER/stop`` appears, when no
request came for ``--idle-s`` seconds (its orchestrator died), or on SIGTERM (scancel).

The folder is the launcher's ``launcher.shared_dir``, which the operator's account alone writes (docs/security.md);
a request is still parsed as data (its fields by their grammars, the file bounded), never executed.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsspec.implementations.local import LocalFileSystem
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainpipe.trainer import grammar
from trainpipe.trainer.config import Profile, load_profile, with_private_env
from trainpipe.trainer.data.sources import NotRegularFile, read_bounded
from trainpipe.trainer.errors import TrainpipeError
from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.layout import RUN_PROFILE
from trainpipe.trainer.proc import node_name, process_started_at
from trainpipe.trainer.supervise.warm_host import keep_warm

log = logging.getLogger("trainpipe.allocation")
REQUEST = re.compile(r"request-(\d{1,6})\.json")
ATTEMPT_FOLDER = r"attempt-\d{1,6}-[0-9a-f]{6}"
STOP = "stop"
REQUEST_LIMIT_BYTES = 64 * 1024
LOOK_S = 0.05  # how often an idle host looks for the next request: part of every retry's start


class AttemptRequest(BaseModel):
    """One attempt a host's part is asked to run: its folder (a sibling of the allocation's) and its inputs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    attempt: int = Field(ge=1, le=999_999)
    folder: str = Field(pattern=rf"^{ATTEMPT_FOLDER}$")
    dataset_uri: str = Field(min_length=1, max_length=4096)
    mlflow_run_id: str | None = Field(None, pattern=rf"^{grammar.MLFLOW_RUN_ID}$")

    def checked(self) -> AttemptRequest:
        if problem := grammar.control_problem([self.dataset_uri]):
            raise ValueError(problem)
        return self


def request_name(attempt: int) -> str:
    return f"request-{attempt}.json"


def next_request(folder: Path, after: int) -> tuple[int, AttemptRequest | None] | None:
    """The lowest-numbered request above ``after``: (its number, the request, or None when the file is not one,
    said once); None when there is none yet."""
    numbers = sorted(
        int(m.group(1)) for p in folder.iterdir() if (m := REQUEST.fullmatch(p.name)) and int(m.group(1)) > after
    )
    if not numbers:
        return None
    number = numbers[0]
    path = folder / request_name(number)
    try:
        body = read_bounded(LocalFileSystem(), str(path), REQUEST_LIMIT_BYTES)
        if body is None:
            raise ValueError(f"larger than {REQUEST_LIMIT_BYTES} bytes")
        request = AttemptRequest.model_validate_json(body).checked()
        if request.attempt != number:
            raise ValueError(f"it asks for attempt {request.attempt}")
        return number, request
    except (OSError, NotRegularFile, ValidationError, ValueError) as exc:
        why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        log.warning("%s is not an attempt request (%s): left alone", path.name, why)
        return number, None


def serve(
    folder: Path,
    run_name: str,
    settings: list[str],
    node_rank_of: Callable[[int], int],
    run_part: Callable[[Profile, AttemptRequest, Path, float], dict[str, Any]],
    write_part: Callable[[Path, int, dict[str, Any]], None],
    idle_s: float,
    say: Callable[[str], None],
) -> int:
    """Run every request that comes into ``folder`` until it is stopped; 0 when it ended as asked or idle.

    ``node_rank_of(configured)``: this host's node rank given the profile's ``cluster.node_rank``;
    ``run_part(profile, request, attempt folder, started_at)`` runs this host's part and returns its record;
    ``write_part(attempt folder, node rank, record)`` writes it. A request whose profile does not load is
    answered with an ``error`` part, so the follower hears at once what went wrong."""
    last, idle_since, first = 0, time.monotonic(), True
    with contextlib.ExitStack() as warm:
        while not (folder / STOP).exists():
            found = next_request(folder, last)
            if found is None:
                if time.monotonic() - idle_since > idle_s:
                    say(f"no attempt was asked for in {idle_s:g}s: this host's part of the allocation ends")
                    return 0
                time.sleep(LOOK_S)
                continue
            last, request = found
            if request is None:
                continue
            # The first part's queue ended when this process started; a later one's when its request was seen.
            started_at = process_started_at() if first else time.time()
            attempt_dir = folder.parent / request.folder
            try:
                profile = with_private_env(load_profile(str(attempt_dir / RUN_PROFILE), settings))
            except TrainpipeError as exc:
                say(f"attempt {request.attempt}: {exc}")
                write_part(attempt_dir, node_rank_of(0), error_record(node_rank_of(0), request.attempt, exc))
                idle_since = time.monotonic()
                continue
            profile.cluster.node_rank = node_rank_of(profile.cluster.node_rank)
            if first and profile.cluster.warm_host:  # the first attempt starts the warm host; the others fork from it
                warm.enter_context(keep_warm(True))
            first = False
            say(f"attempt {request.attempt} of run {run_name}")
            write_part(attempt_dir, profile.cluster.node_rank, run_part(profile, request, attempt_dir, started_at))
            idle_since = time.monotonic()
    say("the allocation's attempts are over: this host's part ends")
    return 0


def error_record(node_rank: int, attempt: int, exc: Exception) -> dict[str, Any]:
    """A host's part that could not start its attempt: the launcher reads why."""
    detail = f"node {node_rank} could not start attempt {attempt}: {str(exc).splitlines()[0][:300]}"
    incident = Incident(kind="error", detail=detail, attempt=attempt, node=node_name())
    return {
        "node": node_name(),
        "node_rank": node_rank,
        "attempt": attempt,
        "result": None,
        "incident": incident.model_dump(mode="json"),
        "findings": [],
        "returncode": None,
    }
