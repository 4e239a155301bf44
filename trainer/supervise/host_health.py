"""After a fault on this host, whether its GPUs still pass the preflight's health check (NVML).

A GPU that fell off the bus or holds uncorrected ECC errors crashes its rank, and the retry that runs on the
same host crashes again: at scale most faults are such a host's (docs/architecture.md §5, "Broken hosts").
Asked right after an attempt ends in a fault on this host, the check turns a guess (the second failure on the
same node) into a reading, which ``policy.after_attempt`` acts on at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pynvml

from trainpipe.trainer.config import PreflightConfig
from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.preflight import gpu_health

log = logging.getLogger("trainpipe.supervisor")

# Faults a broken GPU causes; a rank's own error, a NaN or a store outage say nothing about the host.
KINDS = frozenset({"crash", "hang", "sdc"})
MAX_LINE = 1000  # Incident.host_health's bound


def failing_gpu(
    cfg: PreflightConfig, probe: Callable[[], tuple[str, list[dict[str, Any]]]] = gpu_health.probe
) -> str | None:
    """The first failed GPU check on this host, as its one line; None when every GPU passes, the host has no
    GPU, or NVML cannot be asked (that is no evidence against the host)."""
    try:
        _, states = probe()
    except (pynvml.NVMLError, OSError, ValueError) as exc:
        log.warning("GPU health after the fault: not read (%s)", exc)
        return None
    failed = [c["detail"] for c in gpu_health.evaluate(states, cfg) if c["status"] == "fail"]
    return failed[0][:MAX_LINE] if failed else None


def with_host_health(
    incident: Incident | None,
    cfg: PreflightConfig,
    here: str,
    check: Callable[[PreflightConfig], str | None] = failing_gpu,
) -> Incident | None:
    """``incident`` with this host's failing GPU check, when the fault is one a GPU causes and its culprit is on
    this host (``here``); otherwise unchanged."""
    if incident is None or not incident.fatal or incident.kind not in KINDS or incident.node != here:
        return incident
    if (line := check(cfg)) is None:
        return incident
    return incident.model_copy(update={"host_health": line})
