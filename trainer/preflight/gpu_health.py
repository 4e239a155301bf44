"""GPU health through NVML: read each GPU's state, then judge it against the preflight policy.

Two halves, one seam between them:

- ``read_devices()`` / ``probe()`` call NVML (via ``pynvml``, through the small ``Nvml``
  wrapper) and return one plain dict per GPU, its *state*;
- ``evaluate(states, cfg)`` is a pure function from states to preflight checks.

The state dict is the seam: tests and drills feed recorded states (JSON) instead of
calling NVML. ``probe()`` reads them from the file named by ``TRAINPIPE_NVML_STATES``
when that variable is set, so preflight ranks can be tested on machines without GPUs.
It exists for tests and drills only; never set it on a real cluster.

State keys (``None`` means NVML does not report it on this GPU/driver):

==========================  ====================================================================
``index``                   NVML device index (0-based, as ``nvidia-smi``; not CUDA_VISIBLE_DEVICES)
``name``                    product name, e.g. "NVIDIA H100 80GB HBM3"
``uuid``                    "GPU-…" UUID, stable across reboots
``pci_bus_id``              e.g. "00000000:18:00.0"
``error``                   set (``"NVMLError_GpuIsLost: GPU is lost"``) when the device could not be
                            read at all; the other fields are then ``None``
``ecc_uncorrected_volatile``   uncorrected ECC errors since the driver loaded
``ecc_uncorrected_aggregate``  uncorrected ECC errors over the GPU's lifetime
``retired_pages_pending``   bool: pages wait for a reset to be retired (pre-Ampere; Ampere+ remap rows)
``remap_corrected_rows``    rows remapped after correctable errors
``remap_uncorrected_rows``  rows remapped after uncorrectable errors
``remap_pending``           bool: a row remap waits for a GPU reset
``remap_failure``           bool: a remap failed (no spare rows left)
``temperature_c``           GPU core temperature
``temp_slowdown_c``         temperature at which the GPU slows itself down
``temp_shutdown_c``         temperature at which the GPU shuts down
``clocks_event_reasons``    bitmask of current clock event ("throttle") reasons, pynvml
                            ``nvmlClocksEventReason*``: 0x1 idle, 0x2 applications clocks, 0x4 SW
                            power cap, 0x8 HW slowdown, 0x10 sync boost, 0x20 SW thermal, 0x40 HW
                            thermal, 0x80 HW power brake, 0x100 display clock
``sm_clock_mhz``            current SM clock
``sm_clock_max_mhz``        max SM clock
``power_mw``                power draw, milliwatts
``power_limit_mw``          enforced power limit, milliwatts
``pcie_gen``, ``pcie_gen_max``      current / max PCIe link generation (max of GPU and slot)
``pcie_width``, ``pcie_width_max``  current / max PCIe link width (lanes)
``nvlink_active``           list of bool (or None for a link NVML would not report) per NVLink link,
                            index = link number; ``None`` when the GPU has no NVLink
``recovery_action``         the driver's requested recovery, lower case: "none", "gpu_reset",
                            "node_reboot", "drain_p2p", "drain_and_reset", "recover_imex_domain",
                            "bus_reset", "system_reboot" (``None`` on drivers without the field)
``driver_version``          e.g. "570.86.15" (same on every GPU of a node)
``cuda_driver_version``     CUDA version the driver supports, NVML's int: 12080 = 12.8
``utilization_pct``         share of NVML's last sample period in which a kernel ran (%); the supervisor
                            samples it while training (``trainer.supervise.gpu_use``)
==========================  ====================================================================
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import pynvml

from trainpipe.trainer.config import PreflightConfig

STATES_ENV = "TRAINPIPE_NVML_STATES"

STATE_KEYS = (
    "index",
    "name",
    "uuid",
    "pci_bus_id",
    "error",
    "ecc_uncorrected_volatile",
    "ecc_uncorrected_aggregate",
    "retired_pages_pending",
    "remap_corrected_rows",
    "remap_uncorrected_rows",
    "remap_pending",
    "remap_failure",
    "temperature_c",
    "temp_slowdown_c",
    "temp_shutdown_c",
    "clocks_event_reasons",
    "sm_clock_mhz",
    "sm_clock_max_mhz",
    "power_mw",
    "power_limit_mw",
    "pcie_gen",
    "pcie_gen_max",
    "pcie_width",
    "pcie_width_max",
    "nvlink_active",
    "recovery_action",
    "driver_version",
    "cuda_driver_version",
    "utilization_pct",
)


def _reason_bit(name: str) -> int:
    # pynvml renamed "ClocksThrottleReason" to "ClocksEventReason" (same bits); take whichever exists.
    value = getattr(pynvml, f"nvmlClocksEventReason{name}", None)
    return value if value is not None else getattr(pynvml, f"nvmlClocksThrottleReason{name}")


REASON_IDLE = _reason_bit("GpuIdle")
# Reasons that slow the GPU down because something is wrong (fail) or at its limit (warn). The
# others (idle, applications clocks, sync boost, display clock) are settings, not faults.
FAIL_REASONS = {
    _reason_bit("HwSlowdown"): "HW slowdown",
    _reason_bit("HwThermalSlowdown"): "HW thermal slowdown",
    _reason_bit("HwPowerBrakeSlowdown"): "HW power brake",
    _reason_bit("SwThermalSlowdown"): "SW thermal slowdown",
}
WARN_REASONS = {_reason_bit("SwPowerCap"): "SW power cap"}

# NVML_GPU_RECOVERY_ACTION_GPU_RESET -> "gpu_reset", for the actions this pynvml knows.
_RECOVERY_NAMES = {
    getattr(pynvml, n): n.removeprefix("NVML_GPU_RECOVERY_ACTION_").lower()
    for n in dir(pynvml)
    if n.startswith("NVML_GPU_RECOVERY_ACTION_")
}
_RECOVERY_ADVICE = {
    "gpu_reset": "drain the GPU's work, then reset it (nvidia-smi -r -i {i})",
    "node_reboot": "drain the node and reboot it",
    "drain_p2p": "stop jobs using peer-to-peer/NVLink traffic on this GPU, then re-run preflight",
    "drain_and_reset": "drain the node's jobs, then reset the GPU (nvidia-smi -r -i {i})",
    "recover_imex_domain": "recover the IMEX (multi-node NVLink) domain, then re-run preflight",
    "bus_reset": "drain the node and reset the GPU's PCIe bus (or reboot the node)",
    "system_reboot": "drain the node and reboot it",
}


class Nvml:
    """The pynvml calls this module makes, one method each; they raise ``pynvml.NVMLError`` as pynvml does.

    Kept thin on purpose: ``read_devices`` maps these values to a state, and a test's fake
    subclass proves that mapping without a GPU.
    """

    nvlink_max_links: int = pynvml.NVML_NVLINK_MAX_LINKS

    def init(self) -> None:
        pynvml.nvmlInit()

    def shutdown(self) -> None:
        pynvml.nvmlShutdown()

    def device_count(self) -> int:
        return pynvml.nvmlDeviceGetCount()

    def handle(self, index: int) -> Any:
        return pynvml.nvmlDeviceGetHandleByIndex(index)

    def name(self, h: Any) -> str:
        return _text(pynvml.nvmlDeviceGetName(h))

    def uuid(self, h: Any) -> str:
        return _text(pynvml.nvmlDeviceGetUUID(h))

    def pci_bus_id(self, h: Any) -> str:
        return _text(pynvml.nvmlDeviceGetPciInfo(h).busId)

    def ecc_uncorrected(self, h: Any, volatile: bool) -> int:
        counter = pynvml.NVML_VOLATILE_ECC if volatile else pynvml.NVML_AGGREGATE_ECC
        return pynvml.nvmlDeviceGetTotalEccErrors(h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, counter)

    def retired_pages_pending(self, h: Any) -> bool:
        return pynvml.nvmlDeviceGetRetiredPagesPendingStatus(h) == pynvml.NVML_FEATURE_ENABLED

    def remapped_rows(self, h: Any) -> tuple[int, int, int, int]:
        """(corrected rows, uncorrected rows, pending, failure)."""
        return pynvml.nvmlDeviceGetRemappedRows(h)

    def temperature(self, h: Any) -> int:
        return pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)

    def temperature_threshold(self, h: Any, shutdown: bool) -> int:
        kind = pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN if shutdown else pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
        return pynvml.nvmlDeviceGetTemperatureThreshold(h, kind)

    def clocks_event_reasons(self, h: Any) -> int:
        # The ClocksEvent name needs driver >= 535; older drivers only export the ClocksThrottle one (same bits).
        try:
            return pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)
        except pynvml.NVMLError_FunctionNotFound:  # pyright: ignore[reportAttributeAccessIssue] - made at import
            return pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h)

    def sm_clock(self, h: Any, maximum: bool) -> int:
        get = pynvml.nvmlDeviceGetMaxClockInfo if maximum else pynvml.nvmlDeviceGetClockInfo
        return get(h, pynvml.NVML_CLOCK_SM)

    def power_usage_mw(self, h: Any) -> int:
        return pynvml.nvmlDeviceGetPowerUsage(h)

    def power_limit_mw(self, h: Any) -> int:
        return pynvml.nvmlDeviceGetEnforcedPowerLimit(h)

    def pcie_link(self, h: Any, maximum: bool) -> tuple[int, int]:
        """(generation, width) of the current link, or of the best link GPU and slot allow."""
        if maximum:
            return pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h), pynvml.nvmlDeviceGetMaxPcieLinkWidth(h)
        return pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h), pynvml.nvmlDeviceGetCurrPcieLinkWidth(h)

    def nvlink_state(self, h: Any, link: int) -> bool:
        return pynvml.nvmlDeviceGetNvLinkState(h, link) == pynvml.NVML_FEATURE_ENABLED

    def recovery_action(self, h: Any) -> int:
        field = getattr(pynvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if field is None:  # this pynvml predates the field
            raise pynvml.NVMLError_NotSupported()  # pyright: ignore[reportAttributeAccessIssue] - made at import
        value = pynvml.nvmlDeviceGetFieldValues(h, [field])[0]
        if value.nvmlReturn != pynvml.NVML_SUCCESS:  # older drivers answer per field, not per call
            raise pynvml.NVMLError(value.nvmlReturn)
        return int(value.value.uiVal)

    def utilization_pct(self, h: Any) -> int:
        return int(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)

    def driver_version(self) -> str:
        return _text(pynvml.nvmlSystemGetDriverVersion())

    def cuda_driver_version(self) -> int:
        return pynvml.nvmlSystemGetCudaDriverVersion()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _optional(read: Callable[..., Any], *args: Any) -> Any:
    """One optional NVML read: a feature this GPU or driver lacks is ``None``, not a failed preflight."""
    try:
        return read(*args)
    except pynvml.NVMLError:
        return None


def _read_nvlink(nvml: Nvml, h: Any) -> list[bool | None] | None:
    links: list[bool | None] = []
    for link in range(nvml.nvlink_max_links):
        try:
            links.append(bool(nvml.nvlink_state(h, link)))
        except pynvml.NVMLError_NotSupported:  # pyright: ignore[reportAttributeAccessIssue] - made at import
            if link == 0:
                return None  # no NVLink on this GPU: don't ask 35 more times
            links.append(None)
        except pynvml.NVMLError:
            links.append(None)  # links past the GPU's count answer InvalidArgument
    while links and links[-1] is None:
        links.pop()
    return links or None


def _read_device(nvml: Nvml, index: int, system: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, Any] = dict.fromkeys(STATE_KEYS)
    state.update(index=index, **system)
    try:  # without a handle, name and UUID the GPU is unusable: that is the finding, not a missing feature
        h = nvml.handle(index)
        state["name"], state["uuid"] = nvml.name(h), nvml.uuid(h)
    except pynvml.NVMLError as exc:
        state["error"] = f"{type(exc).__name__}: {exc}"
        return state
    state["pci_bus_id"] = _optional(nvml.pci_bus_id, h)
    state["ecc_uncorrected_volatile"] = _optional(nvml.ecc_uncorrected, h, True)
    state["ecc_uncorrected_aggregate"] = _optional(nvml.ecc_uncorrected, h, False)
    state["retired_pages_pending"] = _optional(nvml.retired_pages_pending, h)
    rows = _optional(nvml.remapped_rows, h)
    if rows is not None:
        corrected, uncorrected, pending, failure = rows
        state.update(
            remap_corrected_rows=corrected,
            remap_uncorrected_rows=uncorrected,
            remap_pending=bool(pending),
            remap_failure=bool(failure),
        )
    state["temperature_c"] = _optional(nvml.temperature, h)
    state["temp_slowdown_c"] = _optional(nvml.temperature_threshold, h, False)
    state["temp_shutdown_c"] = _optional(nvml.temperature_threshold, h, True)
    state["clocks_event_reasons"] = _optional(nvml.clocks_event_reasons, h)
    state["sm_clock_mhz"] = _optional(nvml.sm_clock, h, False)
    state["sm_clock_max_mhz"] = _optional(nvml.sm_clock, h, True)
    state["power_mw"] = _optional(nvml.power_usage_mw, h)
    state["power_limit_mw"] = _optional(nvml.power_limit_mw, h)
    state["pcie_gen"], state["pcie_width"] = _optional(nvml.pcie_link, h, False) or (None, None)
    state["pcie_gen_max"], state["pcie_width_max"] = _optional(nvml.pcie_link, h, True) or (None, None)
    state["nvlink_active"] = _read_nvlink(nvml, h)
    state["utilization_pct"] = _optional(nvml.utilization_pct, h)
    action = _optional(nvml.recovery_action, h)
    state["recovery_action"] = None if action is None else _RECOVERY_NAMES.get(action, f"unknown({action})")
    return state


def _read_all(nvml: Nvml) -> list[dict[str, Any]]:
    system = {
        "driver_version": _optional(nvml.driver_version),
        "cuda_driver_version": _optional(nvml.cuda_driver_version),
    }
    return [_read_device(nvml, i, system) for i in range(nvml.device_count())]


def read_devices(nvml: Nvml | None = None) -> list[dict[str, Any]]:
    """One state dict per GPU (keys: see the module docstring). Raises ``pynvml.NVMLError`` if NVML cannot start."""
    nvml = nvml or Nvml()
    nvml.init()
    try:
        return _read_all(nvml)
    finally:
        nvml.shutdown()


def load_states(path: str) -> list[dict[str, Any]]:
    """Recorded states: a JSON list of state dicts (as ``read_devices`` returns, missing keys read as None)."""
    with open(path) as fh:
        states = json.load(fh)
    if not isinstance(states, list) or not all(isinstance(s, dict) and "index" in s for s in states):
        raise ValueError(f"{STATES_ENV}={path}: expected a JSON list of GPU state objects, each with an 'index'")
    return [{**dict.fromkeys(STATE_KEYS), **s} for s in states]


def recorded_states() -> str | None:
    """The recorded states' file that stands in for NVML (``TRAINPIPE_NVML_STATES``), if any."""
    return os.environ.get(STATES_ENV) or None


