"""The report's data, computed from a small real study: real training trials run by the CLI,
plus an infeasible and a failed trial added through Optuna's own storage API."""

from __future__ import annotations

import itertools
import json
import re
from copy import deepcopy
from pathlib import Path

import numpy as np
import optuna
import pytest
from optuna.trial import TrialState
from plotly.offline import get_plotlyjs
from typer.testing import CliRunner

from loader_search.cli import app
from loader_search.reports import ReportData, collect, render
from loader_search.reports._collect import importances
from loader_search.reports._data import INPUT_BOUND_THRESHOLD
from loader_search.reports._html import PLOT_IDS
from loader_search.study import HARDWARE_ATTR, HARDWARE_CLASS_ATTR, PARAMS_ATTR, points_of
from tests.conftest import TINY_CONFIG, invoke, run_cli

# The added infeasible trial's "measured" values would dominate every real trial: if it
# leaked onto the front, into the hypervolume or the recommendation, the tests below fail.
INFEASIBLE_VALUES = [1e9, 1e-6]
TOLERANCE = 0.05
FAKE_HARDWARE = {"cpu_model": "test CPU", "usable_cpus": 2}


def build_study(folder: Path, trials: int = 4) -> tuple[str, optuna.Study]:
    """A real study: ``trials`` training runs of the tiny config through the CLI, then one
    infeasible trial (out of host memory at batch 32) and one failed trial."""
    config = folder / "tiny.toml"
    config.write_text(TINY_CONFIG.format(trials=trials))
    url = f"sqlite:///{folder / 'report.db'}"
    result = invoke("run", str(config), "--storage", url)
    assert result.returncode == 0, result.stderr
    study = optuna.load_study(study_name="tiny", storage=url)
    template = study.trials[-1]
    params = dict(template.user_attrs[PARAMS_ATTR], batch_size=32)
    # The machine the real trials ran on (one hardware class per study here); trials from
    # before fingerprints existed get a made-up one.
    hardware = {
        HARDWARE_ATTR: template.user_attrs.get(HARDWARE_ATTR, FAKE_HARDWARE),
        HARDWARE_CLASS_ATTR: template.user_attrs.get(HARDWARE_CLASS_ATTR, "cpu-test-2"),
    }
    study.add_trial(
        optuna.trial.create_trial(
            values=INFEASIBLE_VALUES,
            params=template.params,
            distributions=template.distributions,
            user_attrs={
                PARAMS_ATTR: params,
                "failure_reason": "host_oom",
                "failure_message": "MemoryError: host RSS above the limit\nsecond line",
                "failure_hint": "lower batch_size or num_workers",
                "peak_host_rss_bytes": 3 * 2**30,
                "data_wait_fraction": 0.9,
                **hardware,
            },
            constraints={"memory": 1.0},
        )
    )
    study.add_trial(
        optuna.trial.create_trial(
            state=TrialState.FAIL,
            params=template.params,
            distributions=template.distributions,
            user_attrs={
                PARAMS_ATTR: template.user_attrs[PARAMS_ATTR],
                "failure_reason": "exception",
                "failure_message": "RuntimeError: boom",
                **hardware,
            },
        )
    )
    return url, study


@pytest.fixture(scope="module")
def real_study(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, optuna.Study]:
    return build_study(tmp_path_factory.mktemp("report"))


@pytest.fixture(scope="module")
def data(real_study: tuple[str, optuna.Study]) -> ReportData:
    return collect(real_study[1], TOLERANCE)


def _numbers(data: ReportData, status: str) -> set[int]:
    return {t.number for t in data.trials if t.status == status}


def _optuna_front(study: optuna.Study) -> set[int]:
    """Optuna's own Pareto front (``best_trials``) over the study's settings: trials that ran
    the same settings count as one, with their median values, as the service merges them
    (a repeat that Optuna's raw front would split happens here: a sampled trial may land on
    a setting the model already measured). The trial numbers behind each front point."""
    reference = optuna.create_study(directions=list(study.directions))
    for point in points_of(study.get_trials()).points:
        reference.add_trial(
            optuna.trial.create_trial(
                values=[point.throughput, point.val_loss],
                user_attrs={"numbers": list(point.numbers)},
            )
        )
    return {n for t in reference.best_trials for n in t.user_attrs["numbers"]}


