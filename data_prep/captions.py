"""Cache more encoded captions beside a target folder's shipped ones, for a machine without the encoder.

python -m data_prep.captions target=grain num_prompts=512        # held-out captions 0-511
python -m data_prep.captions target=grain prompts=shapes_validation num_prompts=64

The shipped ``captions.safetensors`` holds the first 32 held-out captions; a GPU machine has no network
and no caption encoder, so a run there on more prompts needs them encoded here first. The file
(``<folder>/captions_<name>.safetensors``, ignored by git) is carried with the run (``benchmarks/README.md``,
"GPU check") and served with the shipped cache (``vdtrain.targets.caption_cache``).
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from vdtrain.cli import user_errors
from vdtrain.paths import CONF_DIR


def run(cfg: DictConfig) -> Path:
    from vdtrain.prompts import prompts_for_run
    from vdtrain.targets import load_target
    from vdtrain.targets.caption_cache import CachedCaptions, write_caption_cache
    from vdtrain.targets.shapes import resolve_folder

    if cfg.target.get("kind") != "folder":
        raise ValueError(f"target kind {cfg.target.get('kind')!r} has no folder to cache captions in")
    folder = resolve_folder(cfg.target.folder)
    target = load_target(OmegaConf.to_container(cfg.target))
    captions = prompts_for_run(cfg.prompts, cfg.num_prompts, cfg.caption_column)
    cached = target.caption_encoder
    known = cached.features if isinstance(cached, CachedCaptions) else {}
    missing = list(dict.fromkeys(c for c in captions if c not in known))
    if not missing:
        raise ValueError(f"all {len(captions)} captions are already cached in {folder}")
    encoder = cached.load_encoder() if isinstance(cached, CachedCaptions) else cached
    source = "heldout" if cfg.prompts is None else Path(str(cfg.prompts)).stem
    path = folder / f"captions_{cfg.name or f'{source}{cfg.num_prompts}'}.safetensors"
    write_caption_cache(encoder, missing, path)
    print(f"cached {len(missing)} captions ({len(captions) - len(missing)} were already) in {path}")
    return path


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="data_prep/captions")
@user_errors("data_prep.captions")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