def utilization(nvml: Nvml | None = None) -> dict[str, float]:
    """GPU → utilization (%) now, keyed by NVML index and by UUID (``CUDA_VISIBLE_DEVICES`` names either): from
    the recorded states (read again at every call, so a test can change them), else from ``nvml``, already
    initialised by the caller; a GPU that does not answer, or answers nonsense, is left out."""
    if path := recorded_states():
        states = load_states(path)
    else:
        nvml = nvml or Nvml()
        states = []
        for i in range(nvml.device_count()):
            try:
                h = nvml.handle(i)
                states.append({"index": i, "uuid": nvml.uuid(h), "utilization_pct": nvml.utilization_pct(h)})
            except pynvml.NVMLError:
                continue
    out: dict[str, float] = {}
    for s in states:
        pct = s.get("utilization_pct")
        if isinstance(pct, int | float) and not isinstance(pct, bool) and 0 <= pct <= 100:  # also refuses NaN
            out[str(s["index"])] = float(pct)
            if isinstance(s.get("uuid"), str):
                out[s["uuid"]] = float(pct)
    return out


def probe() -> tuple[str, list[dict[str, Any]]]:
    """``("ok", states)``, ``("no NVIDIA driver", [])``, ``("no GPUs", [])``, or ``("recorded", states)``.

    ``TRAINPIPE_NVML_STATES=/path/states.json`` replaces NVML with recorded states: the one seam for
    tests and drills, so the preflight ranks run the same code on machines without GPUs.
    """
    recorded = os.environ.get(STATES_ENV)
    if recorded:
        return "recorded", load_states(recorded)
    nvml = Nvml()
    try:
        nvml.init()
    except pynvml.NVMLError:  # LibraryNotFound, DriverNotLoaded, ...: this node has no usable NVIDIA driver
        return "no NVIDIA driver", []
    try:
        if nvml.device_count() == 0:
            return "no GPUs", []
        return "ok", _read_all(nvml)
    finally:
        nvml.shutdown()


