"""The supervisor's watchdog: decide hang, desync, crash, straggler and a stalled exit from the ranks' beacons.

It runs in the supervising process (outside the training ranks), is polled
every ``watchdog.poll_s`` while the job runs, and never touches the ranks
except to name them. Every finding is an ``Incident``. Decisions:

- hang: no rank advanced within the allowance of its phase. The culprit is a
  stopped or dead process if there is one; else the rank(s) that never reached
  the collective the others wait in; else the rank whose beacons stopped first.
  A stopped process is a hang sooner: once no rank advanced for
  ``stopped_after_s`` plus three median steps; so is a rank that the others
  wait for in a collective while it sits in its step's compute (forward or
  optimizer) without using the CPU (``CpuUse``): it waits for something that
  will not come. A rank that computes, or waits for data, a checkpoint or an
  evaluation, keeps the allowance.
- desync: every live rank waits in a collective, but not in the same one
  (different step or kind): a skipped or extra collective.
- crash: a worker process is gone while the job still runs.
- straggler: a rank's typical compute time in a window of steps (the median, not
  the mean: a few slow steps, such as those beside a checkpoint commit, are not a
  slow rank; its time waiting in collectives does not count) over
  ``straggler_factor`` × the median of the other ranks (leave-one-out, so a slow
  rank at world size 2 is not half of its own baseline) for ``straggler_patience``
  windows. Under a ``parallel`` layout a rank is compared with its data-parallel
  peers only (the same pipeline stage and tp index: the same work); the ranks of a
  replica (its tp ranks and pipeline stages) wait on each other inside a step, so
  when they are slow together they are named together, not the one that waits.
- Under a layout every incident about a rank carries its mesh coordinates, and
  its line says where the rank sits (a hang names its pipeline stage).
- exit: every rank finished (final checkpoint committed) but the job did not end
  within ``exit_timeout_s``: never a training hang.
- loss_spike, flatline, network, data_stall: from the figures each rank's beacons
  carry for the step it finished (``trainer.loss_health`` for the warnings,
  ``trainer.supervise.time_split``).
- gpu_idle: the GPUs near 0% busy while the steps slowed down
  (``trainer.supervise.gpu_use``), when this host samples its GPUs.
"""

from __future__ import annotations

import logging
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import psutil

from trainpipe.trainer.config import WatchdogConfig
from trainpipe.trainer.incidents import Incident, ranks_text
from trainpipe.trainer.loss_health import checked_by_watchdog
from trainpipe.trainer.parallel_dims import Layout
from trainpipe.trainer.proc import node_name
from trainpipe.trainer.supervise.beacons import BeaconServer, RankProgress
from trainpipe.trainer.supervise.gpu_use import GpuIdle
from trainpipe.trainer.supervise.time_split import TimeSplit

log = logging.getLogger("trainpipe.supervisor")

COMPUTE_PHASES = frozenset({"forward", "optimizer"})  # a rank idle here while the others wait is a hang early


def finding(kind: str, rank: int | None, p: RankProgress | None, detail: str, after: float, **more: Any) -> Incident:
    """An incident about ``rank`` as its last beacon ``p`` placed it."""
    return Incident(
        kind=kind,
        rank=rank,
        node=(p.host if p else None) or node_name(),
        step=p.step if p and p.step > 0 else None,  # -1: the start beacon, before any step
        phase=p.phase if p else "start",
        detail=detail,
        detected_after_s=round(after, 3),
        **more,
    )


