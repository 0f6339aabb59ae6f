"""The HTML report in a real headless browser (Debian's ``chromium``).

The test drives chromium over the DevTools protocol and reads the page's own events: every
URL it requested (only the file itself is allowed), uncaught JavaScript exceptions,
console errors, and whether each plot container holds a drawn plot. The browser resolves no
host name at all (``--host-resolver-rules``), as on a machine without network. A control page
with a remote image and a failing script proves the checks see requests and errors.

Skipped when chromium is not installed, except under ``LOADER_SEARCH_REQUIRE_BROWSER=1``
(set by ``.ci/run``, which installs it).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loader_search.reports import collect, render
from loader_search.reports._html import PLOT_IDS
from tests.test_report import build_study

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
LOCAL_SCHEMES = ("file:", "data:", "blob:", "about:")
BROWSER_FLAGS = (
    "--headless",
    "--no-sandbox",  # runs as root in CI
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--host-resolver-rules=MAP * ~NOTFOUND",  # offline: no name resolves
)


def _chromium() -> str:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    reason = "chromium is not installed (apt-get install -y chromium)"
    if os.environ.get("LOADER_SEARCH_REQUIRE_BROWSER"):
        pytest.fail(f"{reason}, and LOADER_SEARCH_REQUIRE_BROWSER is set")
    pytest.skip(reason)


class DevTools:
    """Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
    JSON messages ending in NUL, commands on fd 3, answers and events on fd 4): no
    websocket client needed. Only the page's own events are read, so the browser's
    background traffic (update checks and the like) is not mistaken for the page's."""

    def __init__(self, chromium: str, profile: Path) -> None:
        commands_read, self._commands = os.pipe()
        self._answers, answers_write = os.pipe()

        def child_fds() -> None:
            # In the child, after fork: our pipe ends become fds 3 and 4 (moved above 10
            # first, so that neither overwrites the other).
            high_read = fcntl.fcntl(commands_read, fcntl.F_DUPFD, 10)
            high_write = fcntl.fcntl(answers_write, fcntl.F_DUPFD, 10)
            os.dup2(high_read, 3)
            os.dup2(high_write, 4)

        self.process = subprocess.Popen(
            [chromium, *BROWSER_FLAGS, f"--user-data-dir={profile}", "--remote-debugging-pipe"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=child_fds,
            pass_fds=(3, 4),
        )
        os.close(commands_read)
        os.close(answers_write)
        self.events: list[dict[str, Any]] = []
        self._replies: dict[int, dict[str, Any]] = {}
        self._next_id = 0
        self._buffer = b""

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("chromium did not answer")
            ready, _, _ = select.select([self._answers], [], [], remaining)
            if ready:
                chunk = os.read(self._answers, 1 << 16)
                if not chunk:
                    raise RuntimeError("chromium closed the DevTools pipe")
                self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        parsed: dict[str, Any] = json.loads(message)
        return parsed

    def send(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        request: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            request["sessionId"] = session
        os.write(self._commands, json.dumps(request).encode() + b"\0")
        deadline = time.monotonic() + 60
        while self._next_id not in self._replies:
            message = self._read_message(deadline)
            if "id" in message:
                self._replies[message["id"]] = message
            else:
                self.events.append(message)
        reply = self._replies.pop(self._next_id)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        result: dict[str, Any] = reply.get("result", {})
        return result

    def open_page(self, url: str) -> str:
        """Open ``url`` in a new tab, watching its network and errors; returns its session."""
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        session = str(
            self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        )
        for domain in ("Network", "Runtime", "Log", "Page"):
            self.send(f"{domain}.enable", session)
        self.send("Page.navigate", session, url=url)
        return session

    def evaluate(self, session: str, expression: str) -> Any:
        result = self.send("Runtime.evaluate", session, expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")

    def requests(self, session: str) -> list[str]:
        """Every URL the page asked for, the page itself included."""
        return [
            e["params"]["request"]["url"]
            for e in self.events
            if e.get("sessionId") == session and e.get("method") == "Network.requestWillBeSent"
        ]

    def errors(self, session: str) -> list[str]:
        """Uncaught exceptions, console.error calls and error log entries of the page."""
        found = []
        for event in self.events:
            if event.get("sessionId") != session:
                continue
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                details = params.get("exceptionDetails", {})
                found.append(str(details.get("exception", {}).get("description") or details))
            elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
                found.append(json.dumps(params.get("args", []))[:500])
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                found.append(str(params["entry"].get("text"))[:500])
        return found

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, TimeoutError, OSError):
            self.send("Browser.close")
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._commands)
        os.close(self._answers)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[DevTools]:
    devtools = DevTools(_chromium(), tmp_path / "profile")
    yield devtools
    devtools.close()


def _wait_for_status(browser: DevTools, session: str, timeout_s: float = 90) -> str:
    """The report's own verdict (``data-report-status``), once its plots are drawn."""
    deadline = time.monotonic() + timeout_s
    status = None
    while time.monotonic() < deadline:
        status = browser.evaluate(
            session, "document.body && document.body.getAttribute('data-report-status')"
        )
        if status not in (None, "loading"):
            return str(status)
        time.sleep(0.2)
    raise AssertionError(f"the report did not finish drawing in {timeout_s} s: {status}")


def test_report_renders_offline_in_chromium(
    tmp_path_factory: pytest.TempPathFactory, browser: DevTools
) -> None:
    folder = tmp_path_factory.mktemp("browser")
    _, study = build_study(folder, trials=3)
    page = folder / "report.html"
    page.write_text(render(collect(study, 0.05)), encoding="utf-8")

    session = browser.open_page(page.as_uri())
    assert _wait_for_status(browser, session) == "ok"
    assert browser.errors(session) == []
    count_svgs = (
        "Object.fromEntries(IDS.map(id => [id, document.getElementById(id)"
        " ? document.getElementById(id).querySelectorAll('svg.main-svg').length : -1]))"
    )
    drawn = browser.evaluate(session, count_svgs.replace("IDS", json.dumps(list(PLOT_IDS))))
    assert drawn == {plot_id: drawn[plot_id] for plot_id in PLOT_IDS}
    empty = [plot_id for plot_id, count in drawn.items() if count <= 0]
    assert not empty, f"plot containers left empty: {empty}"
    # The file itself and data: URIs plotly builds in memory; nothing from any network.
    requested = browser.requests(session)
    assert page.as_uri() in requested
    assert [url for url in requested if not url.startswith(LOCAL_SCHEMES)] == []


def test_the_checks_see_requests_and_errors(tmp_path: Path, browser: DevTools) -> None:
    """Control for the test above: a page that loads something remote and throws is caught."""
    page = tmp_path / "remote.html"
    page.write_text(
        '<html><body data-report-status="ok"><img src="http://report-test.invalid/x.png">'
        "<script>undefinedFunction();</script></body></html>"
    )
    session = browser.open_page(page.as_uri())
    _wait_for_status(browser, session)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(browser.requests(session)) < 2:
        browser.evaluate(session, "1")  # pumps events
        time.sleep(0.2)
    assert "http://report-test.invalid/x.png" in browser.requests(session)
    assert any("undefinedFunction" in e for e in browser.errors(session))