def test_pareto_set_is_optunas_best_trials(
    real_study: tuple[str, optuna.Study], data: ReportData
) -> None:
    study = real_study[1]
    infeasible, failed = study.trials[-2].number, study.trials[-1].number
    assert _optuna_front(study) == _numbers(data, "pareto")
    # Without repeats, that is Optuna's front of the raw trials.
    if len(points_of(study.get_trials()).points) == len(_numbers(data, "pareto")) + len(
        _numbers(data, "dominated")
    ):
        assert {t.number for t in study.best_trials} == _numbers(data, "pareto")
    assert {n for p in data.summary.pareto for n in p.numbers} == _numbers(data, "pareto")
    assert _numbers(data, "infeasible") == {infeasible}
    assert _numbers(data, "failed") == {failed}
    assert len(data.trials) == len(study.trials)
    # No placeholder values anywhere a measurement is expected.
    for number in (infeasible, failed):
        row = data.trial(number)
        assert row.throughput is None and row.val_loss is None and row.bound is None
    assert data.trial(infeasible).peak_host_rss_bytes == 3 * 2**30  # real: still shown


def _dominated_area(points: list[tuple[float, float]], reference: tuple[float, float]) -> float:
    """The hypervolume (both objectives minimised) counted cell by cell on the grid that the
    points' coordinates draw: a cell is dominated when some point is below and left of it.
    Slow and obvious: an independent check of the report's own computation."""
    xs = sorted({x for x, _ in points} | {reference[0]})
    ys = sorted({y for _, y in points} | {reference[1]})
    return sum(
        (x1 - x0) * (y1 - y0)
        for x0, x1 in itertools.pairwise(xs)
        for y0, y1 in itertools.pairwise(ys)
        if any(px <= x0 and py <= y0 for px, py in points)
    )


def test_hypervolume_never_decreases_and_ignores_infeasible(
    real_study: tuple[str, optuna.Study], data: ReportData
) -> None:
    study = real_study[1]
    hv = data.hypervolume
    volumes = [p.hypervolume for p in hv.points]
    assert [p.number for p in hv.points] == [t.number for t in study.trials]
    assert all(b >= a for a, b in itertools.pairwise(volumes))
    assert all(b.elapsed_s >= a.elapsed_s for a, b in itertools.pairwise(hv.points))
    # The infeasible trial (whose values would dominate everything) adds nothing.
    infeasible = study.trials[-2].number
    assert volumes[infeasible] == volumes[infeasible - 1]
    # Fixed reference: throughput 0, worst feasible val_loss + 10%.
    feasible = [t for t in study.trials[:-2]]
    worst = max(t.values[1] for t in feasible)
    assert hv.reference_throughput == 0.0
    assert hv.reference_val_loss == pytest.approx(worst * 1.1)
    points = [(-t.values[0], t.values[1]) for t in feasible]
    assert volumes[-1] == pytest.approx(_dominated_area(points, (0.0, worst * 1.1)))
    assert volumes[-1] > 0


def test_recommendation_satisfies_its_rule(data: ReportData) -> None:
    summary = data.summary
    rec, base = summary.recommended, summary.baseline
    assert rec is not None and base is not None
    limit = base.val_loss * (1 + TOLERANCE)
    assert rec.point.number in _numbers(data, "pareto")
    assert rec.point.val_loss <= limit
    faster = [p for p in summary.pareto if p.throughput > rec.point.throughput]
    assert all(p.val_loss > limit for p in faster)
    assert rec.speedup_vs_baseline == pytest.approx(rec.point.throughput / base.throughput)
    assert "DataLoader(" in rec.snippet


def test_bounds_follow_the_documented_threshold(data: ReportData) -> None:
    measured = [t for t in data.trials if t.status in ("pareto", "dominated")]
    assert measured
    for row in measured:
        assert row.data_wait_fraction is not None
        expected = "input" if row.data_wait_fraction > INPUT_BOUND_THRESHOLD else "compute"
        assert row.bound == expected


def test_every_measured_trial_reports_its_loader_efficiency(data: ReportData) -> None:
    for row in data.trials:
        if row.status in ("pareto", "dominated"):
            # throughput / the ceiling, both real measurements: positive, and not absurd
            assert row.loader_efficiency is not None and 0 < row.loader_efficiency < 2
        else:
            assert row.loader_efficiency is None


