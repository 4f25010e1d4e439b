"""Where the repository's own files are, and how a relative path a user gives is found: from the working
directory first, then from the repository root (so ``checkpoints/shapes/drafter`` works from anywhere).
Light imports only: the apps' checks use it before torch loads."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"


def repo_path(path: str | os.PathLike[str]) -> Path:
    """An absolute path; a relative one that is not under the working directory is the repository's."""
    given = Path(path).expanduser()
    if given.is_absolute() or given.exists():
        return given.resolve()
    return REPO_ROOT / given