def no_gpu_check(reason: str) -> dict[str, Any]:
    """The one GPU check of a node without GPUs: ``skip`` means not applicable, neither pass nor fail."""
    return {"name": "gpu.nvml", "status": "skip", "detail": reason}


# ---- policy: states -> checks (pure) -------------------------------------------------------------


def _who(s: dict[str, Any]) -> str:
    where = ", ".join(str(x) for x in (s.get("name"), s.get("pci_bus_id")) if x)
    return f"GPU {s['index']}" + (f" ({where})" if where else "")


def _reasons(mask: int | None, table: dict[int, str]) -> list[str]:
    return [label for bit, label in table.items() if mask and mask & bit]


def _cuda(version: int | None) -> str:
    return "unknown" if version is None else f"{version // 1000}.{version % 1000 // 10}"


def _check_ecc(s: dict[str, Any], cfg: PreflightConfig) -> tuple[str, str]:
    vol, agg = s.get("ecc_uncorrected_volatile"), s.get("ecc_uncorrected_aggregate")
    if vol is None and agg is None:
        return "pass", f"{_who(s)}: ECC not reported (disabled or unsupported)"
    if vol:
        return "fail", (
            f"{_who(s)}: {vol} uncorrected ECC error(s) since the driver loaded ({agg} over its lifetime); "
            f"memory contents cannot be trusted: drain the node and reset the GPU (nvidia-smi -r -i {s['index']}), "
            "replace it if errors come back"
        )
    if agg:
        return "warn", (
            f"{_who(s)}: {agg} uncorrected ECC error(s) over its lifetime, none since the driver loaded; "
            "usable, but watch the count and replace the GPU if it grows"
        )
    return "pass", f"{_who(s)}: no uncorrected ECC errors (volatile {vol}, aggregate {agg})"