class Watchdog:
    def __init__(
        self,
        cfg: WatchdogConfig,
        beacons: BeaconServer,
        world_size: int,
        can_shrink: bool = False,
        local_gpu_use: Callable[[], dict[int, float]] | None = None,
        layout: Layout | None = None,
    ):
        """``local_gpu_use``: this host's ranks → their GPUs' recent utilization, when this host samples them;
        ``layout``: the ranks' parallel layout (where each rank sits in the mesh)."""
        self.cfg, self.beacons, self.world_size, self.can_shrink = cfg, beacons, world_size, can_shrink
        self.layout = layout if layout is not None and layout.meshed and layout.world_size == world_size else None
        self.local_gpu_use, self.gpu_idle, self._gpu_checked = local_gpu_use, GpuIdle(cfg), 0.0
        self.started = time.monotonic()
        self.cpu = CpuUse()  # this host's rank processes: computing, or idle while the others wait for them
        self.findings: list[Incident] = []
        self._compute: dict[int, dict[int, float]] = {}  # rank -> step -> compute seconds
        self._latest: dict[int, int] = {}  # rank -> the last step it reported compute for
        self._next_window: int | None = None
        self._strikes: dict[int, int] = {}
        self._flagged: set[int] = set()
        self._no_peers_said = False
        self.scores: list[dict[str, Any]] = []  # per window: last step, compute / others' median, compute ms
        self.loss_health, self.time_split = checked_by_watchdog(cfg), TimeSplit(cfg, world_size)
        beacons.keep_reports = True

    # ------------------------------------------------------------------ polling

    def check(self) -> Incident | None:
        """Called every poll; returns a fatal finding, or None to keep going."""
        found = len(self.findings)
        incident = self._check()
        for f in [*self.findings[found:], *([incident] if incident else [])]:
            self._place(f)
        return incident

    def _place(self, incident: Incident) -> None:
        """Under a layout: the culprit's mesh coordinates on the incident, and its place in the line (once)."""
        if self.layout is None or incident.rank is None or incident.mesh is not None:
            return
        incident.mesh = self.layout.coordinates(incident.rank)
        incident.detail += f" [rank {incident.rank}: {place(self.layout, incident.rank)}]"

    def _check(self) -> Incident | None:
        now = time.monotonic()
        ranks = self.beacons.snapshot()
        self._collect_compute()
        straggler = self._check_stragglers()
        if straggler and straggler.fatal:
            return straggler
        if (quiet := self._check_health()) is not None:
            return quiet
        dead = self._dead(ranks)
        if dead is not None:
            return dead
        if (astray := self._off_the_mesh(ranks)) is not None:
            return astray
        if (gave_up := self._host_gave_up(ranks, now)) is not None:
            return gave_up
        if (hang := self._check_hang(ranks, now)) is not None:
            return hang
        self._check_gpu_idle(ranks, now)  # last: a warning never delays the checks that end an attempt
        return None

    def _off_the_mesh(self, ranks: dict[int, RankProgress]) -> Incident | None:
        """A rank whose own mesh coordinates (its first step's beacon) are not where the job's layout puts it: its
        host runs another profile, and its collectives will not meet the others'."""
        if self.layout is None:
            return None
        for r, p in sorted(ranks.items()):
            said = p.extra.get("m")
            if said is not None and said != self.layout.place(r):
                return finding(
                    "desync",
                    r,
                    p,
                    f"rank {r} built its mesh at {said} (pp.dp_replicate.dp_shard.tp), the job's layout "
                    f"{self.layout.describe()} puts it at {self.layout.place(r)}: its host runs another profile",
                    0.0,
                    ranks=[r],
                )
        return None

    def _host_gave_up(self, ranks: dict[int, RankProgress], now: float) -> Incident | None:
        """Another host's supervisor closed its link before every rank started: that host gave up (its agent
        could not join the rendezvous, its part failed) and the job cannot start, so this is said at once
        rather than after watchdog.startup_timeout_s. Its own part of the attempt says why."""
        lost = self.beacons.lost_links
        if not lost or len(ranks) == self.world_size:
            return None
        missing = sorted(set(range(self.world_size)) - set(ranks))
        detail = (
            "another host's supervisor ended before the job started (its link to node 0 closed); "
            f"rank(s) {ranks_text(missing)} never reported: that host gave up, see its part of the attempt"
        )
        # No node is named: node 0 only knows another host went away, not which (its own part names it).
        return Incident(
            kind="crash", detail=detail, phase="start", detected_after_s=round(now - lost[0], 3), ranks=missing
        )

    def allowance(self, ranks: dict[int, RankProgress]) -> float:
        """Seconds without progress that count as a hang: the most that any rank's phase allows."""
        if len(ranks) < self.world_size:
            return self._phase_allowance("start")
        return max(self._phase_allowance(p.phase) for p in ranks.values())

    def _phase_allowance(self, phase: str) -> float:
        return phase_allowance_s(self.cfg, phase, self._median_step_s())

    # ------------------------------------------------------------------ hang / desync / crash

    def _check_hang(self, ranks: dict[int, RankProgress], now: float) -> Incident | None:
        last_progress = max([p.received for p in ranks.values()] + [self.started])
        stalled = now - last_progress
        if stalled < self.allowance(ranks):
            return self._stopped_early(ranks, stalled)
        if len(ranks) == self.world_size and all(p.phase == "finish" for p in ranks.values()):
            step = max(p.step for p in ranks.values())
            return finding(
                "exit",
                None,
                ranks[min(ranks)],
                f"every rank finished training (step {step} committed) but the job "
                f"did not exit within watchdog.exit_timeout_s={self.cfg.exit_timeout_s:g}s (metrics flush, barrier "
                "or teardown stalled)",
                stalled,
                ranks=sorted(ranks),
            )
        return self._diagnose(ranks, stalled)

    def _diagnose(self, ranks: dict[int, RankProgress], stalled: float) -> Incident:
        missing = sorted(set(range(self.world_size)) - set(ranks))
        if missing:
            return finding(
                "hang",
                missing[0],
                None,
                f"rank(s) {ranks_text(missing)} never reported progress (stuck before the first step)",
                stalled,
                ranks=missing,
            )
        stopped = [r for r, p in ranks.items() if _state(p) == "stopped"]
        if stopped:
            return _stopped(ranks, stopped, stalled)
        waiting = {r: p for r, p in ranks.items() if p.phase == "collective"}
        if len(waiting) == len(ranks) and (desync := self._desync(ranks, stalled)) is not None:
            return desync
        if waiting and len(waiting) < len(ranks):
            behind = sorted(r for r in ranks if r not in waiting)
            r = behind[0]
            target = _describe(_position(next(iter(waiting.values()))))
            return finding(
                "hang",
                r,
                ranks[r],
                f"rank {r} never reached {target} that rank(s) {ranks_text(sorted(waiting))} wait in; "
                f"its last beacon: step {ranks[r].step} phase {ranks[r].phase}",
                stalled,
                ranks=behind,
            )
        r = min(ranks, key=lambda k: ranks[k].received)
        return finding(
            "hang",
            r,
            ranks[r],
            f"no rank advanced for {stalled:.1f}s; rank {r}'s beacons stopped first "
            f"(step {ranks[r].step} phase {ranks[r].phase})",
            stalled,
            ranks=[r],
        )

    def _stopped_early(self, ranks: dict[int, RankProgress], stalled: float) -> Incident | None:
        """A rank whose process is stopped, once no rank advanced for ``stopped_after_s`` plus three median steps:
        a hang now, not after the allowance. A stopped process is not slow: nothing it does goes on until someone
        continues it, so the allowance, which is for what may still move, need not be waited out. The process
        states are looked up only past that stillness, which a healthy run's polls rarely see.

        The same holds, once the run has a median step, for ranks the others wait for in one collective while
        they sit idle in their step's compute (``_idle_behind``)."""
        step_s = self._median_step_s()
        if len(ranks) < self.world_size or stalled < early_after_s(self.cfg, step_s):
            return None
        stopped = [r for r, p in ranks.items() if _state(p) == "stopped"]
        if stopped:
            return _stopped(ranks, stopped, stalled)
        idle = self._idle_behind(ranks) if step_s else []
        return _idle(ranks, idle, stalled) if idle else None

    def _idle_behind(self, ranks: dict[int, RankProgress]) -> list[int]:
        """The ranks that every other rank waits for in one collective, when each of them is in its step's
        compute and idle (none if any of them computes: a slow rank is a straggler's case, not a hang's). A
        rank's first look only starts its CPU clock, so this names them one poll later."""
        waiting = {r: p for r, p in ranks.items() if p.phase == "collective"}
        behind = sorted(r for r in ranks if r not in waiting)
        if not waiting or not behind or len({_position(p) for p in waiting.values()}) != 1:
            return []
        if any(ranks[r].phase not in COMPUTE_PHASES for r in behind):
            return []  # reading data (a slow store), checkpointing, evaluating: the allowance is for those
        idle = [r for r in behind if self._is_idle(ranks[r])]  # look at each: every clock starts at once
        return behind if len(idle) == len(behind) else []

    def _is_idle(self, p: RankProgress) -> bool:
        """Idle since the last look, as this host sees its own processes or as another host's supervisor said."""
        pid = p.extra.get("pid")
        if p.extra.get("machine", p.extra.get("host")) not in (None, socket.gethostname()) or not pid:
            return p.extra.get("state") == "idle"
        try:
            return self.cpu.idle(psutil.Process(int(pid))) is True
        except psutil.Error:
            return False  # gone: the next poll's crash check names it

    def _desync(self, ranks: dict[int, RankProgress], after: float) -> Incident | None:
        """Every rank is in a collective, but not the same one: a skipped or extra call on some rank."""
        return desync_of(ranks, after)

    def _dead(self, ranks: dict[int, RankProgress]) -> Incident | None:
        dead = sorted(r for r, p in ranks.items() if p.phase != "finish" and _state(p) == "dead")
        if not dead:
            return None
        desync = self._desync(ranks, time.monotonic() - ranks[dead[0]].received)
        if desync is not None:  # the backend aborted on mismatched collectives rather than hang
            return desync
        # By the time we look, torchrun may already have stopped the survivors: list every dead rank; the
        # first to stop beaconing is the likelier origin (torchrun's root-cause report decides, when it has one).
        r = min(dead, key=lambda k: ranks[k].received)
        p = ranks[r]
        return finding(
            "crash",
            r,
            p,
            f"rank(s) {ranks_text(dead)} exited; rank {r} (pid {p.extra.get('pid')}) last reported step {p.step} "
            f"phase {p.phase}",
            time.monotonic() - p.received,
            ranks=dead,
        )

    # ------------------------------------------------------------------ quiet faults

    def _check_health(self) -> Incident | None:
        """Loss health from rank 0's step figures, data stalls and slow collectives from every rank's: findings
        are kept; the first fatal one (its policy is not 'warn') is returned."""
        found: list[Incident] = []
        for report in self.beacons.drain_reports():
            if report.rank == 0 and self.loss_health is not None and report.loss is not None:
                f = self.loss_health.observe(report.step, report.loss, report.grad_norm, report.host)
                if f is not None:
                    found.append(f)
            self.time_split.observe(report)
        found += self.time_split.check()
        self.findings += found
        return next((f for f in found if f.fatal), None)

    def _check_gpu_idle(self, ranks: dict[int, RankProgress], now: float) -> None:
        """Once a second at most (the samplers sample every 2 s): a warning, kept with the findings."""
        if self.local_gpu_use is None or self.gpu_idle.flagged or now - self._gpu_checked < 1.0:
            return
        self._gpu_checked = now
        try:
            use = {**self.beacons.gpu_use(), **self.local_gpu_use()}
            quiet = any(p.phase in ("checkpoint", "eval") for p in ranks.values())
            found = self.gpu_idle.check(self.beacons.step_times(), use, {r: p.host for r, p in ranks.items()}, quiet)
        except Exception as exc:  # noqa: BLE001 - a sensor's trouble is never the job's: stop looking, say why
            log.warning("the gpu_idle check is off for this attempt (%s)", exc)
            self.local_gpu_use = None
            return
        if found is not None:
            self.findings.append(found)

    # ------------------------------------------------------------------ stragglers

    def score_last_windows(self) -> None:
        """After the job: score the full windows the polls did not reach (a fast attempt ends between two)."""
        self._collect_compute()
        self._check_stragglers()

    def _collect_compute(self) -> None:
        for rank, step, compute_s in self.beacons.drain_compute():
            self._compute.setdefault(rank, {})[step] = compute_s
            self._latest[rank] = max(self._latest.get(rank, 0), step)

    def _median_step_s(self) -> float | None:
        times = self.beacons.step_times()
        return statistics.median(times) if len(times) >= 3 else None

    def _peer_medians(self, typical: dict[int, float]) -> dict[int, float]:
        """Each rank's baseline: the median of its peers' typical compute (leave-one-out); under a layout its
        data-parallel peers only (same pipeline stage and tp index), and its own when it has none."""
        if self.layout is None:
            return leave_one_out_medians(typical)
        groups: dict[tuple[int, int], dict[int, float]] = {}
        for r, m in typical.items():
            c = self.layout.coordinates(r)
            groups.setdefault((c["pp"], c["tp"]), {})[r] = m
        if any(len(g) == 1 for g in groups.values()) and not self._no_peers_said:
            self._no_peers_said = True
            log.info("stragglers: no data-parallel peers to compare ranks with under %s", self.layout.describe())
        return {r: m for g in groups.values() for r, m in leave_one_out_medians(g).items()}

    def _replica_groups(self, struck: list[int]) -> list[list[int]]:
        """The ranks flagged in one window, those of one data-parallel replica together: its tensor-parallel ranks
        and pipeline stages wait on each other (tp collectives, pipeline sends, neither timed apart from
        compute), so a slow one makes them slow together. One list per incident."""
        if self.layout is None:
            return [[r] for r in struck]
        groups: dict[tuple[int, int], list[int]] = {}
        for r in struck:
            c = self.layout.coordinates(r)
            groups.setdefault((c["dp_replicate"], c["dp_shard"]), []).append(r)
        return list(groups.values())

    def _straggler(
        self, group: list[int], scores: dict[int, float], typical: dict[int, float], baseline: dict[int, float],
        step: int,
    ) -> Incident:  # fmt: skip
        """The straggler incident of ``group``: one rank, or a tensor-parallel group slow together."""
        r, w = group[0], self.cfg.straggler_window
        peers = "its data-parallel peers" if self.layout is not None else "the other ranks"
        if len(group) == 1:
            detail = (
                f"rank {r} computes {scores[r]:.2f}x the median of {peers} "
                f"({typical[r] * 1000:.0f} ms vs {baseline[r] * 1000:.0f} ms a step) "
                f"for {self._strikes[r]} windows of {w} steps; policy {self.cfg.on_straggler}"
            )
        else:
            detail = (
                f"ranks {ranks_text(group)} of one data-parallel replica compute {scores[r]:.2f}x the median of "
                f"{peers} ({typical[r] * 1000:.0f} ms vs {baseline[r] * 1000:.0f} ms a step) for "
                f"{self._strikes[r]} windows of {w} steps: they wait on each other (tensor-parallel collectives, "
                f"pipeline sends), so which of them is slow is not told apart; policy {self.cfg.on_straggler}"
            )
        snapshot = self.beacons.snapshot()
        hosts = sorted({h for x in group if (h := snapshot[x].host if x in snapshot else None)})
        fatal = self._straggler_is_fatal()
        if fatal and self.cfg.on_straggler == "exclude" and len(hosts) > 1:  # no one node to leave out
            fatal = False
            detail += f"; they span hosts {', '.join(hosts)}, so no node is excluded"
        return Incident(
            kind="straggler",
            rank=r,
            node=hosts[0] if hosts else node_name(),
            step=step,
            phase="compute",
            detail=detail,
            detected_after_s=0.0,
            fatal=fatal,
            ranks=group,
        )

    def _straggler_is_fatal(self) -> bool:
        # 'exclude' needs a smaller world to relaunch on; with no node to spare it only warns.
        return self.cfg.on_straggler == "abort" or (self.cfg.on_straggler == "exclude" and self.can_shrink)

    def _check_stragglers(self) -> Incident | None:
        """Score each full window of ``straggler_window`` steps once every rank has reported all of it."""
        w = self.cfg.straggler_window
        if len(self._latest) < self.world_size:
            return None
        if self._next_window is None:  # skip the window holding the attempt's first (warm-up) step
            self._next_window = (min(min(s) for s in self._compute.values()) - 1) // w + 1
        reached = min(self._latest.values())
        flagged = None
        while (self._next_window + 1) * w <= reached:
            lo, hi = self._next_window * w + 1, (self._next_window + 1) * w
            self._next_window += 1
            typical = {
                r: statistics.median(v)
                for r, steps in self._compute.items()
                if (v := [c for s, c in steps.items() if lo <= s <= hi])
            }
            for steps in self._compute.values():  # scored: keep memory and each poll's work flat over a run
                for s in [s for s in steps if s <= hi]:
                    del steps[s]
            if len(typical) < self.world_size:
                continue
            baseline = self._peer_medians(typical)
            scores = {r: m / baseline[r] if baseline[r] > 0 else 1.0 for r, m in typical.items()}
            self.scores.append(
                {
                    "step": hi,
                    "score": {r: round(v, 4) for r, v in scores.items()},
                    "compute_ms": {r: round(m * 1000, 3) for r, m in typical.items()},
                }
            )
            struck = []
            for r, score in sorted(scores.items()):
                self._strikes[r] = self._strikes.get(r, 0) + 1 if score > self.cfg.straggler_factor else 0
                if self._strikes[r] >= self.cfg.straggler_patience and r not in self._flagged:
                    struck.append(r)
            for group in self._replica_groups(struck):
                self._flagged.update(group)
                flagged = self._straggler(group, scores, typical, baseline, hi)
                self.findings.append(flagged)
        return flagged


