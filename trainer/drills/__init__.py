"""Fault drills: faults injected on purpose to rehearse detection and recovery (off unless ``faults.kind`` asks).

``faults``: the drills themselves, a callback of the training loop.
"""

from trainpipe.trainer.drills.faults import FaultDrill, throttle

__all__ = ["FaultDrill", "throttle"]
