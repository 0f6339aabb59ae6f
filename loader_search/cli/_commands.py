"""The ``loader-search`` commands. A thin layer: parse options, call a service function, render.

What is printed (errors included) is drawn by `loader_search.cli._console`; what is decided
lives in the layers below (study, report, team). Options that several commands share are
`Annotated` aliases defined once, so their help texts agree.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from loader_search.cli._console import (
    DEBUG_ENV,
    StudyRow,
    console,
    live_progress,
    print_checks,
    print_dashboard_ready,
    print_studies,
    print_study_ready,
    report_destination,
    reports_errors,
    shown,
    write_report,
)

# Heavy modules (torch, optuna) are imported inside the commands: `--help` and input errors
# answer at once.
from loader_search.cli._summary import print_summaries, print_summary
from loader_search.errors import UserError
from loader_search.team._masking import mask_url
from loader_search.team._storage import STORAGE_ENV

if TYPE_CHECKING:
    from loader_search.study._recommend import Recommendation

app = typer.Typer(
    name="loader-search",
    help=(
        "Find the PyTorch DataLoader settings (batch_size, num_workers, prefetch_factor,"
        " pin_memory, persistent_workers, torch threads) that make real training fast without"
        " making the model worse. Every trial is a real training run, scored on throughput"
        " and validation loss."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ConfigArgument = Annotated[
    Path, typer.Argument(help="Study config file (TOML), e.g. studies/quickstart.toml.")
]
StudyArgument = Annotated[str, typer.Argument(help="Study name (see `loader-search studies`).")]
StorageOption = Annotated[
    str | None,
    typer.Option(
        "--storage",
        help=(
            f"Database URL (SQLAlchemy form). Default: ${STORAGE_ENV}, else"
            " sqlite:///loader_search.db in the current directory."
        ),
        show_default=False,
    ),
]
StudyNameOption = Annotated[
    str | None,
    typer.Option(
        "--study-name",
        help="Study name. Default: \\[study] name, else the config file's name.",
    ),
]
BudgetOption = Annotated[
    int | None,
    typer.Option(
        "--n-trials",
        help=(
            "Total trials of the study, stored with it and shared by all workers. Default: a"
            " continued study's stored budget; for a new study, \\[study] trials."
        ),
    ),
]
CpusOption = Annotated[
    str | None,
    typer.Option(
        "--cpus",
        help=(
            "Pin this process's trials to these CPUs (e.g. 0-7 or 0,2,4). Pinned workers with"
            " disjoint CPU sets (and, on a GPU machine, each its own --gpu) train side by side;"
            " unpinned, one trial runs per host at a time."
        ),
        show_default=False,
    ),
]
GpuOption = Annotated[
    int | None,
    typer.Option("--gpu", help="Pin this process's trials to this GPU index.", show_default=False),
]
MixedOption = Annotated[
    bool,
    typer.Option(
        "--allow-mixed-hardware",
        help=(
            "Join a study whose first trials ran on another hardware class; results are then"
            " reported per class."
        ),
    ),
]
LossToleranceOption = Annotated[
    float | None,
    typer.Option(
        "--loss-tolerance",
        help="Relative val-loss slack for the recommendation. Default: the study's (0.05).",
    ),
]


_MAX_CPU = 8191  # Linux's largest CPU number (NR_CPUS is 8192 at most)


def _parse_cpus(text: str | None) -> tuple[int, ...] | None:
    """``0-3,8`` -> (0, 1, 2, 3, 8)."""
    if text is None:
        return None
    shown = text if len(text) <= 40 else text[:40] + "..."
    wrong = UserError(f"--cpus {shown!r}: use CPU numbers and ranges, e.g. 0-3 or 0,2,4")
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            first, last = int(low), int(high or low)
            if max(first, last) > _MAX_CPU:
                raise UserError(
                    f"--cpus {shown!r}: CPU {max(first, last)} does not exist (Linux numbers"
                    f" them 0 to {_MAX_CPU} at most); give the CPUs of this machine, e.g. 0-3"
                )
            cpus.update(range(first, last + 1))
    except ValueError:
        raise wrong from None
    if not cpus or min(cpus) < 0:
        raise wrong
    return tuple(sorted(cpus))


@app.callback()
def _root(
    debug: Annotated[
        bool, typer.Option("--debug", help="Show full tracebacks for errors.")
    ] = False,
) -> None:
    if debug:
        os.environ[DEBUG_ENV] = "1"


@app.command()
@reports_errors
def run(
    config: ConfigArgument,
    storage: StorageOption = None,
    study_name: StudyNameOption = None,
    n_trials: BudgetOption = None,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout",
            help="Stop starting new trials after this many seconds. Default: \\[study] timeout_s.",
        ),
    ] = None,
    cpus: CpusOption = None,
    gpu: GpuOption = None,
    allow_mixed_hardware: MixedOption = False,
) -> None:
    """Run (or continue) a study: every trial trains the workload with one loader setting.

    The first trial of a new study is the baseline (the config's batch size, num_workers=0).
    Running again with the same study name continues it until its trial budget is used; then
    the best candidates and the baseline are measured again (beyond the budget) so that the
    recommendation rests on medians. `loader-search worker` processes on other machines can
    join it meanwhile.
    """
    from loader_search.study._config import load_config

    cfg = load_config(config).with_overrides(name=study_name, timeout_s=timeout)
    pinned = _parse_cpus(cpus)
    from loader_search.study._session import run_study  # torch: only once the config is known good

    with live_progress(interruptible=True) as reporter:
        summary = run_study(
            cfg,
            storage=storage,
            n_trials=n_trials,
            reporter=reporter,
            cpus=pinned,
            gpu=gpu,
            allow_mixed_hardware=allow_mixed_hardware,
        )
    print_summary(summary)


@app.command()
@reports_errors
def init(
    config: ConfigArgument,
    storage: StorageOption = None,
    study_name: StudyNameOption = None,
    n_trials: BudgetOption = None,
) -> None:
    """Create the schema and the study, run nothing: then start `worker`s on any machine.

    Safe to repeat: an existing study is continued (its budget updated with --n-trials).
    """
    from loader_search.study._config import load_config
    from loader_search.team._storage import check_shared, resolve_storage_url

    cfg = load_config(config).with_overrides(name=study_name)
    check_shared(resolve_storage_url(storage), "init")
    from loader_search.study._session import init_study

    with live_progress() as reporter:
        info = init_study(cfg, storage=storage, n_trials=n_trials, reporter=reporter)
    print_study_ready(info)


@app.command()
@reports_errors
def worker(
    study: Annotated[str, typer.Argument(help="Name of an existing study to work on.")],
    storage: StorageOption = None,
    n_trials: Annotated[
        int | None,
        typer.Option(
            "--n-trials",
            help=(
                "Run at most this many trials here. Default: until the study's budget is used"
                " and its candidates are confirmed."
            ),
            show_default=False,
        ),
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout",
            help="Stop starting new trials after this many seconds.",
            show_default=False,
        ),
    ] = None,
    cpus: CpusOption = None,
    gpu: GpuOption = None,
    allow_mixed_hardware: MixedOption = False,
    allow_plugin: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-plugin",
            help=(
                "Run this plug-in workload ('pkg.mod:factory' or 'path/file.py:factory') if"
                " the study names it; repeat for more. Without it a worker runs only built-in"
                " workloads (also: LOADER_SEARCH_ALLOW_PLUGINS, comma-separated)."
            ),
            show_default=False,
        ),
    ] = None,
) -> None:
    """Join a study created by `run` (on this or another machine) and run its trials.

    The study's config and trial budget come from the database: start as many workers as
    you like, on as many machines; together they run exactly the budget. A trial whose
    worker dies is failed after the study's grace period and retried with the same settings.
    Ctrl-C (or SIGTERM) ends the running trial as interrupted and exits.

    Whoever can write to the database chooses the study's workload, so a worker runs a
    plug-in (code) only if this machine allows it with --allow-plugin.
    """
    from loader_search.study._session import run_worker

    with live_progress(interruptible=True) as reporter:
        summary = run_worker(
            study,
            storage=storage,
            n_trials=n_trials,
            timeout_s=timeout,
            reporter=reporter,
            cpus=_parse_cpus(cpus),
            gpu=gpu,
            allow_mixed_hardware=allow_mixed_hardware,
            allow_plugins=tuple(allow_plugin or ()),
        )
    print_summary(summary)


@app.command()
@reports_errors
def best(
    study: StudyArgument,
    storage: StorageOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
    loss_tolerance: LossToleranceOption = None,
) -> None:
    """Show a study's Pareto front (throughput vs validation loss) and the recommendation."""
    from loader_search.study._open import open_existing_study
    from loader_search.study._recommend import summaries

    existing = open_existing_study(study, storage, loss_tolerance=loss_tolerance)
    print_summaries(summaries(existing.study, existing.loss_tolerance), as_json=as_json)


REPORT_FORMATS = ("html", "json")


@app.command()
@reports_errors
def report(
    study: StudyArgument,
    storage: StorageOption = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help=(
                "File to write; '-' for standard output. Default: STUDY-report.html for html,"
                " standard output for json."
            ),
            show_default=False,
        ),
    ] = None,
    fmt: Annotated[str, typer.Option("--format", help="html or json.")] = "html",
    loss_tolerance: LossToleranceOption = None,
    hardware_class: Annotated[
        str | None,
        typer.Option(
            "--hardware-class",
            help="For a study run on several machines: report the trials of this class.",
        ),
    ] = None,
) -> None:
    """Write a study's report: one HTML file that works offline (or its data as JSON).

    Pareto front, recommendation, hypervolume history, parameter importances, throughput by
    workers x prefetch, data-wait, memory, failures and hardware. The JSON holds the same
    data, with `best --json`'s output under "summary".
    """
    from loader_search.study._open import open_existing_study

    if fmt not in REPORT_FORMATS:
        raise UserError(f"--format {fmt!r}: use html or json")
    destination = report_destination(output, fmt, study)  # checked before the slow part
    existing = open_existing_study(study, storage, loss_tolerance=loss_tolerance)
    loaded, tolerance, classes = existing.study, existing.loss_tolerance, existing.hardware_classes
    if hardware_class is not None and hardware_class not in classes:
        raise UserError(
            f"--hardware-class {hardware_class!r}: study {study!r} has no trials of it"
            f" (its classes: {', '.join(classes) or 'none recorded'})"
        )
    if hardware_class is None and len(classes) > 1:
        raise UserError(
            f"study {study!r} ran on several hardware classes ({', '.join(classes)}) whose"
            " throughputs do not compare: pick one with --hardware-class"
        )

    import optuna

    from loader_search.report._collect import collect

    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "study created" lines
    try:
        data = collect(loaded, tolerance, hardware_class)
    finally:
        optuna.logging.set_verbosity(verbosity)
    write_report(data, fmt, destination, study)


