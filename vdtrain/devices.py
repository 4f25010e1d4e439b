"""Which device an app runs on, and a clear refusal when the one asked for is not there (a CPU-only torch
asked for ``cuda`` would otherwise fail deep inside the first model move)."""

from __future__ import annotations

import importlib.util
import runpy
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def torch_built_with_cuda() -> bool:
    """Read from torch's ``version.py`` without importing torch (seconds on a busy machine)."""
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.submodule_search_locations
    version = Path(spec.submodule_search_locations[0]) / "version.py"
    return runpy.run_path(str(version)).get("cuda") is not None


def gpu_missing() -> str | None:
    """Why no GPU can be used here, or None when one can."""
    if not torch_built_with_cuda():
        return "this torch was built without CUDA"
    import torch

    return None if torch.cuda.is_available() else "no CUDA device is visible"


def pick_device(name: str, key: str = "device") -> torch.device:
    """``auto`` → the first GPU when there is one, else the CPU; anything else as torch spells it, if this
    machine has it. ``key`` names the setting in the error."""
    if name.startswith("cuda"):  # refused before torch is imported where torch has no CUDA at all
        why = gpu_missing()
        if why is not None:
            raise ValueError(f"{key}={name!r}, but {why}: use {key}=cpu (or auto)")
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"{key}={name!r} is not a device: {err}") from err
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"{key}={name!r}, but this machine has {torch.cuda.device_count()} GPU(s)")
    return device
