"""Reading a preflight report: which nodes a failing check points at, and the one line a user sees."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class PreflightCheck(BaseModel):
    """One check of a report: what the policy and the report's readers index (other fields are kept)."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(max_length=200)
    status: Literal["pass", "warn", "fail", "skip"]
    detail: str
    node: str | None = None
    ranks: list[int] = Field(default_factory=list)


class PreflightReport(BaseModel):
    """Rank 0's preflight report (``trainer/preflight/probes.py``), read back by this shape before anything acts
    on it: a cluster's report comes back through a host part that others may be able to write."""

    model_config = ConfigDict(extra="allow")
    ok: bool
    world_size: int = Field(ge=1)
    nodes: list[str]
    failing_nodes: list[str]
    checks: list[PreflightCheck]
    ranks: list[dict[str, Any]]
    timings_s: dict[str, float]
    duration_s: float

    @model_validator(mode="after")
    def _ranks_are_the_reports(self) -> PreflightReport:
        if any(not isinstance(f.get("host"), str) for f in self.ranks):
            raise ValueError("every rank's facts name its host")
        if any(r < 0 or r >= len(self.ranks) for c in self.checks for r in c.ranks):
            raise ValueError("a check names a rank the report has no facts of")
        return self


def nodes_of(check: dict[str, Any], facts: list) -> list[str]:
    """The nodes a check points at; none for cluster-wide findings (then exclusion cannot help)."""
    if check.get("node"):
        return [check["node"]]
    if check.get("nodes") and isinstance(check["nodes"], list):
        return list(check["nodes"])
    if check.get("ranks"):
        return [facts[r]["host"] for r in check["ranks"]]
    if isinstance(check.get("nodes"), dict):  # versions: the minority value's nodes
        groups = sorted(check["nodes"].values(), key=len)
        return groups[0] if len(groups) > 1 and len(groups[0]) < len(groups[-1]) else []
    return []


def failed_checks(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in report["checks"] if c["status"] == "fail"]


def failure_line(report: dict[str, Any]) -> str | None:
    """One line naming node, rank, device and check of the first failure; None when nothing failed."""
    failed = failed_checks(report)
    if not failed:
        return None
    c = failed[0]
    where = [f"node {n}" for n in nodes_of(c, report["ranks"])[:3]]
    if c.get("ranks"):
        where.append("rank " + ",".join(map(str, c["ranks"])))
    if c.get("device") is not None:
        where.append(f"GPU {c['device']}")
    more = f" (and {len(failed) - 1} more failing check(s))" if len(failed) > 1 else ""
    return f"preflight check {c['name']} failed{' on ' + ' '.join(where) if where else ''}: {c['detail']}{more}"
