"""Reading a preflight report: which nodes a failing check points at, and the one line a user sees."""

from __future__ import annotations

from typing import Any


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
