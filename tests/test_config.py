from __future__ import annotations

import datetime
import math
from pathlib import Path

import pytest

from loader_search.errors import UserError
from loader_search.study import CpuRange, IntRange, StudyConfig, load_config
from loader_search.study.config import parse_config

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_parses() -> None:
    config = load_config(ROOT / "studies" / "quickstart.toml")
    assert config.name == "quickstart"
    assert config.trials >= 16
    assert config.space.batch_sizes == (32, 64, 128, 256)
    assert config.space.num_workers == CpuRange(0, None)
    assert config.space.torch_threads is None  # the default rule
    assert config.training.batch_size == 64


def test_every_shipped_study_config_parses() -> None:
    paths = sorted([*(ROOT / "studies").glob("*.toml"), *(ROOT / "scripts").glob("*.toml")])
    assert paths
    for path in paths:
        assert isinstance(load_config(path), StudyConfig)


def test_empty_config_gives_defaults_and_file_name(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text("")
    config = load_config(path)
    assert config.name == "mine"
    assert config == StudyConfig(name="mine")


def test_batch_size_forms() -> None:
    def sizes(value: object) -> tuple[int, ...]:
        data = {"space": {"batch_size": value}, "training": {"batch_size": 64}}
        return parse_config(data).space.batch_sizes

    assert sizes({"min": 16, "max": 128}) == (16, 32, 64, 128)
    assert sizes({"min": 32, "max": 96, "step": 32}) == (32, 64, 96)
    assert sizes([128, 64, 64]) == (64, 128)


def test_ranges_and_switches() -> None:
    config = parse_config(
        {
            "space": {
                "num_workers": {"min": 1, "max": 3},
                "prefetch_factor": 4,
                "persistent_workers": True,
                "pin_memory": False,
                "torch_threads": 2,
            }
        }
    )
    assert config.space.num_workers == CpuRange(1, 3)
    assert config.space.prefetch_factor == IntRange(4, 4)
    assert config.space.persistent_workers is True
    assert config.space.pin_memory is False
    assert config.space.torch_threads == 2


# Each bad value must be named in a one-line message, with its key.
BAD = [
    ({"study": {"trails": 5}}, "unknown key study.trails"),
    ({"stduy": {}}, "unknown table or key 'stduy'"),
    ({"study": {"trials": 0}}, "study.trials = 0: must be at least 1"),
    ({"study": {"trials": "ten"}}, 'study.trials = "ten": must be an integer'),
    ({"study": {"trials": True}}, "study.trials = true: must be an integer"),
    ({"study": {"timeout_s": -3}}, "study.timeout_s = -3: must be greater than 0"),
    ({"study": {"loss_tolerance": -0.1}}, "study.loss_tolerance = -0.1: must not be negative"),
    ({"study": {"seed": 2**32}}, "study.seed = 4294967296: must be below 2**32"),
    ({"study": {"seed": -1}}, "study.seed = -1: must be at least 0"),
    ({"sampler": {"name": "cmaes"}}, 'sampler.name = "cmaes": use one of tpe, random, nsga2'),
    ({"sampler": {"name": "random", "multivariate": True}}, "apply to sampler.name"),
    ({"space": {"batch_size": {"min": 0, "max": 64}}}, "space.batch_size.min = 0"),
    ({"space": {"batch_size": {"min": -8, "max": 64}}}, "space.batch_size.min = -8"),
    ({"space": {"batch_size": {"min": 128, "max": 64}}}, "max is below min: the range is empty"),
    ({"space": {"batch_size": []}}, "space.batch_size = []: must be a non-empty list"),
    ({"space": {"batch_size": [64, 0]}}, "space.batch_size = [64, 0]"),
    ({"space": {"batch_size": "big"}}, 'space.batch_size = "big"'),
    ({"space": {"batch_size": {"min": 32}}}, "needs both min and max"),
    ({"space": {"batch_size": {"min": 32, "max": 64, "setp": 8}}}, "space.batch_size.setp"),
    ({"space": {"num_workers": {"min": 3, "max": 1}}}, "space.num_workers = {min = 3, max = 1}"),
    ({"space": {"num_workers": {"max": "lots"}}}, 'space.num_workers.max = "lots"'),
    ({"space": {"num_workers": -1}}, "space.num_workers = -1: must be at least 0"),
    ({"space": {"prefetch_factor": {"min": 0, "max": 4}}}, "space.prefetch_factor.min = 0"),
    ({"space": {"prefetch_factor": {"min": 6, "max": 2}}}, "max is below min"),
    ({"space": {"prefetch_factor": 0}}, "space.prefetch_factor = 0: must be at least 1"),
    ({"space": {"pin_memory": "yes"}}, 'space.pin_memory = "yes": use true, false or "auto"'),
    ({"space": {"torch_threads": 0}}, "space.torch_threads = 0: must be at least 1"),
    ({"space": {"torch_threads": "many"}}, 'space.torch_threads = "many"'),
    ({"training": {"train_samples": 0}}, "training.train_samples = 0"),
    ({"training": {"lr_scaling": "cubic"}}, 'training.lr_scaling = "cubic": use one of none'),
    ({"training": {"lr": 0}}, "training.lr = 0: must be greater than 0"),
    ({"training": {"batch_size": 48}}, "training.batch_size = 48 (the baseline) is not one of"),
    ({"workload": {"options": 3}}, "workload.options = 3"),
    ({"workload": {"options": {"when": datetime.date(1979, 5, 27)}}}, "workload.options.when"),
    ({"workload": {"options": {"x": [1.0, math.nan]}}}, "workload.options.x = [1.0, nan]"),
    ({"workload": {"name": ""}}, 'workload.name = "": must be a non-empty string'),
]


@pytest.mark.parametrize(("data", "message"), BAD)
def test_bad_values_are_named(data: dict, message: str) -> None:
    with pytest.raises(UserError) as info:
        parse_config(data, source="bad.toml")
    text = str(info.value)
    assert message in text
    assert text.startswith("bad.toml")
    assert "\n" not in text


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[study\nname = 1")
    with pytest.raises(UserError, match="not valid TOML"):
        load_config(broken)


def test_cli_overrides() -> None:
    config = StudyConfig(name="a", trials=4).with_overrides(name="b", timeout_s=5)
    assert (config.name, config.trials, config.timeout_s) == ("b", 4, 5)
    with pytest.raises(UserError, match="--timeout -1"):
        StudyConfig().with_overrides(timeout_s=-1)
    with pytest.raises(UserError, match="--study-name is empty"):
        StudyConfig().with_overrides(name=" ")


def test_trial_limits() -> None:
    from loader_search.params import TrialLimits

    assert parse_config({}).limits == TrialLimits(trial_timeout_s=600.0, memory_limit_gb=None)
    limits = parse_config({"limits": {"trial_timeout_s": 30, "memory_limit_gb": 1.5}}).limits
    assert limits == TrialLimits(trial_timeout_s=30.0, memory_limit_gb=1.5)
    assert limits.memory_limit_bytes == 3 * 2**29


BAD_LIMITS = [
    ({"limits": {"trial_timeout_s": 0}}, "limits.trial_timeout_s = 0: must be greater than 0"),
    ({"limits": {"trial_timeout_s": "1h"}}, 'limits.trial_timeout_s = "1h": must be a number'),
    ({"limits": {"memory_limit_gb": -2}}, "limits.memory_limit_gb = -2: must be greater than 0"),
    ({"limits": {"memory_limit_gb": math.inf}}, "limits.memory_limit_gb = inf: must be a number"),
    ({"limits": {"memory_limit": 4}}, "unknown key limits.memory_limit"),
    ({"limits": 5}, "[limits] must be a table"),
]


@pytest.mark.parametrize(("data", "message"), BAD_LIMITS)
def test_bad_limits_are_named(data: dict, message: str) -> None:
    with pytest.raises(UserError) as info:
        parse_config(data, source="bad.toml")
    text = str(info.value)
    assert text.startswith("bad.toml") and message in text
    assert "\n" not in text
