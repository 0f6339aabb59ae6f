"""This machine, as a study sees it: pinning this process (and so every trial it forks) to
CPUs and a GPU, describing the hardware its trials use, checking it against the hardware class
the study is bound to, and fitting the search space to its /dev/shm."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import optuna
import torch

from loader_search._system import resolve_device, shm_bytes, usable_cpus
from loader_search.errors import UserError, shorten
from loader_search.study._keys import STUDY_HARDWARE_ATTR
from loader_search.study.config import StudyConfig
from loader_search.study.search import ResolvedSpace, fit_space, sample_bytes
from loader_search.study.work._timings import check_timings_file
from loader_search.team import Hardware, check_lock_folder, collect, gpu_count
from loader_search.trial import check_step_settings
from loader_search.workloads import Workload


@dataclass(frozen=True)
class Machine:
    """How this process runs trials: pinned to ``cpus`` and ``gpu`` (None: the whole host,
    one trial at a time), and whether it may join a study bound to another hardware class."""

    cpus: Sequence[int] | None = None
    gpu: int | None = None
    allow_mixed_hardware: bool = False


def this_machine(config: StudyConfig, machine: Machine) -> tuple[torch.device, Hardware]:
    """Pin this process, then resolve its device and describe the hardware its trials use
    (in that order: pinning must precede any question to CUDA)."""
    device = resolve_device(_pin_this_process(machine.cpus, machine.gpu, config.device))
    # fp16 on a CPU, bf16 where CUDA lacks it, more ranks than GPUs (or CPUs on a CPU)
    check_step_settings(config.training, device)
    check_lock_folder()  # trials will take the host lock there: refuse a bad one now
    check_timings_file()  # and append their timings here, if asked to
    gpus = 1 if machine.gpu is not None else None
    return device, collect(device.type, usable_cpus(), gpus)


def _pin_this_process(cpus: Sequence[int] | None, gpu: int | None, device_spec: str) -> str:
    """Pin this process (and so every trial it forks) to ``cpus`` and ``gpu``; returns the
    device spec to use. Called before anything asks CUDA about its devices."""
    if cpus is not None:
        allowed = os.sched_getaffinity(0)
        outside = sorted(set(cpus) - allowed)
        if not cpus or outside:
            raise UserError(
                f"--cpus {_ranges(cpus)}: CPU(s) {_ranges(outside) or 'none'} are not"
                f" available to this process (it may use {_ranges(allowed)})"
            )
        os.sched_setaffinity(0, set(cpus))
    if gpu is None:
        return device_spec
    if device_spec == "cpu":
        raise UserError(f"--gpu {gpu} but the study trains on the CPU: leave --gpu out")
    count = gpu_count()
    if gpu < 0 or gpu >= count:
        raise UserError(f"--gpu {gpu}: this machine has {count} GPU(s) (0 .. {count - 1})")
    # Set before CUDA starts (in this process or the trials it forks): the trial then sees
    # one device, cuda:0.
    os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return "cuda"


def _ranges(values: Iterable[int]) -> str:
    """CPU numbers as ``--cpus`` takes them, runs joined (``0-3,8``), cut as errors quote a
    value (`shorten`): ``--cpus 0-8191`` must not become a message of 88 KB."""
    runs: list[list[int]] = []
    for value in sorted(set(values)):
        if runs and value == runs[-1][1] + 1:
            runs[-1][1] = value
        else:
            runs.append([value, value])
    return shorten(",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs))


def check_hardware(study: optuna.Study, hardware: Hardware, allow_mixed: bool) -> list[str]:
    """Refuse early (before the workload is built) a machine of another class than the
    study's first trial; the worker checks again under the study lock before each trial.
    Returns the note to show when mixing is allowed."""
    bound = study.user_attrs.get(STUDY_HARDWARE_ATTR)
    if bound is None or bound == hardware.hardware_class:
        return []
    if not allow_mixed:
        raise hardware_mismatch(study.study_name, bound, hardware)
    return [
        f"mixed hardware: this machine is {hardware.hardware_class}, the study's first"
        f" trials ran on {bound}; results are reported per class"
    ]


def hardware_mismatch(study_name: str, bound: str, hardware: Hardware) -> UserError:
    return UserError(
        f"study {study_name!r} measures hardware class {bound}, but this machine is"
        f" {hardware.hardware_class} ({hardware.describe()}): its throughputs would not"
        " compare. Run on matching hardware, or pass --allow-mixed-hardware (results are then"
        " reported per hardware class)"
    )


def fit_to_machine(
    space: ResolvedSpace, workload: Workload | None, ranks: int = 1
) -> ResolvedSpace:
    """Drop loader settings whose batches cannot fit in this machine's /dev/shm (the
    messages land in ``space.notes``), as `loader-search doctor` reports them; with
    ``ranks``, each rank's loader gets its share. A command's study (no ``workload``) is left
    as it is: its samples live in the script, unseen before its trials."""
    if workload is None:
        return space
    size = shm_bytes()
    fitted, _ = fit_space(space, sample_bytes(workload), size // ranks if size else size)
    return fitted