def phase_allowance_s(c: WatchdogConfig, phase: str, median_step_s: float | None) -> float:
    """Seconds without progress that count as a hang while a rank is in ``phase``: the allowance."""
    if phase == "finish":
        return c.exit_timeout_s
    if phase in ("start", "checkpoint", "eval"):
        return max(c.startup_timeout_s if phase == "start" else c.slow_phase_timeout_s, c.hang_timeout_s or 0.0)
    if c.hang_timeout_s is not None:
        return c.hang_timeout_s
    return max(c.hang_floor_s, c.hang_factor * median_step_s) if median_step_s else c.startup_timeout_s


def early_after_s(c: WatchdogConfig, median_step_s: float | None) -> float:
    """Seconds without progress after which a stopped rank, or an idle one the others wait for, is the hang."""
    return c.stopped_after_s + 3 * (median_step_s or 0.0)


def place(layout: Layout, rank: int) -> str:
    """Where ``rank`` sits in ``layout``, e.g. ``pipeline stage 2 of 4, tp 1 of 2, dp_shard 0 of 8``."""
    coords = layout.coordinates(rank)
    parts = [f"pipeline stage {coords['pp']} of {layout.pp}"] if layout.pp > 1 else []
    parts += [f"{n} {coords[n]} of {s}" for n, s in zip(Layout.NAMES[1:], layout.sizes[1:], strict=True) if s > 1]
    return ", ".join(parts)


