"""What the faults cost and the run summary (docs/architecture.md §6): pure functions over the run's records."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from trainpipe.trainer.checkpoint.interval import expected_cost_s, young_daly_s
from trainpipe.trainer.config import Profile
from trainpipe.trainer.incidents import AttemptRecord, Incident
from trainpipe.trainer.orchestrate.badput import Badput
from trainpipe.trainer.parallel_dims import Layout
from trainpipe.trainer.protocol import TrainResult


@dataclass(frozen=True)
class Recovery:
    """The failed attempts of this pipeline run and what they cost.

    ``lost_steps``: steps begun after the last commit, so computed again;
    ``recovery_s``: from the last fault's detection to the first resumed step;
    ``wasted_s``: per incident id, its lost steps at the typical step time plus
    the time until training ran again.
    """

    recoveries: int = 0
    lost_steps: int = 0
    recovery_s: float = 0.0
    wasted_s: dict[str, float] = field(default_factory=dict)
    steps_this_run: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Trained(BaseModel):
    """What the train task hands the flow: the final attempt's result, its number, and what this pipeline run's
    failed attempts cost."""

    model_config = ConfigDict(frozen=True)
    result: TrainResult
    attempt: int
    recovery: Recovery
    attempts: list[AttemptRecord] = Field(default_factory=list)  # this pipeline run's, the completed one last

    def lost_steps(self) -> list[int]:
        """Per failed attempt, the steps it trained after its last commit (the next attempt trained them again)."""
        return lost_steps(self.attempts[:-1], self.attempts[-1]) if self.attempts else []


def failed_attempts(records: list[AttemptRecord], attempt: int) -> list[AttemptRecord]:
    """This pipeline run's failed attempts before ``attempt``: they are the last records before it, numbered from 1."""
    before = records[-attempt:-1] if attempt > 1 else []
    return [r for r in before if r.incident is not None and r.attempt < attempt]


def lost_steps(failed: list[AttemptRecord], success: AttemptRecord) -> list[int]:
    """Per failed attempt, the steps begun after the commit the next attempt resumed from."""
    nexts = [*failed[1:], success][: len(failed)]  # what followed each failed attempt
    return [max(0, (rec.last_step or 0) - (nxt.start_step or 0)) for rec, nxt in zip(failed, nexts, strict=True)]


def recovery(failed: list[AttemptRecord], success: AttemptRecord, final_step: int, step_s: float) -> Recovery:
    """Recovery figures of a run whose attempt ``success`` completed after the ``failed`` ones."""
    lost, gaps, wasted = lost_steps(failed, success), [], {}
    nexts = [*failed[1:], success][: len(failed)]  # what followed each failed attempt
    for rec, nxt, n in zip(failed, nexts, lost, strict=True):
        gap = max(0.0, nxt.first_step_at - rec.incident.at) if nxt.first_step_at and rec.incident else 0.0
        gaps.append(gap)
        if rec.incident:
            wasted[rec.incident.id] = n * step_s + gap
    first_start = (failed[0] if failed else success).start_step or 0
    return Recovery(len(failed), sum(lost), gaps[-1] if gaps else 0.0, wasted, max(0, final_step - first_start))


