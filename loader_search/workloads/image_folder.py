"""``image-folder``: the user's own images, in the layout ``torchvision.datasets.ImageFolder``
reads, trained with the transforms ImageNet training uses and a torchvision classifier.

``root`` holds one sub-folder per class (``root/cat/1.jpg``), or ``train/`` and ``val/`` with
one sub-folder per class each. Training samples get ``RandomResizedCrop`` (scale 0.08-1, ratio
3/4-4/3, as torchvision draws it) + horizontal flip + ImageNet normalisation; validation
samples the central crop that ``Resize(image_size * 256 / 224)`` + ``CenterCrop(image_size)``
keep. Both crop and resize in one step on the decoded image.

Decoding: ``torchvision.io.decode_image`` with the resize on the uint8 tensor, or PIL. Measured
on 500x375 JPEGs (quality 90, one core of a 2-core EPYC): decoding 1.0-1.1 ms with torchvision
against 1.45-1.5 ms with PIL, and with the crop and resize to 224 1.3-1.6 ms against 2.35-2.4
ms; so ``decoder = "auto"`` takes torchvision when it is installed.

The augmentation of sample ``i`` is drawn from a generator seeded by ``(seed, i)``, as in
``synthetic-images``: loader settings change how fast a model trains, never what it sees.
"""

from __future__ import annotations

import functools
import math
import os
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.utils.data import Dataset

from loader_search._rules import Range, check_options
from loader_search.workloads._base import Workload
from loader_search.workloads.synthetic_images import SmallCNN

# What torchvision.datasets.ImageFolder accepts (torchvision.datasets.folder.IMG_EXTENSIONS).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
DECODERS = ("auto", "torchvision", "pil")
BUILTIN_MODELS = ("small-cnn",)
VISION_HINT = "pip install 'loader-search[vision]'"

_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)  # ImageNet's, as torchvision uses
_STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
_SCALE = (0.08, 1.0)  # RandomResizedCrop's defaults
_LOG_RATIO = (math.log(3 / 4), math.log(4 / 3))

Sample = tuple[str, int]  # (path, class index)
Box = tuple[int, int, int, int]  # (top, left, height, width)


class UnreadableImageError(ValueError):
    """An image file that cannot be decoded. The trial fails with this message, which names
    the file; every setting would read it, so the study stops at the baseline."""


def load_torchvision(purpose: str) -> ModuleType:
    """Import torchvision, or say in one line what to install (`ImportError`)."""
    try:
        import torchvision
    except ImportError:
        raise ImportError(f"{purpose} needs torchvision: {VISION_HINT}") from None
    except RuntimeError as exc:  # a torchvision built for another torch: its operators fail
        raise ImportError(
            f"{purpose} needs torchvision, which is installed but does not load with torch"
            f" {torch.__version__} ({exc}); install the torchvision release made for this"
            " torch"
        ) from None
    module: ModuleType = torchvision
    return module


def random_resized_crop(width: int, height: int, rng: random.Random) -> Box:
    """The crop ``torchvision.transforms.RandomResizedCrop`` draws, with default scale and
    ratio: up to 10 tries at a random area and aspect, then the central crop."""
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(*_SCALE)
        aspect = math.exp(rng.uniform(*_LOG_RATIO))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    ratio = width / height
    if ratio < 3 / 4:
        w, h = width, round(width / (3 / 4))
    elif ratio > 4 / 3:
        w, h = round(height * (4 / 3)), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def center_crop(width: int, height: int, image_size: int) -> Box:
    """The region ``Resize(image_size * 256 / 224)`` + ``CenterCrop(image_size)`` keep, in the
    original image's pixels."""
    side = max(1, round(min(width, height) * 224 / 256))
    side = min(side, width, height)
    return (height - side) // 2, (width - side) // 2, side, side


