"""Loss health: a training loss that spikes or flatlines (docs/architecture.md §9).

Every rank sees the same all-reduced loss and gradient norm, so each decides
alike: under ``watchdog.on_loss_spike: rollback | stop`` (and ``on_flatline:
stop``) the ranks run this check at every step and stop before the next
checkpoint; under ``warn`` the watchdog runs it on rank 0's beacons and reports
while training goes on. Pure Python: the ranks and the supervisor share it.

- A loss above ``loss_spike_factor`` or a gradient norm above
  ``grad_spike_factor`` times its rolling median over ``health_window`` steps is
  a ``loss_spike`` (the spike stays out of the median).
- A training loss whose least-squares trend over the last ``flatline_steps``
  falls by less than one standard error of its slope is a ``flatline``: a
  healthy loss falls by several (the local profile's over 500 steps, by 3.1 or
  more through 3,000 steps of a cosine schedule, three epochs of its data and
  the annealed end included; tests/fixtures/healthy_local_3000.json).
- An eval loss whose trend across the evaluations of the last
  ``flatline_steps`` (at least ``MIN_EVALS`` of them) falls by less than one
  standard error, or by less than ``MIN_EVAL_FALL`` of itself, is a
  ``flatline`` at phase ``eval`` (``EvalTrend``). The
  watchdog never sees eval losses: the ranks check it under ``warn`` too, and
  rank 0 reports it.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from trainpipe.trainer.config import WatchdogConfig
from trainpipe.trainer.incidents import Incident

MIN_EVALS = 4  # fewer points have no noise to measure a trend against
# The eval loss is measured on the same windows every time, so it has almost no noise: a fall this small a share
# of it over a window is no improvement however steady (train.lr=1e-9 under Adam lowers it by ~1e-5 a step).
MIN_EVAL_FALL = 1e-3


@dataclass(frozen=True)
class _Step:
    step: int
    loss: float
    grad_norm: float | None
    host: str | None


class LossHealth:
    """``spikes``, ``flatlines``: which of the two it looks for (each is looked for in one place)."""

    def __init__(self, cfg: WatchdogConfig, spikes: bool = True, flatlines: bool = True):
        self.cfg, self.spikes, self.flatlines = cfg, spikes, flatlines
        self.losses: deque[float] = deque(maxlen=cfg.health_window)
        self.grads: deque[float] = deque(maxlen=cfg.health_window)
        self.recent: deque[float] = deque(maxlen=cfg.flatline_steps)
        self.quiet_until = 0  # after a spike under 'warn', the next one is reported a window later
        self.flatlined = False
        self.last_step = 0

    def observe(self, step: int, loss: float, grad_norm: float | None, host: str | None = None) -> Incident | None:
        """The finding about step ``step`` (its loss and gradient norm, the same on every rank), if any."""
        if step <= self.last_step:
            return None
        self.last_step = step
        r = _Step(step, loss, grad_norm, host)
        found = self._spike(r)
        if found is None:  # a spike stays out of the medians it is measured against
            self.losses.append(loss)
            if grad_norm is not None:
                self.grads.append(grad_norm)
            self.recent.append(loss)
            found = self._flatline(r)
        return found

    def _spike(self, r: _Step) -> Incident | None:
        c = self.cfg
        if not self.spikes or len(self.losses) < c.health_window or r.step < self.quiet_until:
            return None
        loss_median = statistics.median(self.losses)
        grad_median = statistics.median(self.grads) if len(self.grads) >= c.health_window else None
        loss_high = loss_median > 0 and r.loss > c.loss_spike_factor * loss_median
        grad_high = bool(grad_median) and r.grad_norm is not None and r.grad_norm > c.grad_spike_factor * grad_median
        if not (loss_high or grad_high):
            return None
        self.quiet_until = r.step + c.health_window
        what = [f"training loss {r.loss:.4f} is {r.loss / loss_median:.1f}x its median {loss_median:.4f}"]
        if grad_median and r.grad_norm is not None:
            what.append(f"gradient norm {r.grad_norm:.3g} is {r.grad_norm / grad_median:.1f}x its median")
        then = {
            "warn": "training goes on",
            "rollback": f"the run resumes from the newest checkpoint before step {r.step} and skips the data from "
            f"it through step {r.step}",
            "stop": "the run stops; lower train.lr or raise train.grad_clip",
        }[c.on_loss_spike]
        return Incident(
            kind="loss_spike",
            step=r.step,
            phase="optimizer",
            node=r.host,
            detail=f"at step {r.step}: {'; '.join(what)} (over the last {c.health_window} steps); "
            f"policy {c.on_loss_spike}: {then}",
            detected_after_s=0.0,
            fatal=c.on_loss_spike != "warn",
        )

    def _flatline(self, r: _Step) -> Incident | None:
        n = self.cfg.flatline_steps
        if not self.flatlines or self.flatlined or len(self.recent) < n:
            return None
        fall, t = falling_trend(list(self.recent))
        if t >= 1.0:
            return None
        self.flatlined = True
        then = "training goes on" if self.cfg.on_flatline == "warn" else "the run stops"
        return Incident(
            kind="flatline",
            step=r.step,
            phase="optimizer",
            node=r.host,
            detail=f"the training loss did not improve over steps {r.step - n + 1}-{r.step}: its trend fell "
            f"{fall:+.4f} over them, within its own noise ({t:.1f} standard errors); check train.lr, the data and "
            f"the gradients; policy {self.cfg.on_flatline}: {then}",
            detected_after_s=0.0,
            fatal=self.cfg.on_flatline == "stop",
        )


class EvalTrend:
    """The eval loss across evaluations (every rank evaluates the same windows: the same loss everywhere)."""

    def __init__(self, cfg: WatchdogConfig):
        self.cfg = cfg
        self.evals: list[tuple[int, float]] = []  # the last flatline_steps' evaluations
        self.first: int | None = None  # the attempt's first evaluation
        self.flatlined = False

    def observe(self, step: int, loss: float, host: str | None = None) -> Incident | None:
        if self.flatlined or (self.evals and step <= self.evals[-1][0]) or not math.isfinite(loss):
            return None
        n = self.cfg.flatline_steps
        self.first = step if self.first is None else self.first
        self.evals = [(s, v) for s, v in self.evals if s >= step - n] + [(step, loss)]
        if self.first > step - n or len(self.evals) < MIN_EVALS:  # not a whole window yet
            return None
        values = [v for _, v in self.evals]
        fall, t = falling_trend(values, [s for s, _ in self.evals])  # by step: the final one may be off the grid
        share = fall / max(statistics.fmean(values), 1e-12)
        if t >= 1.0 and share >= MIN_EVAL_FALL:
            return None
        self.flatlined = True
        then = "training goes on" if self.cfg.on_flatline == "warn" else "the run stops"
        steps = f"{self.evals[0][0]}-{step}"
        return Incident(
            kind="flatline",
            step=step,
            phase="eval",
            node=host,
            detail=f"the eval loss did not improve across the {len(self.evals)} evaluations of steps {steps}: its "
            f"trend fell {fall:+.4g} ({share:+.3%}, {t:.1f} standard errors; an improvement is at least 1 "
            f"standard error and {MIN_EVAL_FALL:.1%}); check train.lr and the data "
            f"(an eval loss rising while the training loss falls is overfitting); policy {self.cfg.on_flatline}: "
            f"{then}",
            detected_after_s=0.0,
            fatal=self.cfg.on_flatline == "stop",
        )


def falling_trend(values: list[float], xs: list[int] | None = None) -> tuple[float, float]:
    """(how far the least-squares line through ``values`` (at ``xs``, default 0, 1, …) falls from the first to
    the last, that fall in standard errors of the slope): a healthy loss falls by many standard errors; a flat
    one by about none."""
    n = len(values)
    xs = list(range(n)) if xs is None else xs
    xm, ym = statistics.fmean(xs), statistics.fmean(values)
    sxx = sum((x - xm) ** 2 for x in xs)
    slope = sum((x - xm) * (y - ym) for x, y in zip(xs, values, strict=True)) / sxx
    residual = sum((y - ym - slope * (x - xm)) ** 2 for x, y in zip(xs, values, strict=True))
    se = math.sqrt(residual / (n - 2) / sxx) if n > 2 else 0.0
    return -slope * (xs[-1] - xs[0]), (-slope / se if se > 0 else (math.inf if slope < 0 else 0.0))


def checked_by_ranks(cfg: WatchdogConfig) -> LossHealth | None:
    """What the ranks look for themselves: whatever ends the attempt (a spike under rollback or stop, a flatline
    under stop), at the step it happens, before another checkpoint is written."""
    spikes, flatlines = cfg.on_loss_spike != "warn", cfg.on_flatline == "stop"
    return LossHealth(cfg, spikes, flatlines) if spikes or flatlines else None


def checked_by_watchdog(cfg: WatchdogConfig) -> LossHealth | None:
    """What the watchdog looks for on rank 0's beacons: the warnings, reported while training goes on."""
    spikes, flatlines = cfg.on_loss_spike == "warn", cfg.on_flatline == "warn"
    return LossHealth(cfg, spikes, flatlines) if spikes or flatlines else None
