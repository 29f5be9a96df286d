"""Every ``spread`` name that the README, the docs, the examples and the docstrings show imports the
way it is written there.

A name reachable only as an attribute (``spread.callbacks.EarlyStopping`` once ``spread`` is
imported) but not as a module (``from spread.callbacks import EarlyStopping``) is a broken promise
to anyone who copies the text, so each statement is executed as written and each dotted name is
checked in both forms.
"""

from __future__ import annotations

import ast
import importlib
import re
import types
from pathlib import Path

import pytest

import spread

ROOT = Path(__file__).resolve().parents[1]
TEXT_SOURCES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("*.py")])
PACKAGE = ROOT / "src" / "spread"

# `from spread.x import a, b as c` (parenthesised lists may span lines) and `import spread.x as y, z`
# (also after `;` as in `python -c "import spread; ..."`).
_FROM_IMPORT = re.compile(r"\bfrom\s+(spread(?:\.\w+)*)\s+import\s+(\([^)]*\)|[\w ,*]+)")
_IMPORT = re.compile(r"(?:^|;)[ \t>]*import\s+([\w .,]+)", re.MULTILINE)
_DOTTED = re.compile(r"(?<![\w.])spread(?:\.[A-Za-z_]\w*)+")


def _docstrings(path: Path) -> str:
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    tree = ast.parse(path.read_text())
    return "\n".join(
        doc for node in ast.walk(tree) if isinstance(node, nodes) and (doc := ast.get_docstring(node))
    )


def _import_statements(text: str) -> list[str]:
    statements = []
    for module, names in _FROM_IMPORT.findall(text):
        for name in names.strip("()").replace("\n", " ").split(","):
            if name.strip():
                statements.append(f"from {module} import {name.strip()}")
    for names in _IMPORT.findall(text):
        for name in names.split(","):
            target = name.split()[0] if name.split() else ""
            if target == "spread" or target.startswith("spread."):
                statements.append(f"import {name.strip()}")
    return statements


def _documented() -> tuple[dict[str, str], dict[str, str]]:
    """({statement: where}, {dotted name: where}) over every source, first place seen."""
    texts = [(str(path.relative_to(ROOT)), path.read_text()) for path in TEXT_SOURCES]
    for path in sorted(PACKAGE.rglob("*.py")):
        texts.append((f"{path.relative_to(ROOT)} (docstrings)", _docstrings(path)))
    statements: dict[str, str] = {}
    dotted: dict[str, str] = {}
    for where, text in texts:
        for statement in _import_statements(text):
            statements.setdefault(statement, where)
        for name in _DOTTED.findall(text):
            dotted.setdefault(name, where)
    return statements, dotted


STATEMENTS, DOTTED = _documented()


def _resolve(dotted: str) -> None:
    """Resolve ``dotted`` the way Python does after ``import spread``, importing submodules not yet
    loaded; every module met on the way must also import under the name written (``import
    spread.callbacks``, the same module), and the last part from its parent module when the parent is
    one (``from spread.callbacks import EarlyStopping``)."""
    parts = dotted.split(".")
    objects: list[object] = [importlib.import_module("spread")]
    for i, part in enumerate(parts[1:], start=2):
        prefix = ".".join(parts[:i])
        try:
            obj = getattr(objects[-1], part)
        except AttributeError:
            obj = importlib.import_module(prefix)  # a submodule not imported yet
        if isinstance(obj, types.ModuleType) and importlib.import_module(prefix) is not obj:
            raise ImportError(f"`import {prefix}` gives another module than the attribute")
        objects.append(obj)
    if isinstance(objects[-2], types.ModuleType):
        exec(f"from {'.'.join(parts[:-1])} import {parts[-1]}", {})


def test_the_sources_were_read():
    # The extraction itself must find what the text obviously holds, or every check below is vacuous.
    assert "import spread" in STATEMENTS
    assert {"spread.Trainer", "spread.memory.checkpoint_blocks"} <= set(DOTTED)
    text = "x = 1; import spread.ps as ps, torch\nfrom spread.a import (b,\n  c as d)"
    assert _import_statements(text) == [
        "from spread.a import b",
        "from spread.a import c as d",
        "import spread.ps as ps",
    ]


@pytest.mark.parametrize("statement", sorted(STATEMENTS), ids=str)
def test_import_statement_runs_as_written(statement):
    try:
        exec(statement, {})
    except ImportError as exc:
        pytest.fail(f"{STATEMENTS[statement]}: `{statement}` fails: {exc}")


@pytest.mark.parametrize("name", sorted(DOTTED), ids=str)
def test_dotted_name_resolves_and_imports_as_written(name):
    try:
        _resolve(name)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"{DOTTED[name]}: `{name}` does not resolve or import as written: {exc}")


@pytest.mark.parametrize("name", sorted(spread.__all__), ids=str)
def test_every_public_name_imports_from_spread(name):
    namespace: dict[str, object] = {}
    exec(f"from spread import {name}", namespace)
    if isinstance(namespace[name], types.ModuleType):
        # `spread.callbacks.EarlyStopping` is documented, so `import spread.callbacks` and
        # `from spread.callbacks import EarlyStopping` must work too, and give the same module.
        assert importlib.import_module(f"spread.{name}") is namespace[name]


def test_spread_callbacks_is_the_trainers_callbacks():
    import spread.callbacks
    import spread.train.callbacks

    assert spread.callbacks.__all__ == spread.train.callbacks.__all__
    for name in spread.callbacks.__all__:
        assert getattr(spread.callbacks, name) is getattr(spread.train.callbacks, name)
    from spread.callbacks import EarlyStopping

    assert EarlyStopping is spread.train.callbacks.EarlyStopping
