"""Where the ranks' step time goes, for the watchdog (docs/architecture.md §9): waiting in collectives (a slow
link or fabric) or for data.

``TimeSplit`` reads ``StepReport``s, the figures each rank's next beacon
carries for the step it finished, scores them in the straggler windows and
returns ``Incident``s; the watchdog (``trainer.supervise.watchdog``) applies
``watchdog.on_network`` and ``on_data_stall``:

- a rank waiting for data over ``data_stall_share`` of its step for
  ``straggler_patience`` windows is a ``data_stall``, saying where that wait
  went in its last window: fetching shards from the store, checking their
  sha256, or the rest (slicing batches, copying them to the device);
- ranks whose collective wait is above ``network_factor`` times their own
  baseline (the first full window), by at least a quarter of a baseline step,
  while no rank's compute or data wait grew, for ``straggler_patience``
  windows, are a ``network`` incident naming their hosts, when they are at
  least half the ranks or every rank of a host with several. A slow rank also
  makes the others wait in collectives: that is a straggler or a data stall,
  never a network incident, because its own compute or data wait grew.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from trainpipe.trainer.config import WatchdogConfig
from trainpipe.trainer.incidents import Incident, ranks_text
from trainpipe.trainer.supervise.beacons import StepReport


@dataclass
class _Window:
    """A rank's medians over one window, and the window's sums of its data wait and its parts: shard loads
    are a few steps' events, which a median would drop."""

    data_s: float
    compute_s: float
    comm_s: float
    data_sum_s: float = 0.0
    fetch_sum_s: float = 0.0
    verify_sum_s: float = 0.0

    @property
    def total(self) -> float:
        return self.data_s + self.compute_s + self.comm_s

    def data_parts(self) -> str:
        """Where the window's data wait went, as shares."""
        whole = max(self.data_sum_s, self.fetch_sum_s + self.verify_sum_s, 1e-9)
        rest = max(whole - self.fetch_sum_s - self.verify_sum_s, 0.0)
        parts = [
            (self.fetch_sum_s, "fetching shards from the store"),
            (self.verify_sum_s, "checking their sha256"),
            (rest, "the rest of the read (slicing batches and copying them to the device)"),
        ]
        return ", ".join(f"{v / whole:.0%} {what}" for v, what in sorted(parts, key=lambda p: -p[0]))


def _by_host(hosts: dict[int, str | None]) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for r, h in hosts.items():
        out.setdefault(h or "?", set()).add(r)
    return out


