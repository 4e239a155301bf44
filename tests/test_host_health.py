"""trainer/supervise/host_health.py: after a fault, this host's GPUs read through NVML's seam (recorded states)."""

from __future__ import annotations

from pathlib import Path

import pynvml

from trainpipe.trainer.config import PreflightConfig
from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.preflight.gpu_health import load_states
from trainpipe.trainer.supervise.host_health import failing_gpu, with_host_health

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "nvml"
CFG = PreflightConfig()


def recorded(name: str):
    return lambda: ("recorded", load_states(str(FIXTURES / f"{name}.json")))


def test_the_first_failing_gpu_check_is_the_line_and_a_healthy_or_gpu_less_host_has_none():
    line = failing_gpu(CFG, recorded("ecc_uncorrected"))
    assert line is not None and line.startswith("GPU 0 ") and "uncorrected ECC" in line
    assert failing_gpu(CFG, recorded("healthy")) is None
    assert failing_gpu(CFG, lambda: ("no NVIDIA driver", [])) is None


def test_nvml_that_cannot_be_asked_is_no_evidence_against_the_host():
    def broken():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    assert failing_gpu(CFG, broken) is None


def test_only_a_fault_a_gpu_causes_on_this_host_is_annotated():
    bad = lambda cfg: "GPU 1: fell off the bus"  # noqa: E731
    crash = Incident(kind="crash", detail="rank 1 exited with code 1", rank=1, node="here")
    assert with_host_health(crash, CFG, "here", bad).host_health == "GPU 1: fell off the bus"
    assert with_host_health(crash, CFG, "elsewhere", bad).host_health is None  # another host's culprit
    assert with_host_health(crash, CFG, "here", lambda cfg: None).host_health is None  # healthy
    for kind in ("error", "nan", "timeout"):
        assert with_host_health(crash.model_copy(update={"kind": kind}), CFG, "here", bad).host_health is None
    warning = crash.model_copy(update={"fatal": False})
    assert with_host_health(warning, CFG, "here", bad).host_health is None
    assert with_host_health(None, CFG, "here", bad) is None
