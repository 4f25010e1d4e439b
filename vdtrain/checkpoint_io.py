"""Reading weight files strictly, with errors that name what is wrong."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from torch import nn

# Where trainers of the original projects nest the state dict inside a checkpoint file.
STATE_DICT_KEYS = ("model", "module", "state_dict")


class CheckpointError(RuntimeError):
    pass


def read_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """A state dict from a ``.pt``/``.pth``/``.bin`` (optionally nested) or ``.safetensors`` file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise CheckpointError(f"checkpoint file not found: {str(path)!r}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        # The official trainers save their argparse Namespace under "args"; allow that one class.
        with torch.serialization.safe_globals([argparse.Namespace]):
            blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated or foreign file: say which one
        raise CheckpointError(f"cannot read checkpoint {str(path)!r}: {err}") from err
    if isinstance(blob, dict):
        for key in STATE_DICT_KEYS:
            if key in blob and isinstance(blob[key], dict):
                return blob[key]
        if all(isinstance(v, torch.Tensor) for v in blob.values()):
            return blob
    raise CheckpointError(
        f"{str(path)!r} holds no state dict "
        f"(looked for a flat dict of tensors or one under {STATE_DICT_KEYS})"
    )


def _listing(keys: list[str], limit: int = 12) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", … ({len(keys) - limit} more)" if len(keys) > limit else "")


def load_strict(module: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """Load ``state`` into ``module``; on any missing, unexpected or mis-shaped key raise one error
    that lists them, so a wrong file or a wrong size preset is obvious."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = sorted(
        f"{k}: file {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in set(state) & set(expected)
        if state[k].shape != expected[k].shape
    )
    problems = []
    if missing:
        problems.append(f"missing keys: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_listing(unexpected)}")
    if shapes:
        problems.append(f"shape mismatches: {_listing(shapes)}")
    if problems:
        raise CheckpointError(f"{what}: the checkpoint does not match the model — " + "; ".join(problems))
    module.load_state_dict(state, strict=True)
