"""GPU facts: NVML (nvidia-ml-py, the ``gpu`` extra) first, ``nvidia-smi`` as the fallback.

Nothing is mocked: each test asks this machine's real driver (or finds there is none) through
both routes. On a machine without a GPU both must say "no GPU" in the same words, so that a
study's hardware class does not depend on whether the extra is installed; on a GPU machine
both must name the same GPU.
"""

from __future__ import annotations

import shutil
import sys

import pytest

from loader_search.team import NO_GPU, GpuFacts, collect, gpu_count, gpu_facts
from loader_search.team._hardware import _nvidia_smi, _nvidia_smi_count, _nvml_facts, _text


def _no_nvidia_driver() -> bool:
    import torch

    # device_count asks NVML, not the CUDA runtime: safe in a process that forks trials.
    return shutil.which("nvidia-smi") is None and torch.cuda.device_count() == 0


def test_facts_are_the_same_with_and_without_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    with_extra = gpu_facts()  # through NVML where nvidia-ml-py is installed
    first_cuda = collect("cuda", usable_cpus=2)
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
        assert _nvml_facts(None) is None
        without_extra = gpu_facts()
        second_cuda = collect("cuda", usable_cpus=2)
        count_without = gpu_count()
    assert with_extra == without_extra
    assert gpu_count() == count_without == with_extra.count
    # What a trial records, and the hardware class a study is bound to, do not depend on it.
    gpu_fields = ("gpu_model", "gpu_count", "driver_version", "cuda_version", "hardware_class")
    assert {k: first_cuda.as_dict()[k] for k in gpu_fields} == {
        k: second_cuda.as_dict()[k] for k in gpu_fields
    }
    if _no_nvidia_driver():
        assert with_extra == NO_GPU == GpuFacts(count=0, model=None, driver_version=None)
        assert first_cuda.gpu_model is None and first_cuda.driver_version is None
        assert first_cuda.gpu_count == 0


def test_nvml_that_cannot_start_hands_over_to_nvidia_smi() -> None:
    pynvml = pytest.importorskip("pynvml", reason="pip install 'loader-search[gpu]'")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        # No driver here (NVMLError_LibraryNotFound or the like): no facts from NVML, no
        # exception out of it, and the answer is nvidia-smi's.
        assert _nvml_facts(None) is None
        assert _nvml_facts("0") is None
        model, driver = _nvidia_smi(None)
        assert gpu_facts() == GpuFacts(_nvidia_smi_count(), model, driver)
        if _no_nvidia_driver():
            assert gpu_facts("GPU-00000000-0000-0000-0000-000000000000") == NO_GPU
        return
    pynvml.nvmlShutdown()
    # A driver: NVML answers, and names the GPU as nvidia-smi does (the hardware class is
    # built from the name, so the two routes must agree).
    facts = _nvml_facts(None)
    assert facts is not None and facts.count >= 0
    if shutil.which("nvidia-smi") is not None:
        assert (facts.model, facts.driver_version) == _nvidia_smi(None)
        assert facts.count == _nvidia_smi_count()


def test_nvml_strings_old_and_new() -> None:
    # nvidia-ml-py before 11.515 returned bytes; later versions str.
    assert _text(b"NVIDIA H200 ") == "NVIDIA H200"
    assert _text("550.54.15") == "550.54.15"
    assert _text("  ") is None
