"""A cluster job's attempt outcome from its hosts' parts: what the slurm and kubernetes launchers return."""

from __future__ import annotations

from typing import Any

from trainpipe.trainer.config import Profile
from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.launcher import AttemptOutcome, JobOutcome, Watch, stage_outcome
from trainpipe.trainer.supervise.host import job_outcome


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
    unreadable: str | None = None,
) -> AttemptOutcome:
    """``stage``: what the job ran (its result is typed by it); ``records``: the ``outcome_record`` of every host
    that wrote one; ``job`` names the cluster's job
    ("slurm job 12") and ``ended_as`` says how the cluster saw it end, for an attempt no host explains;
    ``node_names``: each node rank's host, where the launcher knows it (a missing part's culprit is named);
    ``unreadable``: why a part was left out (``read_host_parts``), said with the missing host."""
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
        named = (node_names or {}).get(missing[0]) if len(missing) == 1 else None
        detail = f"{ended_as} before node(s) {missing} reported (their supervisor died?); {said}{others}"
        detail += f"; {unreadable}" if unreadable else ""
        incident = Incident(kind="crash", detail=detail, attempt=attempt, node=named)
    node0 = next((r for r in records if r.get("node_rank") == 0), {})
    typed, report, incident = stage_outcome(stage, result, attempt, None if result is not None else incident)
    return AttemptOutcome(
        attempt,
        JobOutcome(returncode, wall_s, timed_out, tail),
        typed,
        incident,
        [Incident.model_validate(f) for f in merged["findings"]],
        {int(r): p for r, p in node0.get("progress", {}).items()},
        node0.get("first_step_at"),
        node0.get("first_step"),
        scores=node0.get("scores", []),
        report=report,
    )


class LiveView:
    """A cluster attempt's follower's view of node 0's ``progress.json`` (``trainer.supervise.host.ProgressFile``):
    every rank's latest beacon goes to ``watch.on_progress``, each warning node 0's watchdog found goes to
    ``watch.on_finding`` once, while the job runs. The file comes from a host of the job (a store others may
    write, for Kubernetes): what does not parse is left out."""

    def __init__(self, watch: Watch):
        self.watch = watch
        self._said: set[str] = set()

    def __call__(self, body: object) -> None:
        ranks = body.get("ranks", {}) if isinstance(body, dict) else {}
        if self.watch.on_progress is not None:
            self.watch.on_progress({int(r): p for r, p in ranks.items() if str(r).isdigit() and isinstance(p, dict)})
        for raw in body.get("findings", []) if isinstance(body, dict) and self.watch.on_finding else []:
            try:
                found = Incident.model_validate(raw)
            except ValueError:
                continue
            if found.id not in self._said and not found.fatal:
                self._said.add(found.id)
                self.watch.on_finding(found)
