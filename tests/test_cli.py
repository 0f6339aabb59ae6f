"""End to end: the real CLI, real training runs, a real SQLite file read back with Optuna."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState
from typer.testing import CliRunner

from loader_search.cli import app
from loader_search.study._keys import METRIC_NAMES
from loader_search.team import host_lock
from tests.conftest import CONFIRMED_CONFIG, ROOT, invoke, run_cli

PLUGIN = Path(__file__).parent / "plugins" / "my_workload.py"


@pytest.fixture(scope="module")
def finished_study(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, str]:
    """One real 3-trial study run through the CLI (in this process: the subprocess path is
    tested by the other `run_cli` tests)."""
    from tests.conftest import TINY_CONFIG

    folder = tmp_path_factory.mktemp("cli")
    config = folder / "tiny.toml"
    config.write_text(TINY_CONFIG.format(trials=3))
    url = f"sqlite:///{folder / 'studies.db'}"
    result = invoke("run", str(config), "--storage", url)
    assert result.returncode == 0, result.stderr
    return url, config, result.stdout


def test_run_prints_a_recommendation(finished_study: tuple[str, Path, str]) -> None:
    url, _, stdout = finished_study
    assert "Created study tiny" in stdout
    assert "Pareto front of tiny" in stdout
    assert "DataLoader(" in stdout and "torch.set_num_threads(1)" in stdout
    # Which trial wins depends on measured speed; the printed verdict must match the data.
    data = json.loads(CliRunner().invoke(app, ["best", "tiny", "--storage", url, "--json"]).stdout)
    recommended = data["recommended"]
    if recommended["keep_baseline"]:  # the verdict's, whichever trial the rule picked
        assert "Recommended: keep the baseline (trial #0)" in stdout
    else:
        speedup = recommended["speedup_vs_baseline"]
        assert f"Recommended: trial #{recommended['number']}," in stdout
        assert f"= {speedup:.2f}x the baseline" in stdout


def test_study_reads_back_with_plain_optuna(finished_study: tuple[str, Path, str]) -> None:
    url, _, _ = finished_study
    study = optuna.load_study(study_name="tiny", storage=url)
    assert study.metric_names == list(METRIC_NAMES)
    assert [d.name for d in study.directions] == ["MAXIMIZE", "MINIMIZE"]
    trials = study.get_trials()
    assert len(trials) == 3
    assert all(t.state == TrialState.COMPLETE for t in trials)
    baseline = trials[0]
    assert baseline.user_attrs["baseline"] is True
    assert baseline.params["batch_size"] == 16 and baseline.params["num_workers"] == 0
    for trial in trials:
        attrs = trial.user_attrs
        assert trial.values[0] == attrs["throughput_samples_per_s"] > 0
        if "val_loss_from" in attrs:  # stopped early: its batch size's evaluated val_loss
            sources = [trials[n].user_attrs["val_loss"] for n in attrs["val_loss_from"]]
            assert trial.values[1] == statistics.median(sources) > 0
        else:
            assert trial.values[1] == attrs["val_loss"] > 0
        for key in ("data_wait_fraction", "time_to_first_batch_s", "peak_host_rss_bytes"):
            assert key in attrs
        assert attrs["loader_params"]["torch_threads"] == 1
        hardware = attrs["hardware"]
        assert hardware["device_type"] == "cpu" and hardware["usable_cpus"] >= 1
        assert (
            attrs["hardware_class"]
            == hardware["hardware_class"]
            == study.user_attrs["hardware_class"]
        )
    info = study.user_attrs
    assert info["torch_version"] and info["optuna_version"] == optuna.__version__
    assert info["trial_budget"] == 3
    assert info["config"]["study"]["name"] == "tiny"  # for workers on other machines


def test_best_json_matches_the_study(finished_study: tuple[str, Path, str]) -> None:
    url, _, _ = finished_study
    result = CliRunner().invoke(app, ["best", "tiny", "--storage", url, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    study = optuna.load_study(study_name="tiny", storage=url)
    values = {t.number: t.values for t in study.best_trials}
    assert {p["number"] for p in data["pareto"]} == set(values)
    for entry in data["pareto"]:
        assert [entry["throughput"], entry["val_loss"]] == values[entry["number"]]
        assert {"batch_size", "num_workers", "prefetch_factor"} <= entry["params"].keys()
    recommended = data["recommended"]
    assert recommended["number"] in values
    # The baseline's throughput: the median over every trial with its exact settings.
    settings = study.trials[0].user_attrs["loader_params"]
    same = [t.values[0] for t in study.trials if t.user_attrs["loader_params"] == settings]
    assert data["baseline"]["throughput"] == pytest.approx(statistics.median(same))
    speedup = recommended["throughput"] / statistics.median(same)
    assert recommended["speedup_vs_baseline"] == pytest.approx(speedup)


def test_studies_lists_counts(finished_study: tuple[str, Path, str]) -> None:
    url, _, _ = finished_study
    result = CliRunner().invoke(app, ["studies", "--storage", url])
    assert result.exit_code == 0
    row = next(line for line in result.stdout.splitlines() if "tiny" in line)
    cells = [cell.strip() for cell in row.strip("│ ").split("│")]
    best = json.loads(CliRunner().invoke(app, ["best", "tiny", "--storage", url, "--json"]).stdout)
    rec = best["recommended"]
    # study, complete, failed, running, budget, recommended samples/s, speedup: the
    # recommendation as `best` states it (confirmation is off here: no interval).
    speedup = "keep the baseline" if rec["baseline"] else f"{rec['speedup_vs_baseline']:.2f}x"
    assert cells[:6] == ["tiny", "3", "0", "0", "3", f"{rec['throughput']:,.0f}"]
    assert cells[6].startswith(speedup)


@pytest.fixture(scope="module")
def confirmed_study(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A study whose candidates ran paired rounds against the baseline. Its candidates gain by
    a loader worker, which needs a core of its own: beside another test (the suite runs two at
    once) every candidate once read slower than the baseline (976, 705 and 883 against 1,017
    samples/s), and the run rightly kept the baseline with nothing to confirm. Then the study
    runs again, in a new database, up to three times in all."""
    for _ in range(3):
        folder = tmp_path_factory.mktemp("confirmed")
        config = folder / "confirmed.toml"
        config.write_text(CONFIRMED_CONFIG)
        url = f"sqlite:///{folder / 'studies.db'}"
        result = invoke("run", str(config), "--storage", url)
        assert result.returncode == 0, result.stderr
        said = " ".join(result.stdout.split())
        if "no faster setting within the loss tolerance was found" not in said:
            break
    return url, result.stdout


