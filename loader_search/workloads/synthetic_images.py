"""``synthetic-images``: a generated, learnable image-classification set held as encoded bytes.

Each class is a smooth random colour pattern; a sample is its class pattern, randomly shifted,
blended with another pattern and noise, then stored as PNG (or JPEG) bytes. ``__getitem__``
decodes and augments (random crop with padding, horizontal flip, normalise), which costs real
CPU time per sample, as decoding files does in a real pipeline. At 32x32 on a small CPU the
loading cost is comparable to the model's, which is what makes loader settings matter.
"""

from __future__ import annotations

import functools
import io
import time
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.utils.data import Dataset

from loader_search._rules import Range, check_options
from loader_search.workloads._base import Workload

_MEAN = torch.tensor([0.5, 0.5, 0.5]).view(3, 1, 1)
_STD = torch.tensor([0.25, 0.25, 0.25]).view(3, 1, 1)


class EncodedImageDataset(Dataset[tuple[torch.Tensor, int]]):
    """Images held as encoded bytes; decoded and augmented on every access.

    The augmentation of sample ``i`` is drawn from a generator seeded by ``(seed, i)``, not from
    the loading process's RNG: loader settings then change how fast a model trains, never what
    it learns, and trials differing only in ``num_workers`` reach the same validation loss.
    """

    def __init__(
        self,
        images: list[bytes],
        labels: list[int],
        augment: bool,
        pad: int = 4,
        seed: int = 0,
        size: int | None = None,
    ) -> None:
        self.images = images
        self.size = size  # images stored larger are resized to it
        self.labels = labels
        self.augment = augment
        self.pad = pad
        self.seed = seed

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        with Image.open(io.BytesIO(self.images[index])) as image:
            rgb = image.convert("RGB")
        if self.size is not None and rgb.size != (self.size, self.size):
            rgb = rgb.resize((self.size, self.size), Image.Resampling.BILINEAR)  # a large one
        array = np.array(rgb)
        x = torch.from_numpy(array).permute(2, 0, 1).float().div_(255.0)
        if self.augment:
            rng = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
            _, h, w = x.shape
            x = nn.functional.pad(x.unsqueeze(0), [self.pad] * 4, mode="reflect").squeeze(0)
            top, left = torch.randint(0, 2 * self.pad + 1, (2,), generator=rng).tolist()
            x = x[:, top : top + h, left : left + w]
            if torch.rand((), generator=rng) < 0.5:
                x = x.flip(2)
        x = (x - _MEAN) / _STD
        return x.contiguous(), self.labels[index]


def _class_patterns(rng: np.random.Generator, n: int, size: int) -> np.ndarray:
    """``n`` smooth colour patterns in [0, 1], shape (n, size, size, 3)."""
    coarse = rng.random((n, 3, 4, 4)).astype(np.float32)
    smooth = nn.functional.interpolate(
        torch.from_numpy(coarse), size=(size, size), mode="bicubic", align_corners=False
    )
    return smooth.clamp(0, 1).permute(0, 2, 3, 1).numpy()


def _encode(pixels: np.ndarray, encoding: str) -> bytes:
    buffer = io.BytesIO()
    image = Image.fromarray(pixels)
    if encoding == "png":
        image.save(buffer, format="PNG")
    else:
        image.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def enlarge(
    images: list[bytes], fraction: float, scale: int, seed: int, encoding: str
) -> list[bytes]:
    """``images`` with ``fraction`` of them (drawn with ``seed``, apart from the data's own
    generator) stored ``scale`` times larger, with fresh grain at that size: decoding and
    resizing them back costs about ``scale**2`` times as much, as large photos among small
    ones do."""
    if not fraction:
        return images
    rng = np.random.default_rng([seed, 7])
    chosen = rng.random(len(images)) < fraction
    out = list(images)
    for i in np.flatnonzero(chosen):
        with Image.open(io.BytesIO(images[i])) as image:
            big = image.convert("RGB").resize(
                (image.width * scale, image.height * scale), Image.Resampling.BICUBIC
            )
        pixels = np.asarray(big, dtype=np.float32) + rng.normal(0, 8, (big.height, big.width, 3))
        out[i] = _encode(np.clip(pixels, 0, 255).astype(np.uint8), encoding)
    return out


