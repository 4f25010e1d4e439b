"""What a target's config says beyond building the target: its own decoding knobs per method preset
(``decode``: a world's relaxed thresholds and tree sizes, chosen on its validation captions) and the
drafter shipped for it (``drafter``). ``generate``, ``evaluate``, fit's after-epoch evaluation,
``data_prep.self_generate`` and the benchmarks all read them here, so a world's settings apply wherever
its target decodes. Light imports only: the apps' checks read these before torch loads."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from vdtrain.paths import CONF_DIR, repo_path

if TYPE_CHECKING:
    from vdtrain.drafters.base import Drafter
    from vdtrain.targets.base import Target


def target_config(name: str) -> dict[str, Any]:
    """``conf/target/<name>.yaml`` as plain data (for scripts that name a target without Hydra)."""
    path = CONF_DIR / "target" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise FileNotFoundError(f"no target config {name!r} in conf/target; known: {known}")
    return OmegaConf.to_container(OmegaConf.load(path))  # type: ignore[return-value]


def world_knobs(target: Mapping[str, Any] | DictConfig) -> dict[str, dict[str, Any]]:
    """The target's own knobs: preset name -> keys merged over ``conf/decode/<preset>.yaml``."""
    knobs = target.get("decode") or {}
    return OmegaConf.to_container(OmegaConf.create(knobs)) if knobs else {}  # type: ignore[return-value]


def with_world_knobs(
    decode: DictConfig, target: Mapping[str, Any] | DictConfig, given: Iterable[str]
) -> DictConfig:
    """A composed method (``generate``'s ``decode``: its preset with the command line's keys) with the
    target's knobs for it set under it, except where the command line gave the key (``given``: the
    ``decode.<key>`` overrides' keys, without ``decode.``): preset < world < command line, the order
    ``evaluate`` applies too."""
    given = list(given)
    out = OmegaConf.create(OmegaConf.to_container(decode))
    for key, value in _flat(world_knobs(target).get(str(decode.name), {})):
        if not any(key == g or key.startswith(f"{g}.") for g in given):
            OmegaConf.update(out, key, value, merge=False)
    return out


def decode_keys_given(overrides: Iterable[str]) -> list[str]:
    """The method keys a command line set: ``decode.tree.total_tokens=50`` -> ``tree.total_tokens``."""
    keys = [o.lstrip("~+").split("=", 1)[0] for o in overrides]
    return [k.removeprefix("decode.") for k in keys if k.startswith("decode.")]


def load_drafter(source: str | os.PathLike[str], target: Target, shipped: str | None = None) -> Drafter:
    """A drafter from an export folder, a ``.ckpt`` or a Hub repo id; relative paths are tried from the
    working directory, then the repository root. A drafter that cannot serve ``target`` is refused with
    the target's own drafter named (``shipped``: its config's ``drafter``)."""
    from vdtrain.drafters.base import Drafter

    path = repo_path(source)
    try:
        return Drafter.from_pretrained(path if path.exists() else source, target)
    except ValueError as err:
        if shipped is None or repo_path(shipped) == path:
            raise
        raise ValueError(f"{err}; this target's own drafter is drafter={shipped}") from err


def _flat(node: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in node.items():
        if isinstance(value, Mapping):
            out += _flat(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out