def _check_memory_remap(s: dict[str, Any], cfg: PreflightConfig) -> tuple[str, str]:
    pages, pending, failure = s.get("retired_pages_pending"), s.get("remap_pending"), s.get("remap_failure")
    rows = f"remapped rows: {s.get('remap_corrected_rows')} corrected, {s.get('remap_uncorrected_rows')} uncorrected"
    if failure:
        return "fail", (
            f"{_who(s)}: row remapping failed ({rows}): the GPU has run out of spare memory rows; "
            "drain the node and replace the GPU"
        )
    if pending or pages:
        what = "a row remap" if pending else "a page retirement"
        return "fail", (
            f"{_who(s)}: {what} is pending ({rows}); "
            f"it only takes effect after a reset: drain the node and reset the GPU (nvidia-smi -r -i {s['index']})"
        )
    if pages is None and pending is None:
        return "pass", f"{_who(s)}: row remapping / page retirement not reported"
    return "pass", f"{_who(s)}: nothing pending ({rows})"


def _check_temperature(s: dict[str, Any], cfg: PreflightConfig) -> tuple[str, str]:
    temp, slow, shut = s.get("temperature_c"), s.get("temp_slowdown_c"), s.get("temp_shutdown_c")
    if temp is None:
        return "pass", f"{_who(s)}: temperature not reported"
    margin = cfg.gpu_temp_margin_c
    limits = f"slowdown at {slow} °C, shutdown at {shut} °C"
    if (shut is not None and temp >= shut - margin) or (slow is not None and temp >= slow):
        where = "at or above slowdown" if slow is not None and temp >= slow else f"within {margin:g} °C of shutdown"
        return "fail", (
            f"{_who(s)}: {temp} °C, {where} ({limits}); it will throttle or shut down under load: "
            "check fans, airflow and inlet temperature before training"
        )
    if slow is not None and temp >= slow - margin:
        return "warn", (
            f"{_who(s)}: {temp} °C, within {margin:g} °C of slowdown ({limits}); "
            "check cooling: under load it will throttle"
        )
    return "pass", f"{_who(s)}: {temp} °C ({limits})"


