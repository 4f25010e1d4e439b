"""Issue #56, item 4: calls that cannot be swapped. A function of vdtrain/ that takes 8 or more positional
parameters (``self`` and ``cls`` not counted) invites two adjacent ints to trade places silently; settings go
by keyword (after ``*``) or as the config object they come from. None is left, and a new one fails here."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "vdtrain"
MOST = 7  # positional parameters a function may take


def wide_functions() -> set[tuple[str, str]]:
    """(file, function) of every function in vdtrain/ with more than ``MOST`` positional parameters."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names = [a.arg for a in node.args.posonlyargs + node.args.args]
                if len([n for n in names if n not in ("self", "cls")]) > MOST:
                    found.add((path.relative_to(PACKAGE).as_posix(), node.name))
    return found


def test_no_function_takes_eight_positional_parameters():
    found = wide_functions()
    assert not found, f"take {MOST + 1}+ positional parameters (make settings keyword-only): {found}"
