"""Fault drills (the profile's ``faults`` section): misbehave on purpose, on one rank, at one step.

Users rehearse detection and alerting with them; tests use them next to
external signals. Each fault fires only in the first ``faults.attempts``
attempts, so the retry shows the recovery.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import torch

from trainer.config import FaultsConfig

log = logging.getLogger("trainpipe.faults")


class Faults:
    def __init__(self, cfg: FaultsConfig, rank: int, attempt: int):
        self.cfg = cfg
        self.armed = cfg.kind != "none" and cfg.rank == rank and (cfg.attempts == 0 or attempt <= cfg.attempts)

    def _due(self, step: int, *kinds: str) -> bool:
        return self.armed and self.cfg.kind in kinds and step >= self.cfg.step

    def before_step(self, step: int) -> None:
        """``step`` is 1-based: the optimizer step about to run."""
        if not self._due(step, "crash", "exception", "hang") or step != self.cfg.step:
            return
        log.warning("fault drill: %s at step %d", self.cfg.kind, step)
        if self.cfg.kind == "crash":
            if self.cfg.exit_code is None:
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(self.cfg.exit_code)
        if self.cfg.kind == "exception":
            raise RuntimeError(f"fault drill: exception injected at step {step}")
        while True:  # hang: alive, holding no lock, making no progress
            time.sleep(1)

    def slow_down(self, step: int, last_compute_s: float) -> None:
        """Stretch this step's compute to about ``factor`` times (a sleep: the numbers are unchanged)."""
        if self._due(step, "slow"):
            time.sleep(last_compute_s / self.cfg.factor * (self.cfg.factor - 1))

    def throttle(self, elapsed_s: float) -> None:
        """slow, outside the training loop (the preflight GEMM): stretch the timed work to ``factor`` times."""
        if self.armed and self.cfg.kind == "slow":
            time.sleep(elapsed_s * (self.cfg.factor - 1))

    def corrupt_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        if self._due(step, "nan") and step == self.cfg.step:
            return loss * float("nan")
        return loss

    def skip_collective(self, step: int) -> bool:
        return self._due(step, "skip_collective") and step == self.cfg.step

    def before_commit(self, step: int) -> None:
        if self._due(step, "slow_checkpoint"):
            log.warning("fault drill: holding the commit of step %d for %.1fs", step, self.cfg.delay_s)
            time.sleep(self.cfg.delay_s)
        if self._due(step, "crash_in_checkpoint"):
            log.warning("fault drill: dying between the write and the commit of step %d", step)
            os.kill(os.getpid(), signal.SIGKILL)
