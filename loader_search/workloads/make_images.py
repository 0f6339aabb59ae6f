"""Generate an image folder that loads like ImageNet: JPEGs of varied sizes around 500x375 at
quality 90 (about 80 KB each), in ``train/<class>/`` and ``val/<class>/``. Nothing is
downloaded. The classes are learnable (each has its own smooth colour layout; an image is its
class's layout, shifted, mixed with another class's, plus grain), so validation loss means
something; what the loader pays per image (reading, decoding, cropping) is what real photos
cost.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image


@dataclass(frozen=True)
class ImageSetSpec:
    """What `make_image_folder` writes. Sizes vary by ±``size_jitter`` around ``width`` x
    ``height``, and a quarter of the images are portrait (width and height swapped)."""

    classes: int = 10
    train_per_class: int = 500
    val_per_class: int = 50
    width: int = 500
    height: int = 375
    size_jitter: float = 0.2
    quality: int = 90
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("classes", "train_per_class", "val_per_class", "width", "height"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} = {value!r}: must be a positive integer")
        if self.classes < 2:
            raise ValueError(f"classes = {self.classes}: a classifier needs at least 2")
        if min(self.width, self.height) < 16:
            raise ValueError(f"{self.width}x{self.height}: images must be at least 16x16")
        if not 0 <= self.size_jitter < 1:
            raise ValueError(f"size_jitter = {self.size_jitter!r}: must be in [0, 1)")
        if not 1 <= self.quality <= 95:
            raise ValueError(f"quality = {self.quality!r}: JPEG quality is 1 .. 95")

    @property
    def total(self) -> int:
        return self.classes * (self.train_per_class + self.val_per_class)


def make_image_folder(
    root: str | Path,
    spec: ImageSetSpec,
    *,
    jobs: int | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> int:
    """Write ``spec``'s images under ``root`` with ``jobs`` processes (default: the usable
    CPUs); returns how many were written. Files already there are kept, so an interrupted run
    resumes; each file appears whole (written aside, then renamed)."""
    root = Path(root)
    tasks = [
        (str(root / split / f"class_{label:03d}" / f"{index:06d}.jpg"), label, index, split)
        for split, per_class in (("train", spec.train_per_class), ("val", spec.val_per_class))
        for label in range(spec.classes)
        for index in range(per_class)
    ]
    todo = [task for task in tasks if not os.path.exists(task[0])]
    for folder in {os.path.dirname(task[0]) for task in todo}:
        os.makedirs(folder, exist_ok=True)
    done = len(tasks) - len(todo)
    if on_progress is not None:
        on_progress(done, len(tasks))
    jobs = jobs or len(os.sched_getaffinity(0))
    if not todo:
        return 0
    context = multiprocessing.get_context("fork")
    with context.Pool(jobs, initializer=_init_worker, initargs=(spec,)) as pool:
        for _ in pool.imap_unordered(_write_one, todo, chunksize=16):
            done += 1
            if on_progress is not None:
                on_progress(done, len(tasks))
    return len(todo)


_SPEC: ImageSetSpec | None = None
_LAYOUTS: np.ndarray | None = None


def _init_worker(spec: ImageSetSpec) -> None:
    global _SPEC, _LAYOUTS
    _SPEC = spec
    # Every class's layout: a coarse 4x4 colour grid, the same in every process (seeded).
    _LAYOUTS = np.random.default_rng(spec.seed).random((spec.classes, 4, 4, 3))


def _write_one(task: tuple[str, int, int, str]) -> None:
    path, label, index, split = task
    assert _SPEC is not None and _LAYOUTS is not None
    spec = _SPEC
    split_id = 0 if split == "train" else 1
    rng = np.random.default_rng([spec.seed, split_id, label, index])
    width, height = _size(spec, rng)
    pixels = _picture(_LAYOUTS, label, width, height, rng)
    partial = f"{path}.{os.getpid()}.part"
    Image.fromarray(pixels).save(partial, format="JPEG", quality=spec.quality)
    os.replace(partial, path)


def _size(spec: ImageSetSpec, rng: np.random.Generator) -> tuple[int, int]:
    scale = 1 + rng.uniform(-spec.size_jitter, spec.size_jitter)
    width = max(16, round(spec.width * scale * rng.uniform(0.9, 1.1)))
    height = max(16, round(spec.height * scale * rng.uniform(0.9, 1.1)))
    return (height, width) if rng.random() < 0.25 else (width, height)


def _picture(
    layouts: np.ndarray, label: int, width: int, height: int, rng: np.random.Generator
) -> np.ndarray:
    """The class's layout, shifted and mixed with another class's, plus fine grain."""
    other = int(rng.integers(len(layouts)))
    coarse = 0.65 * layouts[label] + 0.35 * np.roll(layouts[other], int(rng.integers(4)), 0)
    small = Image.fromarray((coarse * 255).astype(np.uint8))
    # Up-scaled a little beyond the frame, then cut at a random offset: shifted layouts.
    big = small.resize((width * 5 // 4, height * 5 // 4), Image.Resampling.BICUBIC)
    dx, dy = int(rng.integers(width // 4 + 1)), int(rng.integers(height // 4 + 1))
    base = np.array(big.crop((dx, dy, dx + width, dy + height)), dtype=np.float32)
    base += 12.0 * rng.standard_normal((height, width, 1), dtype=np.float32)
    base += 6.0 * rng.standard_normal((height, width, 3), dtype=np.float32)
    return np.clip(base, 0, 255).astype(np.uint8)
