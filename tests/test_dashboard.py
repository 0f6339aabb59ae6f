"""``loader-search dashboard``: optuna-dashboard started by the CLI, checked over HTTP.

The study holds real training trials plus one infeasible trial whose placeholder values would
dominate every real one: plain optuna-dashboard 0.21 lists it as Pareto-optimal; ours must not.
"""

from __future__ import annotations

import contextlib
import json
import re
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest

from loader_search.study._keys import METRIC_NAMES
from tests.conftest import ROOT, invoke, run_cli
from tests.test_report import build_study

pytest.importorskip("optuna_dashboard", reason="pip install 'loader-search[dashboard]'")


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, optuna.Study]:
    return build_study(tmp_path_factory.mktemp("dashboard"), trials=2)


def _read_line(process: subprocess.Popen[str], timeout_s: float) -> str:
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout_s)
    if not ready:
        raise AssertionError(f"the dashboard printed nothing in {timeout_s} s")
    return process.stdout.readline()


@pytest.fixture
def server(study: tuple[str, optuna.Study]) -> Iterator[tuple[str, subprocess.Popen[str], str]]:
    with serving(study[0]) as served:
        yield served


@contextlib.contextmanager
def serving(storage: str) -> Iterator[tuple[str, subprocess.Popen[str], str]]:
    """The CLI's dashboard on a free port: (base URL, process, the line it printed)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "loader_search", "dashboard", "--storage", storage, "--port", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = _read_line(process, 60)
        found = re.search(r"(http://127\.0\.0\.1:\d+)/dashboard/", line)
        assert found, line + (process.stderr.read() if process.poll() is not None else "")
        yield found.group(1), process, line
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def test_dashboard_serves_the_study_without_infeasible_pareto_trials(
    study: tuple[str, optuna.Study], server: tuple[str, subprocess.Popen[str], str]
) -> None:
    url, process, line = server
    real = study[1]
    assert study[0] in line and "Ctrl-C" in line  # where it serves from, and how to stop it
    studies = _get(f"{url}/api/studies")["study_summaries"]
    assert [s["study_name"] for s in studies] == ["tiny"]
    assert studies[0]["directions"] == ["maximize", "minimize"]
    detail = _get(f"{url}/api/studies/{studies[0]['study_id']}")
    assert detail["objective_names"] == list(METRIC_NAMES)
    shown_attrs = {a["key"] for a in detail["union_user_attrs"]}
    assert {"throughput_samples_per_s", "val_loss", "data_wait_fraction"} <= shown_attrs

    infeasible = real.trials[-2].number
    best = {t["number"] for t in detail["best_trials"]}
    assert infeasible not in best
    assert best == {t.number for t in real.best_trials}
    # The browser's own Pareto plot splits trials by this list: the infeasible one is marked.
    constraints = {t["number"]: t["constraints"] for t in detail["trials"]}
    assert constraints[infeasible] == [1.0]
    assert all(v <= 0 for n, c in constraints.items() if n != infeasible for v in c)

    # Without our fix the dashboard would list it (its values dominate every real trial).
    from optuna_dashboard._pareto_front import get_pareto_front_trials

    plain = get_pareto_front_trials(real.trials, real.directions)
    assert infeasible in {t.number for t in plain}

    process.send_signal(signal.SIGINT)  # Ctrl-C stops it cleanly
    assert process.wait(timeout=30) == 0
    assert process.stdout is not None and "Dashboard stopped." in process.stdout.read()


def test_a_study_whose_attributes_cannot_be_read_hides_no_other(tmp_path: Path) -> None:
    from tests.test_unreadable_study import plant_deep_attribute

    url = f"sqlite:///{tmp_path / 'studies.db'}"
    for name in ("good", "bad"):
        optuna.create_study(study_name=name, storage=url).set_user_attr("owner", name)
    plant_deep_attribute(url, "bad")
    with serving(url) as (base, _, _):
        studies = _get(f"{base}/api/studies")["study_summaries"]
        assert [s["study_name"] for s in studies] == ["good", "bad"]
        good = _get(f"{base}/api/studies/{studies[0]['study_id']}")
        assert good["name"] == "good"
        assert good["user_attrs"] == [{"key": "owner", "value": "good"}]


def test_dashboard_binds_to_localhost_by_default(
    server: tuple[str, subprocess.Popen[str], str],
) -> None:
    url, _, _ = server
    port = int(url.rsplit(":", 1)[1])
    addresses = {
        info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    }
    for address in addresses - {"127.0.0.1"}:
        with socket.socket() as probe:
            probe.settimeout(2)
            assert probe.connect_ex((address, port)) != 0, f"reachable on {address}"


def test_dashboard_port_in_use_is_a_user_error(
    study: tuple[str, optuna.Study], tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("dashboard", "--storage", study[0], "--port", str(port))
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


def test_dashboard_needs_an_existing_database(tmp_path: Path) -> None:
    missing = tmp_path / "none.db"
    started = time.monotonic()
    result = run_cli("dashboard", "--storage", f"sqlite:///{missing}", "--port", "0")
    assert result.returncode == 2 and "no database file" in result.stderr
    assert not missing.exists()
    assert time.monotonic() - started < 60


def test_dashboard_answers_only_its_own_host_names(
    server: tuple[str, subprocess.Popen[str], str],
) -> None:
    """DNS rebinding: a page on evil.example that resolves its name to 127.0.0.1 sends
    ``Host: evil.example``; the dashboard refuses it and serves its own names."""
    import urllib.error

    url, _, _ = server
    port = url.rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}"):
        request = urllib.request.Request(f"{url}/api/studies", headers={"Host": host})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}"):
        request = urllib.request.Request(f"{url}/api/studies", headers={"Host": host})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 403


def _status(app: Any, host_header: str) -> str:
    """The status line ``app`` (WSGI) answers a request with ``Host: host_header``."""
    seen: list[str] = []
    app({"HTTP_HOST": host_header}, lambda status, headers: seen.append(status))
    return seen[0]


def test_bound_to_every_address_it_can_still_answer_only_the_names_it_was_given() -> None:
    """In a container the dashboard listens on 0.0.0.0 while its port is published on the
    host's 127.0.0.1 only: ``--allow-host`` keeps the DNS-rebinding check there."""
    from loader_search.reports._dashboard import host_checked

    def ok(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("200 OK", [])
        return [b""]

    checked = host_checked(ok, "0.0.0.0", ["127.0.0.1"])
    for allowed in ("127.0.0.1:8080", "localhost:8080", "[::1]:8080", "127.0.0.1"):
        assert _status(checked, allowed) == "200 OK", allowed
    for foreign in ("evil.example:8080", "evil.example", "127.0.0.1.evil.example"):
        assert _status(checked, foreign).startswith("403"), foreign
    assert _status(host_checked(ok, "0.0.0.0"), "evil.example") == "200 OK"  # as before
    named = host_checked(ok, "0.0.0.0", ["dash.example"])
    assert _status(named, "dash.example:443") == "200 OK"
    assert _status(named, "localhost:8080").startswith("403")


def test_a_bad_allowed_host_is_one_line(tmp_path: Path) -> None:
    for bad in ("http://x", "host:8080", "a b", ""):
        result = invoke(
            "dashboard", "--allow-host", bad, "--storage", f"sqlite:///{tmp_path / 'x.db'}"
        )
        assert result.returncode == 2, (bad, result.stdout, result.stderr)
        output = result.stdout + result.stderr
        assert "--allow-host" in output and "Traceback" not in output
        assert not (tmp_path / "x.db").exists()  # refused before the storage is opened


def test_the_note_is_written_without_loading_the_dashboard_app() -> None:
    """`run` and `worker` end by writing the note: loading optuna-dashboard's package would
    import its web app and scikit-learn (2.2 s, measured) for one function."""
    code = (
        "import sys\n"
        "from loader_search.study._note import _dashboard_save_note\n"
        "save = _dashboard_save_note()\n"
        "print(save is not None, 'optuna_dashboard._app' in sys.modules, 'sklearn' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.stdout.split() == ["True", "False", "False"], done.stderr
