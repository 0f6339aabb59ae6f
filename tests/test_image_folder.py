"""The ``image-folder`` workload and ``make-images``: real JPEG files on disk, real decoding,
real DataLoader workers and a real study run through the CLI."""

from __future__ import annotations

import json
import math
import random
import shutil
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import torch
from PIL import Image

from loader_search.errors import UserError
from loader_search.params import LoaderParams, TrainingSettings
from loader_search.study import load_config
from loader_search.trial import run_trial
from loader_search.trial._failures import classify_exception
from loader_search.workloads import load_workload
from loader_search.workloads.image_folder import (
    UnreadableImageError,
    center_crop,
    random_resized_crop,
)
from loader_search.workloads.make_images import ImageSetSpec, make_image_folder
from tests.conftest import invoke, run_cli

TINY_SET = ImageSetSpec(classes=3, train_per_class=8, val_per_class=3, width=48, height=36)


def tvision_works() -> bool:
    try:
        import torchvision  # noqa: F401
    except (ImportError, RuntimeError):
        return False
    return True


@pytest.fixture(scope="module")
def image_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("images") / "set"
    assert make_image_folder(root, TINY_SET, jobs=2) == TINY_SET.total
    return root


def tiny(root: Path | str, **options: object) -> dict[str, object]:
    return {"root": str(root), "model": "small-cnn", "image_size": 16, "decoder": "pil", **options}


def test_make_images_writes_jpegs_of_varied_sizes_and_resumes(tmp_path: Path) -> None:
    spec = ImageSetSpec(classes=2, train_per_class=6, val_per_class=2, width=64, height=48)
    assert make_image_folder(tmp_path / "a", spec, jobs=1) == 16
    files = sorted((tmp_path / "a").rglob("*.jpg"))
    assert len(files) == 16
    assert sorted({f.parent.parent.name for f in files}) == ["train", "val"]
    assert sorted({f.parent.name for f in files}) == ["class_000", "class_001"]
    sizes = set()
    for f in files:
        with Image.open(f) as image:
            assert image.format == "JPEG" and image.mode == "RGB"
            sizes.add(image.size)
    assert len(sizes) > 4  # sizes vary
    assert all(min(s) >= 38 and max(s) <= 93 for s in sizes)  # 64x48 ± 20% ± 10%, either way
    # The same seed writes the same bytes; files already there are kept (resume).
    assert make_image_folder(tmp_path / "b", spec, jobs=2) == 16
    assert all(
        f.read_bytes() == (tmp_path / "b" / f.relative_to(tmp_path / "a")).read_bytes()
        for f in files
    )
    assert make_image_folder(tmp_path / "a", spec, jobs=1) == 0
    assert not list((tmp_path / "a").rglob("*.part"))


def test_make_images_command_and_its_bad_input(tmp_path: Path) -> None:
    done = run_cli(
        "make-images",
        str(tmp_path / "set"),
        "--classes",
        "2",
        "--train-per-class",
        "2",
        "--val-per-class",
        "1",
        "--width",
        "40",
        "--height",
        "30",
    )
    assert done.returncode == 0, done.stderr
    assert "6 images written" in done.stdout and 'name = "image-folder"' in done.stdout
    assert len(list((tmp_path / "set").rglob("*.jpg"))) == 6
    for args, expected in [
        (["--classes", "1"], "classes = 1: a classifier needs at least 2"),
        (["--quality", "100"], "quality = 100"),
        (["--width", "8"], "images must be at least 16x16"),
        (["--jobs", "0"], "--jobs 0"),
    ]:
        bad = run_cli("make-images", str(tmp_path / "bad"), *args)
        assert bad.returncode == 2, (args, bad.stderr)
        lines = bad.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0] and "Traceback" not in bad.stderr


def test_train_and_val_folders_are_used_as_given(image_root: Path) -> None:
    workload = load_workload("image-folder", tiny(image_root))
    train, val = workload.train_dataset, workload.val_dataset
    assert (len(train), len(val)) == (24, 9)
    assert all("/train/" in p for p in train.paths) and all("/val/" in p for p in val.paths)
    # Classes are numbered in sorted folder order, as torchvision's ImageFolder numbers them.
    assert {Path(p).parent.name: y for p, y in zip(val.paths, val.labels, strict=True)} == {
        "class_000": 0,
        "class_001": 1,
        "class_002": 2,
    }
    x, y = train[0]
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32 and y == 0
    assert torch.equal(train[0][0], x)  # the augmentation of a sample is fixed by its index
    assert not torch.equal(train[1][0], x)
    assert torch.equal(val[0][0], val[0][0])
    assert workload.make_model()(x.unsqueeze(0)).shape == (1, 3)
    assert workload.options["root"] == str(image_root) and workload.options["decoder"] == "pil"


