"""A cluster job's attempt outcome from its hosts' parts: what the slurm and kubernetes launchers return."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from trainpipe.trainer import store_retry
from trainpipe.trainer.config import Profile
from trainpipe.trainer.data.sources import NotRegularFile, read_bounded
from trainpipe.trainer.errors import TrainpipeError
from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.launcher import (
    AttemptOutcome,
    HostPart,
    JobOutcome,
    NodeProgress,
    Watch,
    stage_outcome,
    validation_line,
)
from trainpipe.trainer.store import NotARecord, read_json
from trainpipe.trainer.supervise.host import job_outcome

log = logging.getLogger("trainpipe.launch")
PART_NAME = re.compile(r"host-(\d{1,7})\.json")
PROGRESS_LIMIT_BYTES = 16 * 2**20  # a beacon per rank and the findings, as a host part
PART_LIMIT_BYTES = 16 * 2**20  # a part holds one beacon per rank of its host and its findings: far below this


@dataclass(frozen=True)
class HostParts:
    """The hosts' parts a launcher read back (as JSON dicts), and those it left out."""

    parts: list[dict[str, Any]] = field(default_factory=list)
    problem: str | None = None  # the first part left out, and why, in one line
    left_out: frozenset[int] = frozenset()  # node ranks whose file was there but is not their part


def read_host_parts(fs: Any, paths: list[str], nodes: int) -> HostParts:
    """The parts at ``paths`` (``host-{node rank}.json``; other names are ignored), each read as a regular file
    of at most ``PART_LIMIT_BYTES`` and by ``HostPart``, for a job of ``nodes`` nodes. A file that is not the
    part of its node rank (too large, not JSON, an unknown field, another node rank than its name's, a node
    of another trainpipe version) is left out, as if that host had written none, and said once."""
    parts, problems, left_out = [], [], set()
    for path in sorted(paths):
        name = path.rsplit("/", 1)[-1]
        if not (match := PART_NAME.fullmatch(name)) or int(match.group(1)) >= nodes:
            continue
        rank, why = int(match.group(1)), None
        try:
            body = read_bounded(fs, path, PART_LIMIT_BYTES)
            if body is None:
                why = f"larger than {PART_LIMIT_BYTES // 2**20} MiB"
            else:
                part = HostPart.model_validate_json(body)
                if part.node_rank != rank:
                    why = f"it says node rank {part.node_rank}"
                else:
                    parts.append(part.model_dump(mode="json"))
        except ValidationError as exc:
            why = validation_line(exc)
        except NotRegularFile as exc:  # a folder, a FIFO, a device
            why = f"not a regular file: {exc.what}"
        except OSError as exc:  # gone meanwhile, unreadable
            why = type(exc).__name__
        if why is not None:
            left_out.add(rank)
            problems.append(f"{name} is not node {rank}'s part of the job ({why}; a node of another version?)")
    return HostParts(parts, problems[0] if problems else None, frozenset(left_out))


