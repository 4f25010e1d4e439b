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
        changed = {
            k: v
            for k, v in given.items()
            if getattr(kind_options(saved.kind, {k: v}), k) != getattr(saved.options, k)
        }
        defaults = kind_options(saved.kind, {})
        if changed and all(
            k in type(drafter).grows and getattr(saved.options, k) == getattr(defaults, k) for k in changed
        ):
            return grown(drafter, changed, target)
        if changed:
            clash = "; ".join(
                f"options.{k}={v!r} (saved {getattr(saved.options, k)!r})" for k, v in changed.items()
            )
            addable = sorted(type(drafter).grows)
            raise ValueError(
                f"drafter.init_from={cfg.drafter.init_from!r} disagrees with the options given: {clash}"
                + (f" (only {addable} can be added to a drafter saved without them)" if addable else "")
            )
        return drafter
    layer = OmegaConf.to_container(OmegaConf.create(cfg.drafter.layer or {}))
    config = DrafterConfig.for_target(target, cfg.drafter.kind, layer, **given)
    return Drafter.make(config).start_from(target)


def grown(drafter: Drafter, options: dict, target) -> Drafter:
    """``drafter`` with ``options`` (of its kind's ``grows``: parts that start at zero) added: its trained
    weights copied, the new parts as a new drafter starts them, so it drafts what it drafted until it trains.
    """
    from dataclasses import replace

    from vdtrain.checkpoint_io import load_strict
    from vdtrain.drafters import Drafter

    config = replace(drafter.config, options=replace(drafter.options, **options))
    bigger = Drafter.make(config).start_from(target)
    state = bigger.state_dict() | drafter.state_dict()
    load_strict(bigger, state, f"{drafter.config.kind} drafter grown by {sorted(options)}")
    bigger.metadata = drafter.metadata
    bigger.attach(target)
    weight = target.token_embedding.weight
    return bigger.to(weight.device, weight.dtype)