def test_a_worker_of_a_finished_study_exits_without_waiting_for_the_host_lock(
    confirmed_study: tuple[str, str], tmp_path: Path
) -> None:
    """Seeing that the budget is used (and the rounds done) needs no host lock: a worker
    joining a finished study leaves at once even while another process holds the machine."""
    url, _ = confirmed_study
    env = {"LOADER_SEARCH_LOCK_DIR": str(tmp_path)}
    with host_lock(directory=tmp_path, study="someone else's"):
        started = time.monotonic()
        done = run_cli("worker", "confirmed", "--storage", url, env=env)
        took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert "waiting for the host lock" not in done.stdout + done.stderr
    assert took < 60, took  # a worker that waited would hang here until the lock is free


def test_a_run_waiting_for_the_host_lock_says_so_in_a_log(
    tiny_config: Callable[..., Path], tmp_path: Path
) -> None:
    """Output that is not a terminal (a log) gets a line naming the lock's holder, where a
    terminal gets a spinner."""
    locks = tmp_path / "locks"
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    env = {**os.environ, "LOADER_SEARCH_LOCK_DIR": str(locks)}
    env.pop("LOADER_SEARCH_STORAGE", None)
    command = [sys.executable, "-m", "loader_search", "run", str(tiny_config()), "--storage", url]
    with host_lock(directory=locks, study="held-elsewhere"):
        run = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        assert run.stdout is not None
        said = next((line for line in run.stdout if "waiting for the host lock" in line), "")
        run.send_signal(signal.SIGINT)
        run.communicate(timeout=60)
    assert f"held by pid {os.getpid()} (user " in said
    assert "study held-elsewhere" in said