def test_grid_memory_failures_and_hardware(
    real_study: tuple[str, optuna.Study], data: ReportData
) -> None:
    study = real_study[1]
    infeasible, failed = study.trials[-2].number, study.trials[-1].number
    # Every feasible trial counted once in the throughput grid, with its median.
    assert sum(c.n_trials for c in data.throughput_grid) == len(study.trials) - 2
    for cell in data.throughput_grid:
        same = [
            t.values[0]
            for t in study.trials[:-2]
            if t.user_attrs[PARAMS_ATTR]["batch_size"] == cell.batch_size
            and t.user_attrs[PARAMS_ATTR]["num_workers"] == cell.num_workers
            and t.user_attrs[PARAMS_ATTR]["prefetch_factor"] == cell.prefetch_factor
        ]
        assert cell.throughput == pytest.approx(float(np.median(same)))
    assert data.memory.oom_trials == (infeasible,)
    assert data.memory.smallest_oom_batch_size == 32
    assert data.memory.largest_ok_batch_size == 16
    reasons = {g.reason: g for g in data.failures}
    assert set(reasons) == {"host_oom", "exception"}
    assert reasons["host_oom"].infeasible == (infeasible,)
    assert reasons["host_oom"].message == "MemoryError: host RSS above the limit"
    assert reasons["host_oom"].hint == "lower batch_size or num_workers"
    assert reasons["exception"].trials == (failed,) and reasons["exception"].infeasible == ()
    # One machine: one group, holding every trial that recorded a fingerprint.
    recorded = {t.number for t in study.trials if HARDWARE_ATTR in t.user_attrs}
    assert len(data.hardware) == 1 and set(data.hardware[0].trials) == recorded
    assert {infeasible, failed} <= recorded
    expected = study.trials[infeasible].user_attrs[HARDWARE_ATTR]
    # Every fact shown; byte counts in GiB under their plain name.
    shown = dict(data.hardware[0].details)
    assert shown.keys() == {k.removesuffix("_bytes") for k in expected}
    assert shown["ram"] == f"{expected['ram_bytes'] / 2**30:,.1f} GiB"
    assert dict(data.environment)["optuna_version"] == optuna.__version__


def test_importances_for_each_objective(data: ReportData) -> None:
    assert [i.objective for i in data.importances] == [
        "throughput_samples_per_s",
        "val_loss",
    ]
    speed, loss = data.importances
    assert speed.evaluator == "PedAnovaImportanceEvaluator"
    if speed.values:
        assert sum(v for _, v in speed.values) == pytest.approx(1.0)
        assert {k for k, _ in speed.values} <= {
            "batch_size",
            "num_workers",
            "prefetch_factor",
            "persistent_workers",
        }
        assert "feasible trials" in speed.note
    else:
        assert speed.note.startswith("not computable")
    assert "-throughput" in speed.note
    # val_loss: only the batch size can change it, by design; no loader setting is ranked.
    assert loss.evaluator == "by design"
    assert loss.values in ((), (("batch_size", 1.0),))
    assert "the loader settings cannot change what the model learns" in loss.note
    assert "median val_loss by batch size" in loss.note


def test_importances_degrade_without_enough_trials(real_study: tuple[str, optuna.Study]) -> None:
    one = [real_study[1].trials[0]]
    speed, loss = importances(one, real_study[1].directions)
    assert speed.values == () and speed.note.startswith("not computable")
    # One batch size: nothing to attribute val_loss to, and the note still says why.
    assert loss.values == () and loss.note.startswith("only batch_size can change it")


