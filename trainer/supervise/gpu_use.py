"""Each GPU's utilization, sampled by its host's supervisor, and what idle GPUs say (docs/architecture.md §9).

A GPU that sits near 0% while the steps slow down is waiting for something
other than its kernels: its data, the network, or the host's CPU. Every host's
supervisor samples its own GPUs through NVML (``trainer.preflight.gpu_health``,
whose recorded states stand in for NVML in tests) on a thread; node 0's
watchdog reads its own sampler, and the other hosts send their ranks' figures
over their watchdog link (``trainer.protocol.encode_gpu_use``). A rank's GPU
is its local rank's entry of ``CUDA_VISIBLE_DEVICES`` (or GPU k for local rank k).

``GpuIdle`` judges them: once the median step time of rank 0's last 20 steps
is above ``straggler_factor`` times the attempt's first such median, the GPUs
were busy at that first speed (at least twice ``gpu_idle_pct``), and most
ranks' GPUs averaged under ``gpu_idle_pct`` over the last ``WINDOW_S``, for
``IDLE_CHECKS`` checks in a row outside checkpoints and evaluations, it is a
``gpu_idle`` finding naming their hosts: a warning, which says where to look.
NVML counts a GPU that waits inside an NCCL collective as busy, so a slow link
does not show here (that is the ``network`` check's), nor does one starved rank
while the others wait for it in a collective; this finds the job-wide waits:
shared storage too slow for every rank, CPUs too few for the loaders.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Iterable

import pynvml

from trainpipe.trainer.config import WatchdogConfig
from trainpipe.trainer.incidents import Incident, ranks_text
from trainpipe.trainer.preflight import gpu_health

log = logging.getLogger("trainpipe.supervise")

SAMPLE_S = 2.0  # a sample of every GPU this often
WINDOW_S = 10.0  # utilization averaged over the last this many seconds of samples
STEPS = 20  # the watchdog's window of rank 0's step times (BeaconServer.step_times)
IDLE_CHECKS = 3  # this many checks in a row (one a second at most) before it is said


class GpuUse:
    """Samples this host's GPUs every ``every_s`` on a thread; ``by_rank`` pairs them with the host's ranks.

    NVML starts on that thread too: a GPU fallen off the bus can hang NVML for minutes, and must not hang the
    supervisor. Without GPUs (or a driver) the thread ends and ``by_rank`` stays empty."""

    def __init__(self, procs_per_node: int, every_s: float | None = None):
        self.procs_per_node, self.every_s = procs_per_node, every_s or SAMPLE_S
        self.devices = visible_devices(procs_per_node)
        self._samples: deque[tuple[float, dict[str, float]]] = deque(maxlen=max(2, int(60 / self.every_s)))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-use", daemon=True)
        self._thread.start()

    @staticmethod
    def wanted(device: str) -> bool:
        """Whether this host has GPUs worth sampling: recorded states, or a profile that may train on CUDA."""
        return gpu_health.recorded_states() is not None or device != "cpu"

    def _run(self) -> None:
        nvml = None
        if gpu_health.recorded_states() is None:
            nvml = gpu_health.Nvml()
            try:
                nvml.init()
            except pynvml.NVMLError:
                return
        warned = False
        try:
            while not self._stop.is_set():
                try:
                    sample = gpu_health.utilization(nvml)
                except Exception as exc:  # noqa: BLE001 - a sensor that fails must never stop training
                    if not warned:
                        warned = True
                        log.warning("GPU utilization could not be sampled (%s); trying again", exc)
                    sample = {}
                with self._lock:
                    self._samples.append((time.monotonic(), sample))
                self._stop.wait(self.every_s)
        finally:
            if nvml is not None:
                with contextlib.suppress(pynvml.NVMLError):
                    nvml.shutdown()

    def recent(self, window_s: float | None = None) -> dict[str, float]:
        """GPU (NVML index or UUID) → mean utilization (%) over the samples of the last ``window_s``."""
        since = time.monotonic() - (window_s or WINDOW_S)
        with self._lock:
            samples = [s for t, s in self._samples if t >= since]
        gpus = {g for s in samples for g in s}
        return {g: statistics.fmean(s[g] for s in samples if g in s) for g in sorted(gpus)}

    def by_rank(self, ranks: Iterable[int]) -> dict[int, float]:
        """Rank → its GPU's recent utilization, for ranks of this host: torchrun numbers a host's ranks in a block,
        so rank r is local rank r mod procs_per_node, on the local rank's visible device."""
        use = self.recent()
        keys = {r: self.devices[r % self.procs_per_node] for r in ranks}
        return {r: use[k] for r, k in keys.items() if k in use}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=3)


def visible_devices(procs_per_node: int) -> list[str]:
    """Local rank k's GPU as NVML knows it: the k-th entry of ``CUDA_VISIBLE_DEVICES`` (an index or a UUID), else
    GPU k."""
    listed = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return listed if listed else [str(k) for k in range(procs_per_node)]


class GpuIdle:
    def __init__(self, cfg: WatchdogConfig):
        self.cfg = cfg
        self.baseline_s: float | None = None
        self.baseline_use: float | None = None  # the GPUs' median utilization then
        self.strikes = 0
        self.flagged = False

    def check(
        self, step_times: list[float], use: dict[int, float], hosts: dict[int, str | None], quiet_phase: bool = False
    ) -> Incident | None:
        """``step_times``: rank 0's last step intervals; ``use``: rank → its GPU's recent utilization (%);
        ``quiet_phase``: a rank checkpoints or evaluates now, when GPUs idle by design."""
        if self.flagged or len(step_times) < STEPS or not use:
            return None
        now = statistics.median(step_times)
        if self.baseline_s is None:
            self.baseline_s, self.baseline_use = now, statistics.median(use.values())
            return None
        idle = sorted(r for r, pct in use.items() if pct < self.cfg.gpu_idle_pct)
        slow = now > self.cfg.straggler_factor * self.baseline_s
        busy_before = (self.baseline_use or 0.0) >= 2 * self.cfg.gpu_idle_pct  # a light model idles at any speed
        if quiet_phase:
            return None
        self.strikes = self.strikes + 1 if slow and busy_before and 2 * len(idle) > len(use) else 0
        if self.strikes < IDLE_CHECKS:
            return None
        self.flagged = True
        names = sorted({hosts.get(r) or "?" for r in idle})
        typical = statistics.median(use[r] for r in idle)
        return Incident(
            kind="gpu_idle",
            node=", ".join(names),
            phase="compute",
            detail=f"the GPUs of rank(s) {ranks_text(idle)} ({', '.join(names)}) were {typical:.0f}% busy over the "
            f"last {WINDOW_S:.0f} s (against {self.baseline_use:.0f}% at full speed) while steps take "
            f"{now / self.baseline_s:.1f}x their first {STEPS} steps' ({now * 1000:.0f} ms vs "
            f"{self.baseline_s * 1000:.0f} ms): they wait for something other than their kernels, such as their data "
            "or the host's CPU (a GPU waiting in a collective counts as busy); policy warn",
            ranks=idle,
            detected_after_s=0.0,
            fatal=False,
        )