def test_best_the_json_report_and_studies_agree_on_the_front_and_the_answer(
    confirmed_study: tuple[str, str], tmp_path: Path
) -> None:
    url, stdout = confirmed_study
    best = json.loads(
        CliRunner().invoke(app, ["best", "confirmed", "--storage", url, "--json"]).stdout
    )
    rec = best["recommended"]
    # The run's own account says why, should the rounds not have run.
    why = "\n".join(stdout.splitlines()[-60:])
    assert rec["confirmation_rounds"] >= 2, f"the candidates were not confirmed:\n{why}"
    low, high = rec["speedup_ci95"]
    assert rec["verdict"] == ("faster" if low > 1 else "no_reliable_gain")
    assert rec["keep_baseline"] == best["keep_baseline"] == (rec["verdict"] != "faster")
    # Every view writes the interval as `best` does: in words when it is too noisy to size.
    interval = (
        "95% CI too noisy to size"
        if rec["speedup_ci95_too_noisy"]
        else f"95% CI {low:.2f}-{high:.2f}"
    )
    # The JSON report's summary is `best --json`, front and recommendation alike.
    out = tmp_path / "report.json"
    done = CliRunner().invoke(
        app, ["report", "confirmed", "--storage", url, "--format", "json", "--output", str(out)]
    )
    assert done.exit_code == 0, done.output
    report = json.loads(out.read_text())
    assert report["summary"]["pareto"] == best["pareto"]
    assert report["summary"]["recommended"] == rec
    # `studies` shows the same samples/s (the median of the recommended setting, the
    # baseline's when it is kept) and interval.
    row = next(
        line
        for line in CliRunner().invoke(app, ["studies", "--storage", url]).stdout.splitlines()
        if line.startswith("│ confirmed ")
    )
    cells = [cell.strip() for cell in row.strip("│ ").split("│")]
    kept = best["baseline"] if rec["keep_baseline"] else rec
    assert cells[5] == f"{kept['throughput']:,.0f}"
    assert interval.replace("95% CI too", "too") in cells[6]  # the cell's shorter words
    # The dashboard shows the same answer as the study's note (its own views draw Optuna's
    # front over raw trials, and the note says so).
    from optuna_dashboard._note import get_note_from_system_attrs

    storage = optuna.storages.RDBStorage(url)
    attrs = storage.get_study_system_attrs(storage.get_study_id_from_name("confirmed"))
    note = get_note_from_system_attrs(attrs, None)["body"]
    assert "Optuna's front over raw trials" in note
    assert interval in note
    for point in best["pareto"]:
        assert f"| #{point['number']} |" in note and f"{point['throughput']:,.0f}" in note
    # And the run's own last words state the speedup with that interval, never bare.
    assert f"{interval}, paired over {rec['confirmation_rounds']} rounds" in (
        " ".join(stdout.split())
    )


def test_run_again_continues_to_the_budget(
    tiny_config: Callable[..., Path], sqlite_url: str
) -> None:
    config = tiny_config(trials=2)
    assert invoke("run", str(config), "--storage", sqlite_url).returncode == 0
    again = invoke("run", str(config), "--storage", sqlite_url)
    assert again.returncode == 0
    assert "Continuing study tiny" in again.stdout and "budget already used" in again.stdout
    more = invoke("run", str(config), "--storage", sqlite_url, "--n-trials", "3")
    assert more.returncode == 0, more.stderr
    trials = optuna.load_study(study_name="tiny", storage=sqlite_url).get_trials()
    assert len(trials) == 3
    assert sum(bool(t.user_attrs.get("baseline")) for t in trials) == 1


def test_default_and_environment_storage(tiny_config: Callable[..., Path], tmp_path: Path) -> None:
    config = tiny_config(trials=1)
    work = tmp_path / "work"
    work.mkdir()
    assert invoke("run", str(config), cwd=work).returncode == 0
    assert (work / "loader_search.db").exists()
    env_db = tmp_path / "env.db"
    result = invoke(
        "run", str(config), cwd=work, env={"LOADER_SEARCH_STORAGE": f"sqlite:///{env_db}"}
    )
    assert result.returncode == 0 and env_db.exists()