def _check_throttle(s: dict[str, Any], cfg: PreflightConfig) -> tuple[str, str]:
    mask = s.get("clocks_event_reasons")
    if mask is None:
        return "pass", f"{_who(s)}: clock event reasons not reported"
    bad, capped = _reasons(mask, FAIL_REASONS), _reasons(mask, WARN_REASONS)
    clocks = f"SM {s.get('sm_clock_mhz')} of {s.get('sm_clock_max_mhz')} MHz, {s.get('temperature_c')} °C"
    if bad:
        thermal, brake = any("thermal" in r for r in bad), "HW power brake" in bad
        # HW slowdown alone means "too hot, power brake or too much power": NVML does not say which.
        advice = (
            "check fans, airflow and inlet temperature"
            if thermal and not brake
            else "check the node's power supplies and power brake signal"
            if brake and not thermal
            else "check cooling and the node's power supplies"
        )
        return "fail", (
            f"{_who(s)}: clocks held down by {', '.join(bad)} (reasons 0x{mask:x}; {clocks}); "
            f"{advice}, and drain the node until fixed"
        )
    if capped:
        return "warn", (
            f"{_who(s)}: clocks held down by {', '.join(capped)} (reasons 0x{mask:x}; {clocks}, "
            f"{_watts(s.get('power_mw'))} of {_watts(s.get('power_limit_mw'))} W); expected under full load, "
            "otherwise check the power limit (nvidia-smi -q -d POWER)"
        )
    return "pass", f"{_who(s)}: no throttling (reasons 0x{mask:x}{', idle' if mask & REASON_IDLE else ''})"


