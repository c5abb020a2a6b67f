"""appliance.facts.gpu.Pynvml: the real pynvml where no NVIDIA library exists, and fake pynvml modules."""

from __future__ import annotations

import ctypes
import sys
import types
from collections.abc import Callable
from typing import Any

import pynvml
import pytest

from appliance.facts.gpu import GpuMemory, GpuProcess, NvmlUnavailable, Pynvml

GIB = 1 << 30


def nvidia_library_present() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


no_nvidia_library = pytest.mark.skipif(nvidia_library_present(), reason="an NVIDIA library is installed here")


@no_nvidia_library
@pytest.mark.parametrize("call", [Pynvml.gpus, Pynvml.driver_version, Pynvml.cuda_version, lambda n: n.processes(0)])
def test_no_nvidia_library_is_nvml_unavailable(call: Callable[[Pynvml], Any]) -> None:
    with pytest.raises(NvmlUnavailable) as caught:
        call(Pynvml())
    assert type(caught.value) is NvmlUnavailable
    assert not isinstance(caught.value, pynvml.NVMLError)
    message = str(caught.value)
    assert message.startswith("NVML:")
    assert "library not found" in message.lower()
    assert caught.value.mismatch is False
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


@no_nvidia_library
def test_every_call_tries_again() -> None:
    nvml = Pynvml()
    for _ in range(3):
        with pytest.raises(NvmlUnavailable):
            nvml.gpus()
    assert nvml._lib is None
    with pytest.raises(NvmlUnavailable):
        nvml.xid_errors(0)


def test_pynvml_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    with pytest.raises(NvmlUnavailable, match="pynvml is not installed") as caught:
        Pynvml().gpus()
    assert caught.value.mismatch is False


# -- fake pynvml modules --


def fake_module(**functions: Any) -> types.ModuleType:
    module = types.ModuleType("pynvml")

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(value)
            self.value = value

    class NVMLError_LibRmVersionMismatch(NVMLError):  # pynvml's name
        def __str__(self) -> str:
            return "Driver/library version mismatch"

    class NVMLError_GpuIsLost(NVMLError):
        def __str__(self) -> str:
            return "GPU is lost"

    module.NVMLError = NVMLError  # type: ignore[attr-defined]
    module.NVMLError_LibRmVersionMismatch = NVMLError_LibRmVersionMismatch  # type: ignore[attr-defined]
    module.NVMLError_GpuIsLost = NVMLError_GpuIsLost  # type: ignore[attr-defined]
    module.NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18  # type: ignore[attr-defined]
    module.NVML_ERROR_GPU_IS_LOST = 15  # type: ignore[attr-defined]
    module.NVML_ERROR_NOT_SUPPORTED = 3  # type: ignore[attr-defined]
    module.nvmlInit = lambda: None  # type: ignore[attr-defined]
    for name, function in functions.items():
        setattr(module, name, function)
    return module


def install(monkeypatch: pytest.MonkeyPatch, module: types.ModuleType) -> types.ModuleType:
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


def test_a_driver_library_mismatch_says_reboot(monkeypatch: pytest.MonkeyPatch) -> None:
    module = fake_module()

    def init() -> None:
        raise module.NVMLError_LibRmVersionMismatch(18)

    module.nvmlInit = init  # type: ignore[attr-defined]
    install(monkeypatch, module)
    nvml = Pynvml()
    for call in (nvml.gpus, nvml.driver_version, nvml.cuda_version):
        with pytest.raises(NvmlUnavailable) as caught:
            call()
        assert type(caught.value) is NvmlUnavailable
        assert caught.value.mismatch is True
        assert str(caught.value).startswith("NVML: Driver/library version mismatch")
        assert "reboot" in str(caught.value)
        assert "--hold-driver" in str(caught.value)


def test_a_mismatch_is_known_by_its_code_whatever_the_text(monkeypatch: pytest.MonkeyPatch) -> None:
    # The real pynvml's text for code 18 is "RM has detected an NVML/RM version mismatch."; any text will do.
    module = fake_module()

    class Opaque(module.NVMLError):  # type: ignore[name-defined,misc]
        def __str__(self) -> str:
            return "Unknown Error"

    def init() -> None:
        raise Opaque(18)

    module.nvmlInit = init  # type: ignore[attr-defined]
    install(monkeypatch, module)
    with pytest.raises(NvmlUnavailable, match="reboot") as caught:
        Pynvml().gpus()
    assert caught.value.mismatch is True


def test_other_nvml_errors_keep_their_text(monkeypatch: pytest.MonkeyPatch) -> None:
    module = fake_module(nvmlDeviceGetCount=lambda: 1)

    def handle(index: int) -> Any:
        raise module.NVMLError_GpuIsLost(15)

    module.nvmlDeviceGetHandleByIndex = handle  # type: ignore[attr-defined]
    install(monkeypatch, module)
    with pytest.raises(NvmlUnavailable) as caught:
        Pynvml().gpus()
    assert str(caught.value) == "NVML: GPU is lost"
    assert caught.value.mismatch is False
    assert not isinstance(caught.value, module.NVMLError)


def test_init_is_retried_after_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    module = fake_module(nvmlSystemGetDriverVersion=lambda: "550.54.14")
    attempts = []

    def init() -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise module.NVMLError_LibRmVersionMismatch(18)

    module.nvmlInit = init  # type: ignore[attr-defined]
    install(monkeypatch, module)
    nvml = Pynvml()
    with pytest.raises(NvmlUnavailable):
        nvml.driver_version()
    assert nvml.driver_version() == "550.54.14"
    assert nvml.driver_version() == "550.54.14"
    assert len(attempts) == 2  # initialised once it worked, not on every call


