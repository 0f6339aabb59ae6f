"""Every name stored with a study or a trial is defined once, in `loader_search.study._keys`:
a copy of one of those strings anywhere else in the package is a second definition waiting to
drift (two different `OOM_REASONS` did)."""

from __future__ import annotations

import ast
from pathlib import Path

from loader_search.study import _keys

PACKAGE = Path(_keys.__file__).parents[1]

ATTRS = ("user_attrs", "system_attrs")
SETTERS = ("set_user_attr", "set_system_attr")
# The same word with another meaning, never stored as a key: (file, string) -> what it names.
OTHER_MEANINGS = {
    ("loader_search/cli/_doctor.py", "device"): "a doctor check",
    ("loader_search/study/_pipeline.py", "device"): "a bottleneck",
}


def _stored_names() -> dict[str, str]:
    """Each stored key's string, with the constant that defines it."""
    defined = _key_literals(Path(_keys.__file__))  # its own constants, not what it imports
    names: dict[str, str] = {}
    for name, value in vars(_keys).items():
        if name.isupper() and isinstance(value, str) and (value in {v for _, v in defined}):
            names.setdefault(value, name)
    return names


def _key_literals(path: Path) -> list[tuple[int, str]]:
    """Strings that ``path`` uses as a stored key (read, written, queued) or defines as a
    module-level constant: the places a second definition of a key would stand."""
    found: list[tuple[int, str]] = []

    def literal(node: ast.AST | None) -> None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.append((node.lineno, node.value))

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            receiver = node.func.value
            if node.func.attr in SETTERS or (
                node.func.attr in ("get", "pop")
                and isinstance(receiver, ast.Attribute)
                and receiver.attr in ATTRS
            ):
                literal(node.args[0] if node.args else None)
            for keyword in node.keywords:  # enqueue_trial(..., user_attrs={KEY: ...})
                if keyword.arg in ATTRS and isinstance(keyword.value, ast.Dict):
                    for key in keyword.value.keys:
                        literal(key)
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute):
            if node.value.attr in ATTRS:
                literal(node.slice)
        elif isinstance(node, ast.Compare) and any(isinstance(op, ast.In) for op in node.ops):
            for comparator in node.comparators:  # KEY in trial.user_attrs
                if isinstance(comparator, ast.Attribute) and comparator.attr in ATTRS:
                    literal(node.left)
    module = ast.parse(path.read_text(), filename=str(path))
    for statement in module.body:
        if isinstance(statement, (ast.Assign, ast.AnnAssign)):
            values = statement.value.elts if isinstance(statement.value, ast.Tuple) else []
            for value in [statement.value, *values]:
                literal(value)
    return found


def test_stored_keys_are_defined_only_in_the_keys_module() -> None:
    stored = _stored_names()
    strays = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == Path(_keys.__file__):
            continue
        relative = str(path.relative_to(PACKAGE.parent))
        for line, value in _key_literals(path):
            if value in stored and (relative, value) not in OTHER_MEANINGS:
                strays.append(f"{relative}:{line}: {value!r} (use _keys.{stored[value]})")
    assert not strays, "stored keys written out again:\n" + "\n".join(strays)


def test_the_check_finds_a_stray_key(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(
        '"""Doc mentioning trial_budget is fine."""\n'
        'KEY = "trial_budget"\n'
        'KEYS = ("data_wait_fraction", 3)\n'
        "def f(study, trial):\n"
        '    print("val_loss")  # a column header, not a key\n'
        '    study.set_user_attr("sampler", 1)\n'
        '    return trial.user_attrs.get("baseline"), trial.user_attrs["lr"]\n'
    )
    values = [value for _, value in _key_literals(planted)]
    assert sorted(values) == ["baseline", "data_wait_fraction", "lr", "sampler", "trial_budget"]