def leave_one_out_medians(values: dict[int, float]) -> dict[int, float]:
    """For each key, the median of the other keys' values (its own when it is alone): O(n log n), so that a
    window of thousands of ranks is scored within a poll."""
    order = sorted(values, key=values.__getitem__)
    v = [values[k] for k in order]
    n = len(v)
    if n == 1:
        return {order[0]: v[0]}
    out = {}
    for i, k in enumerate(order):
        # the others, in order, are v without index i: their j-th is v[j] below i, v[j + 1] from i on
        def nth(j: int, i: int = i) -> float:
            return v[j] if j < i else v[j + 1]

        m = n - 1
        out[k] = nth(m // 2) if m % 2 else (nth(m // 2 - 1) + nth(m // 2)) / 2
    return out


def desync_of(ranks: dict[int, RankProgress], after: float) -> Incident | None:
    """A desync when every rank's last beacon is a collective but not the same one (a skipped or extra call)."""
    if len(ranks) < 2 or any(p.phase != "collective" for p in ranks.values()):
        return None
    positions = {r: _position(p) for r, p in ranks.items()}
    if len(set(positions.values())) == 1:
        return None
    detail = "; ".join(f"rank {r} is in {_describe(pos)}" for r, pos in sorted(positions.items()))
    first = min(positions, key=lambda r: positions[r])
    return finding("desync", first, ranks[first], f"collectives out of order: {detail}", after, ranks=sorted(positions))


def _position(p: RankProgress) -> tuple[int, int, str]:
    return (p.step, int(p.extra.get("n", 0)), str(p.extra.get("c", "")))


def _describe(pos: tuple[int, int, str]) -> str:
    step, n, kind = pos
    return f"collective #{n} ({kind or 'unknown'}) of step {step}"


def _stopped(ranks: dict[int, RankProgress], stopped: list[int], stalled: float) -> Incident:
    r = stopped[0]
    return finding(
        "hang",
        r,
        ranks[r],
        f"rank {r} is stopped (SIGSTOP) at step {ranks[r].step} phase {ranks[r].phase}; "
        f"the others wait in {_where(ranks, exclude=r)}",
        stalled,
        ranks=stopped,
    )


def _idle(ranks: dict[int, RankProgress], idle: list[int], stalled: float) -> Incident:
    r = idle[0]
    waiting = sorted(k for k in ranks if k not in idle)
    return finding(
        "hang",
        r,
        ranks[r],
        f"{_who(idle)} idle at step {ranks[r].step} phase {ranks[r].phase} (no CPU used) while rank(s) "
        f"{ranks_text(waiting)} wait in {_describe(_position(ranks[waiting[0]]))}",
        stalled,
        ranks=idle,
    )


def _who(ranks: list[int]) -> str:
    return f"rank {ranks[0]} sits" if len(ranks) == 1 else f"ranks {ranks_text(ranks)} sit"


def _where(ranks: dict[int, RankProgress], exclude: int) -> str:
    others = [f"rank {r}: step {p.step} {p.phase}" for r, p in sorted(ranks.items()) if r != exclude]
    return ", ".join(others) or "nothing"


def _state(p: RankProgress) -> str:
    """alive | stopped | dead for a rank on this host, or as its host's supervisor reports it (else alive)."""
    if p.extra.get("state") in ("stopped", "dead"):
        return p.extra["state"]
    pid = p.extra.get("pid")
    if not pid or p.extra.get("machine", p.extra.get("host")) not in (None, socket.gethostname()):
        return "alive"
    try:
        return process_state(psutil.Process(int(pid)))
    except psutil.NoSuchProcess:
        return "dead"


def process_state(proc: psutil.Process) -> str:
    status = proc.status()
    if status == psutil.STATUS_ZOMBIE or status == psutil.STATUS_DEAD:
        return "dead"
    return "stopped" if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP) else "alive"


