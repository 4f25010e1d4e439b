"""Drafter kinds by name: ``DRAFTERS`` maps ``DrafterConfig.kind`` to the kind's class.

A kind is a ``Drafter`` subclass with its options dataclass and its hooks (``vdtrain.drafters.base``),
entered here by ``@register("<name>")`` in its own module; ``vdtrain/drafters/__init__.py`` imports the
kinds' modules, so every kind is registered once ``vdtrain.drafters`` is. The drafter, the engine, fit, the
train module and the exporter call the hooks and compare no kind's name. A new kind is one module and one
import (docs/extending.md, "Adding a drafter kind"); the registry-driven tests (tests/test_drafter_kinds.py)
train, export, reload and decode it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

K = TypeVar("K", bound=type)

DRAFTERS: dict[str, type] = {}  # name -> Drafter subclass, in the order the kinds' modules register them


def register(name: str) -> Callable[[K], K]:
    """Enter the decorated ``Drafter`` subclass in ``DRAFTERS`` as kind ``name``."""

    def enter(kind: K) -> K:
        if name in DRAFTERS:
            raise ValueError(
                f"drafter kind {name!r} is registered twice ({DRAFTERS[name].__name__}, {kind.__name__})"
            )
        DRAFTERS[name] = kind
        return kind

    return enter


def drafter_class(kind: str) -> type:
    """The ``Drafter`` subclass of drafter ``kind``."""
    if kind not in DRAFTERS:
        raise ValueError(f"drafter kind must be one of {list(DRAFTERS)}, got {kind!r}")
    return DRAFTERS[kind]