def _check_clocks(s: dict[str, Any], cfg: PreflightConfig) -> tuple[str, str]:
    sm, top, mask = s.get("sm_clock_mhz"), s.get("sm_clock_max_mhz"), s.get("clocks_event_reasons")
    if not sm or not top:
        return "pass", f"{_who(s)}: SM clock not reported"
    ratio = sm / top
    numbers = f"SM clock {sm} MHz is {ratio:.0%} of max {top} MHz (threshold {cfg.min_sm_clock_ratio:.0%})"
    if ratio >= cfg.min_sm_clock_ratio:
        return "pass", f"{_who(s)}: SM clock {sm} of {top} MHz"
    throttled = _reasons(mask, FAIL_REASONS) + _reasons(mask, WARN_REASONS)
    if throttled:
        return (
            "fail",
            f"{_who(s)}: {numbers} while throttled by {', '.join(throttled)}; "
            "fix the cause (see gpu.throttle) before training",
        )
    if mask and mask & REASON_IDLE:
        # NVML itself says the GPU is idle: low clocks are its normal resting state, not a fault.
        return "pass", f"{_who(s)}: {numbers}; the GPU is idle, so this is its resting clock"
    return "warn", (
        f"{_who(s)}: {numbers} with no throttle reason reported; GPUs drop clocks when idle, so re-run under load; "
        "if it stays low, check locked clocks (nvidia-smi -q -d CLOCK; reset with nvidia-smi -rgc)"
    )


def _watts(mw: int | None) -> str:
    return "?" if mw is None else f"{mw / 1000:.0f}"


def _check_power(s: dict[str, Any], cfg: PreflightConfig) -> tuple[str, str]:
    draw, limit = s.get("power_mw"), s.get("power_limit_mw")
    if draw is None or not limit:
        return "pass", f"{_who(s)}: power not reported"
    numbers = f"{_watts(draw)} W of its {_watts(limit)} W limit ({draw / limit:.0%})"
    if draw > cfg.max_power_ratio * limit:
        return "warn", (
            f"{_who(s)}: drawing {numbers}, above {cfg.max_power_ratio:.0%}; it is power capped and will clock down; "
            "if nothing else runs on it, check the power limit (nvidia-smi -q -d POWER) and the node's PSUs"
        )
    return "pass", f"{_who(s)}: drawing {numbers}"