class CpuUse:
    """Whether a process used the CPU between two looks at it, at least ``MIN_LOOK_S`` apart (a later look
    starts a new span; one older than ``STALE_S`` only restarts the clock: it would count work from before)."""

    MIN_LOOK_S = 0.2
    STALE_S = 3.0
    IDLE_SHARE = 0.05  # of one CPU: a computing rank uses about one; one waiting on a lock or a socket, ~0

    def __init__(self) -> None:
        self._last: dict[int, tuple[float, float]] = {}  # pid -> (monotonic, CPU seconds) at the last look

    def idle(self, proc: psutil.Process) -> bool | None:
        """True or False since the last look; None at a first or stale look (the clock starts)."""
        now, times = time.monotonic(), proc.cpu_times()
        used = times.user + times.system
        before = self._last.get(proc.pid)
        if before is not None and now - before[0] < self.MIN_LOOK_S:
            return None
        self._last[proc.pid] = (now, used)
        if before is None or now - before[0] > self.STALE_S:
            return None
        return (used - before[1]) / (now - before[0]) < self.IDLE_SHARE


def local_rank_states(cpu: CpuUse | None = None) -> dict[int, str]:
    """rank → alive | idle | stopped | dead of this supervisor's rank processes (named ``trainpipe-r{RANK}``);
    idle (no CPU used since the last call) only with ``cpu``, which remembers the calls."""
    states = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            name = proc.name()
            if name.startswith("trainpipe-r") and name[11:].isdigit():
                state = process_state(proc)
                if state == "alive" and cpu is not None and cpu.idle(proc):
                    state = "idle"
                states[int(name[11:])] = state
        except psutil.Error:
            continue
    return states