def _assert_user_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    # A password in --storage adds its warning (tests/test_storage.py) before the error line.
    warned = "warning: --storage holds a password"
    lines = [x for x in result.stderr.splitlines() if x.strip() and not x.startswith(warned)]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.output + result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def _no_study(url: str) -> bool:
    """Nothing was stored: the fixture's SQLite file was not even created."""
    return not Path(url.removeprefix("sqlite:///")).exists()


@pytest.mark.parametrize(
    ("old", "new", "fragment"),
    [
        ("seed = 0", "seed = 0\n[extra]\nkey = 1", "unknown table or key 'extra'"),
        ("{ min = 16, max = 32 }", "{ min = 0, max = 32 }", "space.batch_size.min = 0"),
        ("train_samples = 512", "train_samples = 64", "training.train_samples = 64 is too small"),
        ("trials = 1", "trials = -1", "study.trials = -1: must be at least 1"),
    ],
)
def test_bad_config_exits_2_and_creates_nothing(
    old: str, new: str, fragment: str, tiny_config: Callable[..., Path], sqlite_url: str
) -> None:
    path = tiny_config(trials=1)
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    result = CliRunner().invoke(app, ["run", str(path), "--storage", sqlite_url])
    _assert_user_error(result, fragment)
    assert _no_study(sqlite_url)


def test_error_text_is_printed_verbatim(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("study = 3\n")
    result = CliRunner().invoke(app, ["run", str(path)])
    _assert_user_error(result, "[study] must be a table, got 3")


def test_unknown_workload_exits_2_and_creates_nothing(
    tiny_config: Callable[..., Path], sqlite_url: str
) -> None:
    path = tiny_config(trials=1)
    path.write_text(path.read_text().replace('"synthetic-images"', '"imagenet"'))
    result = CliRunner().invoke(app, ["run", str(path), "--storage", sqlite_url])
    _assert_user_error(result, "unknown workload 'imagenet'")
    assert _no_study(sqlite_url)


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("bogus", "is malformed"),
        ("postgresql+psycopg://me:topsecret@127.0.0.1:1/db", "cannot reach storage"),
    ],
)
def test_bad_storage_exits_2_without_the_password(
    tiny_config: Callable[..., Path], url: str, fragment: str
) -> None:
    for args in (["run", str(tiny_config(trials=1))], ["studies"], ["best", "x"]):
        result = CliRunner().invoke(app, [*args, "--storage", url])
        _assert_user_error(result, fragment)
        assert "topsecret" not in result.output + result.stderr


def test_missing_database_study_and_config(sqlite_url: str, tmp_path: Path) -> None:
    for args in (["best", "nope"], ["studies"]):
        result = CliRunner().invoke(app, [*args, "--storage", sqlite_url])
        _assert_user_error(result, "no database file", "run `loader-search run` first")
        assert _no_study(sqlite_url)
    optuna.create_study(study_name="other", storage=sqlite_url)
    result = CliRunner().invoke(app, ["best", "nope", "--storage", sqlite_url])
    _assert_user_error(result, "no study named 'nope'", "(studies there: other)")
    result = CliRunner().invoke(app, ["run", str(tmp_path / "none.toml")])
    _assert_user_error(result, "does not exist")