@app.command()
@reports_errors
def dashboard(
    storage: StorageOption = None,
    host: Annotated[
        str,
        typer.Option(
            "--host", help="Address to listen on; 0.0.0.0 exposes it to the network (no login)."
        ),
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option("--port", help="Port to listen on; 0 picks a free one.")
    ] = 8080,
    allow_host: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-host",
            help="A Host header to answer (repeat for more); others get 403. Default: the"
            " --host address (and its loopback names), or any with --host 0.0.0.0.",
        ),
    ] = None,
) -> None:
    """Start optuna-dashboard on the studies' storage (Ctrl-C to stop).

    Objective names and every measured trial attribute are shown; infeasible trials are never
    on its Pareto front. On a remote machine: ssh -L 8080:127.0.0.1:8080 HOST, then open
    http://127.0.0.1:8080/dashboard/ locally. In a container that publishes its port on the
    host's 127.0.0.1: --host 0.0.0.0 --allow-host 127.0.0.1 --allow-host localhost.
    """
    from loader_search.report._dashboard import serve
    from loader_search.team._storage import open_storage, resolve_storage_url

    if not 0 <= port <= 65535:
        raise UserError(f"--port {port}: must be between 1 and 65535 (0: any free port)")
    for name in allow_host or ():
        bare = name.strip("[]")
        if not bare or any(c.isspace() or c in "/@" for c in bare) or bare.count(":") == 1:
            raise UserError(
                f"--allow-host {name!r}: give a host name or address as a browser sends it,"
                " without scheme, port or path (e.g. --allow-host localhost)"
            )
    url = resolve_storage_url(storage)
    rdb = open_storage(url, must_exist=True)
    serve(
        rdb,
        host,
        port,
        on_ready=lambda address: print_dashboard_ready(mask_url(url), address, host),
        allowed_hosts=allow_host or (),
    )
    console.print("Dashboard stopped.")


