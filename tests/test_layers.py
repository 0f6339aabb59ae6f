"""The layers import one way (docs/development.md): cli -> report -> study -> team -> trial ->
workloads -> the base modules (params, errors, interrupts, ...). Every import in the package,
at the top of a module or inside a function, is read from the source (``ast``) and checked."""

from __future__ import annotations

import ast
from pathlib import Path

import loader_search

PACKAGE = Path(loader_search.__file__).parent
# Highest first; a module may import its own layer and the ones after it.
LAYERS = ("cli", "report", "study", "team", "trial", "workloads")
FACADES = {"loader_search/__init__.py", "loader_search/__main__.py"}  # the public entry points


def _layer(module: str) -> int:
    """The rank of ``loader_search.x.y`` (0 highest); the base modules rank below all."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    return len(LAYERS)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every ``loader_search`` import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against the module's package
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            found.append((node.lineno, name))
    return [(line, name) for line, name in found if name.split(".")[0] == "loader_search"]


def test_every_import_goes_down_the_layers() -> None:
    wrong = []
    checked = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).as_posix()
        if relative in FACADES:
            continue
        module = relative.removesuffix(".py").replace("/", ".")
        for line, name in _imports(path):
            checked += 1
            if _layer(name) < _layer(module):
                wrong.append(f"{relative}:{line} imports {name}")
    assert checked > 100  # the walk found the package's imports
    assert wrong == []


def test_the_check_sees_an_import_going_up(tmp_path: Path) -> None:
    # The same reading on a module written to break the rule: it must be caught.
    bad = PACKAGE / "trial" / "_layer_probe_tmp.py"
    bad.write_text("def f():\n    from loader_search.study._keys import PARAMS_ATTR\n")
    try:
        found = _imports(bad)
    finally:
        bad.unlink()
    assert found == [(2, "loader_search.study._keys")]
    assert _layer("loader_search.study._keys") < _layer("loader_search.trial._layer_probe_tmp")
