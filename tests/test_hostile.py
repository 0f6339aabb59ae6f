"""The trust boundary's second pass (issue 28): what a shared database, a planted file or an
absurd value could still do. Each is refused (or contained) before anything runs, in one line
naming the value and the fix, exit 2 (a worker: a failed trial with a reason), nothing stored
is lost, and other studies in the same database keep working. The real CLI in a subprocess,
real SQLite files and servers, a second real user (nobody) through setpriv."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import (
    NOBODY,
    SETPRIV,
    TINY_CONFIG,
    as_nobody,
    folder_under_tmp,
    invoke,
    needs_a_second_user,
    run_cli,
)


def one_line(result: subprocess.CompletedProcess[str], *words: str) -> str:
    """Exit 2, one line on stderr after the progress lines, no traceback; the line."""
    assert result.returncode == 2, f"exit {result.returncode}: {result.stderr[-2000:]}"
    assert "Traceback" not in result.stderr, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    for word in words:
        assert word in line, line
    return line


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A sticky, world-writable folder under /tmp, like /tmp itself."""
    with folder_under_tmp(0o1777) as path:
        yield path


@needs_a_second_user
def test_a_planted_timings_symlink_is_refused_and_its_target_left_alone(
    shared_tmp: Path, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("secret")
    victim.chmod(0o600)
    # In a teammate's own folder (in a sticky one the kernel may refuse the link itself).
    theirs = shared_tmp / "theirs"
    as_nobody("mkdir", "-m", "755", str(theirs))
    planted = theirs / "timings.jsonl"
    as_nobody("ln", "-s", str(victim), str(planted))
    config = tmp_path / "study.toml"
    config.write_text(TINY_CONFIG.format(trials=1))
    database = tmp_path / "study.db"
    result = run_cli(
        "run",
        str(config),
        "--storage",
        f"sqlite:///{database}",
        env={"LOADER_SEARCH_TIMINGS": str(planted)},
    )
    one_line(result, str(planted), "is a symlink")
    assert victim.read_text() == "secret" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert not database.exists()


# -- a shared database that others write ------------------------------------------------


@pytest.fixture(scope="module")
def finished_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file with two finished tiny studies, ``tiny`` and ``other``, run once for the
    module through the real CLI; each test tampers with a copy of its own."""
    folder = tmp_path_factory.mktemp("finished")
    database = folder / "studies.db"
    for name in ("tiny", "other"):
        config = folder / f"{name}.toml"
        config.write_text(
            TINY_CONFIG.format(trials=2).replace('name = "tiny"', f'name = "{name}"')
        )
        done = invoke("run", str(config), "--storage", f"sqlite:///{database}", cwd=folder)
        assert done.returncode == 0, done.stderr[-2000:]
    return database


@pytest.fixture
def shared_db(finished_db: Path, tmp_path: Path) -> str:
    """This test's own copy of the finished studies (a SQLite file copied, not rebuilt)."""
    copy = tmp_path / "studies.db"
    shutil.copyfile(finished_db, copy)
    return f"sqlite:///{copy}"


def _tamper(url: str, study: str, key: str, value: object) -> None:
    import optuna

    optuna.load_study(study_name=study, storage=url).set_user_attr(key, value)


def _sql(url: str, statement: str, *params: object) -> None:
    import sqlite3

    with sqlite3.connect(url.removeprefix("sqlite:///")) as connection:
        connection.execute(statement, params)


READERS = (("best", "tiny"), ("report", "tiny"))


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("loss_tolerance", float("nan"), "loss_tolerance = nan: must be a number"),
        ("loss_tolerance", -1.0, "loss_tolerance = -1.0: must not be negative"),
        ("loss_tolerance", "x", 'loss_tolerance = "x": must be a number'),
        ("confirm", {"top": 10**9}, "confirm.top = 1000000000: must be at most 20"),
        ("confirm", {"max_rounds": 1e308}, "confirm.max_rounds = 1e+308: must be an integer"),
        ("confirm", "hello", 'confirm = "hello", not a table'),
        ("trial_budget", -1, "trial_budget = -1: must be at least 1"),
        ("trial_budget", 10**30, "must be at most 100000"),
    ],
)
def test_a_tampered_study_setting_is_one_line_and_the_other_studies_still_list(
    shared_db: str, tmp_path: Path, key: str, value: object, said: str
) -> None:
    _tamper(shared_db, "tiny", key, value)
    fix = "run `loader-search init CONFIG --storage URL`"
    commands = [["worker", "tiny"]]
    if key != "trial_budget" and key != "confirm":  # what reading commands use
        commands += [list(c) for c in READERS]
    for command in commands:
        result = invoke(*command, "--storage", shared_db, cwd=tmp_path)
        one_line(result, "study 'tiny' stores", said, fix)
    listed = invoke("studies", "--storage", shared_db, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "other" in listed.stdout
    if key == "loss_tolerance":
        assert "damaged settings: see `best tiny`" in listed.stdout, listed.stdout


@pytest.mark.parametrize("stored", ["hello", [1, 2], 7])
def test_a_stored_config_that_is_not_a_table_is_refused_by_a_worker(
    shared_db: str, tmp_path: Path, stored: object
) -> None:
    _tamper(shared_db, "tiny", "config", stored)
    result = invoke("worker", "tiny", "--n-trials", "1", "--storage", shared_db, cwd=tmp_path)
    one_line(result, "study 'tiny''s stored config: must be a table of settings")
    for command in ("studies", "best"):
        done = invoke(command, *(["tiny"] if command == "best" else []), "--storage", shared_db)
        assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "stored", ['"hello"', "[1, 2]", '{"batch_size": "x"}', '{"num_workers": 3}']
)
def test_a_damaged_trial_record_is_left_out_and_every_command_still_works(
    shared_db: str, tmp_path: Path, stored: str
) -> None:
    _sql(
        shared_db,
        "UPDATE trial_user_attributes SET value_json = ? WHERE key = 'loader_params' AND"
        " trial_id = (SELECT min(trial_id) FROM trials)",
        stored,
    )
    for command in (["studies"], ["best", "tiny"], ["report", "tiny"], ["best", "other"]):
        result = invoke(*command, "--storage", shared_db, cwd=tmp_path)
        assert result.returncode == 0, (command, result.stderr[-2000:])
        assert "Traceback" not in result.stderr