@app.command()
@reports_errors
def studies(storage: StorageOption = None) -> None:
    """List the studies in a storage with their trial counts and recommendations."""
    import optuna
    from optuna.trial import TrialState

    from loader_search.study._config import StudyConfig
    from loader_search.study._keys import BUDGET_ATTR, DIRECTIONS, study_budget, study_tolerance
    from loader_search.study._recommend import hardware_classes, summarize
    from loader_search.team._storage import open_storage, resolve_storage_url

    url = resolve_storage_url(storage)
    rdb = open_storage(url, must_exist=True)
    rows = []
    for name in optuna.study.get_all_study_names(rdb):
        study = optuna.load_study(study_name=name, storage=rdb)
        trials = study.get_trials(deepcopy=False)
        throughput: float | None = None
        speedup: str | None = "per machine: see best"
        budget = study.user_attrs.get(BUDGET_ATTR)
        try:
            if len(study.directions) != len(DIRECTIONS):
                speedup = "not a loader-search study"
            elif len(hardware_classes(study)) <= 1:
                tolerance = study_tolerance(name, study.user_attrs, StudyConfig().loss_tolerance)
                summary = summarize(study, tolerance)
                rec = summary.recommended
                throughput = rec.point.throughput if rec else None
                speedup = _short_speedup(rec) if rec else None
            budget = study_budget(name, study.user_attrs, 1) if budget is not None else None
        except UserError:
            # One study's damaged settings must not hide the others: marked, and `best`
            # says what is wrong and how to fix it.
            throughput, speedup, budget = None, f"damaged settings: see `best {name}`", None
        rows.append(
            StudyRow(
                name=name,
                complete=sum(t.state == TrialState.COMPLETE for t in trials),
                failed=sum(t.state == TrialState.FAIL for t in trials),
                running=sum(t.state == TrialState.RUNNING for t in trials),
                budget=budget,
                recommended_throughput=throughput,
                speedup=speedup,
            )
        )
    print_studies(mask_url(url), rows)


def _short_speedup(rec: Recommendation) -> str:
    """The recommendation's speedup for one table cell."""
    if rec.point.is_baseline:
        return "keep the baseline"
    if rec.paired is None:
        return f"{rec.speedup_vs_baseline:.2f}x (unconfirmed)" if rec.speedup_vs_baseline else "-"
    interval = f"95% CI {rec.paired.low:.2f}-{rec.paired.high:.2f}"
    if rec.verdict == "no_reliable_gain":
        return f"no reliable gain ({interval})"
    return f"{rec.paired.estimate:.2f}x ({interval})"


@app.command()
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
    from loader_search.study._config import load_config

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


@app.command("make-images")
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


def main() -> int:
    """Console-script entry point."""
    app(prog_name="loader-search")
    return 0
