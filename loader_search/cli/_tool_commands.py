"""The commands around a search: ``doctor`` (what a search depends on, checked here) and
``make-images`` (a folder of generated JPEGs for the image-folder workload)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from loader_search.cli._console import console, print_checks, reports_errors, shown
from loader_search.cli._options import StorageOption
from loader_search.errors import UserError


@reports_errors
def doctor(
    config: Annotated[
        Path | None,
        typer.Argument(
            help="Study config (TOML): check its device, space and limits too.",
            show_default=False,
        ),
    ] = None,
    storage: StorageOption = None,
) -> None:
    """Check what a search depends on here: device and CUDA, CPUs, memory, /dev/shm against
    the space's largest batches in flight, the start method, and the storage.

    Exits 1 when a check fails, 0 otherwise (warnings included).
    """
    from loader_search.study import load_config

    cfg = load_config(config) if config is not None else None
    from loader_search.cli._doctor import diagnose  # torch: only once the config is known good
    from loader_search.workloads import load_workload

    workload = None
    if cfg is not None:
        with console.status(shown(f"building workload {cfg.workload}") + " ..."):
            workload = load_workload(cfg.workload, cfg.workload_options)
    checks = diagnose(cfg, storage, workload)
    print_checks(checks)
    if any(check.verdict == "fail" for check in checks):
        raise typer.Exit(1)


@reports_errors
def make_images(
    root: Annotated[Path, typer.Argument(help="Folder to write (train/ and val/ inside).")],
    classes: Annotated[int, typer.Option(help="Number of classes.")] = 10,
    train_per_class: Annotated[int, typer.Option(help="Training images per class.")] = 500,
    val_per_class: Annotated[int, typer.Option(help="Validation images per class.")] = 50,
    width: Annotated[int, typer.Option(help="Typical width in pixels (sizes vary ±20%).")] = 500,
    height: Annotated[int, typer.Option(help="Typical height in pixels.")] = 375,
    quality: Annotated[int, typer.Option(help="JPEG quality.")] = 90,
    seed: Annotated[int, typer.Option(help="Seed: the same seed writes the same images.")] = 0,
    jobs: Annotated[
        int | None,
        typer.Option(help="Processes writing images. Default: the CPUs this process may use."),
    ] = None,
) -> None:
    """Write a folder of generated JPEGs that load like ImageNet's (about 500x375, quality 90,
    a quarter portrait), for the image-folder workload: `root/train/<class>/*.jpg` and
    `root/val/<class>/*.jpg`. Nothing is downloaded; files already there are kept, so an
    interrupted run resumes.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    from loader_search.workloads.make_images import ImageSetSpec, make_image_folder

    try:
        spec = ImageSetSpec(
            classes=classes,
            train_per_class=train_per_class,
            val_per_class=val_per_class,
            width=width,
            height=height,
            quality=quality,
            seed=seed,
        )
    except ValueError as exc:
        raise UserError(f"make-images: {exc}") from None
    if jobs is not None and jobs < 1:
        raise UserError(f"--jobs {jobs}: give at least 1 process")
    columns = (BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress("writing images", *columns, console=console, transient=True) as progress:
        task = progress.add_task("images", total=spec.total)

        def advance(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        try:
            written = make_image_folder(root, spec, jobs=jobs, on_progress=advance)
        except OSError as exc:
            raise UserError(f"cannot write images under {str(root)!r}: {exc}") from None
    use = f'[workload] name = "image-folder", options = {{ root = "{root}" }}'
    console.print(
        shown(
            f"{root}: {written:,} images written, {spec.total - written:,} already there"
            f" ({spec.classes} classes, train/ and val/). Use it with: {use}"
        ),
        soft_wrap=True,
    )
