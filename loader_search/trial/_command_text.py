"""What a command's words and output say when its trial fails (`loader_search.trial._command`).

* Its interpreter's flags: the start-up hook is a ``sitecustomize`` on ``PYTHONPATH``, which a
  Python run with ``-I`` or ``-E`` ignores and one run with ``-S`` never imports
  (`interpreter_flag`, `no_hook`).
* Its interpreter: a Python without torch or loader-search (the system's, where the user's
  environment is not active) is named by its path, with the fix (`command_python`,
  `wrong_python`).
* The error in its output: under torchrun, the launcher's own traceback and banner
  (``ChildFailedError``, ``====``) come last, the failing rank's error above them
  (`last_error`). The hook's record of the error a rank ended in is read first
  (`loader_search.trial._command_read.Seen.error_tail`); this is for a command without it.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence

# The interpreter's flags under which the hook cannot load, and why.
_NO_HOOK = {
    "-I": "isolated mode, which ignores PYTHONPATH, where the hook is",
    "-E": "which ignores PYTHONPATH, where the hook is",
    "-S": "which skips the site module that imports the hook",
}
_PYTHON = re.compile(r"(python|pypy)[0-9.]*")
# Launchers that start each rank as a new interpreter, without their own flags.
_LAUNCHERS = ("torch.distributed.run", "torch.distributed.launch")
ELASTIC = "torch.distributed.elastic"  # torchrun's own errors: never a rank's
_RANK_PREFIX = re.compile(r"^\[(?:rank|default)(\d+)\]:\s?")
_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
LINE_CHARS = 200  # of the line that names an error


def interpreter_flag(argv: Sequence[str]) -> str | None:
    """``-I``, ``-E`` or ``-S`` where the command's interpreter runs with it (``python -I
    train.py``, ``python3 -uE -m pkg``), else None; None too for ``-m torch.distributed.run``,
    whose ranks start without it."""
    if not argv or not _PYTHON.fullmatch(os.path.basename(argv[0])):
        return None
    found = None
    words = iter(argv[1:])
    for word in words:
        if word == "--check-hash-based-pycs":
            next(words, None)
            continue
        if not word.startswith("-") or word in ("-", "--"):
            return found  # the script: the options end
        if word.startswith("--"):
            continue
        letters = word[1:]
        for at, letter in enumerate(letters):
            if letter in "cm":
                rest = letters[at + 1 :] or next(words, "")
                return None if letter == "m" and rest.startswith(_LAUNCHERS) else found
            if letter in "WX":  # a value follows: the word's rest, or the next word
                if at == len(letters) - 1:
                    next(words, None)
                break
            if f"-{letter}" in _NO_HOOK and found is None:
                found = f"-{letter}"
    return found


def no_hook(flag: str | None) -> str:
    """One line: the hook did not load in the command, because of ``flag`` (None: unknown)."""
    if flag is not None:
        return (
            f"the loader-search hook did not load in the command: its Python runs with {flag},"
            f" {_NO_HOOK[flag]}; drop {flag} from the command"
        )
    return (
        "the loader-search hook did not load in the command: its Python ignores PYTHONPATH,"
        " where the hook is (-I, -E, -S, or a wrapper that clears it); run it without those"
        " flags and with PYTHONPATH kept"
    )


NO_HOOK_HINT = (
    "loader-search's start-up hook is a sitecustomize on PYTHONPATH: run the command with a"
    " Python that reads it (no -I, -E or -S) and keep PYTHONPATH as loader-search sets it"
)
NOTHING_SEEN = (
    "the command ended without building a torch.utils.data.DataLoader the loader-search hook"
    " saw, so there is nothing to tune: feed its training loop from a DataLoader (its settings"
    " in the code or as flags, docs/scripts.md); if it builds one, the hook did not load (a"
    " Python run with -I, -E or -S ignores PYTHONPATH, where the hook is: drop the flag)"
)
# torch missing from the interpreter that ran the command, as Python says it.
_NO_TORCH = re.compile(r"ModuleNotFoundError: No module named 'torch'")
WRONG_PYTHON_HINT = (
    "the command's first word picks the Python that runs it: name the one whose environment"
    " has torch and loader-search installed"
)


def command_python(argv: Sequence[str], workdir: str) -> str:
    """The program the command's first word names, found as the command finds it: a word
    with a slash from the command's folder, a bare name on ``PATH`` (the command inherits
    this process's); the word itself where nothing is found."""
    word = argv[0] if argv else "python"
    if os.sep in word:
        return os.path.normpath(os.path.join(workdir, word))
    return shutil.which(word, path=os.environ.get("PATH")) or word


def lacks_torch(output: str) -> bool:
    """Whether the command's ``output`` says its Python has no torch."""
    return _NO_TORCH.search(output) is not None


def wrong_python(python: str, modules: Sequence[str], *, found: bool) -> str:
    """One line: the command's Python cannot import ``modules``, and the fix. ``python``: the
    interpreter that ran (``found``: as it named itself), or the program the command's first
    word names (a launcher, a wrapper: the Python it runs is named by it)."""
    named = [
        m if m in ("torch", "loader_search") else f"{m} (loader-search needs it)" for m in modules
    ]
    who = python if found or _PYTHON.fullmatch(os.path.basename(python)) else f"(run by {python})"
    return (
        f"the command's Python {who} cannot import {', '.join(named)}: activate the environment"
        " that has torch and loader-search, or give that environment's python by its full"
        " path, e.g. .venv/bin/python"
    )


def last_error(text: str) -> str:
    """The line that says what went wrong in the command's output ``text``: under torchrun's
    banner, the failing rank's error (the root cause's rank where the banner names it), else
    the last traceback's final line that is not torchrun's own, else the last line."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return "(no output)"
    found = _tracebacks(lines)
    root = _root_rank(lines)
    chosen: list[tuple[int | None, str]] = [
        (rank, line) for rank, line in found if root is not None and rank == root
    ]
    chosen = chosen or [(rank, line) for rank, line in found if not line.startswith(ELASTIC)]
    if not chosen:
        return lines[-1].strip()[:LINE_CHARS]
    rank, line = chosen[-1]
    return (line if rank is None else f"rank {rank}: {line}")[:LINE_CHARS]


def _tracebacks(lines: list[str]) -> list[tuple[int | None, str]]:
    """Each traceback's final line in ``lines``, with the rank whose prefix it bears
    (``[rank1]:``, torchrun's; None without one)."""
    found: list[tuple[int | None, str]] = []
    inside: dict[int | None, bool] = {}
    for raw in lines:
        prefix = _RANK_PREFIX.match(raw)
        rank = int(prefix.group(1)) if prefix else None
        line = raw[prefix.end() :] if prefix else raw
        if line.startswith("Traceback (most recent call last)"):
            inside[rank] = True
        elif inside.get(rank) and line and not line[0].isspace():
            inside[rank] = False
            found.append((rank, line.strip()))
    return found


def _root_rank(lines: list[str]) -> int | None:
    """The rank torchrun's banner names as the root cause (its first observed failure)."""
    for at, line in enumerate(lines):
        if line.startswith("Root Cause"):
            for after in lines[at + 1 :]:
                found = _ROOT_RANK.match(after)
                if found:
                    return int(found.group(1))
    return None
