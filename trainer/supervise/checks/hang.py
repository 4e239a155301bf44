"""hang: no rank advanced within the allowance of its phase. The culprit is a stopped or dead process if there
is one; else the rank(s) that never reached the collective the others wait in; else the rank whose beacons
stopped first. A stopped process is a hang sooner: once no rank advanced for ``stopped_after_s`` plus three
median steps; so is a rank that the others wait for in a collective while it sits in its step's compute
(forward or optimizer) without using the CPU (``CpuUse``): it waits for something that will not come. A rank
that computes, or waits for data, a checkpoint or an evaluation, keeps the allowance.

exit: every rank finished (final checkpoint committed) but the job did not end within ``exit_timeout_s``:
never a training hang."""

from __future__ import annotations

import socket

import psutil

from trainpipe.trainer.config import WatchdogConfig
from trainpipe.trainer.incidents import Incident, ranks_text
from trainpipe.trainer.supervise.beacons import RankProgress
from trainpipe.trainer.supervise.checks.base import Check, CheckSpec, Poll, Watch, finding
from trainpipe.trainer.supervise.checks.desync import describe, desync_of, position
from trainpipe.trainer.supervise.rank_states import rank_state

COMPUTE_PHASES = frozenset({"forward", "optimizer"})  # a rank idle here while the others wait is a hang early


class Hang(Check):
    def observe(self, poll: Poll) -> Incident | None:
        ranks = poll.ranks
        last_progress = max([p.received for p in ranks.values()] + [self.watch.started])
        stalled = poll.now - last_progress
        if stalled < allowance_s(self.watch, ranks):
            return self._stopped_early(ranks, stalled)
        if len(ranks) == self.watch.world_size and all(p.phase == "finish" for p in ranks.values()):
            step = max(p.step for p in ranks.values())
            return finding(
                "exit",
                None,
                ranks[min(ranks)],
                f"every rank finished training (step {step} committed) but the job did not exit within "
                f"watchdog.exit_timeout_s={self.watch.cfg.exit_timeout_s:g}s (metrics flush, barrier or teardown "
                "stalled)",
                stalled,
                ranks=sorted(ranks),
            )
        return self._diagnose(ranks, stalled)

    def _diagnose(self, ranks: dict[int, RankProgress], stalled: float) -> Incident:
        missing = sorted(set(range(self.watch.world_size)) - set(ranks))
        if missing:
            return finding(
                "hang",
                missing[0],
                None,
                f"rank(s) {ranks_text(missing)} never reported progress (stuck before the first step)",
                stalled,
                ranks=missing,
            )
        stopped = [r for r, p in ranks.items() if rank_state(p) == "stopped"]
        if stopped:
            return _stopped(ranks, stopped, stalled)
        waiting = {r: p for r, p in ranks.items() if p.phase == "collective"}
        if len(waiting) == len(ranks) and (desync := desync_of(ranks, stalled)) is not None:
            return desync
        if waiting and len(waiting) < len(ranks):
            behind = sorted(r for r in ranks if r not in waiting)
            r = behind[0]
            target = describe(position(next(iter(waiting.values()))))
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
        step_s = self.watch.median_step_s()
        if len(ranks) < self.watch.world_size or stalled < early_after_s(self.watch.cfg, step_s):
            return None
        stopped = [r for r, p in ranks.items() if rank_state(p) == "stopped"]
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
        if not waiting or not behind or len({position(p) for p in waiting.values()}) != 1:
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
            return self.watch.cpu.idle(psutil.Process(int(pid))) is True
        except psutil.Error:
            return False  # gone: the next poll's crash check names it


def allowance_s(watch: Watch, ranks: dict[int, RankProgress]) -> float:
    """Seconds without progress that count as a hang: the most that any rank's phase allows."""
    median = watch.median_step_s()
    if len(ranks) < watch.world_size:
        return phase_allowance_s(watch.cfg, "start", median)
    return max(phase_allowance_s(watch.cfg, p.phase, median) for p in ranks.values())


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
        f"{ranks_text(waiting)} wait in {describe(position(ranks[waiting[0]]))}",
        stalled,
        ranks=idle,
    )


def _who(ranks: list[int]) -> str:
    return f"rank {ranks[0]} sits" if len(ranks) == 1 else f"ranks {ranks_text(ranks)} sit"


def _where(ranks: dict[int, RankProgress], exclude: int) -> str:
    others = [f"rank {r}: step {p.step} {p.phase}" for r, p in sorted(ranks.items()) if r != exclude]
    return ", ".join(others) or "nothing"


CHECK = CheckSpec("hang", 60, Hang)
