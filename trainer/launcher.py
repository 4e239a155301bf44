"""The launcher contract (docs/architecture.md): one request in, one ``AttemptOutcome`` out, whoever runs it.

A launcher starts the per-host parts of one stage of a run (``train``, or the
``preflight`` probes) here or on a cluster's nodes, follows them, and says how
they ended. The Prefect tasks know this module and the registry, never the
supervisor: ``trainer.launch`` registers a ``LauncherSpec`` for each
``launcher.kind`` (``local``, ``slurm``, ``kubernetes``), the way torchtitan
registers a ``TrainSpec`` per model, and ``trainer.launch.launch`` dispatches a
request to the spec of the profile's kind.

Shared: no module of the supervisor or of a launcher is imported here, so the
ranks, the supervisor and the orchestrator all read the same types.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, Self, TypedDict, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from trainpipe.trainer import grammar
from trainpipe.trainer.config import MAX_STEP, Profile
from trainpipe.trainer.errors import LaunchError, ProfileError
from trainpipe.trainer.incidents import AttemptRecord, Incident
from trainpipe.trainer.preflight.report import PreflightReport
from trainpipe.trainer.protocol import TrainResult
from trainpipe.trainer.redact import redact_text

Stage = Literal["train", "preflight"]


@dataclass
class JobOutcome:
    """How one job ended: a host's torchrun, or a cluster's job as its scheduler saw it."""

    returncode: int | None
    wall_s: float
    timed_out: bool = False
    tail: list[str] = field(default_factory=list)
    stopped_by: Incident | None = None  # the watchdog's finding, when it ended the job
    job: str | None = None  # which job: "torchrun pid 123 on host", "slurm job 12", "TrainJob ns/name"

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and self.stopped_by is None


@dataclass
class AttemptOutcome:
    """How one attempt of a stage ended: rank 0's result (train) or report (preflight) when it succeeded, else
    the incident that ended it."""

    attempt: int
    job: JobOutcome
    result: TrainResult | None  # rank 0's result of a training attempt; None when it failed, or for preflight
    incident: Incident | None  # what ended a failed attempt
    findings: list[Incident] = field(default_factory=list)  # warnings: stragglers under 'warn', an unclean exit
    progress: dict[int, dict] = field(default_factory=dict)  # each rank's last beacon
    first_step_at: float | None = None  # wall clock of the first training step's first beacon
    first_step: int | None = None  # that step (1-based)
    scores: list[dict[str, Any]] = field(default_factory=list)  # straggler scores per window
    flight: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank → flight recorder, after a hang
    report: dict[str, Any] | None = None  # the preflight stage's report (trainer/preflight/report.py), when it ran
    started_at: float | None = None  # a cluster job: when its last host's supervisor started (its queue ended)

    @property
    def succeeded(self) -> bool:
        return self.result is not None or self.report is not None

    @property
    def last_step(self) -> int | None:
        steps = [p["step"] for p in self.progress.values() if p.get("step", -1) >= 0]
        return max(steps) if steps else None

    @property
    def fault_at(self) -> float | None:
        """The last sign of life before the fault: the culprit's last beacon (any rank's when none is named)."""
        if self.incident is None:
            return None
        beacons = [self.progress.get(self.incident.rank)] if self.incident.rank is not None else []
        beacons = [b for b in beacons if b] or list(self.progress.values())
        times = [b["time"] for b in beacons if isinstance(b.get("time"), (int, float)) and b["time"] > 0]
        return min(max(times), self.incident.at) if times else None

    def record(self, launched_at: float | None = None, task_run_id: str | None = None) -> AttemptRecord:
        start = self.result.start_step if self.result else (self.first_step - 1 if self.first_step else None)
        return AttemptRecord(
            attempt=self.attempt,
            start_step=start,
            launched_at=launched_at,
            started_at=self.started_at,
            first_step_at=self.first_step_at,
            last_step=self.last_step,
            fault_at=self.fault_at,
            incident=self.incident,
            task_run_id=task_run_id,
            job=self.job.job,
            resume_verified=(
                self.result.resume_verified if self.result else _resume_verified(self.progress.get(0, {}))
            ),
            resumed_tier=self.result.resumed_tier if self.result else _resumed_tier(self.progress.get(0, {})),
            **_totals(self.progress.get(0, {})),
        )


class _Totals(TypedDict, total=False):
    data_wait_s: float
    eval_s: float
    checkpoint_s: float


def _totals(beacon: dict[str, Any]) -> _Totals:
    """Rank 0's running totals from its last step's beacon (trainer.loop.beacon), where they are usable."""
    names = {"td": "data_wait_s", "te": "eval_s", "tc": "checkpoint_s"}
    usable = {
        name: float(v)
        for key, name in names.items()
        if isinstance(v := beacon.get(key), int | float) and not isinstance(v, bool) and math.isfinite(v)
        if 0 <= v <= 1e7
    }
    return cast(_Totals, usable)


def _resume_verified(beacon: dict[str, Any]) -> bool | None:
    """Whether rank 0 verified the state it resumed from (its beacons' ``rv``); None when it did not resume."""
    return bool(beacon["rv"]) if type(beacon.get("rv")) is int and beacon["rv"] in (0, 1) else None


def _resumed_tier(beacon: dict[str, Any]) -> Literal["memory", "peer", "store"] | None:
    """Where rank 0's resumed checkpoint lay (its beacons' ``rm``: 1 memory, 2 peer); None when it did not
    resume."""
    if _resume_verified(beacon) is None:
        return None
    tier = beacon.get("rm") if type(beacon.get("rm")) is int else 0
    return "memory" if tier == 1 else "peer" if tier == 2 else "store"


class HostPart(BaseModel):
    """One host's part of a cluster job's attempt, as its supervisor writes it (``host-{node rank}.json`` in the
    launcher's shared folder, or the store under Kubernetes) and the launcher reads it back: by this model, and
    bounded, since whoever may write there could have written anything (docs/security.md)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # times and durations feed the summary's sums
    node: str = Field(max_length=253)
    node_rank: int = Field(ge=0, le=1_000_000)
    attempt: int = Field(default=1, ge=0)
    result: dict[str, Any] | None = None  # rank 0's TrainResult or the preflight report, as JSON
    incident: Incident | None = None
    findings: list[Incident] = Field(default_factory=list, max_length=256)
    returncode: int | None = None
    wall_s: float = 0.0
    first_step: int | None = None
    first_step_at: float | None = None
    started_at: float | None = Field(
        default=None, allow_inf_nan=False
    )  # the host's supervisor started: its queue ended
    agent: str | None = Field(default=None, max_length=300)  # how its torchrun agent ran ("…, forked by a warm host")
    scores: list[dict[str, Any]] = Field(default_factory=list, max_length=100_000)
    progress: dict[int, dict[str, Any]] = Field(default_factory=dict, max_length=1_000_000)  # rank → last beacon

    @field_validator("node")
    @classmethod
    def _a_node_name(cls, value: str) -> str:
        if not grammar.matches(grammar.NODE_NAME, value):
            raise ValueError("not a node's name")
        return value

    @field_validator("progress")
    @classmethod
    def _steps_are_numbers(cls, value: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        return rank_progress(value)


def rank_progress(value: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Each rank's last beacon as read back from a file others may write: its step an integer and its time a
    finite number, which is what the follower and the records compute with (the rest is only shown)."""
    for p in value.values():
        if type(p.get("step", 0)) is not int or not -1 <= p.get("step", 0) <= MAX_STEP:
            raise ValueError("a rank's step is not a number of steps")
        if "time" in p and not (type(p["time"]) in (int, float) and math.isfinite(p["time"])):
            raise ValueError("a rank's time is not a finite number")
    return value


class NodeProgress(BaseModel):
    """Node 0's view of a running cluster attempt (``progress.json``: ``trainer.supervise.host.ProgressFile``),
    read back by the follower by this model: it lies where others may write (docs/security.md)."""

    model_config = ConfigDict(extra="forbid")
    ranks: dict[int, dict[str, Any]] = Field(default_factory=dict, max_length=1_000_000)
    findings: list[Incident] = Field(default_factory=list, max_length=256)

    @field_validator("ranks")
    @classmethod
    def _checked(cls, value: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        return rank_progress(value)


@dataclass(frozen=True)
class LaunchRequest:
    """One stage of one run to start: what the launcher needs, and nothing it must look up."""

    stage: Stage
    profile: Profile
    run_name: str
    attempt: int = 1
    dataset_uri: str | None = None  # train: the dataset the ranks read
    mlflow_run_id: str | None = None  # train: the run rank 0's host sends its metrics to

    def __post_init__(self) -> None:
        if self.stage == "train" and not self.dataset_uri:
            raise ValueError("a train request names its dataset")


@dataclass(frozen=True)
class Watch:
    """What the caller hears while a stage runs (every callback optional). ``on_progress`` may raise (the run was
    cancelled): the launcher then stops the job and lets it propagate."""

    on_line: Callable[[str], None] | None = None  # each line of the job's output
    on_finding: Callable[[Incident], None] | None = None  # a warning the watchdog found, as it finds it
    on_progress: Callable[[dict[int, dict]], None] | None = None  # every rank's latest beacon, at each look


def stage_outcome(
    stage: str, raw: dict[str, Any] | None, attempt: int, incident: Incident | None
) -> tuple[TrainResult | None, dict[str, Any] | None, Incident | None]:
    """(result, report, incident) of a stage from rank 0's file as read (``raw``): a training attempt's is a
    ``TrainResult``, a preflight's a ``PreflightReport`` (as a dict); one that is not (a host part rewritten
    where others could write it, a node of another version) ends the attempt as an error, in one line. Without
    a result there is always an incident."""
    if raw is None:
        missing = Incident(kind="error", detail="the attempt ended without a result and without a reason")
        return None, None, incident or missing.model_copy(update={"attempt": attempt})
    try:
        if stage == "train":
            return TrainResult.model_validate(raw), None, incident
        if set(raw) == {"rank"} and raw["rank"] != 0:  # another host's local rank 0: its part finished
            return None, raw, incident
        return None, PreflightReport.model_validate(raw).model_dump(mode="json"), incident
    except ValidationError as exc:
        what = "training result" if stage == "train" else "preflight report"
        why = f"rank 0's result is not a {what} ({validation_line(exc)}); nothing of it was used"
        return None, None, Incident(kind="error", detail=why, attempt=attempt, rank=0)


def validation_line(exc: ValidationError) -> str:
    """The first error of a document read from outside, as one short line: its field and what was wrong (the
    field's name is the document's, so it is shown quoted and cut)."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "the document"
    return f"{where[:80]!r}: {first['msg'][:200]}"


def stage_timeout(profile: Profile, stage: str) -> tuple[str, float]:
    """The key and the value of a stage's wall-clock limit."""
    if stage == "preflight":
        return "preflight.timeout_s", profile.preflight.timeout_s
    return "train.timeout_s", profile.train.timeout_s


class Launcher(Protocol):
    def __call__(self, request: LaunchRequest, watch: Watch) -> AttemptOutcome: ...


class LauncherOptions(BaseModel):
    """A launcher's own options: the profile's ``launcher.<kind>`` section, whose model its launcher's module
    defines (``trainer/launch/slurm.py``'s ``SlurmOptions``). Each value may reach a job script, a command's
    arguments or a manifest: a model checks it against that place's grammar (trainer/grammar.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True, coerce_numbers_to_str=True, allow_inf_nan=False)
    kind: ClassVar[str] = ""  # the launcher whose section this is

    @field_validator("*", mode="before")
    @classmethod
    def _plain(cls, value: Any) -> Any:
        if problem := grammar.control_problem(value):  # a newline would start a line of a job script
            raise ValueError(problem.replace("a value", "the value", 1))
        return value

    def check(self, profile: Profile) -> None:
        """Checks against the rest of the profile (ValueError, one line), once the section itself is valid."""

    @classmethod
    def of(cls, profile: Profile) -> Self:
        """This launcher's options of ``profile``, checked: ProfileError (one line) when they are not valid."""
        options = cls.checked(profile.launcher.section(cls.kind), profile.hide)
        try:
            options.check(profile)
        except ValueError as exc:
            raise ProfileError(profile.hide(str(exc))) from None
        return options

    @classmethod
    def checked(cls, section: dict[str, Any], hide: Callable[[str], str] = redact_text) -> Self:
        """``launcher.<kind>`` as this model; ProfileError (one line, naming the key) when it is not. The value
        shown goes through ``hide`` (the profile's: its secrets and URL user-info are never shown)."""
        try:
            return cls.model_validate(section)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(repr(p) if grammar.CONTROL.search(str(p)) else str(p) for p in first["loc"])[:120]
            if first["type"] == "extra_forbidden":
                known = ", ".join(cls.model_fields)
                raise ProfileError(
                    f"unknown key 'launcher.{cls.kind}.{where}' (keys of launcher.{cls.kind}: {known})"
                ) from None
            shown = f" (got {first['input']!r})"[:120] if isinstance(first.get("input"), str | int | float) else ""
            raise ProfileError(
                hide(f"launcher.{cls.kind}.{where}: {first['msg'].removeprefix('Value error, ')}{shown}")
            ) from None


class NoOptions(LauncherOptions):
    """A launcher without options of its own."""


@contextlib.contextmanager
def _cold(profile: Profile) -> Iterator[None]:
    yield


@dataclass(frozen=True)
class LauncherSpec:
    """Everything a ``launcher.kind`` is, registered by its own module (``trainer/launch/KIND.py``) as torchtitan
    registers a ``TrainSpec`` per model: nothing else names a launcher's kind.

    ``launch`` runs a request; ``options`` is the model of the profile's ``launcher.<kind>`` section; ``warm(profile)``
    is the block around a run's attempts (a warm host here, or the run's cluster job held across its attempts:
    ``trainer/launch/held.py``); a launcher that submits jobs a SIGKILLed orchestrator leaves running records each
    one (``trainer/launch/jobs.py``): ``job_line`` names a record's job, raising ValueError when its identity is
    not one of this launcher's, and ``stop_left(profile, run_name, job)`` stops one that still runs."""

    kind: str
    launch: Launcher
    stages: frozenset[str] = frozenset({"train"})
    description: str = ""
    options: type[LauncherOptions] = NoOptions
    warm: Callable[[Profile], AbstractContextManager[None]] = _cold
    job_line: Callable[[Any], str] | None = None
    stop_left: Callable[[Profile, str, Any], tuple[bool, str] | None] | None = None


_LAUNCHERS: dict[str, LauncherSpec] = {}


def register_launcher(spec: LauncherSpec) -> LauncherSpec:
    if spec.kind in _LAUNCHERS and _LAUNCHERS[spec.kind] is not spec:
        raise ValueError(f"launcher {spec.kind!r} is registered twice")
    if not grammar.matches(grammar.LAUNCHER_KIND, spec.kind):
        raise ValueError(f"launcher kind {spec.kind!r} is not a name (lower-case letters, digits and _)")
    if spec.options is not NoOptions and spec.options.kind != spec.kind:
        raise ValueError(f"launcher {spec.kind!r} has the options of {spec.options.kind!r}")
    if (spec.job_line is None) != (spec.stop_left is None):
        raise ValueError(f"launcher {spec.kind!r}: a launcher that records its jobs names them and stops them")
    _LAUNCHERS[spec.kind] = spec
    return spec


def registered(kind: str) -> LauncherSpec | None:
    return _LAUNCHERS.get(kind)


def launcher_spec(kind: str, stage: str | None = None) -> LauncherSpec:
    """The registered spec of ``kind``; LaunchError (one line) when none is, or it cannot run ``stage``."""
    spec = _LAUNCHERS.get(kind)
    if spec is None:
        raise LaunchError(f"no launcher {kind!r} (registered: {', '.join(sorted(_LAUNCHERS)) or 'none'})")
    if stage is not None and stage not in spec.stages:
        raise LaunchError(f"launcher.kind={kind} cannot run the {stage} stage yet ({', '.join(sorted(spec.stages))})")
    return spec


def check_launcher(profile: Profile) -> None:
    """ProfileError (one line) unless ``launcher.kind`` is a registered launcher and every ``launcher.<kind>``
    section is a registered launcher's valid options (its kind's own checked against the whole profile): run
    where the run is resolved, before anything starts, once the launchers are registered (``trainer.launch``)."""
    la = profile.launcher
    if la.kind not in _LAUNCHERS:
        raise ProfileError(
            f"launcher.kind={la.kind!r} is not a launcher (registered: {', '.join(sorted(_LAUNCHERS)) or 'none'})"
        )
    for kind in la.sections():
        spec = _LAUNCHERS.get(kind)
        if spec is None or spec.options is NoOptions:
            having = ", ".join(sorted(k for k, s in _LAUNCHERS.items() if s.options is not NoOptions)) or "none"
            raise ProfileError(
                f"launcher.{kind}: no launcher has options named {kind!r} (launchers with options: {having})"
            )
        if kind != la.kind:
            spec.options.checked(la.section(kind), profile.hide)  # checked, though this run does not use it
    _LAUNCHERS[la.kind].options.of(profile)
