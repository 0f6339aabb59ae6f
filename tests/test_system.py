from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from loader_search._system import cgroup_cpu_limit, resolve_device, usable_cpus
from loader_search.errors import UserError


def test_usable_cpus_follow_the_affinity_mask() -> None:
    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))


def test_cgroup_quota_of_a_nested_group_counts(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    scope = root / "system.slice" / "job.scope"
    scope.mkdir(parents=True)
    (root / "cpu.max").write_text("max 100000\n")
    (root / "system.slice" / "cpu.max").write_text("400000 100000\n")
    (scope / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(root, "0::/system.slice/job.scope\n") == 1.5
    assert cgroup_cpu_limit(root, "0::/system.slice\n") == 4.0
    assert cgroup_cpu_limit(root, "0::/\n") is None  # unlimited at the root


def test_devices() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    with pytest.raises(UserError, match=r"training\.device = 'tpu'"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="CUDA is not available here"):
            resolve_device("cuda")