def _check_pcie(s: dict[str, Any], cfg: PreflightConfig) -> tuple[str, str]:
    gen, gmax, width, wmax = s.get("pcie_gen"), s.get("pcie_gen_max"), s.get("pcie_width"), s.get("pcie_width_max")
    if gen is None or gmax is None or width is None or wmax is None:
        return "pass", f"{_who(s)}: PCIe link not reported"
    numbers = f"PCIe gen {gen} x{width}, max gen {gmax} x{wmax}"
    if gen >= gmax and width >= wmax:
        return "pass", f"{_who(s)}: {numbers}"
    idle = bool(s.get("clocks_event_reasons") and s["clocks_event_reasons"] & REASON_IDLE)
    if width >= wmax and idle:
        # Idle GPUs lower the link generation to save power (never the width): not conclusive, so never a fail.
        return "warn", (
            f"{_who(s)}: {numbers}; the GPU is idle and GPUs drop link gen when idle, "
            "so re-check under load (nvidia-smi -q -d PCIE)"
        )
    return cfg.pcie_degraded, (
        f"{_who(s)}: link degraded: {numbers}; host-device copies and GPUDirect traffic slow down; "
        "GPUs drop link gen when idle, so re-check under load; if it stays low, reseat the GPU or riser "
        "and check the slot's BIOS link settings"
    )


def _check_nvlink(s: dict[str, Any], cfg: PreflightConfig) -> tuple[str, str]:
    links = s.get("nvlink_active")
    if not links:
        return "pass", f"{_who(s)}: no NVLink"
    active = [i for i, up in enumerate(links) if up]
    down = [i for i, up in enumerate(links) if up is False]
    if down and active:
        return "fail", (
            f"{_who(s)}: NVLink links {', '.join(map(str, down))} inactive ({len(active)} of {len(links)} active); "
            "NCCL traffic slows or hangs: check nvidia-smi nvlink -s and the fabric manager, "
            f"then reset the GPU (nvidia-smi -r -i {s['index']}) or drain the node"
        )
    if down:
        return "warn", (
            f"{_who(s)}: all {len(down)} NVLink links inactive; fine for a PCIe card without a bridge, "
            "otherwise (HGX/NVSwitch) check nvidia-fabricmanager and nvidia-smi nvlink -s"
        )
    return "pass", f"{_who(s)}: {len(active)} NVLink links active"


def _check_recovery_action(s: dict[str, Any], cfg: PreflightConfig) -> tuple[str, str]:
    action = s.get("recovery_action")
    if action is None:
        return "pass", f"{_who(s)}: recovery action not reported (driver without the field)"
    if action == "none":
        return "pass", f"{_who(s)}: the driver requests no recovery"
    advice = _RECOVERY_ADVICE.get(action, "follow the driver's recovery action (nvidia-smi -q)").format(i=s["index"])
    return "fail", f"{_who(s)}: the driver requests recovery action '{action}'; {advice}"


def _check_driver(s: dict[str, Any], cfg: PreflightConfig) -> tuple[str, str]:
    return (
        "pass",
        f"{_who(s)}: driver {s.get('driver_version') or 'unknown'}, CUDA driver {_cuda(s.get('cuda_driver_version'))}",
    )


CHECKS: dict[str, Callable[[dict[str, Any], PreflightConfig], tuple[str, str]]] = {
    "gpu.ecc": _check_ecc,
    "gpu.memory_remap": _check_memory_remap,
    "gpu.temperature": _check_temperature,
    "gpu.throttle": _check_throttle,
    "gpu.clocks": _check_clocks,
    "gpu.power": _check_power,
    "gpu.pcie": _check_pcie,
    "gpu.nvlink": _check_nvlink,
    "gpu.recovery_action": _check_recovery_action,
    "gpu.driver": _check_driver,
}


def evaluate(states: list[dict[str, Any]], cfg: PreflightConfig) -> list[dict[str, Any]]:
    """One check per (GPU, check), shaped as ``trainer.preflight.check()`` plus ``device`` and ``uuid``."""
    out = []
    for s in states:
        s = {**dict.fromkeys(STATE_KEYS), **s}  # recorded states may leave keys out
        tag = {"device": s["index"], "uuid": s["uuid"]}
        if s["error"]:
            out.append(
                {
                    "name": "gpu.nvml",
                    "status": "fail",
                    **tag,
                    "detail": f"{_who(s)}: NVML cannot read it ({s['error']}); it may have fallen off the bus: "
                    "drain the node, then reset the GPU or reboot the node",
                }
            )
            continue
        for name, judge in CHECKS.items():
            status, detail = judge(s, cfg)
            out.append({"name": name, "status": status, "detail": detail, **tag})
    return out
