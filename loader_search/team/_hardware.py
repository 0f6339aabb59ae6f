"""The machine a trial runs on, and the short key that says which throughputs compare.

Throughput only means something on the hardware it was measured on: every trial records the
full description (`Hardware.as_dict`), and a study is bound to the *hardware class* of its
first trial, a short key built from what changes speed (device model and count, CPU model,
usable CPUs, memory). Versions and ``/dev/shm`` are recorded but do not change the class.

Nothing here initialises CUDA: trials run in processes forked from this one, and a process
that has touched CUDA cannot fork usable children. GPU facts (`gpu_facts`) come from the
driver's NVML library through ``pynvml`` (package nvidia-ml-py, the ``gpu`` extra) when it is
installed and NVML starts; else from ``nvidia-smi`` (which reads NVML too, so both give the same
names); the count last from ``torch.cuda.device_count()`` (NVML-based as well).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass
from typing import Any

from loader_search._system import cpu_model, shm_bytes, total_ram_bytes


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


@dataclass(frozen=True)
class GpuFacts:
    """What the driver says about this machine's GPUs, read without starting CUDA."""

    count: int  # every GPU of the machine, visible or not
    model: str | None  # of the first visible GPU; None without a GPU or a driver
    driver_version: str | None


NO_GPU = GpuFacts(0, None, None)


def gpu_facts(visible: str | None = None) -> GpuFacts:
    """This machine's GPUs; ``visible`` (``CUDA_VISIBLE_DEVICES``' value) picks the GPU whose
    model is reported. NVML first, then ``nvidia-smi``; on a machine without a GPU or driver,
    `NO_GPU` either way."""
    facts = _nvml_facts(visible)
    if facts is not None:
        return facts
    model, driver = _nvidia_smi(visible)
    return GpuFacts(_nvidia_smi_count(), model, driver)


def _first_visible(visible: str | None) -> str:
    return (visible or "").split(",")[0].strip()


def _nvml_facts(visible: str | None) -> GpuFacts | None:
    """`GpuFacts` from NVML; None when pynvml is not installed or NVML fails (no driver:
    ``NVMLError_LibraryNotFound``; a device it cannot name), so that nvidia-smi is asked."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        count = int(pynvml.nvmlDeviceGetCount())
        if count == 0:  # a driver but no GPU: what nvidia-smi says too ("No devices found")
            return NO_GPU
        first = _first_visible(visible)
        if first.isdigit() or not first:
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(first or 0))
        else:  # a UUID (GPU-..., MIG-...), as nvidia-smi -i also takes
            handle = pynvml.nvmlDeviceGetHandleByUUID(first)
        model = _text(pynvml.nvmlDeviceGetName(handle))
        return GpuFacts(count, model, _text(pynvml.nvmlSystemGetDriverVersion()))
    except pynvml.NVMLError:
        return None
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def _text(value: str | bytes) -> str | None:
    """NVML strings (bytes before nvidia-ml-py 11.515), stripped; None when empty."""
    text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    return text.strip() or None


def _nvidia_smi(visible: str | None) -> tuple[str | None, str | None]:
    """(model, driver version) of the first visible GPU, from nvidia-smi; (None, None) if
    it is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, None
    command = [exe, "--query-gpu=name,driver_version", "--format=csv,noheader"]
    first = _first_visible(visible)
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


def _nvidia_smi_count() -> int:
    """GPUs listed by ``nvidia-smi -L``, else torch's count (NVML-based), else 0."""
    exe = shutil.which("nvidia-smi")
    if exe is not None:
        try:
            out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=10)
            return sum(line.startswith("GPU ") for line in out.stdout.splitlines())
        except (OSError, subprocess.SubprocessError):
            pass
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def collect(device_type: str, usable_cpus: int, gpu_count: int | None = None) -> Hardware:
    """Describe this machine as a trial on ``device_type`` would use it.

    ``usable_cpus`` is what the trial may run on (after any ``--cpus`` pinning) and
    ``gpu_count`` the GPUs it sees (1 when pinned with ``--gpu``; default: all visible).
    """
    import torch

    gpu_model = driver = None
    count = 0
    if device_type == "cuda":
        facts = gpu_facts(os.environ.get("CUDA_VISIBLE_DEVICES"))
        gpu_model, driver = facts.model, facts.driver_version
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
    """GPUs on this machine, without starting CUDA: NVML, else ``nvidia-smi -L``, else
    torch's count (NVML-based), else 0."""
    return gpu_facts().count