def test_class_folders_are_split_per_class(tmp_path: Path, image_root: Path) -> None:
    flat = tmp_path / "flat"
    shutil.copytree(image_root / "train", flat)
    workload = load_workload("image-folder", tiny(flat, val_fraction=0.25))
    train, val = workload.train_dataset, workload.val_dataset
    assert (len(train), len(val)) == (18, 6)  # 2 of each class's 8
    assert sorted(val.labels) == [0, 0, 1, 1, 2, 2]
    assert not set(train.paths) & set(val.paths)
    again = load_workload("image-folder", tiny(flat, val_fraction=0.25))
    assert again.val_dataset.paths == val.paths  # the split is seeded
    capped = load_workload("image-folder", tiny(flat, val_fraction=0.25, val_size=4))
    assert len(capped.val_dataset) == 4 and set(capped.val_dataset.paths) <= set(val.paths)


@pytest.mark.timeout(60)
def test_a_symlink_loop_under_the_root_ends_and_linked_classes_count(
    tmp_path: Path, image_root: Path
) -> None:
    flat = tmp_path / "flat"
    shutil.copytree(image_root / "train", flat)
    classes = sorted(p.name for p in flat.iterdir())
    (flat / classes[0] / "loop").symlink_to("..")  # back up the tree: walked for ever before
    elsewhere = tmp_path / "kept-elsewhere"
    shutil.move(flat / classes[1], elsewhere)
    (flat / classes[1]).symlink_to(elsewhere)  # a class folder linked in: followed
    workload = load_workload("image-folder", tiny(flat, val_fraction=0.25))
    assert len(workload.train_dataset) + len(workload.val_dataset) == 24  # each image once