def test_escape_sequences_from_the_database_never_reach_the_terminal(
    shared_db: str, tmp_path: Path
) -> None:
    _sql(shared_db, "UPDATE studies SET study_name = ? WHERE study_name = 'other'", "o\x1b[2Jx")
    _tamper(shared_db, "tiny", "workload_description", "\x1b]0;pwned\x07 synthetic")
    for command in (["studies"], ["best", "tiny"]):
        result = invoke(*command, "--storage", shared_db, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert "\x1b" not in result.stdout + result.stderr and "\x07" not in result.stdout
    listed = invoke("studies", "--storage", shared_db, cwd=tmp_path)
    assert "o\\x1b[2Jx" in listed.stdout  # shown, written out


def test_a_queued_trial_outside_the_space_is_refused_and_uses_no_budget(
    shared_db: str, tmp_path: Path
) -> None:
    import optuna
    from optuna.trial import TrialState

    study = optuna.load_study(study_name="tiny", storage=shared_db)
    study.set_user_attr("trial_budget", 3)  # room for one more trial
    for planted in ({"num_workers": 6}, {"num_workers": -5}, {"batch_size": 4096}):
        study.enqueue_trial({"batch_size": 16, **planted}, skip_if_exists=False)
    # As a user runs it: a real process, whose trials fork from it.
    result = run_cli("worker", "tiny", "--storage", shared_db, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    trials = study.get_trials()
    refused = [t for t in trials if t.user_attrs.get("failure_reason") == "refused"]
    assert len(refused) == 3, [t.user_attrs for t in trials]
    for trial, named in zip(refused, ("num_workers=6", "-5", "4096"), strict=True):
        assert trial.state == TrialState.FAIL and named in trial.user_attrs["failure_message"]
        assert "loader_params" not in trial.user_attrs  # never ran
    assert sum(t.state == TrialState.COMPLETE for t in trials) == 3  # the budget, untouched
    said = result.stdout + result.stderr
    assert "queued settings refused" in said and "Traceback" not in said


# -- absurd values and files --------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ("[study]\ntrials = " + "9" * 5000 + "\n", "an integer of thousands of digits"),
        ("a = " + "[" * 3000 + "]" * 3000 + "\n", "nested too deep"),
        (None, "is not a regular file"),  # /dev/zero: read for ever before
        ("[workload.options]\nimage_size = 1000000\n", "image_size = 1000000: must be at most"),
    ],
)
def test_absurd_config_files_are_one_line(tmp_path: Path, content: str | None, said: str) -> None:
    config = Path("/dev/zero")
    if content is not None:
        config = tmp_path / "study.toml"
        config.write_text(content)
    database = tmp_path / "study.db"
    result = invoke("run", str(config), "--storage", f"sqlite:///{database}", cwd=tmp_path)
    one_line(result, said)
    assert not database.exists()


