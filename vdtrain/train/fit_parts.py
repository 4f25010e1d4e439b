"""What fit builds before training, shared with the memory plan and preflight (which must not import fit)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from omegaconf import OmegaConf

if TYPE_CHECKING:
    from vdtrain.config import FitConfig
    from vdtrain.drafters import Drafter


def frozen_dtype(cfg: FitConfig) -> str:
    """The frozen target's dtype in fit: ``trainer.target_dtype`` (bf16 in the GPU trainer configs), else
    ``target.dtype``. The after-epoch evaluation decodes with the same object, so in the same dtype."""
    return cfg.trainer.target_dtype or cfg.target.dtype


def build_drafter(cfg: FitConfig, target) -> Drafter:
    """The drafter to train: ``drafter.init_from``'s (which must agree with the kind and the options given),
    or a new one of ``drafter.kind`` with ``drafter.options`` over its defaults for this target."""
    from vdtrain.drafters import Drafter, DrafterConfig
    from vdtrain.drafters.config import kind_options

    given = OmegaConf.to_container(OmegaConf.create(cfg.drafter.options or {}))
    kind_options(cfg.drafter.kind, {k: v for k, v in given.items() if v is not None})  # the kind's keys only
    if cfg.drafter.init_from:
        drafter = Drafter.from_pretrained(cfg.drafter.init_from, target)
        saved = drafter.config
        if saved.kind != cfg.drafter.kind:
            raise ValueError(
                f"drafter.init_from={cfg.drafter.init_from!r} is a {saved.kind} drafter, not "
                f"drafter.kind={cfg.drafter.kind!r}"
            )
        clash = [
            f"options.{k}={v!r} (saved {getattr(saved.options, k)!r})"
            for k, v in given.items()
            if getattr(kind_options(saved.kind, {k: v}), k) != getattr(saved.options, k)
        ]
        if clash:
            raise ValueError(
                f"drafter.init_from={cfg.drafter.init_from!r} disagrees with the options given: "
                + "; ".join(clash)
            )
        return drafter
    layer = OmegaConf.to_container(OmegaConf.create(cfg.drafter.layer or {}))
    config = DrafterConfig.for_target(target, cfg.drafter.kind, layer, **given)
    return Drafter.make(config).start_from(target)
