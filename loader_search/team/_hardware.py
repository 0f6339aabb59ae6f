"""The machine a trial runs on, and the short key that says which throughputs compare.

Throughput only means something on the hardware it was measured on: every trial records the
full description (`Hardware.as_dict`), and a study is bound to the *hardware class* of its
first trial, a short key built from what changes speed (device model and count, CPU model,
usable CPUs, memory). Versions and ``/dev/shm`` are recorded but do not change the class.

Nothing here initialises CUDA: trials run in processes forked from this one, and a process
that has touched CUDA cannot fork usable children. GPU facts come from ``nvidia-smi`` and
``torch.cuda.device_count()`` (which asks NVML, not the CUDA runtime).
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass
from typing import Any

from loader_search.trial._system import cpu_model, shm_bytes, total_ram_bytes


@dataclass(frozen=True)
class Hardware:
    device_type: str  # "cuda" or "cpu"
    gpu_model: str | None
    gpu_count: int
    driver_version: str | None
    cuda_version: str | None
    torch_version: str
    cpu_model: str
    usable_cpus: int
    ram_bytes: int
    shm_bytes: int | None
    python_version: str

    @property
    def hardware_class(self) -> str:
        """A short, readable key, e.g. ``cpu-2c-1a2b3c`` or ``h200x1-16c-9f8e7d``: the
        device, the usable CPUs, and a hash of everything that sets speed."""
        identity = [
            self.device_type,
            self.gpu_model or "",
            str(self.gpu_count),
            self.cpu_model,
            str(self.usable_cpus),
            # Whole GiB: the kernel reports a few MiB more or less between boots.
            str(round(self.ram_bytes / 2**30)),
        ]
        digest = hashlib.sha256("|".join(identity).encode()).hexdigest()[:6]
        if self.device_type == "cuda" and self.gpu_model:
            words = re.findall(r"[A-Za-z]*\d+[A-Za-z]*", self.gpu_model)
            name = (words[-1] if words else "gpu").lower()
            return f"{name}x{self.gpu_count}-{self.usable_cpus}c-{digest}"
        return f"cpu-{self.usable_cpus}c-{digest}"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hardware_class": self.hardware_class}

    def describe(self) -> str:
        gpu = f"{self.gpu_count}x {self.gpu_model}, " if self.device_type == "cuda" else ""
        return (
            f"{gpu}{self.usable_cpus} usable CPU(s) of {self.cpu_model},"
            f" {self.ram_bytes / 2**30:.0f} GiB RAM"
        )


def _nvidia_smi(visible: str | None) -> tuple[str | None, str | None]:
    """(model, driver version) of the first visible GPU, from nvidia-smi; (None, None) if
    it is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, None
    command = [exe, "--query-gpu=name,driver_version", "--format=csv,noheader"]
    first = (visible or "").split(",")[0].strip()
    if first:
        command += ["-i", first]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None, None
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    if not lines:
        return None, None
    name, _, driver = lines[0].partition(",")
    return name.strip() or None, driver.strip() or None


def collect(device_type: str, usable_cpus: int, gpu_count: int | None = None) -> Hardware:
    """Describe this machine as a trial on ``device_type`` would use it.

    ``usable_cpus`` is what the trial may run on (after any ``--cpus`` pinning) and
    ``gpu_count`` the GPUs it sees (1 when pinned with ``--gpu``; default: all visible).
    """
    import torch

    gpu_model = driver = None
    count = 0
    if device_type == "cuda":
        gpu_model, driver = _nvidia_smi(os.environ.get("CUDA_VISIBLE_DEVICES"))
        count = gpu_count if gpu_count is not None else torch.cuda.device_count()
    return Hardware(
        device_type=device_type,
        gpu_model=gpu_model,
        gpu_count=count,
        driver_version=driver,
        cuda_version=torch.version.cuda if device_type == "cuda" else None,
        torch_version=torch.__version__,
        cpu_model=cpu_model(),
        usable_cpus=usable_cpus,
        ram_bytes=total_ram_bytes(),
        shm_bytes=shm_bytes(),
        python_version=platform.python_version(),
    )


def gpu_count() -> int:
    """GPUs on this machine, without starting CUDA: ``nvidia-smi -L``, else torch's count
    (NVML-based), else 0."""
    exe = shutil.which("nvidia-smi")
    if exe is not None:
        try:
            out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=10)
            return sum(line.startswith("GPU ") for line in out.stdout.splitlines())
        except (OSError, subprocess.SubprocessError):
            pass
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
