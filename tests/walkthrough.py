"""docs/extending.md followed literally: a section's titled code blocks written into a temporary copy of the
repository (a file where its title says; a registry block's imports and rows into that file's table),
and tests run there, in a fresh interpreter, on the copy's code."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "extending.md"
BLOCK = re.compile(r'^```(\w+) title="([^"]+)"\n(.*?)^```$', re.MULTILINE | re.DOTALL)
TABLE = re.compile(r"^(\w+): dict\[.*\] = \{$", re.MULTILINE)
SOURCES = ("vdtrain", "conf", "tests", "docs", "benchmarks", "data_prep", "pyproject.toml")


def blocks(section: str) -> dict[str, str]:
    """The titled code blocks of ``## <section>``, by title."""
    text = PAGE.read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    return {title: code for _, title, code in BLOCK.findall(text[start : end if end > 0 else None])}


def copy_repo(dest: Path) -> Path:
    """The repository's code, configs, docs and tests (not its checkpoints) under ``dest``."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in SOURCES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=skip)
        else:
            shutil.copy2(src, dest / name)
    return dest


def registry_parts(block: str) -> tuple[list[str], str | None, str]:
    """A registry block → (its import lines, the table it adds to, its rows as written); a block of
    imports alone (a registry its modules fill themselves) adds to no table."""
    imports = [line for line in block.splitlines() if line.startswith(("from ", "import "))]
    table = TABLE.search(block)
    if table is None:
        assert "".join(imports) and len(imports) == len(block.strip().splitlines()), block
        return imports, None, ""
    body = block[table.end() + 1 : block.rindex("}")]
    rows = "".join(
        line + "\n" for line in body.splitlines() if line.strip() != "# ... the kinds already there ..."
    )
    return imports, table.group(1), rows


def add_rows(path: Path, block: str) -> None:
    """Write a registry block into ``path``: its imports after the file's last top-level import, its rows
    at the end of the table it names."""
    imports, table, rows = registry_parts(block)
    text = path.read_text()
    last_import = [m.end() for m in re.finditer(r"^(from|import) [^\n]*(\([^)]*\))?[^\n]*\n", text, re.M)][-1]
    text = text[:last_import] + "".join(line + "\n" for line in imports) + text[last_import:]
    if table is None:
        path.write_text(text)
        return
    start = text.index(f"\n{table}: dict[")
    end = text.index("\n}\n", start)
    path.write_text(text[: end + 1] + rows + text[end + 1 :])


def follow(section: str, root: Path, registries: tuple[str, ...]) -> dict[str, str]:
    """Every block of ``section`` applied to the copy at ``root``: files written, ``registries`` (the
    titles that are registry files) added to. Returns the blocks."""
    found = blocks(section)
    for title, code in found.items():
        if title in registries:
            add_rows(root / title, code)
        elif "/" in title or title.endswith(".py"):
            (root / title).parent.mkdir(parents=True, exist_ok=True)
            (root / title).write_text(code)
    return found


def run_pytest(root: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m pytest -q -x *args`` in the copy, importing the copy's ``vdtrain``."""
    return _run(
        root,
        ["-m", "pytest", "-q", "-x", "-o", "addopts=-ra", "-p", "no:cacheprovider", *args],
        str(root),
        timeout,
    )


def run_python(root: Path, code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``code`` run by a fresh interpreter in the copy, importing the copy's ``vdtrain``."""
    return _run(root, ["-c", code], f"{root}{os.pathsep}{root / 'tests'}", timeout)


def _run(root: Path, args: list[str], pythonpath: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=root,
        env={**os.environ, "PYTHONPATH": pythonpath},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
