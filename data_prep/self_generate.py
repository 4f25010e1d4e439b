"""The target generates its own training images from a caption file.

python -m data_prep.self_generate captions=../shared/data/prompts/captions_val2017_longest.json \
    num_samples=100 out_dir=data/shapes_selfgen
python -m data_prep.self_generate target=llamagen_t2i_xl_stage1 target.gpt_ckpt=... captions=... \
    sampling.cfg_scale=7.5 sampling.top_k=1000 out_dir=...

Captions: .txt / .json (list or COCO annotations) / .csv / .tsv, or through ``datasets`` a parquet /
jsonl file or a Hub dataset id (``caption_column=...`` picks the column). Each sample's seed and
sampling settings go to its ``meta.json``. Resumable: run the same command again and finished shards
are skipped; then check the set with ``python -m data_prep.validate shards=<out_dir>``.
"""

from __future__ import annotations

import json

import hydra
from omegaconf import DictConfig

from vdtrain.cli import user_errors
from vdtrain.data.prepare import prepare_self_generate
from vdtrain.generate import sampling_config
from vdtrain.targets import target_for_run


def run(cfg: DictConfig) -> dict:
    target = target_for_run(cfg)
    manifest = prepare_self_generate(
        target,
        str(cfg.captions),
        cfg.out_dir,
        num_samples=cfg.num_samples,
        sampling=sampling_config(target, cfg.sampling),
        seed=cfg.seed,
        samples_per_shard=cfg.samples_per_shard,
        batch_size=cfg.batch_size,
        store_cond=cfg.store_cond,
        caption_column=cfg.caption_column,
        overwrite=cfg.overwrite,
    )
    return {"out_dir": cfg.out_dir, "num_samples": manifest["num_samples"], "shards": len(manifest["shards"])}


@hydra.main(version_base=None, config_path="../conf", config_name="data_prep/self_generate")
@user_errors("data_prep.self_generate")
def main(cfg: DictConfig) -> None:
    print(json.dumps(run(cfg), indent=2))


if __name__ == "__main__":
    main()