def build_summary(
    profile: Profile,
    trained: Trained,
    validated: dict[str, Any],
    incidents: list[Incident],
    *,
    run_name: str,
    mlflow_run_id: str | None,
    dataset_id: str,
    badput: Badput,
    published: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The run summary (docs/architecture.md §6): the validated checkpoint, what the faults cost, every incident of
    the run, and the registered model (``published_view``)."""
    wasted, result = trained.recovery.wasted_s, trained.result
    usd_per_s = (
        profile.cost.gpu_hour_usd * profile.cluster.world_size / 3600 if profile.cost.gpu_hour_usd is not None else None
    )
    records = []
    for i in incidents:
        cost = {}
        if i.id in wasted:
            cost["wasted_s"] = round(wasted[i.id], 3)
            if usd_per_s is not None:
                cost["wasted_usd"] = round(wasted[i.id] * usd_per_s, 4)
        records.append(i.model_copy(update=cost).model_dump(mode="json"))
    summary = {
        "published": published or published_view(None, None, profile),
        "run_name": run_name,
        "mlflow_run_id": mlflow_run_id,
        "checkpoint_uri": validated["uri"],
        "final_step": validated["step"],
        "val_loss": validated["val_loss"],
        "model_digest": validated["model_digest"],
        "recoveries": trained.recovery.recoveries,
        "lost_steps": trained.recovery.lost_steps,
        "recovery_s": trained.recovery.recovery_s,
        "incidents": records,
        "goodput": badput.goodput,
        "wasted_s": sum(wasted.values()),
        "wall_s": badput.wall_s,
        "badput": badput.as_dict(),
        "checkpoint_interval": interval_costs(profile, result, trained.recovery.recoveries, badput),
        "memory_tier": memory_tier_view(result, trained.attempts),
        "incident_chains": incident_chains(trained, usd_per_s),
        "resumes_verified": resumes_verified(trained.attempts),
        # The final attempt's training proper: first step's start to the final commit (not launch or start-up).
        "steps_s": result.attempt_s - result.step_starts_s[0] if result.step_starts_s else 0.0,
        "dataset_id": dataset_id,
        # the final attempt's layout: pp, dp_replicate, dp_shard, tp (the incidents carry each culprit's place)
        "layout": dict(zip(Layout.NAMES, profile.layout.sizes, strict=True)),
    }
    if usd_per_s is not None:
        summary["wasted_usd"] = round(summary["wasted_s"] * usd_per_s, 4)
    return summary


def incident_chains(trained: Trained, usd_per_s: float | None = None) -> list[dict[str, Any]]:
    """Each failed attempt of this pipeline run as a chain: the fault (the culprit's last beacon), its detection,
    the policy's decision, the first step of the attempt that resumed; what it lost (steps, seconds, money); the
    Prefect task run and the launcher's job it happened in."""
    attempts, chains = trained.attempts, []
    lost = trained.lost_steps()
    for rec, nxt, steps in zip(attempts, attempts[1:], lost, strict=False):
        if rec.incident is None:
            continue
        i, resumed = rec.incident, nxt.first_step_at
        wasted = trained.recovery.wasted_s.get(i.id)
        chain = {
            "incident_id": i.id,
            "attempt": rec.attempt,
            "kind": i.kind,
            "rank": i.rank,
            "node": i.node,
            "task_run_id": rec.task_run_id,
            "job": rec.job,
            "fault_at": rec.fault_at,
            "detected_at": i.at,
            "decided_at": rec.decided_at,
            "decision": rec.decision,
            "resumed_at": resumed,
            "detection_s": _span(rec.fault_at, i.at),
            "decision_s": _span(i.at, rec.decided_at),
            "resume_s": _span(rec.decided_at, resumed),
            "fault_to_resume_s": _span(rec.fault_at or i.at, resumed),
            "lost_steps": steps,
            "lost_s": None if wasted is None else round(wasted, 3),
            "resume": _resume(nxt.resume_verified),
            "resumed_tier": nxt.resumed_tier,
        }
        if usd_per_s is not None and wasted is not None:
            chain["lost_usd"] = round(wasted * usd_per_s, 4)
        chains.append(chain)
    return chains


def _resume(verified: bool | None) -> str | None:
    """How the attempt after a fault resumed: from a checkpoint whose state hash it verified, or not."""
    if verified is None:
        return None
    return "verified" if verified else "not verified (its checkpoint records no state hash)"


def resumes_verified(attempts: list[AttemptRecord]) -> str | None:
    """'k/n': of the n attempts of this pipeline run that resumed from a checkpoint, the k that verified its state
    hash (trainer.checkpoint.state_hash); None when none resumed."""
    resumed = [a.resume_verified for a in attempts if a.resume_verified is not None]
    return f"{sum(resumed)}/{len(resumed)}" if resumed else None


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else round(max(0.0, end - start), 3)


def memory_tier_view(result: TrainResult, attempts: list[AttemptRecord]) -> dict[str, Any] | None:
    """The memory tier's figures (trainer.checkpoint.memory_tier): the final attempt's snapshot interval and median
    blocking time, and how many of the run's attempts resumed from it; None when the run had no memory tier."""
    if result.memory_every_steps is None:
        return None
    stalls = result.memory_stalls_s
    return {
        "every_steps": result.memory_every_steps,
        "snapshots": len(stalls),
        "save_blocking_s": round(statistics.median(stalls), 4) if stalls else None,
        "resumes": sum(a.resumed_tier in ("memory", "peer") for a in attempts),
        "from_peers": sum(a.resumed_tier == "peer" for a in attempts),
    }


def interval_costs(profile: Profile, result: TrainResult, failures: int, badput: Badput) -> dict[str, Any] | None:
    """The checkpoint interval the final attempt used, what saves and failures cost at it by the Young/Daly model,
    and what they would have cost at twice and half of it; None without a measured save or step time."""
    every = result.checkpoint_every_steps
    if every is None and isinstance(profile.checkpoint.every_steps, int):
        every = profile.checkpoint.every_steps
    if not every or not 1e-6 <= result.step_s_median <= 86400 or not result.checkpoint_stalls_s:
        return None
    interval_s, blocking_s = every * result.step_s_median, statistics.median(result.checkpoint_stalls_s)
    b = badput.buckets
    training_s = badput.productive_s + b["data_wait"] + b["checkpoint"] + b["evaluation"] + b["wasted_progress"]
    mtbf_h = result.checkpoint_mtbf_hours or profile.checkpoint.mtbf_hours  # the run's history may have set it
    mtbf_s = mtbf_h * 3600

    def cost(seconds: float) -> float:
        return round(expected_cost_s(seconds, blocking_s, failures, training_s), 3)

    return {
        "every_steps": every,
        "auto": profile.checkpoint.every_steps == "auto",
        "interval_s": round(interval_s, 3),
        "save_blocking_s": round(blocking_s, 4),
        "mtbf_hours": mtbf_h,
        "young_daly_steps": max(1, round(young_daly_s(blocking_s, mtbf_s) / result.step_s_median)),
        "failures": failures,
        "measured_s": round(b["checkpoint"] + b["wasted_progress"], 3),
        "model_s": {"used": cost(interval_s), "twice": cost(2 * interval_s), "half": cost(interval_s / 2)},
    }


def _mlflow_cell(summary: dict[str, Any]) -> str:
    """The MLflow run's id, a link to its charts when a tracking server has them."""
    run_id, url = f"`{summary['mlflow_run_id']}`", summary.get("mlflow_url")
    return f"[{run_id}]({url})" if url else run_id


def _layout_cell(layout: dict[str, int] | None) -> str:
    """E.g. ``pp 2 × tp 2``; ``1 rank`` when every dimension is 1."""
    parts = [f"{name} {size}" for name, size in (layout or {}).items() if isinstance(size, int) and size > 1]
    return " × ".join(parts) or "1 rank"


def published_view(published: Any | None, unpublished: str | None, profile: Profile) -> dict[str, Any]:
    """The summary's ``published``: the registered version, its aliases and the gate's decision, or why none."""
    enabled = profile.publish.enabled
    if published is None:
        if unpublished:
            line = f"not published: {unpublished}"
        elif not enabled:
            line = "not published (publish.enabled: false)"
        else:
            line = "not published (tracking.enabled: false: no MLflow run to log the model to)"
        return {"line": line, "error": unpublished, "enabled": enabled}
    aliases = ", ".join(published.aliases) or "no alias"
    reused = " (published earlier by this run)" if published.reused else ""
    return {
        "line": f"{published.registered_model} version {published.version} ({aliases}){reused}",
        "registered_model": published.registered_model,
        "version": published.version,
        "aliases": published.aliases,
        "model_uri": published.model_uri,
        "model_id": published.model_id,
        "gate": published.gate.line,
        "candidate_val_loss": published.gate.candidate_val_loss,
        "champion_version": published.gate.champion_version,
        "champion_val_loss": published.gate.champion_val_loss,
        "files": published.files,
        "reused": published.reused,
        "enabled": enabled,
    }


def summary_markdown(summary: dict[str, Any]) -> str:
    """The summary as the Prefect run page shows it: the outcome, then one row per incident."""
    wasted = f"{summary['wasted_s']:.1f} s" + (f" (${summary['wasted_usd']:.2f})" if "wasted_usd" in summary else "")
    rows = [
        ("final step", summary["final_step"]),
        ("validation loss", f"{summary['val_loss']:.4f}"),
        ("checkpoint", f"`{summary['checkpoint_uri']}`"),
        ("model digest", f"`{summary['model_digest'][:16]}`"),
        ("recoveries", f"{summary['recoveries']} ({summary['lost_steps']} lost steps, {summary['recovery_s']:.1f} s)"),
        ("resumes verified", summary.get("resumes_verified") or "none resumed"),
        ("goodput", f"{summary['goodput']:.0%}"),
        ("wasted", wasted),
        ("wall time", f"{summary['wall_s']:.0f} s"),
        ("MLflow run", _mlflow_cell(summary)),
        ("dataset", f"`{summary['dataset_id']}`"),
        ("layout", _layout_cell(summary.get("layout"))),
        *_published_rows(summary.get("published")),
    ]
    text = f"# trainpipe run {summary['run_name']}\n\n| | |\n|---|---|\n"
    text += "\n".join(f"| {k} | {v} |" for k, v in rows)
    incidents = summary["incidents"]
    text += f"\n\n## Incidents ({len(incidents)})\n\n"
    if incidents:
        text += "| attempt | kind | rank | step | wasted | detail |\n|---|---|---|---|---|---|\n"
        for i in incidents:
            detail = _cell(i["detail"], 1000)
            cost = f"{i['wasted_s']:.1f} s" if i.get("wasted_s") is not None else ""
            text += f"| {i.get('attempt') or ''} | {i['kind']} | {_blank(i.get('rank'))} | {_blank(i.get('step'))} "
            text += f"| {cost} | {detail} |\n"
    else:
        text += "none\n"
    sections = (chains_markdown, badput_markdown, interval_markdown, memory_tier_markdown)
    return text + "".join(section(summary) for section in sections)


def _published_rows(published: dict[str, Any] | None) -> list[tuple[str, str]]:
    if not published:
        return []
    rows = [("model", _cell(published["line"], 300))]
    if published.get("gate"):
        rows.append(("gate", _cell(published["gate"], 300)))
    if published.get("model_uri"):
        rows.append(("load it", f'`mlflow.pyfunc.load_model("{_cell(published["model_uri"], 300)}")`'))
    return rows


def chains_markdown(summary: dict[str, Any]) -> str:
    """Each incident of a failed attempt from the fault to the first resumed step."""
    chains = summary.get("incident_chains") or []
    if not chains:
        return ""
    text = "\n## From fault to resumed training\n\n| attempt | kind | detected | decided | resumed | lost | decision "
    text += "| resume | task run | job |\n|---|---|---|---|---|---|---|---|---|---|\n"
    for c in chains:
        lost = f"{c['lost_steps']} steps" + (f", {c['lost_s']:.1f} s" if c["lost_s"] is not None else "")
        cells = [_after(c["detection_s"]), _after(c["decision_s"]), _after(c["resume_s"])]
        decision = _cell(c["decision"])
        text += f"| {c['attempt']} | {c['kind']} | {' | '.join(cells)} | {lost} | {decision} "
        text += f"| {_cell(c.get('resume'))} | {_cell(c['task_run_id'])} | {_cell(c['job'])} |\n"
    return text


def _after(seconds: float | None) -> str:
    return "" if seconds is None else f"+{seconds:.2f} s"


def interval_markdown(summary: dict[str, Any]) -> str:
    """The checkpoint interval and what it cost against twice and half of it."""
    c = summary.get("checkpoint_interval")
    if not c:
        return ""
    how = "auto, Young/Daly" if c["auto"] else f"Young/Daly would take {c['young_daly_steps']}"
    m = c["model_s"]
    return (
        f"\n## Checkpoint interval\n\nEvery {c['every_steps']} steps ({c['interval_s']:.1f} s; {how}), a save "
        f"blocking {c['save_blocking_s']:.3f} s, {c['failures']} failure(s), MTBF {c['mtbf_hours']:g} h. Saves and "
        f"lost work cost {c['measured_s']:.1f} s (model: {m['used']:.1f} s); at twice the interval the model says "
        f"{m['twice']:.1f} s, at half {m['half']:.1f} s.\n"
    )


def memory_tier_markdown(summary: dict[str, Any]) -> str:
    """The memory tier's interval, its cost and the resumes it served."""
    m = summary.get("memory_tier")
    if not m:
        return ""
    blocking = "" if m["save_blocking_s"] is None else f", each blocking {m['save_blocking_s'] * 1000:.1f} ms"
    peers = f", {n} with a lost host's files gathered from its peer's copy" if (n := m.get("from_peers")) else ""
    return (
        f"\n## Memory tier\n\nA snapshot every {m['every_steps']} steps in host memory ({m['snapshots']} in the "
        f"final attempt{blocking}); {m['resumes']} attempt(s) resumed from one{peers}.\n"
    )


def badput_markdown(summary: dict[str, Any]) -> str:
    """Where the wall time went: productive time and each bucket that took any, for the run and per attempt."""
    b = summary.get("badput")
    if not b or not b["wall_s"]:
        return ""
    attempts = b["attempts"]
    head = "| | run | share |" + "".join(f" attempt {int(a['attempt'])} |" for a in attempts)
    text = f"\n## Where the time went ({b['wall_s']:.0f} s)\n\n{head}\n|---|---|---|" + "---|" * len(attempts) + "\n"
    rows = [("productive", b["productive_s"])] + [(k, v) for k, v in b["buckets"].items() if v >= 0.05]
    for name, seconds in rows:
        cells = "".join(f" {a[name]:.1f} s |" if a.get(name) else " |" for a in attempts)
        text += f"| {name.replace('_', ' ')} | {seconds:.1f} s | {seconds / b['wall_s']:.0%} |{cells}\n"
    return text


def badput_line(summary: dict[str, Any], top: int = 4) -> str:
    """The largest shares of the wall time, productive first: ``productive 62%, startup 12%, …``."""
    b = summary.get("badput")
    if not b or not b["wall_s"]:
        return ""
    ranked = sorted(b["buckets"].items(), key=lambda kv: -kv[1])[:top]
    parts = [("productive", b["productive_s"]), *ranked]
    return ", ".join(f"{name.replace('_', ' ')} {seconds / b['wall_s']:.0%}" for name, seconds in parts if seconds > 0)


def _blank(value: Any) -> str:
    return "" if value is None else str(value)


_CELL = str.maketrans(
    {"|": "\\|", "`": "\\`", "\\": "\\\\", "[": "\\[", "<": "&lt;", "\n": " ", "\r": " ", "\u2028": " ", "\u2029": " "}
)


def _cell(value: Any, limit: int = 300) -> str:
    """A table cell from text that may come from the store (a detail, a decision, a job): no column, code span,
    link, tag or line of its own."""
    return "" if value is None else str(value)[:limit].translate(_CELL)