@pytest.mark.parametrize(
    ("option", "said"),
    [
        (["--n-trials", str(10**30)], "must be at most 100000"),
        (["--n-trials", "0"], "must be at least 1"),
        (["--cpus", "0-100000000"], "CPU 100000000 does not exist"),
    ],
)
def test_absurd_options_are_one_line_before_anything_is_stored(
    tmp_path: Path, option: list[str], said: str
) -> None:
    config = tmp_path / "study.toml"
    config.write_text(TINY_CONFIG.format(trials=1))
    database = tmp_path / "study.db"
    result = invoke("run", str(config), "--storage", f"sqlite:///{database}", *option)
    one_line(result, said)
    assert not database.exists()


def test_the_debug_traceback_is_scrubbed_of_the_password(tmp_path: Path) -> None:
    url = "postgresql+psycopg://postgres:s3cretpw@127.0.0.1:1/test?sslpassword=s3cretkey"
    result = invoke("--debug", "studies", "--storage", url, cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" in result.stderr  # --debug shows it...
    assert "s3cretpw" not in result.stderr and "s3cretkey" not in result.stderr  # ...scrubbed


@needs_a_second_user
def test_a_read_only_database_is_one_line_at_once_not_an_outage(
    finished_db: Path, shared_tmp: Path
) -> None:
    """Another user's database file (root's, mode 0644): nobody may read it, not write it.
    Before, every write was retried as an outage for up to 300 s, then exit 1."""
    import time

    folder = shared_tmp / "theirs"
    folder.mkdir(mode=0o755)
    database = folder / "studies.db"
    shutil.copyfile(finished_db, database)
    database.chmod(0o644)
    config = folder / "tiny.toml"
    config.write_text(TINY_CONFIG.format(trials=2))
    url = f"sqlite:///{database}"
    assert SETPRIV is not None
    nobody = [SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    env = {**os.environ, "HOME": str(shared_tmp), "LOADER_SEARCH_LOCK_DIR": str(shared_tmp)}
    started = time.monotonic()
    result = subprocess.run(
        [
            *(*nobody, sys.executable, "-m", "loader_search", "run", str(config)),
            *("--n-trials", "3", "--storage", url),
        ],
        env=env,
        cwd=shared_tmp,
        capture_output=True,
        text=True,
        timeout=120,
    )
    one_line(result, "the database refuses writes", "readonly database", "--storage")
    assert time.monotonic() - started < 60  # at once, not after 300 s of retries
    listed = subprocess.run(
        [*nobody, sys.executable, "-m", "loader_search", "studies", "--storage", url],
        env=env,
        cwd=shared_tmp,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0 and "tiny" in listed.stdout, listed.stderr


def test_tampered_workload_options_are_refused_by_a_worker(shared_db: str, tmp_path: Path) -> None:
    import optuna

    study = optuna.load_study(study_name="tiny", storage=shared_db)
    document = study.user_attrs["config"]
    document["workload"]["options"]["train_size"] = 10**8  # built for hours before
    study.set_user_attr("config", document)
    study.set_user_attr("trial_budget", 3)
    result = invoke("worker", "tiny", "--storage", shared_db, cwd=tmp_path)
    one_line(result, "train_size = 100000000: must be at most 1000000")


# -- fuzzing what a study stores ----------------------------------------------------------

STORED_NUMBERS = {
    "trial_budget": "study.trials",
    "loss_tolerance": "study.loss_tolerance",
    "confirm.top": "study.confirm_top",
    "confirm.min_rounds": "study.confirm_min_rounds",
    "confirm.max_rounds": "study.confirm_max_rounds",
    "confirm.half_width": "study.confirm_half_width",
}


def _fuzz_values() -> object:
    from hypothesis import strategies as st

    numbers = st.one_of(
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=True, allow_infinity=True, width=64),
        st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 1e308, -0.0, 0.5]),
    )
    return st.one_of(numbers, st.booleans(), st.none(), st.text(max_size=8), st.lists(numbers))


