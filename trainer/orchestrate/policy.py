"""Run policy: one pure function per decision, over incidents, reports and the profile (docs/architecture.md §5).

- ``after_attempt``: retry, stop, or retry without a node, after a failed training attempt;
- ``after_preflight``: go on, stop, or go on without the failing nodes;
- ``without_excluded``: the cluster an attempt runs on after earlier exclusions;
- ``for_attempt``: the profile an attempt runs, after the run's earlier attempts (exclusions, rollbacks, probe);
- ``retryable``: whether a stage that failed with an error is worth another try (what Prefect's retries ask).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from trainpipe.trainer.config import MAX_RETRY_DELAY_S, Profile
from trainpipe.trainer.errors import ProfileError, StoreError, StoreUnavailable, TrainingIncident
from trainpipe.trainer.incidents import AttemptRecord, Incident
from trainpipe.trainer.orchestrate.records import MAX_ROLLBACKS, RunRecords
from trainpipe.trainer.preflight.report import failed_checks, failure_line, nodes_of
from trainpipe.trainer.profile_files import can_shrink, with_nodes

# A rank's own errors that another attempt may not meet again (the store came back).
TRANSIENT_ERRORS = frozenset({"StoreError", "StoreUnavailable"})
# Faults that say something about the machine a rank ran on; the same node this many times is excluded.
HOST_FAULTS = frozenset({"crash", "hang", "sdc"})
REPEATS_TO_EXCLUDE = 2


def retryable(error: BaseException, stage: Literal["train", "shard"]) -> bool:
    """Whether a stage that raised ``error`` is worth another try; the one place retries are decided.

    train: what ``after_attempt`` called retryable (``TrainingIncident``) and a store that stayed away through
    every retry of one operation (``StoreUnavailable``), never bad input or a stop. shard: a store that failed
    us (unreachable, a write that did not land); bad data fails the same way again."""
    if stage == "train":
        return isinstance(error, TrainingIncident | StoreUnavailable)
    return isinstance(error, StoreError)


@dataclass(frozen=True)
class Decision:
    action: Literal["retry", "stop"]
    reason: str  # one line for the user
    exclude_node: str | None = None  # retry without this node
    rollback_before: int | None = None  # retry from the newest checkpoint before this loss spike, skipping its data

    def line(self) -> str:
        """``retry``, ``retry without node n3``, ``retry from before step 40``, ``stop: …``."""
        if self.action == "stop":
            return f"stop: {self.reason}"
        if self.exclude_node:
            return f"retry without node {self.exclude_node}"
        return f"retry from before step {self.rollback_before}" if self.rollback_before is not None else "retry"


def after_attempt(incident: Incident, history: list[Incident], profile: Profile) -> Decision:
    """What to do after a failed attempt ended by ``incident``; ``history`` holds the run's earlier incidents.

    A crash, hang, desync, timeout, stalled exit without a result, straggler
    abort or store error is retried (the retry resumes from the last commit).
    When the cluster can shrink, the retry leaves out a node that is a
    straggler under ``on_straggler: exclude``, or that crashed or hung for the
    second time in the run.
    A rank's expected error (bad data, a checkpoint that does not load) is
    not: another attempt would meet it again. Neither is a non-finite loss at
    the same step as the attempt before: resuming from the same checkpoint
    diverges the same way. A loss spike (a non-finite loss too) under
    ``on_loss_spike: rollback`` is retried from the newest checkpoint before
    it, without the data that fed it, once per step; under ``warn`` a
    non-finite loss is retried from the last commit once per step; a flatline
    or spike that ends an attempt otherwise stops.
    A replica mismatch (sdc) is retried from the newest checkpoint, whose
    replicas agreed; the same node twice is excluded, like a crash.
    A crash, hang or sdc whose host then fails its GPU health check
    (``Incident.host_health``) excludes that host at once, or stops the run
    when it cannot go: a retry on a broken GPU only fails again.
    A network incident under ``on_network: abort`` is retried, and the retry
    measures the links first (``with_link_probe``); a host the probe blames is
    left out when the cluster can shrink, else the run stops.
    """
    line = incident.line()
    if incident.kind == "loss_spike" and incident.step is not None:
        return _after_loss_spike(incident, profile)
    if incident.kind == "sdc" and incident.phase == "replay":
        again = [i for i in history if i.fatal and i.kind == "sdc" and i.phase == "replay" and i.step == incident.step]
        if again:
            return Decision(
                "stop",
                f"{incident.detail}; it happened again on the retry: the checkpoint does not resume to what was "
                "saved. Check the store and the hosts; to go on from it anyway, rerun with the same --run-name and "
                "--set watchdog.replay=false",
            )
    if incident.kind == "flatline":
        return Decision("stop", f"{line}; watchdog.on_flatline=stop")
    if incident.kind == "error" and incident.error not in TRANSIENT_ERRORS:
        return Decision("stop", f"{incident.error or 'error'} on rank {incident.rank}: {incident.detail}")
    if incident.kind == "nan" and incident.step is not None and profile.watchdog.on_loss_spike != "warn":
        return _after_non_finite(incident, profile)
    if incident.kind == "nan":  # under warn: retried from the last commit, once at the same step
        previous = [i for i in history if i.fatal]
        if previous and previous[-1].kind == "nan" and previous[-1].step == incident.step:
            return Decision(
                "stop",
                f"{incident.detail} again after resuming; lower train.lr or raise train.grad_clip, "
                "then rerun with the same --run-name",
            )
    shrinks = can_shrink(profile)
    if incident.kind == "network" and incident.phase == "probe" and profile.watchdog.probe_links:
        if incident.node and "," not in incident.node and incident.rank in incident.ranks and shrinks:
            return Decision("retry", f"{line}; the retry runs without node {incident.node}", exclude_node=incident.node)
        why = (
            f"the cluster cannot shrink below cluster.min_nodes={profile.cluster.min_nodes}"
            if incident.node and "," not in incident.node
            else "no single host to leave out"
        )
        return Decision("stop", f"{incident.detail}; {why}: fix the link, then rerun with the same --run-name")
    if incident.kind == "straggler" and profile.watchdog.on_straggler == "exclude" and incident.node and shrinks:
        return Decision("retry", f"{line}; the retry runs without node {incident.node}", exclude_node=incident.node)
    if incident.kind in HOST_FAULTS and incident.node and incident.host_health:
        return _broken_host(incident, line, profile, shrinks)
    if incident.kind in HOST_FAULTS and incident.node and shrinks and profile.cluster.nodes > 1:
        before = [i for i in history if i.fatal and i.kind in HOST_FAULTS and i.node == incident.node]
        if len(before) + 1 >= REPEATS_TO_EXCLUDE:
            return Decision(
                "retry",
                f"{line}; node {incident.node} crashed or hung {len(before) + 1} times in this run: the retry runs "
                "without it",
                exclude_node=incident.node,
            )
    return Decision("retry", line)


def _after_loss_spike(incident: Incident, profile: Profile) -> Decision:
    """rollback: once per spike step (the same step spiking again on other data is not the data's fault)."""
    step = incident.step
    if profile.watchdog.on_loss_spike == "stop":
        return Decision("stop", f"{incident.line()}; lower train.lr or raise train.grad_clip, then rerun")
    if len(profile.train.rollbacks) >= MAX_ROLLBACKS:
        return Decision(
            "stop",
            f"{incident.line()}; the run already rolled back {len(profile.train.rollbacks)} times: lower train.lr or "
            "raise train.grad_clip, then rerun with the same --run-name",
        )
    if step in profile.train.rollbacks:
        return Decision(
            "stop",
            f"the loss spiked again at step {step} after rolling back and skipping the data that fed it; lower "
            "train.lr or raise train.grad_clip, then rerun with the same --run-name",
        )
    return Decision("retry", incident.line(), rollback_before=step)


def _after_non_finite(incident: Incident, profile: Profile) -> Decision:
    """A non-finite loss is the worst of spikes: under ``on_loss_spike: rollback`` it rolls back past its data
    (once per step), under ``stop`` it stops."""
    step = incident.step
    advice = "lower train.lr or raise train.grad_clip, then rerun with the same --run-name"
    if profile.watchdog.on_loss_spike == "stop" or len(profile.train.rollbacks) >= MAX_ROLLBACKS:
        return Decision("stop", f"{incident.detail}; {advice}")
    if step in profile.train.rollbacks:
        return Decision(
            "stop", f"{incident.detail} again after resuming before it without the data that fed it; {advice}"
        )
    return Decision("retry", f"{incident.line()}; the retry rolls back past the data that fed it", rollback_before=step)


def with_rollbacks(profile: Profile, rollbacks: list[int]) -> Profile:
    """The profile with the run's rollbacks from loss spikes, which the ranks apply on resume."""
    if not rollbacks:
        return profile
    return profile.model_copy(
        update={"train": profile.train.model_copy(update={"rollbacks": sorted({*profile.train.rollbacks, *rollbacks})})}
    )


def needs_link_probe(history: list[Incident]) -> bool:
    """Whether the next attempt measures the links first: the run's last failed attempt ended in a network
    incident (from the watchdog, or from the probe, which checks again after the exclusion)."""
    fatal = [i for i in history if i.fatal]
    return bool(fatal) and fatal[-1].kind == "network"


def with_link_probe(profile: Profile) -> Profile:
    return profile.model_copy(update={"watchdog": profile.watchdog.model_copy(update={"probe_links": True})})


def for_attempt(profile: Profile, records: RunRecords) -> tuple[Profile, list[str]]:
    """The profile the run's next attempt runs, after what its earlier attempts left in ``records``, and one line
    for each change: without the excluded nodes, skipping the data that fed a loss spike, and measuring the
    links between hosts first after a network incident."""
    changes = []
    if excluded := records.excluded_nodes():
        profile = without_excluded(profile, excluded)
        changes.append(f"running without excluded node(s) {', '.join(excluded)}: {profile.cluster.nodes} node(s) left")
    if rollbacks := records.rollbacks():
        profile = with_rollbacks(profile, rollbacks)
        changes.append(f"rolling back from the loss spike(s) at step(s) {rollbacks}, without the data that fed them")
    if profile.cluster.nodes > 1 and needs_link_probe(records.incidents()):
        profile = with_link_probe(profile)
        changes.append("the last attempt ended in a network incident: this one measures the links between hosts first")
    if profile.checkpoint.every_steps == "auto" and (seen := observed_mtbf(records.attempts())) is not None:
        hours, failures, trained_h = seen
        changes.append(
            f"checkpoint interval (auto) from this run's history: {failures} failures in {trained_h:.2f} h of "
            f"training, one every {hours:.2f} h (checkpoint.mtbf_hours says {profile.checkpoint.mtbf_hours:g})"
        )
        checkpoint = type(profile.checkpoint).model_validate({**profile.checkpoint.model_dump(), "mtbf_hours": hours})
        profile = profile.model_copy(update={"checkpoint": checkpoint})
    return profile, changes


# A fault of the job's own processes: a fresh start is the fix, and waiting only adds to the recovery.
RETRY_AT_ONCE = frozenset({"crash", "hang", "desync", "straggler", "nan", "loss_spike", "sdc"})


def _broken_host(incident: Incident, line: str, profile: Profile, shrinks: bool) -> Decision:
    """A fault whose host then failed its GPU health check: leave the host out at once, or stop."""
    if shrinks and profile.cluster.nodes > 1:
        return Decision(
            "retry",
            f"{line}; node {incident.node} fails its GPU health check after it ({incident.host_health}): the "
            "retry runs without it",
            exclude_node=incident.node,
        )
    why = (
        f"the cluster cannot shrink below cluster.min_nodes={profile.cluster.min_nodes}"
        if profile.cluster.nodes > 1
        else "it is the job's only node"
    )
    return Decision(
        "stop",
        f"{line}; node {incident.node} fails its GPU health check after it ({incident.host_health}) and {why}: "
        "drain or repair it, then rerun with the same --run-name",
    )


def retry_delay_s(before: list[Incident | None], backoff_s: float) -> float:
    """Seconds to wait before the next attempt, after ``before``: what ended each earlier attempt, oldest first
    (None: it could not be read). None after a fault in ``RETRY_AT_ONCE``; otherwise (a store error, a timeout,
    a slow network, or an incident that could not be read) ``backoff_s``, doubling with each such failure in a
    row, for what is outside the job to recover: a store outage after a hundred crashes waits ``backoff_s``,
    not the cap."""
    if not before or backoff_s <= 0 or (before[-1] is not None and before[-1].kind in RETRY_AT_ONCE):
        return 0.0
    streak = 0
    for incident in reversed(before):
        if incident is not None and incident.kind in RETRY_AT_ONCE:
            break
        streak += 1
    return min(MAX_RETRY_DELAY_S, backoff_s * 2 ** min(streak - 1, 30))


def ended_before(attempts: list[AttemptRecord], task_run_id: str, attempt: int) -> list[Incident | None]:
    """What ended this task run's attempts before ``attempt``, oldest first, for ``retry_delay_s``: the one just
    before is None when it failed before it could record itself (its incident is unknown, so the retry backs
    off)."""
    if attempt <= 1:
        return []
    tries = sorted(
        (a for a in attempts if a.task_run_id == task_run_id and a.attempt < attempt), key=lambda a: a.attempt
    )
    return [a.incident for a in tries] + ([] if tries and tries[-1].attempt == attempt - 1 else [None])


MTBF_FAILURES = 2  # a run's own failures on record before its history stands for the profile's mtbf_hours
MTBF_TRAINED_S = 600.0  # and the training time they happened in
MTBF_FLOOR_H = 0.01  # never below 36 s, whatever the records say
# Failures of the machines or the job's processes, in attempts that had started training (not a rendezvous, a
# store or a person).
MTBF_KINDS = frozenset({"crash", "hang", "desync", "sdc", "network", "straggler"})


def observed_mtbf(attempts: list[AttemptRecord]) -> tuple[float, int, float] | None:
    """Hours between failures in the run's own history (hours trained over failures), the failures and the hours
    trained; None with fewer than ``MTBF_FAILURES`` failures or an implausible record."""
    started = [a for a in attempts if a.first_step_at is not None]
    trained_s = sum(max(0.0, a.ended_at - a.first_step_at) for a in started)  # type: ignore[operator]
    failures = sum(1 for a in started if a.incident is not None and a.incident.kind in MTBF_KINDS)
    if failures < MTBF_FAILURES or not MTBF_TRAINED_S <= trained_s < 10 * 365 * 86400:  # the store: bounded
        return None
    hours = max(MTBF_FLOOR_H, trained_s / failures / 3600)
    return hours, failures, trained_s / 3600


def without_excluded(profile: Profile, excluded: list[str]) -> Profile:
    """The profile on the nodes left after ``excluded`` ones, never below ``cluster.min_nodes``."""
    if not excluded:
        return profile
    nodes = max(profile.cluster.min_nodes, profile.cluster.nodes - len(excluded))
    why = f"exclusion of {', '.join(excluded)}"
    k, per_node = profile.train.virtual_ranks, profile.cluster.procs_per_node
    # the most nodes left on which the profile still holds: a world size dividing the virtual ranks (the weights'
    # bits stay the run's), a parallel layout whose sizes fit, a global batch of whole micro-batches
    smaller, first_problem = None, None
    for n in range(nodes, profile.cluster.min_nodes - 1, -1):
        try:
            smaller = with_nodes(profile, n, why)
            break
        except ProfileError as exc:
            first_problem = first_problem or str(exc).split(": ", 1)[-1]
    if smaller is None:
        if k:
            raise ProfileError(
                f"leaving out {', '.join(excluded)} leaves {nodes} node(s), and no count from there down to "
                f"cluster.min_nodes={profile.cluster.min_nodes} divides train.virtual_ranks={k} with "
                f"{per_node} process(es) each: lower cluster.min_nodes or change train.virtual_ranks"
            )
        raise ProfileError(
            f"leaving out {', '.join(excluded)} leaves {nodes} node(s), and the profile holds on no count from there "
            f"down to cluster.min_nodes={profile.cluster.min_nodes} ({nodes} node(s): {first_problem})"
        )
    # and a cluster launcher places the job elsewhere than on them
    smaller.launcher.excluded_nodes = [*smaller.launcher.excluded_nodes, *excluded]
    return smaller


@dataclass(frozen=True)
class PreflightDecision:
    action: Literal["proceed", "stop", "exclude"]
    profile: Profile  # what training runs on (smaller after an exclusion)
    reason: str = ""
    incident: Incident | None = None  # an exclusion, recorded with the run's incidents


def after_preflight(report: dict[str, Any], profile: Profile) -> PreflightDecision:
    """stop: a failing check ends the run. exclude: go on without the failing nodes when enough remain."""
    line = failure_line(report)
    if line is None:
        return PreflightDecision("proceed", profile)
    if profile.preflight.on_fail == "stop":
        return PreflightDecision("stop", profile, line)
    cluster_wide = [c["name"] for c in failed_checks(report) if not nodes_of(c, report["ranks"])]
    if cluster_wide:
        return PreflightDecision(
            "stop",
            profile,
            f"{line}; cannot exclude: {', '.join(cluster_wide)} fails cluster-wide, so dropping nodes cannot help",
        )
    failing = report["failing_nodes"]
    remaining = profile.cluster.nodes - len(failing)
    if remaining < profile.cluster.min_nodes:
        return PreflightDecision(
            "stop",
            profile,
            f"{line}; cannot exclude: without {', '.join(failing)} {remaining} node(s) "
            f"remain, below cluster.min_nodes={profile.cluster.min_nodes}",
        )
    detail = f"preflight excluded node(s) {', '.join(failing)}; continuing on {remaining} node(s): {line}"
    smaller = without_excluded(profile, failing)  # fewer nodes, and a cluster launcher's job placed elsewhere
    return PreflightDecision(
        "exclude", smaller, detail, Incident(kind="exclude", detail=detail, node=", ".join(failing), fatal=False)
    )
