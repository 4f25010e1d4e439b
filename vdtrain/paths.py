"""Where the repository's own files are, and how a relative path a user gives is found: from the working
directory first, then from the repository root (so ``checkpoints/shapes/drafter`` works from anywhere).
Light imports only: the apps' checks use it before torch loads."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# The repository's conf/ in a checkout or an editable install; an installed wheel carries a copy in the
# package (setup.py's build step puts it there), since site-packages has no conf/ beside vdtrain/.
_REPO_CONF = REPO_ROOT / "conf"
CONF_DIR = _REPO_CONF if (_REPO_CONF / "fit.yaml").is_file() else Path(__file__).parent / "conf"


def repo_path(path: str | os.PathLike[str]) -> Path:
    """An absolute path; a relative one that is not under the working directory is the repository's (an
    installed wheel has no repository: the working directory's, so an error names a folder the user knows)."""
    given = Path(path).expanduser()
    if given.is_absolute() or given.exists() or CONF_DIR != _REPO_CONF:
        return given.resolve()
    return REPO_ROOT / given
