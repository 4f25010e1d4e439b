"""Issue #56, item 4: calls that cannot be swapped. A function of vdtrain/ that takes 8 or more positional
parameters (``self`` and ``cls`` not counted) invites two adjacent ints to trade places silently; settings go
by keyword (after ``*``) or as the config object they come from. The goal is none; ``WIDE`` lists those
still wide, and may only shrink: a new wide function fails here, and so does an entry that is no longer
wide (strike it)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "vdtrain"
MOST = 7  # positional parameters a function may take
WIDE = {  # (file under vdtrain/, function): still wide, to be narrowed (issue #56)
    ("eval/runner.py", "__init__"),
    ("generate.py", "write_stats"),
    ("shapes/build.py", "train_target"),
    ("shapes/build.py", "write_target_folder"),
    ("targets/chameleon.py", "__init__"),
    ("targets/janus.py", "__init__"),
}


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


def test_no_new_function_takes_eight_positional_parameters():
    found = wide_functions()
    assert not found - WIDE, (
        f"take {MOST + 1}+ positional parameters (make settings keyword-only): {found - WIDE}"
    )
    assert not WIDE - found, f"no longer wide, strike from WIDE: {WIDE - found}"
