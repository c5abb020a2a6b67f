"""The GPU as NVML reports it, behind one small interface.

The real implementation calls pynvml (nvidia-ml-py). No NVIDIA library exists on the build machines, so
tests pass a fake with the same methods; the library-not-found path of the real one runs everywhere.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Protocol

MISMATCH_FIX = (
    "the NVIDIA kernel module and user-space library differ (an upgrade replaced one under the running "
    "system): reboot to load the matching module, and hold the driver packages (install.sh --hold-driver)"
)


@dataclass(frozen=True)
class GpuMemory:
    index: int
    name: str
    total_bytes: int
    used_bytes: int
    free_bytes: int

    @property
    def device(self) -> str:
        # llama.cpp's CUDA device names; the units set CUDA_DEVICE_ORDER=PCI_BUS_ID so CUDA and NVML agree.
        return f"CUDA{self.index}"


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: int


class NvmlUnavailable(Exception):
    """NVML cannot be used; `mismatch` is set for the driver/library version mismatch."""

    def __init__(self, message: str, mismatch: bool = False) -> None:
        super().__init__(message)
        self.mismatch = mismatch


class Nvml(Protocol):
    def gpus(self) -> list[GpuMemory]: ...
    def driver_version(self) -> str: ...
    def cuda_version(self) -> str: ...
    def processes(self, index: int) -> list[GpuProcess]: ...
    def process_utilization(self, index: int) -> dict[int, float]: ...
    def xid_errors(self, index: int) -> int: ...
    def energy_millijoules(self, index: int) -> int | None: ...
    def power_milliwatts(self, index: int) -> int: ...


class Pynvml:
    """NVML through pynvml; every call raises NvmlUnavailable instead of pynvml's own errors."""

    def __init__(self) -> None:
        self._lib: Any = None
        self._xids: dict[int, int] = {}
        self._utilization_seen: dict[int, int] = {}  # the newest sample's timestamp (µs) read, by GPU index
        self._events: Any = None

    def _nvml(self) -> Any:
        if self._lib is None:
            try:
                import pynvml
            except ImportError as exc:
                raise NvmlUnavailable(f"pynvml is not installed ({exc})") from None
            self._call(pynvml, pynvml.nvmlInit)
            self._lib = pynvml
        return self._lib

    @staticmethod
    def _call(pynvml: Any, function: Any, *args: Any) -> Any:
        try:
            return function(*args)
        except pynvml.NVMLError as exc:
            raise Pynvml._unavailable(pynvml, exc) from None

    @staticmethod
    def _unavailable(pynvml: Any, exc: Exception) -> NvmlUnavailable:
        text = str(exc)
        mismatch = "mismatch" in text.lower() or getattr(exc, "value", None) == getattr(
            pynvml, "NVML_ERROR_LIB_RM_VERSION_MISMATCH", -1
        )
        if mismatch:
            return NvmlUnavailable(f"NVML: Driver/library version mismatch; {MISMATCH_FIX}", mismatch=True)
        return NvmlUnavailable(f"NVML: {text}")

    def gpus(self) -> list[GpuMemory]:
        nvml = self._nvml()
        found = []
        for index in range(self._call(nvml, nvml.nvmlDeviceGetCount)):
            handle = self._call(nvml, nvml.nvmlDeviceGetHandleByIndex, index)
            name = self._call(nvml, nvml.nvmlDeviceGetName, handle)
            memory = self._call(nvml, nvml.nvmlDeviceGetMemoryInfo, handle)
            found.append(GpuMemory(index, str(name), int(memory.total), int(memory.used), int(memory.free)))
        return found

    def driver_version(self) -> str:
        nvml = self._nvml()
        return str(self._call(nvml, nvml.nvmlSystemGetDriverVersion))

    def cuda_version(self) -> str:
        nvml = self._nvml()
        version = int(self._call(nvml, nvml.nvmlSystemGetCudaDriverVersion))
        return f"{version // 1000}.{version % 1000 // 10}"

    def energy_millijoules(self, index: int) -> int | None:
        """The GPU's energy counter since the driver was loaded, in mJ; None where the GPU has none (before
        Volta): then only its power draw can be read."""
        nvml = self._nvml()
        handle = self._call(nvml, nvml.nvmlDeviceGetHandleByIndex, index)
        try:
            return int(nvml.nvmlDeviceGetTotalEnergyConsumption(handle))
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) == getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", 3):
                return None
            raise self._unavailable(nvml, exc) from None

    def power_milliwatts(self, index: int) -> int:
        nvml = self._nvml()
        handle = self._call(nvml, nvml.nvmlDeviceGetHandleByIndex, index)
        return int(self._call(nvml, nvml.nvmlDeviceGetPowerUsage, handle))

    def processes(self, index: int) -> list[GpuProcess]:
        nvml = self._nvml()
        handle = self._call(nvml, nvml.nvmlDeviceGetHandleByIndex, index)
        running = self._call(nvml, nvml.nvmlDeviceGetComputeRunningProcesses, handle)
        return [GpuProcess(int(p.pid), int(p.usedGpuMemory or 0)) for p in running]

    def process_utilization(self, index: int) -> dict[int, float]:
        """Each process's share of the GPU's SM time (0..1) over the samples NVML took since the last call: the
        driver keeps a few seconds of samples, so a call per check sees the recent use, not the whole interval."""
        nvml = self._nvml()
        handle = self._call(nvml, nvml.nvmlDeviceGetHandleByIndex, index)
        try:
            samples = nvml.nvmlDeviceGetProcessUtilization(handle, self._utilization_seen.get(index, 0))
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) == getattr(nvml, "NVML_ERROR_NOT_FOUND", 6):
                return {}  # no process ran on it since the last call
            raise self._unavailable(nvml, exc) from None
        by_pid: dict[int, list[int]] = {}
        for sample in samples:
            by_pid.setdefault(int(sample.pid), []).append(int(sample.smUtil))
            self._utilization_seen[index] = max(self._utilization_seen.get(index, 0), int(sample.timeStamp))
        return {pid: sum(values) / len(values) / 100 for pid, values in by_pid.items()}

    def xid_errors(self, index: int) -> int:
        """Critical XID errors seen on this GPU since the first call: NVML delivers them as events,
        which are drained here without waiting."""
        nvml = self._nvml()
        if self._events is None:
            self._events = self._call(nvml, nvml.nvmlEventSetCreate)
            for device in range(self._call(nvml, nvml.nvmlDeviceGetCount)):
                handle = self._call(nvml, nvml.nvmlDeviceGetHandleByIndex, device)
                # Some GPUs (and vGPUs) do not report XID events; they stay at 0.
                with contextlib.suppress(nvml.NVMLError):
                    nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self._events)
        while True:
            try:
                event = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError:  # NVML_ERROR_TIMEOUT: nothing pending
                break
            handle_index = self._call(nvml, nvml.nvmlDeviceGetIndex, event.device)
            self._xids[handle_index] = self._xids.get(handle_index, 0) + 1
        return self._xids.get(index, 0)
