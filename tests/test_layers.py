"""The layers import one way (docs/development.md): cli -> reports -> study -> team -> trial ->
workloads -> the base modules (params, errors, interrupts, ...). Every import in the package,
at the top of a module or inside a function, is read from the source (``ast``) and checked."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import loader_search

PACKAGE = Path(loader_search.__file__).parent
# Highest first; a module may import its own layer and the ones after it.
LAYERS = ("cli", "reports", "study", "team", "trial", "workloads")
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


def _module_name(path: Path) -> str:
    return path.relative_to(PACKAGE.parent).with_suffix("").as_posix().replace("/", ".")


def _face_exports(module: str) -> dict[str, str]:
    """Name -> defining module of a package face's lazy ``_EXPORTS`` map (read from the source,
    so that an import through a face counts as an import of the module behind it)."""
    init = PACKAGE.parent / module.replace(".", "/") / "__init__.py"
    if not init.is_file():
        return {}
    for node in ast.parse(init.read_text()).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else None
        if isinstance(target, ast.Name) and target.id == "_EXPORTS":
            exports: dict[str, str] = ast.literal_eval(node.value)
            return exports
    return {}


def _imported_names(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every ``from loader_search... import names`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if (
            isinstance(node, ast.ImportFrom)
            and not node.level
            and (node.module or "").split(".")[0] == "loader_search"
        ):
            found.append((str(node.module), [a.name for a in node.names]))
    return found


def _graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (at the top, inside a function or under
    ``TYPE_CHECKING`` alike), each import resolved to the deepest module that exists, and an
    import through a package's face to the module that defines the name."""
    modules = {_module_name(p).removesuffix(".__init__") for p in PACKAGE.rglob("*.py")}
    faces = {name: _face_exports(name) for name in modules}
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _module_name(path).removesuffix(".__init__")
        names = [name for _, name in _imports(path)]
        for module, imported in _imported_names(path):
            names += [faces[module][n] for n in imported if n in faces.get(module, {})]
        targets = set()
        for name in names:
            while name not in modules and "." in name:
                name = name.rsplit(".", 1)[0]
            if name != me and not me.startswith(name + "."):  # not itself, not its package
                targets.add(name)
        graph[me] = targets
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_through_others() -> None:
    graph = _graph()
    assert len(graph) > 80 and sum(map(len, graph.values())) > 100  # the walk saw the package
    # A facade that names a layer's API re-exports from its own modules: not a circle.
    faces = {name for name in graph if (PACKAGE.parent / name.replace(".", "/")).is_dir()}
    assert _circles({m: t - faces for m, t in graph.items()}) == []


def test_the_circle_check_sees_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


# The house's size rule: a module over this many lines does two jobs, a function over that
# many is several steps that want names.
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 100


def test_modules_and_functions_stay_small() -> None:
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        relative = path.relative_to(PACKAGE.parent).as_posix()
        if len(source.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{relative}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{relative}:{node.lineno} {node.name}: {length} lines")
    assert too_long == []


# Packages that name their API in their __init__: code outside such a package imports from
# that face, never from its private modules (tests may reach inside the package they test).
# A room of a package (``study/work/``) has a face of its own: the package's other modules
# import the room through it too.
FACED = ("cli", "reports", "study", "team", "trial", "workloads")


def _private_owner(name: str) -> str | None:
    """The folder that holds the private module ``name`` imports (``loader_search/study/work``
    for ``loader_search.study.work._take``), for a faced package; None for a public name."""
    parts = name.split(".")
    if len(parts) < 3 or parts[1] not in FACED:
        return None
    private = next((i for i, part in enumerate(parts) if i >= 2 and part.startswith("_")), None)
    return None if private is None else "/".join(parts[:private])


def test_code_outside_a_package_imports_its_face() -> None:
    wrong = []
    roots = [PACKAGE, PACKAGE.parent / "benchmarks", PACKAGE.parent / "scripts"]
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            relative = path.relative_to(PACKAGE.parent).as_posix()
            for line, name in _imports(path):
                owner = _private_owner(name)
                if owner is not None and not relative.startswith(owner + "/"):
                    wrong.append(f"{relative}:{line} imports {name}")
    assert wrong == []


def test_the_face_check_sees_a_private_import() -> None:
    assert _private_owner("loader_search.study.work._take") == "loader_search/study/work"
    assert _private_owner("loader_search.study._keys") == "loader_search/study"
    assert _private_owner("loader_search.team._storage") == "loader_search/team"
    assert _private_owner("loader_search.study.work") is None  # a room's face
    assert _private_owner("loader_search.workloads.digits") is None  # a public module
    assert _private_owner("loader_search._system") is None  # a base module


def _faces() -> list[str]:
    return sorted(
        _module_name(init).removesuffix(".__init__")
        for name in FACED
        for init in (PACKAGE / name).rglob("__init__.py")
        if "_hook" not in init.parts  # the start-up hook's folder is no package face
    )


def test_every_face_names_what_it_offers() -> None:
    faces = _faces()
    assert "loader_search.study.work" in faces and len(faces) >= 10
    for face in faces:
        module = importlib.import_module(face)
        offered = module.__all__
        assert offered, f"{face} names nothing"
        for name in offered:
            assert getattr(module, name) is not None, f"{face}.{name}"
        exports = _face_exports(face)
        if exports:  # a lazy face: its map and its list agree
            assert set(exports) == set(offered) - {"main", "__version__"}, face


def test_the_faces_import_nothing_heavy() -> None:
    # Reading a study (`best`, `report`) goes through these faces: importing them, and the
    # names those commands read, must not import torch (the workloads are torch models).
    light = [face for face in _faces() if not face.endswith(".workloads")]
    code = (
        "import sys\n"
        f"for face in {light!r}:\n"
        "    __import__(face)\n"
        "from loader_search.study import StudySummary, open_existing_study, summaries\n"
        "from loader_search.reports import collect\n"
        "from loader_search.team import mask_url, open_storage\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"