def test_fuzzed_stored_settings_are_read_in_range_or_refused_in_one_line() -> None:
    """Every numeric setting a study stores, as a teammate could write it: read back inside
    its documented range, or a one-line `UserError` naming the study and the key."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from loader_search._rules import RANGES
    from loader_search.errors import UserError
    from loader_search.study import StudyConfig, study_budget
    from loader_search.study.work import confirm_settings

    @settings(max_examples=300, deadline=None)
    @given(key=st.sampled_from(sorted(STORED_NUMBERS)), value=_fuzz_values())
    def check(key: str, value: object) -> None:
        table, _, field = key.rpartition(".")
        attrs: dict[str, object] = {table: {field: value}} if table else {key: value}
        try:
            budget = study_budget("s", attrs, 10)
            confirm = confirm_settings(attrs, StudyConfig(), "s")
        except UserError as exc:
            text = str(exc)
            assert text.startswith("study 's' stores ") and "\n" not in text, text
            assert key in text or table in text, text
            return
        rule = RANGES[STORED_NUMBERS[key]]
        read = {
            "trial_budget": budget,
            "loss_tolerance": confirm.loss_tolerance,
            "confirm.top": confirm.top,
            "confirm.min_rounds": confirm.min_rounds,
            "confirm.max_rounds": confirm.max_rounds,
            "confirm.half_width": confirm.half_width,
        }[key]
        assert rule.problem(read) is None, (key, value, read)

    check()


def test_fuzzed_workload_options_build_in_range_or_are_one_line() -> None:
    """The built-in workload's numeric options, as a stored config could carry them: the
    workload builds (with every option inside its rule), or a one-line `UserError`."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from loader_search.errors import UserError
    from loader_search.workloads import load_workload
    from loader_search.workloads.synthetic_images import OPTION_RULES

    small = {"image_size": 8, "train_size": 4, "val_size": 2}
    built_images = 256  # what an in-range size is built at (see below)

    @settings(max_examples=150, deadline=None)
    @given(key=st.sampled_from(sorted(OPTION_RULES)), value=_fuzz_values())
    def check(key: str, value: object) -> None:
        options = {**small, key: value}
        if key == "image_size" and isinstance(value, int) and not isinstance(value, bool):
            options["train_size"] = options["val_size"] = 1  # in range: 1 image, built fast
        rule = OPTION_RULES[key]
        if (
            key in ("train_size", "val_size")
            and isinstance(value, int)
            and not isinstance(value, bool)
            and value > built_images
            and rule.problem(value) is None
        ):
            # In range, and up to a million images: about a minute to generate through the
            # same code as a few hundred. The rule accepted the size; the build runs smaller.
            options[key] = built_images
        try:
            workload = load_workload("synthetic-images", options)
        except UserError as exc:
            text = str(exc)
            assert text.startswith("workload 'synthetic-images': ") and "\n" not in text, text
            return
        assert isinstance(value, (int, float)) and rule.problem(value) is None, (key, value)
        assert len(workload.train_dataset) >= 1  # type: ignore[arg-type]

    check()
