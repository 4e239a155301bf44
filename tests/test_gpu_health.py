"""GPU health: recorded NVML states -> preflight verdicts, the NVML wrapper -> state mapping, and probe()."""

from __future__ import annotations

import json
from pathlib import Path

import pynvml
import pytest

from trainpipe.trainer.config import PreflightConfig
from trainpipe.trainer.preflight import gpu_health
from trainpipe.trainer.preflight.gpu_health import (
    STATE_KEYS,
    Nvml,
    evaluate,
    load_states,
    no_gpu_check,
    probe,
    read_devices,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "nvml"
CFG = PreflightConfig()


def states(name: str) -> list[dict]:
    return load_states(str(FIXTURES / f"{name}.json"))


def verdicts(checks: list[dict]) -> dict[tuple[int, str], dict]:
    return {(c["device"], c["name"]): c for c in checks}


def not_passing(checks: list[dict]) -> dict[tuple[int, str], str]:
    return {(c["device"], c["name"]): c["status"] for c in checks if c["status"] != "pass"}


def test_every_fixture_is_a_list_of_complete_states():
    for path in FIXTURES.glob("*.json"):
        raw = json.loads(path.read_text())
        assert isinstance(raw, list) and 1 <= len(raw) <= 2, path.name
        for s in raw:
            assert set(s) == set(STATE_KEYS), path.name


def test_healthy_passes_everything():
    checks = evaluate(states("healthy"), CFG)
    assert not_passing(checks) == {}
    assert len(checks) == 2 * len(gpu_health.CHECKS)
    v = verdicts(checks)
    # The idle GPU rests at 345 MHz: NVML says it is idle, so low clocks are no finding.
    assert "idle" in v[0, "gpu.clocks"]["detail"]
    assert v[1, "gpu.driver"]["detail"].endswith("driver 570.124.06, CUDA driver 12.8")
    assert v[1, "gpu.nvlink"]["detail"].endswith("18 NVLink links active")
    assert all(
        c["uuid"].startswith("GPU-") and set(c) >= {"name", "status", "detail", "device", "uuid"} for c in checks
    )


def test_ecc_uncorrected():
    checks = evaluate(states("ecc_uncorrected"), CFG)
    assert not_passing(checks) == {(0, "gpu.ecc"): "fail", (1, "gpu.ecc"): "warn"}
    v = verdicts(checks)
    fail = v[0, "gpu.ecc"]["detail"]
    assert fail.startswith("GPU 0 (NVIDIA H100 80GB HBM3, 00000000:18:00.0)")
    assert "2 uncorrected ECC error(s) since the driver loaded (3 over its lifetime)" in fail
    assert "reset the GPU (nvidia-smi -r -i 0)" in fail
    warn = v[1, "gpu.ecc"]["detail"]
    assert warn.startswith("GPU 1 ") and "1 uncorrected ECC error(s) over its lifetime" in warn and "replace" in warn


def test_remap_pending_and_failure():
    checks = evaluate(states("remap_pending"), CFG)
    assert not_passing(checks) == {
        (0, "gpu.memory_remap"): "fail",
        (1, "gpu.memory_remap"): "fail",
        (0, "gpu.ecc"): "warn",
        (1, "gpu.ecc"): "warn",
    }
    v = verdicts(checks)
    pending = v[0, "gpu.memory_remap"]["detail"]
    assert pending.startswith("GPU 0 ") and "row remap is pending" in pending and "1 uncorrected" in pending
    assert "reset the GPU" in pending
    failed = v[1, "gpu.memory_remap"]["detail"]
    assert failed.startswith("GPU 1 ") and "row remapping failed" in failed and "8 uncorrected" in failed
    assert "replace the GPU" in failed


def test_retired_pages_pending_fails_on_pre_ampere_gpus():
    s = states("healthy")[0] | {
        "retired_pages_pending": True,
        "remap_pending": None,
        "remap_failure": None,
        "remap_corrected_rows": None,
        "remap_uncorrected_rows": None,
    }
    check = verdicts(evaluate([s], CFG))[0, "gpu.memory_remap"]
    assert check["status"] == "fail" and "page retirement is pending" in check["detail"] and "reset" in check["detail"]


def test_memory_remap_not_reported_passes():
    s = states("healthy")[0] | dict.fromkeys(
        ("retired_pages_pending", "remap_pending", "remap_failure", "remap_corrected_rows", "remap_uncorrected_rows")
    )
    check = verdicts(evaluate([s], CFG))[0, "gpu.memory_remap"]
    assert check["status"] == "pass" and "not reported" in check["detail"]


def test_thermal_throttle():
    checks = evaluate(states("thermal_throttle"), CFG)
    assert not_passing(checks) == {
        (0, "gpu.temperature"): "fail",
        (0, "gpu.throttle"): "fail",
        (0, "gpu.clocks"): "fail",
    }
    v = verdicts(checks)
    temp = v[0, "gpu.temperature"]["detail"]
    assert (
        temp.startswith("GPU 0 ")
        and "88 °C, within 5 °C of shutdown" in temp
        and "slowdown at 89 °C, shutdown at 92 °C" in temp
    )
    assert "check fans, airflow" in temp
    throttle = v[0, "gpu.throttle"]["detail"]
    assert "HW slowdown, HW thermal slowdown, SW thermal slowdown" in throttle and "0x68" in throttle
    assert "check fans, airflow" in throttle and "drain the node" in throttle
    clocks = v[0, "gpu.clocks"]["detail"]
    assert "855 MHz is 43% of max 1980 MHz" in clocks and "throttled by" in clocks


@pytest.mark.parametrize("temp,status", [(80, "pass"), (84, "warn"), (86, "warn"), (87, "fail"), (89, "fail")])
def test_temperature_thresholds(temp, status):
    # slowdown 89 °C, shutdown 92 °C, margin 5 °C: warn from 84, fail from 87 (shutdown - margin).
    s = states("healthy")[1] | {"temperature_c": temp}
    assert verdicts(evaluate([s], CFG))[1, "gpu.temperature"]["status"] == status


def test_pcie_degraded_warns_by_default_and_fails_when_configured():
    v = verdicts(evaluate(states("pcie_degraded"), CFG))
    check = v[0, "gpu.pcie"]
    assert check["status"] == "warn"
    assert check["detail"].startswith("GPU 0 ") and "PCIe gen 3 x8, max gen 5 x16" in check["detail"]
    assert "drop link gen when idle" in check["detail"] and "reseat" in check["detail"]
    strict = evaluate(states("pcie_degraded"), PreflightConfig(pcie_degraded="fail"))
    assert not_passing(strict) == {(0, "gpu.pcie"): "fail"}


def test_idle_gen_drop_only_warns_even_when_strict():
    # An idle GPU lowers its link generation to save power: not conclusive, so never a fail.
    s = states("healthy")[0] | {"pcie_gen": 1}
    check = verdicts(evaluate([s], PreflightConfig(pcie_degraded="fail")))[0, "gpu.pcie"]
    assert check["status"] == "warn" and "idle" in check["detail"]


def test_clocks_low_under_power_cap():
    checks = evaluate(states("clocks_low"), CFG)
    assert not_passing(checks) == {(0, "gpu.clocks"): "fail", (0, "gpu.throttle"): "warn", (0, "gpu.power"): "warn"}
    v = verdicts(checks)
    assert (
        "810 MHz is 41% of max 1980 MHz (threshold 50%) while throttled by SW power cap" in v[0, "gpu.clocks"]["detail"]
    )
    assert "SW power cap" in v[0, "gpu.throttle"]["detail"] and "699 of 700 W" in v[0, "gpu.throttle"]["detail"]
    assert "drawing 699 W of its 700 W limit (100%)" in v[0, "gpu.power"]["detail"]


def test_low_clocks_without_reason_warn():
    s = states("healthy")[1] | {"sm_clock_mhz": 600}
    check = verdicts(evaluate([s], CFG))[1, "gpu.clocks"]
    assert (
        check["status"] == "warn"
        and "600 MHz is 30% of max 1980 MHz" in check["detail"]
        and "re-run under load" in check["detail"]
    )


def test_mixed_flags_only_the_bad_gpu():
    checks = evaluate(states("mixed"), CFG)
    assert not_passing(checks) == {(1, "gpu.ecc"): "fail"}
    bad = verdicts(checks)[1, "gpu.ecc"]
    assert bad["uuid"] == "GPU-b81e07d4-52c9-6af3-1e8d-c47a90b3f215" and bad["detail"].startswith("GPU 1 ")


def test_nvlink():
    base = states("healthy")[1]
    down = base | {"nvlink_active": [True] * 5 + [False] + [True] * 10 + [False, True]}
    check = verdicts(evaluate([down], CFG))[1, "gpu.nvlink"]
    assert check["status"] == "fail" and "links 5, 16 inactive (16 of 18 active)" in check["detail"]
    assert verdicts(evaluate([base | {"nvlink_active": None}], CFG))[1, "gpu.nvlink"]["detail"].endswith("no NVLink")
    assert verdicts(evaluate([base | {"nvlink_active": [False] * 4}], CFG))[1, "gpu.nvlink"]["status"] == "warn"


@pytest.mark.parametrize(
    "action,advice",
    [("gpu_reset", "nvidia-smi -r -i 1"), ("node_reboot", "reboot"), ("drain_and_reset", "drain the node")],
)
def test_recovery_action(action, advice):
    s = states("healthy")[1] | {"recovery_action": action}
    check = verdicts(evaluate([s], CFG))[1, "gpu.recovery_action"]
    assert check["status"] == "fail" and f"'{action}'" in check["detail"] and advice in check["detail"]
    assert check["detail"].startswith("GPU 1 ")


def test_unreadable_gpu_fails_alone():
    lost = dict.fromkeys(STATE_KEYS) | {"index": 3, "error": "NVMLError_GpuIsLost: GPU is lost"}
    checks = evaluate([lost], CFG)
    assert [(c["name"], c["status"]) for c in checks] == [("gpu.nvml", "fail")]
    assert checks[0]["detail"].startswith("GPU 3: NVML cannot read it (NVMLError_GpuIsLost")


def test_power_limit_ratio_comes_from_config():
    s = states("healthy")[1] | {"power_mw": 665000}  # 95% of 700 W
    assert verdicts(evaluate([s], CFG))[1, "gpu.power"]["status"] == "pass"
    assert verdicts(evaluate([s], PreflightConfig(max_power_ratio=0.9)))[1, "gpu.power"]["status"] == "warn"


def test_no_gpu_check():
    assert no_gpu_check("no NVIDIA driver") == {"name": "gpu.nvml", "status": "skip", "detail": "no NVIDIA driver"}


# ---- probe() and the NVML wrapper ----------------------------------------------------------------


def test_probe_on_this_machine_does_not_raise(monkeypatch):
    monkeypatch.delenv(gpu_health.STATES_ENV, raising=False)
    status, found = probe()
    if status == "ok":  # a GPU machine: real states, and the policy reads them
        assert found and all(s["uuid"] for s in found)
        assert evaluate(found, CFG)
    else:
        assert status in ("no NVIDIA driver", "no GPUs") and found == []


def test_recorded_states_replace_nvml(monkeypatch):
    monkeypatch.setenv(gpu_health.STATES_ENV, str(FIXTURES / "mixed.json"))
    status, found = probe()
    assert status == "recorded"
    assert [s["uuid"] for s in found] == [
        "GPU-4f2a9c1e-8b7d-3e65-a0c4-9d1b2e7f6a83",
        "GPU-b81e07d4-52c9-6af3-1e8d-c47a90b3f215",
    ]


def test_recorded_states_fill_missing_keys_and_reject_garbage(tmp_path, monkeypatch):
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps([{"index": 0, "temperature_c": 40}]))
    monkeypatch.setenv(gpu_health.STATES_ENV, str(partial))
    _, found = probe()
    assert set(found[0]) == set(STATE_KEYS) and found[0]["temperature_c"] == 40
    assert {c["status"] for c in evaluate(found, CFG)} == {"pass"}
    partial.write_text(json.dumps({"index": 0}))
    with pytest.raises(ValueError, match="TRAINPIPE_NVML_STATES"):
        probe()


