"""Habits that keep the code readable (issue 15): no function in the library over 60 lines."""

from __future__ import annotations

import ast

from tests.conftest import REPO

MAX_LINES = 60


def test_no_function_is_longer_than_60_lines():
    long = []
    for path in sorted((REPO / "rollart").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "split these into smaller pieces:\n" + "\n".join(long)