def test_report_json_embeds_best_json(
    real_study: tuple[str, optuna.Study], tmp_path: Path
) -> None:
    url = real_study[0]
    best = CliRunner().invoke(app, ["best", "tiny", "--storage", url, "--json"])
    assert best.exit_code == 0, best.output
    out = tmp_path / "report.json"
    result = CliRunner().invoke(
        app, ["report", "tiny", "--storage", url, "--format", "json", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["summary"] == json.loads(best.stdout)
    assert report["study"] == "tiny" and len(report["trials"]) == len(real_study[1].trials)
    # Standard output by default for json.
    piped = CliRunner().invoke(app, ["report", "tiny", "--storage", url, "--format", "json"])
    assert json.loads(piped.stdout)["summary"] == report["summary"]


def test_html_is_self_contained(real_study: tuple[str, optuna.Study], tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    result = run_cli("report", "tiny", "--storage", real_study[0], "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert str(out) in result.stdout
    page = out.read_text(encoding="utf-8")
    bundle = get_plotlyjs()
    assert page.count(bundle) == 1  # plotly.js inline, once
    # Outside the plotly.js bundle (whose map-tile URL strings this report never uses), the
    # page names no remote address at all, and it loads no file of any kind.
    rest = page.replace(bundle, "")
    assert not re.search(r"https?:|//cdn|mathjax", rest, re.IGNORECASE)
    assert not re.search(r"<(script|link|img|iframe)[^>]*\b(src|href)=", rest, re.IGNORECASE)
    for plot_id in PLOT_IDS:
        assert f'id="{plot_id}"' in page
    assert "DataLoader(" in page and "speedup" in page.lower()
    # The captions' code spans are rendered, never shown as literal tags.
    assert "as in <code>best</code> and <code>studies</code>" in rest
    assert "&lt;code&gt;" not in rest


def test_render_survives_a_study_without_results(tmp_path: Path) -> None:
    study = optuna.create_study(directions=["maximize", "minimize"])
    data = collect(study, TOLERANCE)
    assert data.trials == () and data.summary.recommended is None
    assert data.hypervolume.points == () and data.hypervolume.reference_val_loss is None
    assert all(not i.values for i in data.importances)
    page = render(data)
    assert "nothing to recommend" in page
    json.dumps(data.as_dict())  # JSON-ready as it is


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["report", "nope"], "no study named 'nope'"),
        (["report", "tiny", "-o", "{missing}/r.html"], "does not exist"),
        (["report", "tiny", "-o", "{dir}"], "is a directory"),
        (["report", "tiny", "--format", "pdf"], "--format 'pdf'"),
    ],
)
def test_report_input_errors(
    real_study: tuple[str, optuna.Study], tmp_path: Path, args: list[str], message: str
) -> None:
    filled = [a.format(missing=tmp_path / "missing", dir=tmp_path) for a in args]
    result = run_cli(*filled, "--storage", real_study[0])
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_report_on_a_missing_database(tmp_path: Path) -> None:
    result = run_cli("report", "tiny", "--storage", f"sqlite:///{tmp_path / 'none.db'}")
    assert result.returncode == 2 and "no database file" in result.stderr
    assert not (tmp_path / "none.db").exists()


def test_a_study_from_several_machines_is_reported_per_class(
    real_study: tuple[str, optuna.Study], tmp_path: Path
) -> None:
    """Throughputs from different machines never compare: like `best`, the report takes one
    hardware class at a time, and its summary is `best --json`'s entry for that class."""
    url = f"sqlite:///{tmp_path / 'copy.db'}"
    source = real_study[1]
    copy = optuna.create_study(study_name="tiny", storage=url, directions=source.directions)
    for key, value in source.user_attrs.items():
        copy.set_user_attr(key, value)
    mine = source.trials[0].user_attrs.get(HARDWARE_CLASS_ATTR, "cpu-test-2")
    other = source.trials[1].number
    for trial in source.trials:  # the same trials, trial 1 from another machine
        clone = deepcopy(trial)
        machine = "other-machine" if trial.number == other else mine
        clone.user_attrs = {**trial.user_attrs, HARDWARE_CLASS_ATTR: machine}
        copy.add_trial(clone)

    refused = run_cli("report", "tiny", "--storage", url, "--format", "json")
    assert refused.returncode == 2 and "--hardware-class" in refused.stderr
    best = json.loads(CliRunner().invoke(app, ["best", "tiny", "--storage", url, "--json"]).stdout)
    by_class = {entry["hardware_class"]: entry for entry in best["hardware_classes"]}
    result = CliRunner().invoke(
        app,
        [
            "report",
            "tiny",
            "--storage",
            url,
            "--format",
            "json",
            "--hardware-class",
            "other-machine",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["summary"] == by_class["other-machine"]
    assert [t["number"] for t in report["trials"]] == [other]