class FakeNvml(Nvml):
    """One H100 as NVML would describe it; the only fake of the NVML calls in the suite."""

    nvlink_max_links = 36  # links past the GPU's 18 answer InvalidArgument, as NVML does

    def __init__(self):
        self.calls: list[str] = []

    def init(self):
        self.calls.append("init")

    def shutdown(self):
        self.calls.append("shutdown")

    def device_count(self):
        return 1

    def handle(self, index):
        return f"handle-{index}"

    def name(self, h):
        return "NVIDIA H100 80GB HBM3"

    def uuid(self, h):
        return "GPU-4f2a9c1e-8b7d-3e65-a0c4-9d1b2e7f6a83"

    def utilization_pct(self, h):
        return 97

    def pci_bus_id(self, h):
        return "00000000:18:00.0"

    def ecc_uncorrected(self, h, volatile):
        return 0 if volatile else 2

    def retired_pages_pending(self, h):
        raise pynvml.NVMLError_NotSupported()  # Hopper remaps rows instead

    def remapped_rows(self, h):
        return (1, 2, 1, 0)

    def temperature(self, h):
        return 33

    def temperature_threshold(self, h, shutdown):
        return 92 if shutdown else 89

    def clocks_event_reasons(self, h):
        return pynvml.nvmlClocksEventReasonGpuIdle

    def sm_clock(self, h, maximum):
        return 1980 if maximum else 345

    def power_usage_mw(self, h):
        return 71250

    def power_limit_mw(self, h):
        return 700000

    def pcie_link(self, h, maximum):
        return (5, 16) if maximum else (4, 16)

    def nvlink_state(self, h, link):
        if link >= 18:
            raise pynvml.NVMLError_InvalidArgument()
        return link != 7

    def recovery_action(self, h):
        return pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET

    def driver_version(self):
        return "570.124.06"

    def cuda_driver_version(self):
        return 12080


