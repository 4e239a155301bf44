"""The watchdog's fault checks (docs/watchdog.md): one file each, one interface (``base.Check``).

Each check is built from the attempt's ``Watch`` and, at every poll, observes the ``Poll`` (the ranks' last
beacons and what they reported since), decides, and returns the finding that ends the attempt or None; a
warning it keeps. Each module registers its ``CheckSpec`` as ``CHECK``, with its place in a poll: a new
detector is its file here, its fields in ``WatchdogConfig`` and its test.

Modules: ``base`` (Check, CheckSpec, Watch, Poll) · ``straggler`` · ``loss_health`` (loss_spike, flatline) ·
``time_split`` (network, data_stall) · ``crash`` · ``desync`` (a rank off the job's mesh; collectives out of
order) · ``lost_host`` (a host that gave up before the job started) · ``hang`` (hang, exit) · ``gpu_idle``.
"""

from __future__ import annotations

import importlib
import pkgutil

from trainpipe.trainer.supervise.checks.base import CheckSpec


def check_specs() -> list[CheckSpec]:
    """Every check of this folder (each module's ``CHECK``), in the order a poll asks them."""
    specs = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        if isinstance(spec := getattr(module, "CHECK", None), CheckSpec):
            specs.append(spec)
    return sorted(specs, key=lambda s: (s.order, s.name))