def hosts_outcome(
    stage: str,
    profile: Profile,
    attempt: int,
    job: str,
    ended_as: str,
    returncode: int | None,
    records: list[dict[str, Any]],
    timed_out: bool,
    wall_s: float,
    tail: list[str],
    timeout: tuple[str, float] | None = None,
    node_names: dict[int, str] | None = None,
    unreadable: HostParts | None = None,
) -> AttemptOutcome:
    """``stage``: what the job ran (its result is typed by it); ``records``: the ``outcome_record`` of every host
    that wrote one; ``job`` names the cluster's job
    ("slurm job 12") and ``ended_as`` says how the cluster saw it end, for an attempt no host explains;
    ``node_names``: each node rank's host, where the launcher knows it (a missing part's culprit is named);
    ``unreadable``: what ``read_host_parts`` left out: said with the missing host, never blamed on it (its file
    may have been written by someone else)."""
    merged = job_outcome(records) if records else {"result": None, "incident": None, "findings": []}
    incident = Incident.model_validate(merged["incident"]) if merged["incident"] else None
    result = merged["result"] if len(records) == profile.cluster.nodes else None
    missing = sorted(set(range(profile.cluster.nodes)) - {r.get("node_rank") for r in records})
    if timed_out:
        key, limit = timeout or ("train.timeout_s", profile.train.timeout_s)
        detail = f"attempt {attempt} ({job}) exceeded {key}={limit:g}s"
        incident = Incident(kind="timeout", detail=detail, attempt=attempt)
    elif result is None and missing:
        # A host whose part is missing is the likeliest culprit: its supervisor died (SIGKILL, its machine lost)
        # before it could write one. What the others report (a peer's connection reset) follows from it, so it
        # is told, not blamed: excluding the host that did report would exclude a survivor.
        others = f"; the others then: {incident.line()}" if incident else ""
        said = f"its output: {tail[-1]}" if tail else "no output"
        blameless = unreadable.left_out if unreadable else frozenset()
        named = (node_names or {}).get(missing[0]) if len(missing) == 1 and missing[0] not in blameless else None
        detail = f"{ended_as} before node(s) {missing} reported (their supervisor died?); {said}{others}"
        detail += f"; {unreadable.problem}" if unreadable and unreadable.problem else ""
        incident = Incident(kind="crash", detail=detail, attempt=attempt, node=named)
    node0 = next((r for r in records if r.get("node_rank") == 0), {})
    # The job could run once every host's supervisor had started: before that, it waited in the cluster's queue.
    starts = [s for r in records if (s := r.get("started_at")) is not None]
    started_at = max(starts) if starts and len(starts) == len(records) and not missing else None
    typed, report, incident = stage_outcome(stage, result, attempt, None if result is not None else incident)
    return AttemptOutcome(
        attempt,
        JobOutcome(returncode, wall_s, timed_out, tail, job=job),
        typed,
        incident,
        [Incident.model_validate(f) for f in merged["findings"]],
        {int(r): p for r, p in node0.get("progress", {}).items()},
        node0.get("first_step_at"),
        node0.get("first_step"),
        scores=node0.get("scores", []),
        report=report,
        started_at=started_at,
    )


def forked_warm(parts: list[dict[str, Any]]) -> bool:
    """Whether every host's torchrun agent of an attempt was forked by its warm host (``HostPart.agent``)."""
    return bool(parts) and all("forked by a warm host" in (p.get("agent") or "") for p in parts)


class LiveView:
    """A cluster attempt's follower's view of node 0's ``progress.json`` (``trainer.supervise.host.ProgressFile``):
    every rank's latest beacon goes to ``watch.on_progress``, each warning node 0's watchdog found goes to
    ``watch.on_finding`` once, while the job runs. The file lies where others may write (the store, under
    Kubernetes): it is read by ``NodeProgress``, and one that is not node 0's progress is left out, said once in
    one line and blamed on no one."""

    def __init__(self, watch: Watch):
        self.watch = watch
        self._said: set[str] = set()
        self._ranks: dict[int, dict[str, Any]] = {}  # the last view that parsed

    def look(self, fs: Any, path: str) -> None:
        """Read ``progress.json`` at ``path`` now (bounded, a regular file only) and pass on what it says; nothing
        while it is not there, half written, or the store does not answer (the next look tries again)."""
        body: object = None  # on_progress hears every look, with or without a file: it is where a cancel is seen
        try:
            with store_retry.limited(2.0):
                body = read_json(fs, path, PROGRESS_LIMIT_BYTES)
        except NotARecord as exc:
            self._say(f"{exc} (node 0's progress: left out, blamed on no one)")
        except (OSError, ValueError, TrainpipeError) as exc:  # FileNotFoundError included; a JSONDecodeError
            log.debug("progress: %s", exc)
        self(body)

    def __call__(self, body: object) -> None:
        """``body``: what ``progress.json`` holds now; None when there is nothing to read (the last view stands)."""
        progress = NodeProgress(ranks=self._ranks)
        try:
            if body is not None:
                progress = NodeProgress.model_validate(body)
                self._ranks = progress.ranks
        except ValidationError as exc:
            self._say(f"progress.json is not node 0's progress ({validation_line(exc)}): left out, blamed on no one")
        if self.watch.on_progress is not None:
            self.watch.on_progress(progress.ranks)
        on_finding = self.watch.on_finding
        for found in progress.findings if on_finding is not None else []:
            if on_finding is not None and found.id not in self._said and not found.fatal:
                self._said.add(found.id)
                on_finding(found)

    def _say(self, line: str) -> None:
        if line not in self._said:
            self._said.add(line)
            log.warning("%s", line)
            if self.watch.on_line is not None:
                self.watch.on_line(line)
