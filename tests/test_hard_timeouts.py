"""H6: every test that waits on another process does so with a hard timeout, and so does the suite.

A chaos test that can hang is worse than none. Calls that block on a child (``subprocess.run``,
``check_output``, ``check_call``, ``Popen.communicate``) must pass ``timeout=``; the harness
(``launch_ranks``/``run_ranks``) always has one (120 s unless given); and pytest-timeout kills any
single test after the suite-wide limit in pyproject.toml.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
BLOCKING = {"run", "check_output", "check_call", "call", "communicate"}


def _blocking_calls_without_timeout(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value
        is_subprocess = (
            isinstance(owner, ast.Name) and owner.id == "subprocess" and node.func.attr in BLOCKING
        )
        is_communicate = node.func.attr == "communicate"
        if (is_subprocess or is_communicate) and not any(k.arg == "timeout" for k in node.keywords):
            found.append(f"{path.relative_to(TESTS.parent)}:{node.lineno} {ast.unparse(node.func)}(...)")
    return found


def test_every_blocking_wait_on_a_child_process_has_a_timeout():
    offenders = [hit for path in sorted(TESTS.rglob("*.py")) for hit in _blocking_calls_without_timeout(path)]
    assert offenders == [], "calls that could wait forever on a child process:\n" + "\n".join(offenders)


def test_the_suite_has_a_per_test_hard_timeout():
    config = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert 0 < int(config["timeout"]) <= 600
    pytest.importorskip("pytest_timeout")