def test_the_supervisors_sampler_reads_utilization_from_nvml_or_the_recorded_states(tmp_path, monkeypatch):
    nvml = FakeNvml()  # the sampler initialised it once, on its own thread
    assert gpu_health.utilization(nvml) == {"0": 97.0, "GPU-4f2a9c1e-8b7d-3e65-a0c4-9d1b2e7f6a83": 97.0}
    assert nvml.calls == []
    recorded = tmp_path / "states.json"
    nonsense = [{"index": i, "utilization_pct": v} for i, v in ((2, "nan"), (3, True), (4, 1e9), (5, -1))]
    recorded.write_text(json.dumps([{"index": 0, "utilization_pct": 12}, {"index": 1}, *nonsense]))
    monkeypatch.setenv(gpu_health.STATES_ENV, str(recorded))
    assert gpu_health.utilization() == {"0": 12.0}  # a GPU whose figure is missing or nonsense is left out


def test_read_devices_maps_the_nvml_calls_to_a_state():
    nvml = FakeNvml()
    [state] = read_devices(nvml)
    assert nvml.calls == ["init", "shutdown"]
    assert state == {
        "index": 0,
        "name": "NVIDIA H100 80GB HBM3",
        "uuid": "GPU-4f2a9c1e-8b7d-3e65-a0c4-9d1b2e7f6a83",
        "pci_bus_id": "00000000:18:00.0",
        "error": None,
        "ecc_uncorrected_volatile": 0,
        "ecc_uncorrected_aggregate": 2,
        "retired_pages_pending": None,
        "remap_corrected_rows": 1,
        "remap_uncorrected_rows": 2,
        "remap_pending": True,
        "remap_failure": False,
        "temperature_c": 33,
        "temp_slowdown_c": 89,
        "temp_shutdown_c": 92,
        "clocks_event_reasons": 1,
        "sm_clock_mhz": 345,
        "sm_clock_max_mhz": 1980,
        "power_mw": 71250,
        "power_limit_mw": 700000,
        "pcie_gen": 4,
        "pcie_gen_max": 5,
        "pcie_width": 16,
        "pcie_width_max": 16,
        "nvlink_active": [i != 7 for i in range(18)],
        "recovery_action": "gpu_reset",
        "driver_version": "570.124.06",
        "cuda_driver_version": 12080,
        "utilization_pct": 97,
    }
    json.dumps(state)  # a state is plain JSON: that is what makes it recordable
    found = not_passing(evaluate([state], CFG))
    assert found == {
        (0, "gpu.ecc"): "warn",
        (0, "gpu.memory_remap"): "fail",
        (0, "gpu.pcie"): "warn",
        (0, "gpu.nvlink"): "fail",
        (0, "gpu.recovery_action"): "fail",
    }


