"""Each GPU's utilization, sampled by its host's supervisor, and what idle GPUs say (docs/architecture.md §9).

A GPU that sits near 0% while the steps slow down is waiting for something
other than its kernels: its data, the network, or the host's CPU. Every host's
supervisor samples its own GPUs through NVML (``trainer.preflight.gpu_health``,
whose recorded states stand in for NVML in tests) on a thread; node 0's
watchdog reads its own sampler, and the other hosts send their ranks' figures
over their watchdog link (``trainer.protocol.encode_gpu_use``). torchrun puts a
host's k-th rank on its GPU k, so rank and GPU pair up by that order.

``GpuIdle`` judges them: once the median step time of rank 0's last 20 steps
is above ``straggler_factor`` times the attempt's first such median, and most
ranks' GPUs averaged under ``gpu_idle_pct`` over the last ``WINDOW_S``, it is a
``gpu_idle`` finding naming their hosts: a warning, which says where to look.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque

from trainpipe.trainer.config import WatchdogConfig
from trainpipe.trainer.incidents import Incident, ranks_text
from trainpipe.trainer.preflight import gpu_health

log = logging.getLogger("trainpipe.supervise")

WINDOW_S = 10.0  # utilization averaged over the last this many seconds of samples
STEPS = 20  # the watchdog's window of rank 0's step times (BeaconServer.step_times)


class GpuUse:
    """Samples this host's GPUs every ``every_s`` on a thread; ``by_rank`` pairs them with the host's ranks."""

    def __init__(self, every_s: float = 2.0):
        self.every_s = every_s
        self._samples: deque[tuple[float, dict[int, float]]] = deque(maxlen=max(2, int(60 / every_s)))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-use", daemon=True)
        self._thread.start()

    @classmethod
    def start_if_any(cls, device: str) -> GpuUse | None:
        """A sampler when this host has GPUs to watch: recorded states, or NVML on a profile that may use CUDA."""
        if gpu_health.recorded_states() is None and device == "cpu":
            return None
        return cls() if gpu_health.utilization() else None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                sample = gpu_health.utilization()
            except Exception as exc:  # noqa: BLE001 - a sensor that fails must never stop training
                log.warning("GPU utilization is not sampled any more (%s)", exc)
                return
            with self._lock:
                self._samples.append((time.monotonic(), sample))
            self._stop.wait(self.every_s)

    def recent(self, window_s: float = WINDOW_S) -> dict[int, float]:
        """GPU index → mean utilization (%) over the samples of the last ``window_s``."""
        since = time.monotonic() - window_s
        with self._lock:
            samples = [s for t, s in self._samples if t >= since]
        gpus = {g for s in samples for g in s}
        return {g: statistics.fmean(s[g] for s in samples if g in s) for g in sorted(gpus)}

    def by_rank(self, ranks: list[int]) -> dict[int, float]:
        """Rank → its GPU's recent utilization, for this host's ``ranks`` (the k-th smallest on GPU k)."""
        use = self.recent()
        return {r: use[k] for k, r in enumerate(sorted(ranks)) if k in use}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=3)


class GpuIdle:
    def __init__(self, cfg: WatchdogConfig):
        self.cfg = cfg
        self.baseline_s: float | None = None
        self.flagged = False

    def check(self, step_times: list[float], use: dict[int, float], hosts: dict[int, str | None]) -> Incident | None:
        """``step_times``: rank 0's last step intervals; ``use``: rank → its GPU's recent utilization (%)."""
        if self.flagged or len(step_times) < STEPS:
            return None
        now = statistics.median(step_times)
        if self.baseline_s is None:
            self.baseline_s = now
            return None
        if not use or now <= self.cfg.straggler_factor * self.baseline_s:
            return None
        idle = sorted(r for r, pct in use.items() if pct < self.cfg.gpu_idle_pct)
        if 2 * len(idle) <= len(use):  # most GPUs busy: slower kernels, which the straggler check judges
            return None
        self.flagged = True
        names = sorted({hosts.get(r) or "?" for r in idle})
        typical = statistics.median(use[r] for r in idle)
        return Incident(
            kind="gpu_idle",
            node=", ".join(names),
            phase="compute",
            detail=f"the GPUs of rank(s) {ranks_text(idle)} ({', '.join(names)}) were {typical:.0f}% busy over the "
            f"last {WINDOW_S:.0f} s while steps take {now / self.baseline_s:.1f}x their first {STEPS} steps' "
            f"({now * 1000:.0f} ms vs {self.baseline_s * 1000:.0f} ms): they wait for something other than their "
            "kernels: the data (a data_stall, health/data_ms), the network (health/comm_ms) or the host's CPU; "
            "policy warn",
            ranks=idle,
            detected_after_s=0.0,
            fatal=False,
        )