class Memory:
    def __init__(self, total: int, used: int) -> None:
        self.total, self.used, self.free = total, used, total - used


class Process:
    def __init__(self, pid: int, used: int | None) -> None:
        self.pid, self.usedGpuMemory = pid, used


class Event:
    def __init__(self, device: Any) -> None:
        self.device = device


def working_module(xids: list[int] | None = None) -> types.ModuleType:
    """A working NVML; `xids` lists the GPU index of each pending critical XID event."""
    pending = list(xids or [])
    devices = {
        0: ("NVIDIA GeForce RTX 4090", Memory(24 * GIB, 20 * GIB), [Process(4242, 19 * GIB), Process(77, None)]),
        1: ("NVIDIA GeForce RTX 4090", Memory(24 * GIB, 1 * GIB), []),
    }
    module = fake_module(
        nvmlDeviceGetCount=lambda: len(devices),
        nvmlDeviceGetHandleByIndex=lambda index: ("handle", index),
        nvmlDeviceGetName=lambda handle: devices[handle[1]][0],
        nvmlDeviceGetMemoryInfo=lambda handle: devices[handle[1]][1],
        nvmlDeviceGetComputeRunningProcesses=lambda handle: devices[handle[1]][2],
        nvmlSystemGetDriverVersion=lambda: "550.54.14",
        nvmlSystemGetCudaDriverVersion=lambda: 12040,
        nvmlEventSetCreate=lambda: "event-set",
        nvmlEventTypeXidCriticalError=8,
        nvmlDeviceRegisterEvents=lambda handle, kind, events: None,
        nvmlDeviceGetIndex=lambda handle: handle[1],
        nvmlDeviceGetTotalEnergyConsumption=lambda handle: 123_456_789 + handle[1],
        nvmlDeviceGetPowerUsage=lambda handle: 287_500,
    )
    module.nvmlEventSetWait_v2 = lambda events, timeout_ms: (
        Event(("handle", pending.pop(0))) if pending else _timeout(module)
    )  # type: ignore[attr-defined]
    return module


def _timeout(module: types.ModuleType) -> Any:
    raise module.NVMLError(10)  # NVML_ERROR_TIMEOUT: no event pending


def test_a_working_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, working_module())
    nvml = Pynvml()
    assert nvml.gpus() == [
        GpuMemory(0, "NVIDIA GeForce RTX 4090", 24 * GIB, 20 * GIB, 4 * GIB),
        GpuMemory(1, "NVIDIA GeForce RTX 4090", 24 * GIB, 1 * GIB, 23 * GIB),
    ]
    assert [g.device for g in nvml.gpus()] == ["CUDA0", "CUDA1"]
    assert nvml.driver_version() == "550.54.14"
    assert nvml.cuda_version() == "12.4"
    assert nvml.processes(0) == [GpuProcess(4242, 19 * GIB), GpuProcess(77, 0)]
    assert nvml.processes(1) == []
    assert nvml.xid_errors(0) == 0


def test_xid_events_are_counted_per_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, working_module(xids=[1, 1, 0]))
    nvml = Pynvml()
    assert nvml.xid_errors(1) == 2  # draining counts every pending event, for every GPU
    assert nvml.xid_errors(0) == 1
    assert nvml.xid_errors(1) == 2  # nothing new


@pytest.mark.parametrize(("code", "version"), [(12040, "12.4"), (12000, "12.0"), (11080, "11.8"), (12090, "12.9")])
def test_cuda_versions(monkeypatch: pytest.MonkeyPatch, code: int, version: str) -> None:
    module = working_module()
    module.nvmlSystemGetCudaDriverVersion = lambda: code  # type: ignore[attr-defined]
    install(monkeypatch, module)
    assert Pynvml().cuda_version() == version


def test_energy_and_power(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, working_module())
    nvml = Pynvml()
    assert nvml.energy_millijoules(0) == 123_456_789
    assert nvml.energy_millijoules(1) == 123_456_790
    assert nvml.power_milliwatts(1) == 287_500


def test_a_gpu_without_an_energy_counter_says_none_and_other_errors_stay_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = working_module()

    def unsupported(handle: Any) -> int:
        raise module.NVMLError(3)  # NVML_ERROR_NOT_SUPPORTED: a GPU before Volta

    module.nvmlDeviceGetTotalEnergyConsumption = unsupported  # type: ignore[attr-defined]
    install(monkeypatch, module)
    assert Pynvml().energy_millijoules(0) is None

    def lost(handle: Any) -> int:
        raise module.NVMLError_GpuIsLost(15)

    module.nvmlDeviceGetTotalEnergyConsumption = lost  # type: ignore[attr-defined]
    with pytest.raises(NvmlUnavailable, match=r"^NVML: GPU is lost$"):
        Pynvml().energy_millijoules(0)

    def mismatch(handle: Any) -> int:
        raise module.NVMLError_LibRmVersionMismatch(18)

    module.nvmlDeviceGetTotalEnergyConsumption = mismatch  # type: ignore[attr-defined]
    with pytest.raises(NvmlUnavailable, match="reboot") as caught:
        Pynvml().energy_millijoules(0)
    assert caught.value.mismatch is True


@no_nvidia_library
def test_no_nvidia_library_reads_no_energy() -> None:
    for call in (lambda n: n.energy_millijoules(0), lambda n: n.power_milliwatts(0)):
        with pytest.raises(NvmlUnavailable, match=r"(?i)library not found"):
            call(Pynvml())