class ImageFileDataset(Dataset[tuple[torch.Tensor, int]]):
    """Image files decoded, cropped, resized and normalised on every access."""

    def __init__(
        self,
        samples: Sequence[Sample],
        image_size: int,
        train: bool,
        decoder: str = "pil",
        seed: int = 0,
    ) -> None:
        self.paths = [path for path, _ in samples]
        self.labels = [label for _, label in samples]
        self.image_size = image_size
        self.train = train
        self.decoder = decoder
        self.seed = seed

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path = self.paths[index]
        rng = random.Random(self.seed * 1_000_003 + index) if self.train else None
        try:
            if self.decoder == "torchvision":
                pixels = self._torchvision(path, rng)
            else:
                pixels = self._pil(path, rng)
        except (OSError, ValueError, RuntimeError, SyntaxError) as exc:
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise UnreadableImageError(
                f"image {path!r} cannot be decoded ({reason}): remove or replace the file"
            ) from None
        if rng is not None and rng.random() < 0.5:
            pixels = pixels.flip(-1)
        x = (pixels.float().div_(255.0) - _MEAN) / _STD
        return x, self.labels[index]

    def _box(self, width: int, height: int, rng: random.Random | None) -> Box:
        if rng is None:
            return center_crop(width, height, self.image_size)
        return random_resized_crop(width, height, rng)

    def _pil(self, path: str, rng: random.Random | None) -> torch.Tensor:
        with Image.open(path) as image:
            rgb = image.convert("RGB")  # decodes; a truncated file raises here
        top, left, h, w = self._box(rgb.width, rgb.height, rng)
        size = (self.image_size, self.image_size)
        # PIL's bilinear resize of a box filters like torchvision's antialias=True.
        resized = rgb.resize(size, Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
        return torch.from_numpy(np.array(resized)).permute(2, 0, 1)

    def _torchvision(self, path: str, rng: random.Random | None) -> torch.Tensor:
        from torchvision.io import ImageReadMode, decode_image, read_file
        from torchvision.transforms.v2.functional import resized_crop

        pixels = decode_image(read_file(path), mode=ImageReadMode.RGB)
        top, left, h, w = self._box(pixels.shape[2], pixels.shape[1], rng)
        size = [self.image_size, self.image_size]
        cropped: torch.Tensor = resized_crop(pixels, top, left, h, w, size, antialias=True)
        return cropped


def find_images(
    root: Path, val_fraction: float, seed: int
) -> tuple[list[str], list[Sample], list[Sample]]:
    """The classes, training and validation samples under ``root``: ``train/`` and ``val/``
    when both are there, else the class folders split per class (``val_fraction`` of each
    class, drawn with ``seed``; ``train/`` alone is split the same way)."""
    if not root.is_dir():
        raise ValueError(f"root = {str(root)!r}: no such folder; give the image folder's path")
    train_dir, val_dir = root / "train", root / "val"
    if train_dir.is_dir() and val_dir.is_dir():
        classes, train = _class_folders(train_dir)
        val_classes, val_files = _class_folders(val_dir)
        unknown = sorted(set(val_classes) - set(classes))
        if unknown:
            raise ValueError(
                f"root = {str(root)!r}: val/ has class folder {unknown[0]!r} that train/ lacks;"
                " give both the same class folders"
            )
        index = {name: i for i, name in enumerate(classes)}
        val = [(path, index[val_classes[label]]) for path, label in val_files]
        return classes, train, val
    if val_dir.is_dir():
        raise ValueError(
            f"root = {str(root)!r}: has val/ but no train/; add train/ beside it, or put the"
            " class folders directly in root"
        )
    classes, samples = _class_folders(train_dir if train_dir.is_dir() else root)
    train, val = split_per_class(samples, len(classes), val_fraction, seed)
    if not val:
        raise ValueError(
            f"root = {str(root)!r}: val_fraction = {val_fraction} leaves no validation images;"
            " raise it or add a val/ folder"
        )
    return classes, train, val


def _class_folders(folder: Path) -> tuple[list[str], list[Sample]]:
    """Class names (sorted, as ImageFolder numbers them) and every image below each."""
    layout = f"{folder}/<class>/<image> with one of {', '.join(IMAGE_EXTENSIONS)}"
    try:
        entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
    except OSError as exc:
        raise ValueError(f"cannot read folder {str(folder)!r}: {exc.strerror}") from None
    classes = [e.name for e in entries if e.is_dir() and not e.name.startswith(".")]
    samples: list[Sample] = []
    # The root and every class folder are walked once, as themselves: a link that leads
    # back to one of them (a loop) is not followed again from inside another.
    tops = {_folder_id(folder), *(_folder_id(folder / name) for name in classes)}
    for label, name in enumerate(classes):
        own = _folder_id(folder / name)
        files = _images_below(folder / name, seen=tops - {own})
        if not files:
            raise ValueError(
                f"class folder {str(folder / name)!r} holds no images ({layout}); add images"
                " or remove the folder"
            )
        samples += [(path, label) for path in files]
    if not classes:
        raise ValueError(
            f"root = {str(folder)!r} has no class folders; lay the images out as {layout}"
        )
    if len(classes) < 2:
        raise ValueError(
            f"root = {str(folder)!r} has one class ({classes[0]!r}): a classifier needs at"
            " least 2 class folders"
        )
    return classes, samples


def _folder_id(path: Path | str) -> tuple[int, int]:
    info = os.stat(path)
    return info.st_dev, info.st_ino


def _images_below(folder: Path, seen: set[tuple[int, int]]) -> list[str]:
    """The image files under ``folder``, in a stable order. Symlinked folders are followed
    (class folders often link to data kept elsewhere), each real folder once and none in
    ``seen``: a link back up the tree would otherwise be walked for ever."""
    found = []
    seen = set(seen)
    for directory, subfolders, files in os.walk(folder, followlinks=True):
        here = _folder_id(directory)
        if here in seen:
            subfolders.clear()  # met before, through another path: a loop, or a second link
            continue
        seen.add(here)
        subfolders.sort()
        found += [
            os.path.join(directory, name)
            for name in sorted(files)
            if name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith(".")
        ]
    return found


def split_per_class(
    samples: Sequence[Sample], n_classes: int, fraction: float, seed: int
) -> tuple[list[Sample], list[Sample]]:
    """``fraction`` of each class's samples (rounded; at least one of a class of two or more)
    for validation, drawn with ``seed``; the rest for training. Both keep the files' order."""
    rng = np.random.default_rng(seed)
    by_class: list[list[int]] = [[] for _ in range(n_classes)]
    for i, (_, label) in enumerate(samples):
        by_class[label].append(i)
    held: set[int] = set()
    for members in by_class:
        n_val = min(len(members) - 1, max(1, round(len(members) * fraction)))
        held.update(int(i) for i in rng.permutation(members)[:n_val])
    train = [s for i, s in enumerate(samples) if i not in held]
    val = [s for i, s in enumerate(samples) if i in held]
    return train, val


def _subset_per_class(samples: list[Sample], size: int, seed: int) -> list[Sample]:
    """At most ``size`` of ``samples``, spread over the classes as the whole set is."""
    if len(samples) <= size:
        return samples
    rng = np.random.default_rng(seed)
    keep = sorted(int(i) for i in rng.permutation(len(samples))[:size])
    return [samples[i] for i in keep]


def model_factory(name: str, num_classes: int) -> Callable[[], nn.Module]:
    """``small-cnn`` (built in), or a torchvision classification model by name, randomly
    initialised (nothing is downloaded)."""
    if name == "small-cnn":
        return functools.partial(SmallCNN, num_classes, 16)
    torchvision = load_torchvision(f"model = {name!r}")
    names = torchvision.models.list_models(module=torchvision.models)
    if name not in names:
        raise ValueError(
            f"model = {name!r}: not a torchvision classification model; use 'small-cnn' or"
            f" one of torchvision.models.list_models() (resnet18, resnet50, mobilenet_v3_large,"
            f" efficientnet_b0, ...: {len(names)} names)"
        )
    return functools.partial(
        torchvision.models.get_model, name, weights=None, num_classes=num_classes
    )


# The options' rules (a worker builds what the study stores: see `check_options`).
OPTION_RULES = {
    "val_fraction": Range(0, 0.5, integer=False, low_open=True),
    "val_size": Range(1, 10_000_000),
    "image_size": Range(8, 4096),
    "seed": Range(0, 2**32 - 1),
}


def image_folder(
    root: str,
    val_fraction: float = 0.1,
    val_size: int = 2048,
    image_size: int = 224,
    model: str = "resnet18",
    decoder: str = "auto",
    seed: int = 0,
) -> Workload:
    """Build the ``image-folder`` workload from the images under ``root`` (see the module)."""
    if not isinstance(root, str) or not root:
        raise ValueError(f"root = {root!r}: give the image folder's path as a string")
    check_options(locals(), OPTION_RULES)
    if decoder not in DECODERS:
        raise ValueError(f"decoder = {decoder!r}: use one of {', '.join(DECODERS)}")
    if not isinstance(model, str) or not model:
        raise ValueError(f"model = {model!r}: use 'small-cnn' or a torchvision model name")
    if decoder == "torchvision":
        load_torchvision("decoder = 'torchvision'")
    elif decoder == "auto":
        try:
            load_torchvision("decoder = 'auto'")
            decoder = "torchvision"
        except ImportError:
            decoder = "pil"

    folder = Path(os.path.normpath(Path(root).expanduser().absolute()))
    classes, train, val = find_images(folder, val_fraction, seed)
    val = _subset_per_class(val, val_size, seed)
    make_model = model_factory(model, len(classes))
    options: dict[str, Any] = {
        "root": str(folder),
        "val_fraction": val_fraction,
        "val_size": val_size,
        "image_size": image_size,
        "model": model,
        "decoder": decoder,  # resolved: machines that decode differently do not compare
        "seed": seed,
    }
    return Workload(
        name="image-folder",
        train_dataset=ImageFileDataset(train, image_size, True, decoder, seed),
        val_dataset=ImageFileDataset(val, image_size, False, decoder, seed),
        make_model=make_model,
        base_lr=0.02 if model == "small-cnn" else 0.05,
        description=(
            f"{len(train)} training and {len(val)} validation images of {len(classes)} classes"
            f" under {folder}, RandomResizedCrop + flip at {image_size}px ({decoder} decoding);"
            f" {model}"
        ),
        options=options,
    )