def make_images(
    n: int, patterns: np.ndarray, rng: np.random.Generator, noise: float, encoding: str
) -> tuple[list[bytes], list[int]]:
    """``n`` encoded samples: shifted class pattern + a distractor pattern + Gaussian noise."""
    n_classes, size = patterns.shape[0], patterns.shape[1]
    labels = rng.integers(0, n_classes, size=n)
    distractors = rng.integers(0, n_classes, size=n)
    shifts = rng.integers(-size // 4, size // 4 + 1, size=(n, 2))
    images = []
    for label, other, (dy, dx) in zip(labels, distractors, shifts, strict=True):
        signal = np.roll(patterns[label], (int(dy), int(dx)), axis=(0, 1))
        x = 0.65 * signal + 0.35 * patterns[other]
        x = x + rng.normal(0.0, noise, size=x.shape)
        pixels = (np.clip(x, 0, 1) * 255).astype(np.uint8)
        images.append(_encode(pixels, encoding))
    return images, [int(label) for label in labels]


class SmallCNN(nn.Module):
    """Three conv layers and a linear head: small, but a real convolutional workload.

    ``device_us_per_sample`` makes every training forward pass also wait that long per
    sample with the GIL released (``time.sleep``), as a GPU step keeps the training process
    waiting while the CPUs are free: a stand-in for the loader-bound regime of a GPU server
    on a CPU-only machine. It is not a GPU: the wait costs no CPU and never varies.
    ``device_memory_mb`` likewise stands in for a device's memory: a training batch whose
    convolution and BatchNorm outputs (what backward keeps) exceed it raises torch's
    out-of-memory error, as a GPU of that size would. It is not a memory limit: nothing else
    is counted, and the host's memory is untouched.
    """

    def __init__(
        self,
        num_classes: int,
        width: int = 8,
        device_us_per_sample: float = 0.0,
        device_memory_mb: float = 0.0,
    ) -> None:
        super().__init__()
        self.wait_s_per_sample = device_us_per_sample / 1e6
        self.memory_bytes = int(device_memory_mb * 2**20)
        self.activation_bytes = 0
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(2 * width, num_classes)
        if self.memory_bytes:
            for layer in self.features:
                if isinstance(layer, (nn.Conv2d, nn.BatchNorm2d)):  # what backward keeps
                    layer.register_forward_hook(self._count)

    def _count(self, layer: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        self.activation_bytes += output.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.wait_s_per_sample:
            time.sleep(self.wait_s_per_sample * x.shape[0])  # releases the GIL
        self.activation_bytes = 0
        features = self.features(x)
        if self.training and self.activation_bytes > self.memory_bytes > 0:
            raise torch.OutOfMemoryError(
                f"stand-in device memory: a batch of {x.shape[0]} keeps"
                f" {self.activation_bytes / 2**20:.1f} MiB of activations for backward, above"
                f" device_memory_mb = {self.memory_bytes / 2**20:g}"
            )
        logits: torch.Tensor = self.head(features.flatten(1))
        return logits


# The options' rules: far above any real use, low enough that a value changed in a shared
# database (a worker builds what the study stores) cannot take a machine's memory or hours.
OPTION_RULES = {
    "image_size": Range(8, 1024),
    "train_size": Range(1, 1_000_000),
    "val_size": Range(1, 1_000_000),
    "num_classes": Range(2, 10_000),
    "width": Range(1, 1024),
    "noise": Range(0, 1, integer=False),
    "seed": Range(0, 2**32 - 1),
    "device_us_per_sample": Range(0, 1e6, integer=False),  # microseconds
    "device_memory_mb": Range(0, 1e7, integer=False),  # 0: no stand-in memory
    "slow_fraction": Range(0, 1, integer=False),
    "slow_scale": Range(2, 32),
}
MAX_PIXEL_BYTES = 8 * 2**30  # what the generated images may hold, decoded


def synthetic_images(
    image_size: int = 32,
    train_size: int = 8192,
    val_size: int = 1024,
    num_classes: int = 10,
    noise: float = 0.25,
    encoding: str = "png",
    width: int = 8,
    seed: int = 0,
    device_us_per_sample: float = 0.0,
    device_memory_mb: float = 0.0,
    slow_fraction: float = 0.0,
    slow_scale: int = 4,
) -> Workload:
    """Build the ``synthetic-images`` workload (data are generated, never downloaded)."""
    check_options(locals(), OPTION_RULES)
    if encoding not in ("png", "jpeg"):
        raise ValueError(f"encoding = {encoding!r}: use 'png' or 'jpeg'")
    pixels = (train_size + val_size) * image_size**2 * 3
    if pixels > MAX_PIXEL_BYTES:
        raise ValueError(
            f"train_size + val_size = {train_size + val_size} images of {image_size}x{image_size}"
            f" are {pixels / 2**30:.1f} GiB of pixels to generate, above"
            f" {MAX_PIXEL_BYTES // 2**30} GiB: use fewer or smaller images"
        )
    rng = np.random.default_rng(seed)
    patterns = _class_patterns(rng, num_classes, image_size)
    train = make_images(train_size, patterns, rng, noise, encoding)
    val = make_images(val_size, patterns, rng, noise, encoding)
    train = (enlarge(train[0], slow_fraction, slow_scale, seed, encoding), train[1])
    options: dict[str, Any] = {
        "image_size": image_size,
        "train_size": train_size,
        "val_size": val_size,
        "num_classes": num_classes,
        "noise": noise,
        "encoding": encoding,
        "width": width,
        "seed": seed,
    }
    stand_in = ""
    if device_us_per_sample:  # only when set: studies without it keep their fingerprint
        options["device_us_per_sample"] = device_us_per_sample
        stand_in = f"; a {device_us_per_sample:g} us/sample GIL-free wait stands in for a GPU"
    if slow_fraction:  # likewise
        options["slow_fraction"] = slow_fraction
        options["slow_scale"] = slow_scale
        stand_in += f"; {slow_fraction:.0%} of training images stored {slow_scale}x larger"
    if device_memory_mb:  # likewise
        options["device_memory_mb"] = device_memory_mb
        stand_in += f"; {device_memory_mb:g} MB of activations stand in for a GPU's memory"
    return Workload(
        name="synthetic-images",
        train_dataset=EncodedImageDataset(
            *train, augment=True, pad=max(1, image_size // 8), seed=seed, size=image_size
        ),
        val_dataset=EncodedImageDataset(*val, augment=False),
        make_model=functools.partial(
            SmallCNN, num_classes, width, device_us_per_sample, device_memory_mb
        ),
        # Measured on this workload: at 0.05 the validation loss after 8k samples varied by up
        # to 75% between seeds (chaotic training); at 0.02 by 7-20%, with batch size's effect
        # well above that spread.
        base_lr=0.02,
        description=(
            f"{train_size} generated {image_size}x{image_size} {encoding.upper()} images,"
            f" {num_classes} classes, decoded + augmented per sample; 3-conv CNN{stand_in}"
        ),
        options=options,
    )
