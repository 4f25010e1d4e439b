"""Offline mode: add the target's features (``feats.npy`` [L+N, H], in ``feats_dtype``) to every sample of
a shard set.

python -m data_prep.features in_dir=data/coco_mini out_dir=data/coco_mini_feats

The target runs once per sample here instead of at every training step. With probability ``p_null``
(seeded per sample by ``seed`` and its key) a sample's features are computed under the null condition
and its ``meta.json`` says ``null_conditioned: true``. Resumable: re-run the same command. Under
``torchrun`` / ``launch.sh`` (``VDTRAIN_APP=data_prep.features NPROC=8 ./launch.sh ...``) each process
does its part of the shards.
"""

from __future__ import annotations

import json

import hydra
from omegaconf import DictConfig

from vdtrain.cli import user_errors
from vdtrain.config import DataConfig
from vdtrain.data.prepare import prepare_features
from vdtrain.paths import CONF_DIR
from vdtrain.sharding import Ranks, decoding_processes, ranks_from_env
from vdtrain.targets import target_for_run


def run(cfg: DictConfig) -> dict:
    with decoding_processes(str(cfg.device)) as ranks:
        return run_on(cfg, ranks)


def run_on(cfg: DictConfig, ranks: Ranks) -> dict:
    target = target_for_run(cfg, apply_dtype=True)
    manifest = prepare_features(
        target,
        cfg.in_dir,
        cfg.out_dir,
        p_null=DataConfig.p_null if cfg.p_null is None else cfg.p_null,
        seed=cfg.seed,
        batch_size=cfg.batch_size,
        on_corrupt=cfg.on_corrupt,
        overwrite=cfg.overwrite,
        taps=tuple(cfg.feature_layers),
        ranks=ranks,
        warn_bytes=cfg.warn_bytes,
        feats_dtype=cfg.feats_dtype,
    )
    return {"out_dir": cfg.out_dir, "num_samples": manifest["num_samples"], "shards": len(manifest["shards"])}


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="data_prep/features")
@user_errors("data_prep.features")
def main(cfg: DictConfig) -> None:
    summary = run(cfg)
    if ranks_from_env().is_main:
        print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