def test_crops_follow_torchvisions_rules() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        width, height = rng.randint(16, 600), rng.randint(16, 600)
        top, left, h, w = random_resized_crop(width, height, rng)
        assert top >= 0 and top + h <= height and left >= 0 and left + w <= width
        if (h, w) != (height, width) and (top, left) != ((height - h) // 2, (width - w) // 2):
            # A drawn crop (not the fallback): area 8-100%, aspect 3/4-4/3, as torchvision.
            assert 0.08 * 0.9 <= h * w / (width * height) <= 1.0
            assert 3 / 4 * 0.9 <= w / h <= 4 / 3 * 1.1
    # Resize(256) + CenterCrop(224) of a 500x375 image keeps the central 328 px square.
    assert center_crop(500, 375, 224) == (23, 86, 328, 328)
    assert center_crop(10, 400, 224)[2:] == (9, 9)


@pytest.mark.skipif(not tvision_works(), reason="torchvision does not load with this torch")
def test_torchvision_decoding_matches_pil(image_root: Path) -> None:  # pragma: no cover
    pil = load_workload("image-folder", tiny(image_root, image_size=32))
    tv = load_workload("image-folder", tiny(image_root, image_size=32, decoder="torchvision"))
    for i in range(4):
        # Same crop, same flip; the two resamplers differ by rounding only.
        assert (pil.train_dataset[i][0] - tv.train_dataset[i][0]).abs().mean() < 0.05
    resnet = load_workload("image-folder", tiny(image_root, model="resnet18", image_size=32))
    assert resnet.make_model()(torch.zeros(2, 3, 32, 32)).shape == (2, 3)


def test_without_torchvision_one_line_says_what_to_install(image_root: Path) -> None:
    hide = "import sys; sys.modules['torchvision'] = None; "
    for option, expected in [
        (
            "model='resnet18'",
            "model = 'resnet18' needs torchvision: pip install 'loader-search[vision]'",
        ),
        (
            "decoder='torchvision'",
            "decoder = 'torchvision' needs torchvision: pip install 'loader-search[vision]'",
        ),
    ]:
        code = (
            f"{hide}from loader_search.workloads import load_workload\n"
            f"options = dict(root={str(image_root)!r}, image_size=16, {option})\n"
            "try:\n    load_workload('image-folder', options)\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        assert out.stdout.startswith("UserError workload 'image-folder': ImportError:")
        assert expected in out.stdout
    # "auto" decodes with PIL where torchvision is missing.
    code = (
        f"{hide}from loader_search.workloads import load_workload\n"
        f"w = load_workload('image-folder', dict(root={str(image_root)!r}, model='small-cnn'))\n"
        "print(w.options['decoder'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "pil"


def test_folders_that_cannot_train_say_why(tmp_path: Path, image_root: Path) -> None:
    def refused(root: Path, **options: object) -> str:
        with pytest.raises(UserError) as raised:
            load_workload("image-folder", tiny(root, **options))
        message = str(raised.value)
        assert "\n" not in message
        return message

    assert "no such folder" in refused(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    assert "has no class folders" in refused(tmp_path / "empty")
    one = tmp_path / "one"
    shutil.copytree(image_root / "train" / "class_000", one / "cats")
    assert "has one class ('cats'): a classifier needs at least 2" in refused(one)
    (one / "dogs").mkdir()
    (one / "dogs" / "notes.txt").write_text("no images here")
    assert f"class folder '{one / 'dogs'}' holds no images" in refused(one)
    only_val = tmp_path / "only_val"
    shutil.copytree(image_root / "val", only_val / "val")
    assert "has val/ but no train/" in refused(only_val)
    assert "val_fraction = 0.9: must be at most 0.5" in refused(image_root, val_fraction=0.9)
    assert "image_size = 100000: must be at most 4096" in refused(image_root, image_size=10**5)
    assert "decoder = 'cv2'" in refused(image_root, decoder="cv2")


def test_a_corrupt_image_fails_the_trial_naming_the_file(tmp_path: Path, image_root: Path) -> None:
    root = tmp_path / "set"
    shutil.copytree(image_root, root)
    victim = sorted((root / "train" / "class_001").glob("*.jpg"))[2]
    victim.write_bytes(victim.read_bytes()[:200])  # truncated mid-file
    empty = sorted((root / "val" / "class_000").glob("*.jpg"))[0]
    empty.write_bytes(b"")
    workload = load_workload("image-folder", tiny(root))
    index = workload.train_dataset.paths.index(str(victim))
    with pytest.raises(UnreadableImageError, match="remove or replace the file"):
        workload.train_dataset[index]
    with pytest.raises(UnreadableImageError, match=str(empty)):
        workload.val_dataset[workload.val_dataset.paths.index(str(empty))]
    # In a real trial, read by a loader worker: the failure names the file.
    settings = TrainingSettings(
        train_samples=96, batch_size=8, warmup_batches=1, eval_batch_size=8
    )
    params = LoaderParams(batch_size=8, num_workers=1, prefetch_factor=2)
    with pytest.raises(UnreadableImageError) as raised:
        run_trial(workload, params, settings)
    failure = classify_exception(raised.value)
    assert failure.reason == "exception" and str(victim) in failure.message
    assert "remove or replace the file" in failure.message


def test_a_study_runs_on_a_folder_with_a_five_line_config(
    tmp_path: Path, image_root: Path
) -> None:
    project = tmp_path / "project"
    (project / "configs").mkdir(parents=True)
    shutil.copytree(image_root, project / "data")
    config = project / "configs" / "images.toml"
    config.write_text(
        "[workload]\n"
        'name = "image-folder"\n'
        'options = { root = "../data", model = "small-cnn", image_size = 16 }\n'
        "[study]\n"
        "trials = 3\n"
        "confirm_top = 0\n"
        "[training]\n"
        "train_samples = 192\n"
        "batch_size = 8\n"
        "eval_batch_size = 16\n"
        "[space]\n"
        "batch_size = { min = 8, max = 16 }\n"
        "num_workers = { min = 0, max = 1 }\n"
        "prefetch_factor = { min = 1, max = 2 }\n"
    )
    # Run from elsewhere: the relative root resolves against the config file's folder.
    db = tmp_path / "studies.db"
    done = invoke("run", str(config), "--storage", f"sqlite:///{db}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "DataLoader(" in done.stdout
    study = optuna.load_study(study_name="images", storage=f"sqlite:///{db}")
    measured = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(measured) == 3 and all(math.isfinite(t.values[1]) for t in measured)
    stored = json.loads(json.dumps(study.user_attrs))
    assert stored["fingerprint"]["workload_options"]["root"] == str(project / "data")
    assert stored["config"]["workload"]["options"]["root"] == "../data"  # as written


def test_relative_plugin_paths_resolve_against_the_config_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "config_folder_data.py").write_text("N = 64\n")
    monkeypatch.setattr(sys, "path", list(sys.path))  # the plug-in's folder goes on it
    monkeypatch.delitem(sys.modules, "config_folder_data", raising=False)
    (folder / "plug.py").write_text(
        "import torch\nfrom torch.utils.data import TensorDataset\n"
        "from config_folder_data import N\n"  # a module beside the plug-in
        "from loader_search import Workload\n"
        "def build() -> Workload:\n"
        "    x = torch.randn(N, 4); y = (x.sum(1) > 0).long()\n"
        "    data = TensorDataset(x, y)\n"
        "    return Workload(name='plug', train_dataset=data, val_dataset=data,\n"
        "                    make_model=lambda: torch.nn.Linear(4, 2))\n"
    )
    (folder / "study.toml").write_text('[workload]\nname = "plug.py:build"\n')
    config = load_config(folder / "study.toml")  # from the tests' folder, not `folder`
    assert config.workload == f"{folder / 'plug.py'}:build"
    assert config.document["workload"]["name"] == "plug.py:build"  # stored as written
    assert len(load_workload(config.workload, config.workload_options).train_dataset) == 64
    (folder / "other.toml").write_text('[workload]\nname = "gone.py:build"\n')
    with pytest.raises(UserError) as raised:
        load_config(folder / "other.toml")
    assert f"no file '{folder / 'gone.py'}'" in str(raised.value)
    assert f"resolves against the config file's folder, '{folder}'" in str(raised.value)
