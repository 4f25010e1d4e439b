"""How the Hydra apps end on a user's mistake: one line naming the problem, exit status 2.

A bad config value, a missing or mismatched checkpoint, a bad prompt file or shard, a refused option or
a missing optional package is the user's to fix, and the message says how; a traceback with Hydra's
footer buries that line. ``HYDRA_FULL_ERROR=1`` or ``debug=true`` keeps the full traceback. Anything
else (a bug) still raises with its traceback.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import TypeVar

from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from vdtrain.checkpoint_io import CheckpointError
from vdtrain.data.shards import ShardError

USER_ERROR_EXIT = 2
# Errors raised for what a user gave: values, files, checkpoints, shards, packages, config types.
USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
    ImportError,
    CheckpointError,
    ShardError,
    OmegaConfBaseException,
    FloatingPointError,  # a non-finite loss or weights: the message names the step and what to change
)

R = TypeVar("R")


def user_errors(app: str) -> Callable[[Callable[[DictConfig], R]], Callable[[DictConfig], R]]:
    """Decorate a Hydra task function (under ``@hydra.main``): a user error prints
    ``<app>: error: <message>`` to stderr and exits with status 2."""

    def wrap(task: Callable[[DictConfig], R]) -> Callable[[DictConfig], R]:
        @functools.wraps(task)
        def run(cfg: DictConfig) -> R:
            try:
                return task(cfg)
            except USER_ERRORS as err:
                if os.environ.get("HYDRA_FULL_ERROR") == "1" or cfg.get("debug", False):
                    raise
                print(f"{app}: error: {err}", file=sys.stderr)
                print(f"{app}: (debug=true or HYDRA_FULL_ERROR=1 shows the traceback)", file=sys.stderr)
                sys.exit(USER_ERROR_EXIT)

        return run

    return wrap
