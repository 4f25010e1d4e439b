"""The private Lightning members vdtrain overrides (issue 57, item 6) are still there with the parameters
vdtrain's overrides take: a new Lightning release that changes one fails here, by name, not silently in
``fit``."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import lightning as L

from vdtrain.train.lightning_private import ATTRIBUTES, METHODS

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def find(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def instance(cls: type) -> object:
    """One object of ``cls``, built as Lightning builds it, to see its instance attributes."""
    if issubclass(cls, L.Trainer):
        return cls(logger=False, enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu")
    if cls.__name__ == "_SignalConnector":
        return cls(None)
    if cls.__name__ == "CSVLogger":
        return cls("unused")
    return cls()


def test_the_overridden_private_methods_keep_their_parameters():
    changed = []
    for path, name, params in METHODS:
        member = getattr(find(path), name, None)
        if member is None:
            changed.append(f"{path}.{name} is gone")
        elif tuple(inspect.signature(member).parameters) != params:
            got = tuple(inspect.signature(member).parameters)
            changed.append(f"{path}.{name} takes {got}, vdtrain's override expects {params}")
    assert not changed, (
        f"lightning {L.__version__} changed private members vdtrain uses "
        f"(vdtrain/train/lightning_private.py): {'; '.join(changed)}"
    )


def test_the_private_attributes_vdtrain_sets_are_there():
    missing = [f"{path}.{name}" for path, name in ATTRIBUTES if not hasattr(instance(find(path)), name)]
    assert not missing, (
        f"lightning {L.__version__} has no {', '.join(missing)} (vdtrain/train/lightning_private.py)"
    )


def test_lightning_is_capped_below_its_next_minor():
    (pin,) = re.findall(r'^    "(lightning[^"]*)"', PYPROJECT.read_text(), re.MULTILINE)
    assert "<" in pin, f"{pin!r}: private members are overridden (vdtrain/train/lightning_private.py), cap it"
