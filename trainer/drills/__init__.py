"""Fault drills: faults injected on purpose to rehearse detection and recovery (off unless ``faults.kind`` asks)."""

from trainpipe.trainer.drills.faults import FaultDrill, throttle

__all__ = ["FaultDrill", "throttle"]