class TimeSplit:
    def __init__(self, cfg: WatchdogConfig, world_size: int):
        self.cfg, self.world_size = cfg, world_size
        self.steps: dict[int, dict[int, tuple[float, ...]]] = {}  # rank -> step -> split, fetch, verify
        self.hosts: dict[int, str | None] = {}
        self.latest: dict[int, int] = {}  # rank -> the last step it reported
        self.baseline: dict[int, _Window] = {}
        self.next_window: int | None = None
        self.stall_strikes: dict[int, int] = {}
        self.net_strikes: dict[int, int] = {}
        self.flagged: set[tuple[str, int]] = set()
        self.windows: list[dict] = []  # per window: last step, per rank medians (ms), for MLflow

    def observe(self, r: StepReport) -> None:
        if r.data_s is None or r.compute_s is None or r.comm_s is None:
            return
        split = (r.data_s, r.compute_s, r.comm_s, r.data_fetch_s, r.data_verify_s)
        self.steps.setdefault(r.rank, {})[r.step] = split
        self.hosts[r.rank] = r.host
        self.latest[r.rank] = max(self.latest.get(r.rank, 0), r.step)

    def check(self) -> list[Incident]:
        """Score every window of ``straggler_window`` steps that every rank has reported in full."""
        w = self.cfg.straggler_window
        if len(self.latest) < self.world_size:
            return []
        if self.next_window is None:  # skip the window holding the attempt's first (warm-up) step
            self.next_window = (min(min(s) for s in self.steps.values()) - 1) // w + 1
        reached = min(self.latest.values())
        found: list[Incident] = []
        while (self.next_window + 1) * w <= reached:
            lo, hi = self.next_window * w + 1, (self.next_window + 1) * w
            self.next_window += 1
            medians = {r: self._median(steps, lo, hi) for r, steps in self.steps.items()}
            for steps in self.steps.values():  # scored: keep memory flat over a long run
                for s in [s for s in steps if s <= hi]:
                    del steps[s]
            if any(m is None for m in medians.values()):
                continue
            found += self._score(hi, medians)  # type: ignore[arg-type]
        return found

    @staticmethod
    def _median(steps: dict[int, tuple[float, ...]], lo: int, hi: int) -> _Window | None:
        window = [v for s, v in steps.items() if lo <= s <= hi]
        if not window:
            return None
        medians = (statistics.median(v[i] for v in window) for i in range(3))
        return _Window(*medians, *(sum(v[i] for v in window) for i in (0, 3, 4)))

    def _score(self, step: int, medians: dict[int, _Window]) -> list[Incident]:
        c = self.cfg
        self.windows.append(
            {
                "step": step,
                "data_ms": {r: round(m.data_s * 1000, 3) for r, m in medians.items()},
                "comm_ms": {r: round(m.comm_s * 1000, 3) for r, m in medians.items()},
            }
        )
        found = []
        for r, m in medians.items():
            share = m.data_s / m.total if m.total > 0 else 0.0
            self.stall_strikes[r] = self.stall_strikes.get(r, 0) + 1 if share > c.data_stall_share else 0
            if self.stall_strikes[r] >= c.straggler_patience and ("data", r) not in self.flagged:
                self.flagged.add(("data", r))
                found.append(
                    Incident(
                        kind="data_stall",
                        rank=r,
                        node=self.hosts.get(r),
                        step=step,
                        phase="data",
                        detail=f"rank {r} waits for its data {share:.0%} of a step ({m.data_s * 1000:.0f} ms of "
                        f"{m.total * 1000:.0f} ms) for {self.stall_strikes[r]} windows of {c.straggler_window} steps; "
                        f"in the last window: {m.data_parts()}; policy {c.on_data_stall}",
                        ranks=[r],
                        detected_after_s=0.0,
                        fatal=c.on_data_stall == "abort",
                    )
                )
        if not self.baseline:
            self.baseline = dict(medians)
            return found
        found += self._network(step, medians)
        return found

    def _a_network(self, struck: list[int]) -> bool:
        """Slow collectives on at least half the ranks, or on every rank of a host with several: one rank's
        collectives alone are too noisy to blame a link on (a busy core, a page fault)."""
        if not struck:
            return False
        if 2 * len(struck) >= self.world_size:
            return True
        return any(len(ranks) > 1 and ranks <= set(struck) for ranks in _by_host(self.hosts).values())

    def _network(self, step: int, medians: dict[int, _Window]) -> list[Incident]:
        c = self.cfg
        base = self.baseline

        def grew(now: float, before: float, total: float) -> bool:
            return now > c.straggler_factor * before and now - before > 0.1 * total

        others_flat = not any(
            grew(m.compute_s, base[r].compute_s, m.total) or grew(m.data_s, base[r].data_s, m.total)
            for r, m in medians.items()
        )
        slow = {
            r
            for r, m in medians.items()
            if others_flat
            and m.comm_s > c.network_factor * max(base[r].comm_s, 1e-4)
            and m.comm_s - base[r].comm_s > 0.25 * base[r].total  # noise on a busy machine is smaller
        }
        for r in medians:
            self.net_strikes[r] = self.net_strikes.get(r, 0) + 1 if r in slow else 0
        struck = sorted(r for r in slow if self.net_strikes[r] >= c.straggler_patience)
        if not self._a_network(struck) or ("network", 0) in self.flagged:
            return []
        self.flagged.add(("network", 0))
        hosts = sorted({self.hosts.get(r) or "?" for r in struck})
        all_hosts = sorted({h or "?" for h in self.hosts.values()})
        where = "every rank" if len(struck) == len(medians) else f"rank(s) {ranks_text(struck)}"
        ratio = statistics.median(medians[r].comm_s / max(base[r].comm_s, 1e-4) for r in struck)
        typical = statistics.median(medians[r].comm_s for r in struck)
        scope = "a slow fabric or a link every host uses" if hosts == all_hosts else "a slow link of those hosts"
        return [
            Incident(
                kind="network",
                node=", ".join(hosts),
                step=step,
                phase="collective",
                detail=f"collectives on {where} ({', '.join(hosts)}) take {ratio:.1f}x their own baseline "
                f"({typical * 1000:.0f} ms a step) for {self.net_strikes[struck[0]]} windows of "
                f"{c.straggler_window} steps while compute and data stay flat: {scope}; policy {c.on_network}",
                ranks=struck,
                detected_after_s=0.0,
                fatal=c.on_network == "abort",
            )
        ]
