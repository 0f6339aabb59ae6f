from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loader_search.errors import UserError
from loader_search.workloads import Workload, load_workload
from loader_search.workloads.synthetic_images import synthetic_images

PLUGIN = Path(__file__).parent / "plugins" / "my_workload.py"


def test_synthetic_images_are_encoded_and_augmented() -> None:
    workload = synthetic_images(image_size=16, train_size=32, val_size=8, encoding="jpeg")
    train = workload.train_dataset
    assert all(isinstance(b, bytes) and b[:2] == b"\xff\xd8" for b in train.images)  # JPEG
    x, y = train[0]
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32
    assert 0 <= y < 10
    assert torch.equal(train[0][0], x)  # per-index augmentation: the same every access
    assert not torch.equal(train[1][0], x)
    val_x, _ = workload.val_dataset[0]
    assert val_x.shape == (3, 16, 16)
    assert workload.make_model()(x.unsqueeze(0)).shape == (1, 10)


def test_synthetic_images_are_learnable() -> None:
    # Classes differ in pattern: a nearest-class-mean rule on raw pixels beats chance clearly.
    workload = synthetic_images(image_size=16, train_size=400, val_size=200)
    xs = torch.stack([workload.train_dataset[i][0] for i in range(400)])
    ys = torch.tensor(workload.train_dataset.labels)
    means = torch.stack([xs[ys == c].mean(0) for c in range(10)])
    vx = torch.stack([workload.val_dataset[i][0] for i in range(200)])
    vy = torch.tensor(workload.val_dataset.labels)
    predicted = torch.cdist(vx.flatten(1), means.flatten(1)).argmin(1)
    assert (predicted == vy).float().mean() > 0.3  # chance is 0.1


def test_builtin_by_name_with_options() -> None:
    workload = load_workload("synthetic-images", {"image_size": 16, "train_size": 16})
    assert len(workload.train_dataset) == 16
    assert workload.options["image_size"] == 16


def test_digits_uses_bundled_real_data() -> None:
    workload = load_workload("digits")
    assert len(workload.train_dataset) + len(workload.val_dataset) == 1797
    x, y = workload.train_dataset[0]
    assert x.shape == (1, 8, 8) and 0 <= y < 10
    assert workload.make_model()(x.unsqueeze(0)).shape == (1, 10)


def test_plugin_from_file_and_module(monkeypatch: pytest.MonkeyPatch) -> None:
    workload = load_workload(f"{PLUGIN}:build", {"n": 64})
    assert isinstance(workload, Workload) and len(workload.train_dataset) == 48
    monkeypatch.syspath_prepend(str(PLUGIN.parent))
    assert load_workload("my_workload:build").name == "my-workload"


@pytest.mark.parametrize(
    ("spec", "options", "message"),
    [
        ("imagenet", {}, "unknown workload 'imagenet': use one of synthetic-images, digits"),
        ("no_such_module_xyz:build", {}, "no module named 'no_such_module_xyz'"),
        (".my_workload:build", {}, "relative module names do not work here"),
        (
            "missing/file.py:build",
            {},
            "file.py' does not exist (a relative path resolves against the current folder)",
        ),
        (f"{PLUGIN}:nothing", {}, "has no function 'nothing'"),
        (f"{PLUGIN}:not_a_workload", {}, "returned int, not a loader_search.Workload"),
        ("synthetic-images", {"colour": 3}, "does not accept options ['colour']"),
        ("synthetic-images", {"image_size": -4}, "image_size = -4: must be at least 8"),
        # Upper bounds: a worker builds the options a shared database stores.
        ("synthetic-images", {"image_size": 3000}, "image_size = 3000: must be at most 1024"),
        ("synthetic-images", {"image_size": 10**6}, "image_size = 1000000: must be at most"),
        ("synthetic-images", {"train_size": 10**8}, "train_size = 100000000: must be at most"),
        (
            "synthetic-images",
            {"image_size": 1024, "train_size": 4096},
            "GiB of pixels to generate, above 8 GiB",
        ),
        ("digits", {"width": 10**9}, "width = 1000000000: must be at most 4096"),
        ("synthetic-images", {"encoding": "gif"}, "encoding = 'gif'"),
        ("synthetic-images", {"noise": "high"}, "noise = 'high': must be a number"),
        ("synthetic-images", {"seed": 1.5}, "seed = 1.5: must be an integer"),
        ("digits", {"val_fraction": "x"}, "val_fraction = 'x': must be a number"),
    ],
)
def test_bad_workloads_are_user_errors(spec: str, options: dict, message: str) -> None:
    with pytest.raises(UserError) as info:
        load_workload(spec, options)
    assert message in str(info.value)


def test_a_bug_in_the_users_factory_is_not_hidden() -> None:
    # One line for the user, naming the error; the bug itself stays attached for --debug.
    with pytest.raises(UserError, match="RuntimeError: the user's factory has a bug") as caught:
        load_workload(f"{PLUGIN}:broken")
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_a_gpu_stand_in_waits_per_sample_in_training_only() -> None:
    import time

    plain = synthetic_images(image_size=16, train_size=64, val_size=16)
    assert "device_us_per_sample" not in plain.options  # the quickstart's fingerprint stays
    # 50 ms a sample: an evaluation pass of 8 samples (1 ms on a quiet machine, 49 ms once
    # beside the rest of the suite) stays far below the 0.4 s a training pass waits.
    stand_in = synthetic_images(
        image_size=16, train_size=64, val_size=16, device_us_per_sample=50_000
    )
    assert stand_in.options["device_us_per_sample"] == 50_000
    assert "stands in for a GPU" in stand_in.description
    model = stand_in.make_model()
    batch = torch.randn(8, 3, 16, 16)
    model.train()
    started = time.perf_counter()
    model(batch)
    assert time.perf_counter() - started >= 8 * 0.05  # 8 samples x 50 ms, asleep
    model.eval()
    started = time.perf_counter()
    model(batch)
    assert time.perf_counter() - started < 8 * 0.05  # evaluation does not wait
    with pytest.raises(ValueError, match="device_us_per_sample"):
        synthetic_images(device_us_per_sample=-1)
