"""docs/extending.md, "Adding a drafter kind", followed literally: in a copy of the repository the Medusa
kind is taken out (its module and its import in the drafters package, which must be the page's blocks as
written) and added back from the page; no other file names it, and its tests pass there."""

from __future__ import annotations

import re

import pytest
from walkthrough import REPO, blocks, copy_repo, follow, registry_parts, run_pytest

SECTION = "Adding a drafter kind"
MODULE, PACKAGE = "vdtrain/drafters/medusa.py", "vdtrain/drafters/__init__.py"

pytestmark = pytest.mark.slow  # a copy of the repository and a fresh interpreter decoding: 30-60 s


def test_the_page_holds_the_kind_as_the_repository_has_it():
    found = blocks(SECTION)
    assert set(found) == {MODULE, PACKAGE}
    assert found[MODULE] == (REPO / MODULE).read_text()
    imports, table, _ = registry_parts(found[PACKAGE])
    assert table is None and imports and set(imports) <= set((REPO / PACKAGE).read_text().splitlines())


def test_a_drafter_kind_is_its_module_and_its_import(tmp_path):
    root = copy_repo(tmp_path)
    imports, _, _ = registry_parts(blocks(SECTION)[PACKAGE])
    package = (root / PACKAGE).read_text()
    for line in imports:
        package = package.replace(line + "\n", "")
    (root / PACKAGE).write_text(package)
    (root / MODULE).unlink()
    named = [
        f"{path.relative_to(root)}:{n}"
        for path in (root / "vdtrain").rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bmedusa\b", line) and not line.lstrip().startswith("#")
    ]
    docstrings = {"vdtrain/drafters/base.py"}  # names the kinds in prose only
    assert {name.split(":")[0] for name in named} <= docstrings, named
    follow(SECTION, root, (PACKAGE,))
    result = run_pytest(root, "tests/test_medusa.py", "-k", "t0 and eagle2 or head_reads or compares")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "3 passed" in result.stdout, result.stdout[-500:]
