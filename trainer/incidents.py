"""Incident records (DESIGN §5), kept per run in the store so every attempt and rerun sees them."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from trainer.checkpoint import run_uri
from trainer.store import filesystem, join

FIELDS = ("kind", "rank", "node", "step", "phase", "detected_after_s", "detail")


def incident(kind: str, detail: str, rank: int | None = None, node: str | None = None, step: int | None = None,
             phase: str | None = None, detected_after_s: float | None = None) -> dict[str, Any]:
    return {"kind": kind, "rank": rank, "node": node, "step": step, "phase": phase,
            "detected_after_s": detected_after_s, "detail": detail}


def _path(store_root: str, run_name: str, storage_options: dict[str, Any] | None):
    fs, base = filesystem(run_uri(store_root, run_name), storage_options)
    return fs, join(base, "incidents.json")


def record_incidents(store_root: str, run_name: str, records: list[dict[str, Any]], storage_options: dict[str, Any] | None = None) -> None:
    # Object stores cannot append: rewrite the small list (one writer, the supervising task).
    fs, path = _path(store_root, run_name, storage_options)
    existing = load_incidents(store_root, run_name, storage_options)
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    existing += [{**r, "time": r.get("time", now)} for r in records]
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "w") as fh:
        json.dump(existing, fh, indent=2)


def load_incidents(store_root: str, run_name: str, storage_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    fs, path = _path(store_root, run_name, storage_options)
    if not fs.exists(path):
        return []
    with fs.open(path, "r") as fh:
        return json.load(fh)


def _excluded_path(store_root: str, run_name: str, storage_options: dict[str, Any] | None):
    fs, base = filesystem(run_uri(store_root, run_name), storage_options)
    return fs, join(base, "excluded_nodes.json")


def excluded_nodes(store_root: str, run_name: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    fs, path = _excluded_path(store_root, run_name, storage_options)
    if not fs.exists(path):
        return []
    with fs.open(path, "r") as fh:
        return json.load(fh)


def exclude_node(store_root: str, run_name: str, node: str, storage_options: dict[str, Any] | None = None) -> None:
    """Remember a node the run must not use again (a straggler under on_straggler: exclude)."""
    nodes = excluded_nodes(store_root, run_name, storage_options)
    if node not in nodes:
        fs, path = _excluded_path(store_root, run_name, storage_options)
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        with fs.open(path, "w") as fh:
            json.dump(nodes + [node], fh)
