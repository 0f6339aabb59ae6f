"""`loader-search doctor` and the /dev/shm fitting `run` applies before the first trial."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from loader_search.cli._doctor import (
    CPUS,
    DEVICE,
    ISOLATION,
    MEMORY,
    SHARED_MEMORY,
    START_METHOD,
    STORAGE,
    WORKLOAD,
    diagnose,
)
from loader_search.params import LoaderParams
from loader_search.study import (
    CpuRange,
    IntRange,
    SearchSpace,
    fit_space,
    load_config,
    sample_bytes,
)
from loader_search.study.config import parse_config
from loader_search.study.search import shm_footprint_bytes
from loader_search.workloads import Workload
from tests.conftest import run_cli

BASIC = [DEVICE, CPUS, MEMORY, SHARED_MEMORY, START_METHOD, ISOLATION, STORAGE]


def _by_name(checks: list) -> dict:
    return {check.name: check for check in checks}


def test_diagnose_here(sqlite_url: str) -> None:
    checks = diagnose(None, sqlite_url, None)
    assert [check.name for check in checks] == BASIC
    assert all(check.verdict in ("ok", "warn") for check in checks), checks
    found = _by_name(checks)
    assert found[DEVICE].detail.startswith("cpu")
    assert "usable" in found[CPUS].detail
    assert "will be created" in found[STORAGE].detail
    assert not Path(sqlite_url.removeprefix("sqlite:///")).exists()  # doctor creates nothing


def test_diagnose_a_study(
    tiny_config: Callable[..., Path], tiny_workload: Workload, sqlite_url: str
) -> None:
    config = load_config(tiny_config())
    checks = diagnose(config, sqlite_url, tiny_workload)
    assert [check.name for check in checks] == [*BASIC[:3], WORKLOAD, *BASIC[3:]]
    found = _by_name(checks)
    assert "3.0 KiB per collated sample" in found[WORKLOAD].detail
    assert "largest setting needs" in found[SHARED_MEMORY].detail
    assert "600 s" in found[ISOLATION].detail


def test_a_trial_memory_limit_above_the_machine_is_a_warning(sqlite_url: str) -> None:
    config = parse_config({"limits": {"memory_limit_gb": 1e6}})
    memory = _by_name(diagnose(config, sqlite_url, None))[MEMORY]
    assert memory.verdict == "warn" and "memory_limit_gb" in memory.fix


def test_storage_problems_fail(tmp_path: Path) -> None:
    missing_folder = _by_name(diagnose(None, f"sqlite:///{tmp_path}/no/such/x.db", None))
    assert missing_folder[STORAGE].verdict == "fail"
    not_a_study_file = tmp_path / "notes.db"
    not_a_study_file.write_text("hello")
    other = _by_name(diagnose(None, f"sqlite:///{not_a_study_file}", None))[STORAGE]
    assert other.verdict == "fail"
    assert not_a_study_file.read_text() == "hello"
    server = "postgresql+psycopg://me:hunter2secret@127.0.0.1:1/db"
    unreachable = _by_name(diagnose(None, server, None))[STORAGE]
    assert unreachable.verdict == "fail"
    assert "hunter2secret" not in unreachable.detail
    assert "me:***@127.0.0.1" in unreachable.detail


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:"])
def test_an_in_memory_storage_fails_as_run_refuses_it(url: str) -> None:
    found = _by_name(diagnose(None, url, None))[STORAGE]
    assert found.verdict == "fail" and "refuse" in found.detail


def test_sample_bytes_counts_the_collated_tensors(tiny_workload: Workload) -> None:
    # A 3x16x16 float32 image and an int64 label.
    assert sample_bytes(tiny_workload) == 3 * 16 * 16 * 4 + 8


def test_shm_footprint() -> None:
    assert shm_footprint_bytes(LoaderParams(32, 4, 2), 100) == 4 * 2 * 32 * 100
    assert shm_footprint_bytes(LoaderParams(32), 100) == 0


SPACE = SearchSpace(
    batch_sizes=(32, 64), num_workers=CpuRange(0, 8), prefetch_factor=IntRange(2, 8)
).resolve(8, cuda=False)
PER_SAMPLE = 1000
PER_BATCH = 32 * PER_SAMPLE  # the smallest batch


def test_fit_space_drops_workers_when_one_batch_does_not_fit() -> None:
    fitted, messages = fit_space(SPACE, PER_SAMPLE, PER_BATCH - 1)
    assert fitted.num_workers == IntRange(0, 0)
    assert len(messages) == 1
    assert "num_workers" in messages[0] and "--shm-size" in messages[0]
    assert "31.2 KiB" in messages[0]  # the batch that does not fit
    assert fitted.notes[-1] == messages[0]
    assert fitted.size() == len(SPACE.batch_sizes)  # only num_workers = 0 remains


@pytest.mark.parametrize("batches", [1, 3, 5, 17, 64])
def test_fit_space_keeps_exactly_what_can_fit(batches: int) -> None:
    shm = batches * PER_BATCH
    fitted, messages = fit_space(SPACE, PER_SAMPLE, shm)
    workers, prefetch = fitted.num_workers, fitted.prefetch_factor
    # The extremes of each range fit with the smallest values of the others ...
    assert max(1, workers.low) * prefetch.high * PER_BATCH <= shm
    assert workers.high * prefetch.low * PER_BATCH <= shm
    # ... and nothing that could fit was dropped.
    assert workers.high == min(8, shm // (prefetch.low * PER_BATCH))
    assert prefetch.high == min(8, shm // (max(1, workers.low) * PER_BATCH))
    assert bool(messages) == (fitted != SPACE)
    for message in messages:
        assert "/dev/shm" in message and "docker run --shm-size=2g" in message


def test_fit_space_leaves_a_space_that_fits_alone() -> None:
    assert fit_space(SPACE, PER_SAMPLE, 2**40) == (SPACE, [])
    assert fit_space(SPACE, PER_SAMPLE, None) == (SPACE, [])


def test_doctor_command(tiny_config: Callable[..., Path], sqlite_url: str) -> None:
    plain = run_cli("doctor", "--storage", sqlite_url)
    assert plain.returncode == 0, plain.stderr
    assert "shared memory" in plain.stdout and "start method" in plain.stdout
    study = run_cli("doctor", str(tiny_config()), "--storage", sqlite_url)
    assert study.returncode == 0, study.stderr
    assert "per collated sample" in study.stdout


def test_doctor_command_failures(tmp_path: Path) -> None:
    missing = run_cli("doctor", str(tmp_path / "missing.toml"))
    assert missing.returncode == 2
    assert missing.stderr.strip().count("\n") == 0
    assert "does not exist" in missing.stderr
    failing = run_cli("doctor", "--storage", f"sqlite:///{tmp_path}/no/such/x.db")
    assert failing.returncode == 1
    assert "fail" in failing.stdout
