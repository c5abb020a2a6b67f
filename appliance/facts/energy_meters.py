"""The energy the machine draws, behind one small interface (`EnergyMeter`): RAPL's counters under
/sys/class/powercap for the CPUs, NVML's for the server's GPUs.

Counters, not power samples: a counter read at both ends of a window gives that window's energy whatever
happened in between, where one power sample is one instant. NVML's power draw is integrated only on GPUs whose
driver keeps no energy counter. A meter that cannot be read raises EnergyUnreadable saying why; its users then
export and report nothing for it, never a zero that would pass for a measurement.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from appliance.facts.gpu import Nvml, NvmlUnavailable

POWERCAP = Path("/sys/class/powercap")


class EnergyUnreadable(Exception):
    """Energy cannot be read here; the message says why."""


class EnergyMeter(Protocol):
    @property
    def source(self) -> str:
        """The metric label and the report's word for it: "rapl" or "nvml"."""
        ...

    def joules(self) -> float:
        """Joules drawn since this meter's first reading (0.0 at that reading); it never decreases."""
        ...


@dataclass
class _Zone:
    energy: Path
    range_uj: int
    last_uj: int | None = None


class RaplMeter:
    """The CPU packages' energy (and DRAM's, where the kernel reports it) from the powercap files.

    The top-level zones are the packages; their subzones core and uncore lie inside them and are skipped, while
    dram lies outside and is added. psys, where present, is the whole platform, packages included: skipped, or
    the packages would count twice. Each counter wraps at its max_energy_range_uj (a few minutes at full power
    on a large CPU): a reading that went down wrapped once, so readings must come more often than that.
    """

    source = "rapl"

    def __init__(self, root: Path = POWERCAP) -> None:
        self.root = root
        self._zones: list[_Zone] | None = None
        self._total_uj = 0

    def _find(self) -> list[_Zone]:
        if not self.root.is_dir():
            raise EnergyUnreadable(
                f"no {self.root}: this kernel exposes no RAPL counters (a virtual machine, or no intel_rapl driver)"
            )
        found = []
        for zone in sorted(self.root.glob("intel-rapl:*")):
            name = _text(zone / "name")
            top = zone.name.count(":") == 1
            if (top and name.startswith("package")) or (not top and name == "dram"):
                found.append(_Zone(zone / "energy_uj", _microjoules(zone / "max_energy_range_uj")))
        if not found:
            raise EnergyUnreadable(f"no RAPL package zone under {self.root}")
        return found

    def joules(self) -> float:
        zones = self._zones or self._find()
        readings = [_microjoules(zone.energy) for zone in zones]
        self._zones = zones
        for zone, now in zip(zones, readings, strict=True):
            if zone.last_uj is not None:
                delta = now - zone.last_uj
                self._total_uj += delta if delta >= 0 else delta + zone.range_uj
            zone.last_uj = now
        return self._total_uj / 1e6


def _microjoules(path: Path) -> int:
    text = _text(path)
    if not text.isdigit():  # the daemon reads every check: a surprise here must not end a check
        raise EnergyUnreadable(f"{path} holds {text[:40]!r}, not a count of microjoules")
    return int(text)


def _text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except PermissionError:
        raise EnergyUnreadable(
            f"{path} is readable by root only (Linux 5.10 and later, against the PLATYPUS power side channel)"
        ) from None
    except OSError as exc:
        raise EnergyUnreadable(f"cannot read {path}: {exc.strerror or exc}") from None


class NvmlMeter:
    """The energy of the server's GPUs: NVML's energy counter (mJ since the driver loaded), or, on a GPU without
    one, its power draw integrated between readings (trapezoids: as good as the readings are frequent)."""

    source = "nvml"

    def __init__(self, nvml: Nvml, indices: Sequence[int], clock: Callable[[], float] = time.monotonic) -> None:
        self.nvml = nvml
        self.indices = tuple(indices)
        self.clock = clock
        self._counter: dict[int, int] = {}
        self._power: dict[int, tuple[float, float]] = {}  # index -> (when, watts) of the last reading
        self._total = 0.0

    def joules(self) -> float:
        try:
            for index in self.indices:
                self._total += self._read(index)
        except NvmlUnavailable as exc:
            raise EnergyUnreadable(str(exc)) from None
        return self._total

    def _read(self, index: int) -> float:
        """Joules GPU `index` drew since its last reading (0.0 at its first)."""
        millijoules = self.nvml.energy_millijoules(index)
        if millijoules is not None:
            last = self._counter.get(index)
            self._counter[index] = millijoules
            # The counter starts again when the driver reloads: that window is lost, not negative.
            return max(millijoules - last, 0) / 1000 if last is not None else 0.0
        now, watts = self.clock(), self.nvml.power_milliwatts(index) / 1000
        previous = self._power.get(index)
        self._power[index] = (now, watts)
        return (previous[1] + watts) / 2 * (now - previous[0]) if previous is not None else 0.0


def meters_for(devices: Sequence[str], nvml: Nvml) -> list[EnergyMeter]:
    """The meters of a server on `devices` (llama.cpp device names): the CPUs' always, since they serve the
    requests and prefill where no GPU does; the GPUs' (CUDA<n>, NVML's index n) where the server uses some."""
    gpus = [int(d.removeprefix("CUDA")) for d in devices if d.startswith("CUDA")]
    meters: list[EnergyMeter] = [NvmlMeter(nvml, gpus)] if gpus else []
    return [*meters, RaplMeter()]


class Energy:
    """The machine's meters summed, for a measurement: each meter is tried once at the start, and one that
    cannot be read then is left out (with its reason) rather than summed as zero."""

    def __init__(self, meters: Sequence[EnergyMeter]) -> None:
        self.meters: list[EnergyMeter] = []
        self.unreadable: dict[str, str] = {}
        for meter in meters:
            try:
                meter.joules()
            except EnergyUnreadable as exc:
                self.unreadable[meter.source] = str(exc)
                continue
            self.meters.append(meter)

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(meter.source for meter in self.meters)

    def joules(self) -> float | None:
        """Joules drawn since the start, by every readable meter together; None when none can be read now."""
        total = 0.0
        for meter in self.meters:
            try:
                total += meter.joules()
            except EnergyUnreadable as exc:  # it was readable at the start: a sample without energy, said once
                self.unreadable.setdefault(meter.source, f"stopped being readable: {exc}")
                return None
        return total if self.meters else None
