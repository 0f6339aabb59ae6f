"""The documentation cannot drift: the command reference is regenerated from the CLI and
compared, the README stays one screen with its two commands runnable as written, and every
relative link in the README and docs/ points at a file (and heading) that exists."""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from loader_search.cli import app
from tests.conftest import ROOT

DOCS = ROOT / "docs"
COMMANDS = DOCS / "commands.md"
GENERATOR = ROOT / "scripts" / "gen_docs.sh"
README = ROOT / "README.md"
README_MAX_LINES = 250

# The two commands a newcomer copies into a fresh machine: they must stay exactly as written.
QUICKSTART_COMMAND = (
    "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e . &&"
    " .venv/bin/loader-search run studies/quickstart.toml"
)
TEST_COMMAND = (
    "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e '.[test]' &&"
    " .venv/bin/python -m pytest -n 2"
)

MARKDOWN = [README, *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)


def test_command_reference_is_current(tmp_path: Path) -> None:
    fresh = tmp_path / "commands.md"
    result = subprocess.run(
        ["bash", str(GENERATOR), str(fresh)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    expected = fresh.read_text(encoding="utf-8")
    committed = COMMANDS.read_text(encoding="utf-8") if COMMANDS.exists() else ""
    if committed != expected:
        diff = "".join(
            difflib.unified_diff(
                committed.splitlines(keepends=True),
                expected.splitlines(keepends=True),
                "docs/commands.md (committed)",
                "docs/commands.md (from the CLI)",
            )
        )
        pytest.fail(
            "docs/commands.md is stale: run `bash scripts/gen_docs.sh` and commit the result\n"
            + "\n".join(diff.splitlines()[:40])
        )
    # Every command of the app has its section (the generator did not skip one).
    for command in app.registered_commands:
        name = command.name or (command.callback.__name__ if command.callback else "")
        assert f"## `loader-search {name}`" in expected, name


def test_readme_fits_on_a_screen_and_keeps_its_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    lines = text.count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move the detail to docs/"
    )
    code = "\n".join(_code_blocks(text))
    for command in (QUICKSTART_COMMAND, TEST_COMMAND):
        assert command in code.splitlines(), f"README.md lost the command line {command!r}"


def test_every_doc_is_linked_from_the_readme() -> None:
    linked = {(README.parent / target).resolve() for target, _ in _relative_links(README)}
    orphans = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not orphans, f"docs not linked from README.md's 'Where to go next': {orphans}"


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files_that_exist(page: Path) -> None:
    broken = []
    for target, anchor in _relative_links(page):
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target}#{anchor}: no such heading in {path.name}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def _code_blocks(text: str) -> list[str]:
    """The lines inside fenced code blocks."""
    inside, lines = False, []
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        elif inside:
            lines.append(line)
    return lines


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks (a `[x](y)` in code is no link)."""
    inside, lines = False, []
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        elif not inside:
            lines.append(line)
    return "\n".join(lines)


def _relative_links(page: Path) -> list[tuple[str, str]]:
    """(path, anchor) of each link in ``page`` that stays in the repository."""
    text = _prose(page.read_text(encoding="utf-8"))
    found = []
    for target in [*LINK.findall(text), *REFERENCE.findall(text)]:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
            continue  # https:, mailto: ...: not a file here
        path, _, anchor = target.partition("#")
        found.append((path, anchor))
    return found


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of ``page``: lower case, punctuation dropped, spaces to '-'."""
    anchors = set()
    for line in _prose(page.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            title = re.sub(r"[^\w\- ]", "", match.group(1).lower())
            anchors.add(title.replace(" ", "-"))
    return anchors


def test_the_configuration_page_lists_every_range() -> None:
    from loader_search._rules import RANGES

    page = (ROOT / "docs" / "configuration.md").read_text()
    for key, rule in RANGES.items():
        assert f"| `{key}` | {rule.text} |" in page, f"docs/configuration.md lacks {key}"


def _walk_rows() -> list[tuple[int, str, str]]:
    """(step, file, name) of each row of docs/development.md's walk of one setting."""
    text = (DOCS / "development.md").read_text(encoding="utf-8")
    section = text.split("## One setting, from `run` to the loop", 1)[1].split("\n## ", 1)[0]
    row = re.compile(r"^\| (\d+) \| `([^`]+)` \| `([^`]+)` \|", re.M)
    return [(int(n), file, name) for n, file, name in row.findall(section)]


def _defines(path: Path, name: str) -> bool:
    """Whether ``path`` defines ``name`` at its top level (``Class.method`` inside a class)."""
    import ast

    owner, _, member = name.rpartition(".")
    body = ast.parse(path.read_text(encoding="utf-8")).body
    if owner:
        classes = [n for n in body if isinstance(n, ast.ClassDef) and n.name == owner]
        body = classes[0].body if classes else []
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return any(isinstance(n, kinds) and n.name == member for n in body)


def test_the_walk_of_one_setting_names_functions_where_they_live() -> None:
    rows = _walk_rows()
    assert [n for n, _, _ in rows] == list(range(1, len(rows) + 1)), "rows not numbered 1..N"
    assert rows[0][2] == "run" and rows[-1][2] == "build_loader", "not from `run` to the loop"
    package = ROOT / "loader_search"
    moved = [
        f"{n}: {file} {name}"
        for n, file, name in rows
        if not (package / file).is_file() or not _defines(package / file, name)
    ]
    assert not moved, f"docs/development.md's walk names what is not there: {moved}"