def test_a_foreign_study_is_refused(sqlite_url: str) -> None:
    optuna.create_study(study_name="one", storage=sqlite_url)
    optuna.create_study(study_name="two", storage=sqlite_url, directions=["maximize", "minimize"])
    for name in ("one", "two"):
        result = CliRunner().invoke(app, ["best", name, "--storage", sqlite_url])
        _assert_user_error(result, "was not created by loader-search")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--n-trials", "0"], "--n-trials 0: must be at least 1"),
        (["--timeout", "-5"], "--timeout -5.0"),
        (["--study-name", ""], "--study-name is empty"),
        (["--storage", ""], "--storage is empty"),
    ],
)
def test_bad_options(
    args: list[str], fragment: str, tiny_config: Callable[..., Path], sqlite_url: str
) -> None:
    config = str(tiny_config(trials=1))
    storage = [] if "--storage" in args else ["--storage", sqlite_url]
    result = CliRunner().invoke(app, ["run", config, *storage, *args])
    _assert_user_error(result, fragment)
    assert _no_study(sqlite_url)


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_bad_loss_tolerance(value: str, sqlite_url: str) -> None:
    result = CliRunner().invoke(
        app, ["best", "x", "--storage", sqlite_url, "--loss-tolerance", value]
    )
    _assert_user_error(result, f"--loss-tolerance {float(value)}")


def test_subprocess_error_is_one_line_and_debug_shows_traceback(tmp_path: Path) -> None:
    missing = str(tmp_path / "none.toml")
    plain = run_cli("run", missing)
    assert plain.returncode == 2
    assert plain.stderr.strip().count("\n") == 0 and "Traceback" not in plain.stderr
    debug = run_cli("--debug", "run", missing)
    assert debug.returncode == 2 and "Traceback" in debug.stderr


def test_plugin_workload_from_the_cli(tiny_config: Callable[..., Path], sqlite_url: str) -> None:
    path = tiny_config(trials=2)
    text = path.read_text().replace('"synthetic-images"', f'"{PLUGIN}:build"')
    text = text.replace("image_size = 16\ntrain_size = 256\nval_size = 64", "n = 256")
    path.write_text(text)
    result = run_cli("run", str(path), "--storage", sqlite_url)
    assert result.returncode == 0, result.stderr
    study = optuna.load_study(study_name="tiny", storage=sqlite_url)
    assert len(study.get_trials(states=(TrialState.COMPLETE,))) == 2


def test_ctrl_c_records_the_running_trial_as_interrupted(tmp_path: Path, sqlite_url: str) -> None:
    # Trial #0 (the baseline, no workers) is quick; trial #1 loads through a slow worker.
    config = tmp_path / "slow.toml"
    config.write_text(
        f"""
[study]
name = "tiny"
trials = 3
[sampler]
name = "random"
[workload]
name = "{ROOT / "tests" / "_datasets.py"}:slow_in_workers"
[training]
device = "cpu"
train_samples = 2000
batch_size = 16
[space]
batch_size = [16]
num_workers = 1
prefetch_factor = 2
persistent_workers = false
"""
    )
    env = {k: v for k, v in os.environ.items() if k != "LOADER_SEARCH_STORAGE"}
    # A session of its own: Ctrl-C in a terminal signals the whole foreground process group,
    # the loader's worker processes included.
    process = subprocess.Popen(
        [sys.executable, "-m", "loader_search", "run", str(config), "--storage", sqlite_url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    db = Path(sqlite_url.removeprefix("sqlite:///"))
    try:
        deadline = time.monotonic() + 120
        while _running_trial(db) != 1:  # wait until trial #1 trains with its worker
            if process.poll() is not None:
                pytest.fail(f"the run ended early: {process.communicate()[1]}")
            if time.monotonic() > deadline:
                pytest.fail("trial #1 did not start within 120 s")
            time.sleep(0.2)
        time.sleep(1.0)
        os.killpg(process.pid, signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130, stderr
    assert "Interrupted" in stderr and "Traceback" not in stderr
    trials = optuna.load_study(study_name="tiny", storage=sqlite_url).get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.FAIL]
    assert trials[1].user_attrs["failure_reason"] == "interrupted"
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):  # no loader worker outlived the run
        os.killpg(process.pid, 0)


def _running_trial(db: Path) -> int | None:
    """The number of the trial now RUNNING, read-only, so the poll never races the run's
    schema creation."""
    if not db.exists():
        return None
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as connection:
            row = connection.execute(
                "SELECT number FROM trials WHERE state = 'RUNNING' ORDER BY number DESC"
            ).fetchone()
    except sqlite3.OperationalError:  # tables not created yet, or briefly locked
        return None
    return None if row is None else int(row[0])
