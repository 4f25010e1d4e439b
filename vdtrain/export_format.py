"""The drafter export folder's file names, what a folder holding a drafter looks like, and its download:
the bottom layer that the drafter (which reads and writes the folder), the Hub side (which checks and
pushes it) and the export app's checks stand on."""

from __future__ import annotations

import os
import re
from pathlib import Path

from huggingface_hub import constants, snapshot_download

from vdtrain.zero_checkpoint import is_zero_checkpoint

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
CARD_FILE = "README.md"
EXPORT_FILES = (CONFIG_FILE, WEIGHTS_FILE, CARD_FILE)
# A Hugging Face Hub model id: ``owner/name``.
REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")


def is_run(folder: Path) -> bool:
    """A ``vdtrain.fit`` run folder (Hydra's record or fit's summary is there)."""
    return (folder / ".hydra").is_dir() or (folder / "summary.json").is_file()


def holds_drafter(folder: Path) -> bool:
    """A run folder, a drafter folder or a DeepSpeed ZeRO checkpoint folder: what ``source=`` may name
    besides a ``.ckpt`` file or a repo id."""
    return is_run(folder) or (folder / CONFIG_FILE).is_file() or is_zero_checkpoint(folder)


def no_drafter_here(source: str, folder: Path) -> FileNotFoundError:
    return FileNotFoundError(
        f"source={source!r}: no drafter here: {str(folder)!r} is not a vdtrain.fit run folder (.hydra/ or "
        f"summary.json), a drafter folder ({CONFIG_FILE}), a .ckpt or a DeepSpeed ZeRO checkpoint folder"
    )


def download(
    repo_id: str, revision: str | None = None, cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """The local snapshot of a Hub drafter repo (only the cache is used when ``HF_HUB_OFFLINE`` is set)."""
    try:
        folder = snapshot_download(
            repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=list(EXPORT_FILES)
        )
    except (OSError, ValueError) as err:  # huggingface_hub's HTTP, cache and id errors
        offline = (
            " (HF_HUB_OFFLINE is set: only the cache was searched)" if constants.is_offline_mode() else ""
        )
        raise FileNotFoundError(
            f"drafter {repo_id!r} is not a local path, and Hub repo {repo_id!r} (revision "
            f"{revision or 'main'}) could not be downloaded and is not in the local cache "
            f"{str(cache_dir or constants.HF_HUB_CACHE)!r}{offline}: {err}"
        ) from err
    return Path(folder)