class BareNvml(FakeNvml):
    """A GPU/driver that supports none of the optional features."""

    def _unsupported(self, *args):
        raise pynvml.NVMLError_NotSupported()

    pci_bus_id = ecc_uncorrected = retired_pages_pending = remapped_rows = _unsupported
    temperature = temperature_threshold = clocks_event_reasons = sm_clock = _unsupported
    power_usage_mw = power_limit_mw = pcie_link = nvlink_state = recovery_action = _unsupported
    driver_version = cuda_driver_version = utilization_pct = _unsupported


def test_every_unsupported_feature_reads_as_none_and_passes():
    [state] = read_devices(BareNvml())
    identity = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-4f2a9c1e-8b7d-3e65-a0c4-9d1b2e7f6a83"}
    assert {k: v for k, v in state.items() if v is not None} == identity
    checks = evaluate([state], CFG)
    assert {c["status"] for c in checks} == {"pass"}
    assert verdicts(checks)[0, "gpu.nvlink"]["detail"].endswith("no NVLink")


def test_a_lost_gpu_is_recorded_not_raised():
    class LostNvml(FakeNvml):
        def handle(self, index):
            raise pynvml.NVMLError_GpuIsLost()

    nvml = LostNvml()
    [state] = read_devices(nvml)
    assert state["error"] == "NVMLError_GpuIsLost: GPU is lost" and state["name"] is None
    assert nvml.calls == ["init", "shutdown"]
