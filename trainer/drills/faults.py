"""Fault drills (the profile's ``faults`` section): misbehave on purpose, on one rank, at one step.

Users rehearse detection and alerting with them; tests use them next to
external signals. Each fault fires only in the first ``faults.attempts``
attempts, so the retry shows the recovery. The drill is a loop callback, built
only when ``faults.kind`` is not ``none``; the loop itself has no drill code.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import torch
import torch.distributed as dist

from trainpipe.trainer.config import FaultsConfig
from trainpipe.trainer.loop.callbacks import Callback, StepMetrics

log = logging.getLogger("trainpipe.faults")


def armed(cfg: FaultsConfig, rank: int, attempt: int) -> bool:
    return cfg.kind != "none" and cfg.rank == rank and (cfg.attempts == 0 or attempt <= cfg.attempts)


class FaultDrill(Callback):
    def __init__(self, cfg: FaultsConfig, rank: int, attempt: int):
        self.cfg, self.armed = cfg, armed(cfg, rank, attempt)
        self.step, self.compute_start, self.compute_s = 0, 0.0, 0.0
        self.device = torch.device("cpu")
        self.model: torch.nn.Module | None = None
        self.held_data = 0  # the last step whose data slow_data held

    def _due(self, step: int, *kinds: str, once: bool = False) -> bool:
        return self.armed and self.cfg.kind in kinds and (step == self.cfg.step if once else step >= self.cfg.step)

    def on_setup(self, model: torch.nn.Module) -> None:
        self.device = next(model.parameters()).device  # collectives run where the model does (NCCL: on the GPU)
        self.model = model
        if self.armed and self.cfg.kind in ("nan", "loss_spike"):
            model.register_forward_hook(self._poison)

    def _poison(self, module: torch.nn.Module, inputs, output):
        """nan: the model's loss turns NaN on this rank at the drill's step (its gradients follow); loss_spike: it
        is multiplied by ``factor`` (and so are its gradients)."""
        logits, loss = output
        if loss is not None and self._due(self.step, "nan", once=True):
            return logits, loss * float("nan")
        if loss is not None and self._due(self.step, "loss_spike", once=True):
            return logits, loss * self.cfg.factor
        return output

    def on_data(self, step: int) -> None:
        if self._due(step, "slow_data") and self.held_data != step:  # inside the timed read of the step's first batch
            self.held_data = step
            time.sleep(self.cfg.step_delay_s)

    def on_step_start(self, step: int) -> None:
        self.step = step
        if self._due(step, "crash", "exception", once=True):
            self._strike(step)
        if self._due(step, "slow"):  # stretch this step's compute to about `factor` times; the numbers are unchanged
            time.sleep(self.compute_s * (self.cfg.factor - 1))
        self.compute_start = time.perf_counter()

    def on_phase(self, step: int, phase: str) -> None:
        if phase == "forward" and self._due(step, "hang", once=True):  # the step's data read: stuck in compute
            self._strike(step)

    def on_gradients_ready(self) -> None:
        self.compute_s = time.perf_counter() - self.compute_start
        if self._due(self.step, "slow_network"):  # before the last bucket's all-reduce: every rank waits in it
            time.sleep(self.cfg.step_delay_s)

    def on_step_end(self, metrics: StepMetrics) -> None:
        if self._due(metrics.step, "bitflip", once=True):
            self._flip(metrics.step)
        if self._due(metrics.step, "extra_collective", once=True):
            # A collective the other ranks never call: theirs of the next step meets this one.
            log.warning("fault drill: an extra collective at step %d", metrics.step)
            dist.all_reduce(torch.zeros(3, device=self.device))

    def on_checkpoint_written(self, step: int) -> None:
        if self._due(step, "slow_checkpoint"):
            log.warning("fault drill: holding the commit of step %d for %.1fs", step, self.cfg.delay_s)
            time.sleep(self.cfg.delay_s)
        if self._due(step, "crash_in_checkpoint"):
            log.warning("fault drill: dying between the write and the commit of step %d", step)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_finish(self) -> None:
        if self.armed and self.cfg.kind == "slow_exit":
            log.warning("fault drill: holding the end of the attempt for %.1fs", self.cfg.delay_s)
            time.sleep(self.cfg.delay_s)

    def _flip(self, step: int) -> None:
        """bitflip: one bit of the middle element of the model's largest float32 weight, after the optimizer step:
        what a faulty device's memory does, silently."""
        assert self.model is not None  # given before the first step
        p = max((p for p in self.model.parameters() if p.dtype == torch.float32), key=lambda p: p.numel())
        with torch.no_grad():
            bits = p.data.view(-1).view(torch.int32)  # a view: the flip lands in the weight itself
            i = bits.numel() // 2
            bits[i] ^= 1 << self.cfg.bit if self.cfg.bit < 31 else -(2**31)
        shape = tuple(p.shape)
        log.warning("fault drill: flipped bit %d of element %d of a %s weight at step %d", self.cfg.bit, i, shape, step)

    def _strike(self, step: int) -> None:
        log.warning("fault drill: %s at step %d", self.cfg.kind, step)
        if self.cfg.kind == "crash":
            if self.cfg.exit_code is None:
                os.kill(os.getpid(), signal.SIGKILL)
            else:
                os._exit(self.cfg.exit_code)
        if self.cfg.kind == "exception":
            raise RuntimeError(f"fault drill: exception injected at step {step}")
        while True:  # hang: alive, holding no lock, making no progress
            time.sleep(1)


def throttle(cfg: FaultsConfig, rank: int, elapsed_s: float) -> None:
    """slow, outside the training loop (the preflight GEMM): stretch the timed work to ``factor`` times."""
    if armed(cfg, rank, attempt=1) and cfg.kind == "slow":
        time.sleep(elapsed_s * (cfg.factor - 1))
