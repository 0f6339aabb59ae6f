"""Every name stored with a study or a trial is defined once, in `loader_search.study._keys`:
a copy of one of those strings anywhere else in the package is a second definition waiting to
drift (two different `OOM_REASONS` did).

The keys inside a stored value (the pipeline snapshot, its model, each batch size's entry and
its lifts) are written by the `as_dict` of a typed value and read by its `from_dict`: a read of
one of them anywhere else is a loose dict travelling again (``lift['what']`` did)."""

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
    ("loader_search/study/search/_pipeline.py", "device"): "a bottleneck",
    ("loader_search/study/stats/_recommend.py", "lr"): "a training setting in the fingerprint",
    ("loader_search/trial/_frameworks.py", "val_loss"): "the metric a Lightning module logs",
    ("loader_search/trial/_placeholders.py", "lr"): "a command's placeholder, {lr}",
}


# Stored values with keys of their own: the module that owns each shape, and the classes whose
# `as_dict` writes it.
NESTED = {
    "loader_search/study/search/_pipeline.py": (
        "PipelineSnapshot",
        "PipelineModel",
        "BatchLimit",
        "Lift",
    ),
}
# The same word read with another meaning: (file, key) -> what it names.
NESTED_OTHER_MEANINGS = {
    ("loader_search/_snippets.py", "ranks"): "the training step's ranks",
    ("loader_search/study/stats/_recommend.py", "ranks"): "the training step's ranks",
    ("loader_search/study/config/_config.py", "ranks"): "the [training] key",
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


def _nested_keys(path: Path, classes: tuple[str, ...]) -> set[str]:
    """The keys that the `as_dict` of ``classes`` in ``path`` write (dict literals)."""
    keys: set[str] = set()
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if not (isinstance(node, ast.ClassDef) and node.name in classes):
            continue
        for method in node.body:
            if isinstance(method, ast.FunctionDef) and method.name == "as_dict":
                for found in ast.walk(method):
                    if isinstance(found, ast.Dict):
                        keys.update(
                            k.value
                            for k in found.keys
                            if isinstance(k, ast.Constant) and isinstance(k.value, str)
                        )
    return keys


def _key_reads(path: Path) -> list[tuple[int, str]]:
    """Strings that ``path`` reads a value with: ``x["key"]``, ``x.get("key")``,
    ``x.pop("key")``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            key = node.slice
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("get", "pop")
            and node.args
        ):
            key = node.args[0]
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            found.append((node.lineno, key.value))
    return found


def test_nested_keys_are_read_only_where_their_shape_is_defined() -> None:
    owners: dict[str, str] = {}
    for owner, classes in NESTED.items():
        for key in _nested_keys(PACKAGE.parent / owner, classes):
            owners.setdefault(key, owner)
    assert {"lifts", "what", "limit_from", "batch_sizes", "fetch_cpu_s_per_sample"} <= set(owners)
    strays = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = str(path.relative_to(PACKAGE.parent))
        if relative in NESTED:
            continue
        for line, key in _key_reads(path):
            if key in owners and (relative, key) not in NESTED_OTHER_MEANINGS:
                strays.append(f"{relative}:{line}: {key!r} (read it through {owners[key]})")
    assert not strays, "stored nested keys read outside their type:\n" + "\n".join(strays)


def test_the_check_finds_a_stray_nested_key(tmp_path: Path) -> None:
    owner = tmp_path / "owner.py"
    owner.write_text(
        "class Lift:\n"
        "    def as_dict(self):\n"
        '        return {"what": self.what, "gain": {"inner": 1}}\n'
        "class Other:\n"
        "    def as_dict(self):\n"
        '        return {"elsewhere": 1}\n'
    )
    assert _nested_keys(owner, ("Lift",)) == {"what", "gain", "inner"}
    planted = tmp_path / "planted.py"
    planted.write_text(
        "def f(lift, entry, out):\n"
        '    out["what"] = 1  # a write: not a read\n'
        '    return lift["what"], entry.get("gain"), entry.pop("inner", None), lift.what\n'
    )
    assert sorted(key for _, key in _key_reads(planted)) == ["gain", "inner", "what"]
