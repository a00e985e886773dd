"""Device profiles: what the planner needs to know of a machine it may not be running on.

Memory is what a deployment may use (a Jetson's unified memory less what the OS keeps); bandwidth and the dense
matmul rates are datasheet figures, which the speed model scales by efficiencies measured on a real device
(``estimate.SpeedModel``, calibrated by ``scripts/plan_vs_measured.py``). ``current_profile()`` reads the GPU this
process sees and takes the closest profile's rates (or, for an unknown GPU, its memory and a guess it says it makes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from autodeploy.errors import ConfigError

_GB = 10**9


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    description: str
    memory_bytes: int  # what one device offers a deployment
    bandwidth: float  # bytes/s
    bf16_flops: float  # dense tensor-core rate
    int8_ops: float
    compute_capability: tuple[int, int]
    count: int = 1  # devices of one machine (tensor parallelism spreads over them)
    fp8_flops: float | None = None  # None: no FP8 tensor cores (compute capability < 8.9)
    reserved_bytes: int = 0  # kept from the deployment: the OS's share of a Jetson's unified memory, CUDA's context

    @property
    def fp8(self) -> bool:
        return self.compute_capability >= (8, 9)

    @property
    def base_name(self) -> str:
        """The profile's name without its device count (``h200`` of ``8xh200``)."""
        return self.name.split("x", 1)[1] if self.count > 1 else self.name

    @property
    def usable_bytes(self) -> int:
        return self.memory_bytes - self.reserved_bytes

    def with_count(self, count: int) -> DeviceProfile:
        return dataclasses.replace(self, count=count, name=f"{self.name}" if count == 1 else f"{count}x{self.name}")


PROFILES: dict[str, DeviceProfile] = {
    profile.name: profile
    for profile in (
        DeviceProfile("h200", "NVIDIA H200 SXM, 141 GB HBM3e", 141 * _GB, 4.8e12, 989e12, 1979e12, (9, 0),
                      fp8_flops=1979e12, reserved_bytes=1 * _GB),
        DeviceProfile("h100", "NVIDIA H100 SXM, 80 GB HBM3", 80 * _GB, 3.35e12, 989e12, 1979e12, (9, 0),
                      fp8_flops=1979e12, reserved_bytes=1 * _GB),
        DeviceProfile("a100-80gb", "NVIDIA A100 SXM, 80 GB HBM2e", 80 * _GB, 2.04e12, 312e12, 624e12, (8, 0),
                      reserved_bytes=1 * _GB),
        DeviceProfile("l40s", "NVIDIA L40S, 48 GB GDDR6", 48 * _GB, 0.864e12, 362e12, 733e12, (8, 9),
                      fp8_flops=733e12, reserved_bytes=1 * _GB),
        # Jetson Orin (compute capability 8.7: no FP8): unified LPDDR5 shared with the CPU and the OS.
        DeviceProfile("orin-agx-64gb", "Jetson AGX Orin 64 GB", 64 * _GB, 204.8e9, 42.5e12, 85e12, (8, 7), reserved_bytes=6 * _GB),
        DeviceProfile("orin-agx-32gb", "Jetson AGX Orin 32 GB", 32 * _GB, 204.8e9, 27e12, 54e12, (8, 7), reserved_bytes=4 * _GB),
        DeviceProfile("orin-nx-16gb", "Jetson Orin NX 16 GB", 16 * _GB, 102.4e9, 15e12, 30e12, (8, 7), reserved_bytes=3 * _GB),
        DeviceProfile("orin-nano-8gb", "Jetson Orin Nano 8 GB", 8 * _GB, 68e9, 10e12, 20e12, (8, 7), reserved_bytes=2 * _GB),
        DeviceProfile("cpu", "this machine's CPU (float32, 1 GiB KV budget by default)", 16 * _GB, 20e9, 0.2e12, 0.2e12, (0, 0)),
    )
}


def profile(name: str) -> DeviceProfile:
    """A profile by name; ``N x NAME`` (``8xh200``) for N devices of one machine."""
    count, _, base = name.partition("x") if name.split("x", 1)[0].isdigit() and "x" in name else ("1", "", name)
    if base not in PROFILES:
        raise ConfigError(f"unknown device profile {name!r}; known: {', '.join(PROFILES)} (and NxNAME for N of them, e.g. 8xh200)")
    return PROFILES[base].with_count(int(count))


def current_profile(device: torch.device) -> tuple[DeviceProfile, str]:
    """The profile of ``device`` (a GPU: the known one its name matches, with its real memory), and how it was found."""
    if device.type != "cuda":
        return PROFILES["cpu"], "the CPU profile"
    properties = torch.cuda.get_device_properties(device)
    name = properties.name.lower()
    for key, known in PROFILES.items():
        if key.split("-")[0] in name.replace(" ", "-"):
            return dataclasses.replace(known, memory_bytes=properties.total_memory), f"{properties.name}: the {key} profile's rates"
    guess = dataclasses.replace(PROFILES["h100"], name=name, description=properties.name, memory_bytes=properties.total_memory,
                                compute_capability=(properties.major, properties.minor))
    return guess, f"{properties.name} is not profiled: its memory, with H100 rates (a guess)"
