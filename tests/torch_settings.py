"""torch's process-wide settings that a test must leave readable.

Since pytest 9, ``monkeypatch.setattr``'s undo restores through an object's ``__dict__``, and deletes a
setting that was never there. torch's config modules (dynamo, inductor, functorch) and
``torch.backends.cuda.matmul`` answer their settings from ``__getattr__``, so the undo deletes the
setting, torch then hides it for the rest of the process, and every later test that compiles or decodes
fails far from the cause (430 failures, issue #53). Patch them with torch's own
``torch._dynamo.config.patch(...)`` instead; conftest checks after every test that nothing went missing.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import torch
import torch._dynamo.config
import torch._functorch.config
import torch._inductor.config

#: the objects whose settings live behind ``__getattr__``, by the dotted name a patch would spell
SETTINGS_OBJECTS = {
    "torch._dynamo.config": torch._dynamo.config,
    "torch._inductor.config": torch._inductor.config,
    "torch._functorch.config": torch._functorch.config,
    "torch.backends.cuda.matmul": torch.backends.cuda.matmul,
}
_MATMUL_SETTINGS = (
    "allow_tf32",
    "allow_fp16_reduced_precision_reduction",
    "allow_bf16_reduced_precision_reduction",
)


def setting_names() -> dict[str, tuple[str, ...]]:
    """Every setting each object answers now: taken once, before the first test."""
    names = {name: tuple(obj._config) for name, obj in SETTINGS_OBJECTS.items() if hasattr(obj, "_config")}
    names["torch.backends.cuda.matmul"] = tuple(
        s for s in _MATMUL_SETTINGS if _readable(torch.backends.cuda.matmul, s)
    )
    return names


def _readable(obj: object, name: str) -> bool:
    try:
        getattr(obj, name)
    except AttributeError:
        return False
    except Exception:  # a setting that cannot be read on this build (no CUDA) is not ours to judge
        return True
    return True


def missing_settings(names: dict[str, tuple[str, ...]]) -> list[str]:
    """The settings of ``names`` that no longer read, as dotted names."""
    return [
        f"{obj}.{s}"
        for obj, settings in names.items()
        for s in settings
        if not _readable(SETTINGS_OBJECTS[obj], s)
    ]


def restore(missing: list[str]) -> None:
    """Bring hidden config-module settings back at their defaults, so one culprit fails alone."""
    for dotted in missing:
        obj_name, _, setting = dotted.rpartition(".")
        obj = SETTINGS_OBJECTS[obj_name]
        entry = getattr(obj, "_config", {}).get(setting)
        if entry is not None:
            entry.hide = False


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return ""


def settings_patches(paths: list[Path]) -> Iterator[str]:
    """``file:line`` of every ``monkeypatch.setattr`` / ``mock.patch`` / ``patch.object`` call that aims
    at one of ``SETTINGS_OBJECTS`` (by the object or a dotted string)."""
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            verb = _dotted(node.func)
            if not verb.endswith(("setattr", "patch", "patch.object", "patch.dict")) or verb == "setattr":
                continue
            aimed = _dotted(node.args[0])
            if any(aimed == obj or aimed.startswith(obj + ".") for obj in SETTINGS_OBJECTS):
                yield f"{path}:{node.lineno}: {verb}({aimed}, …)"
