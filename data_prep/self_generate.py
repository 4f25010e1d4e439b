"""The target generates its own training images from a caption file.

python -m data_prep.self_generate captions=../shared/data/prompts/captions_val2017_longest.json \
    num_samples=100 out_dir=data/shapes_selfgen
python -m data_prep.self_generate target=llamagen_t2i_xl_stage1 target.gpt_ckpt=... captions=... \
    sampling.cfg_scale=7.5 sampling.top_k=1000 out_dir=...
python -m data_prep.self_generate method=eagle2 drafter=checkpoints/shapes/drafter captions=... out_dir=...
VDTRAIN_APP=data_prep.self_generate NPROC=8 ./launch.sh captions=... out_dir=...   # one process per GPU

Captions: .txt / .json (list or COCO annotations) / .csv / .tsv, or through ``datasets`` a parquet /
jsonl file or a Hub dataset id (``caption_column=...`` picks the column). Each sample's seed and
sampling settings go to its ``meta.json``, with the method that drew it: AR, or an exact method with a
drafter (lossless, so the samples follow the target's distribution; relaxed methods are refused).
Resumable: run the same command again (any number of processes) and finished shards are skipped; then
check the set with ``python -m data_prep.validate shards=<out_dir>``.
"""

from __future__ import annotations

import json

import hydra
from omegaconf import DictConfig

from vdtrain.cli import user_errors
from vdtrain.data.prepare import prepare_self_generate
from vdtrain.decode.compiled import prepare_decoding
from vdtrain.decode.methods import load_preset
from vdtrain.generate import sampling_config
from vdtrain.paths import CONF_DIR
from vdtrain.sharding import Ranks, decoding_processes, ranks_from_env
from vdtrain.target_settings import load_drafter, world_knobs
from vdtrain.targets import target_for_run


def run(cfg: DictConfig) -> dict:
    with decoding_processes(str(cfg.device)) as ranks:
        return run_on(cfg, ranks)


def run_on(cfg: DictConfig, ranks: Ranks) -> dict:
    method = load_preset(cfg.method, world_knobs(cfg.target).get(cfg.method))
    if not method.exact:  # before loading any model
        raise ValueError(
            f"method={cfg.method} is relaxed (not exact): its samples would not follow the target's "
            "distribution; use ar or an exact method (e.g. eagle2)"
        )
    target = target_for_run(cfg)
    drafter = None
    if method.needs_drafter:
        if not cfg.drafter:
            raise ValueError(
                f"method={cfg.method} needs a drafter: set drafter=<export folder, .ckpt or Hub id>"
            )
        drafter = load_drafter(cfg.drafter, target, cfg.target.get("drafter"))
    speculative = method.tree.kind != "none"
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
        method=method if speculative else None,
        drafter=drafter,
        drafter_source=str(cfg.drafter) if drafter is not None else None,
        options=prepare_decoding(target, drafter, compile=False, cuda_graphs=cfg.cuda_graphs)
        if speculative
        else None,
        ranks=ranks,
    )
    return {"out_dir": cfg.out_dir, "num_samples": manifest["num_samples"], "shards": len(manifest["shards"])}


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="data_prep/self_generate")
@user_errors("data_prep.self_generate")
def main(cfg: DictConfig) -> None:
    summary = run(cfg)
    if ranks_from_env().is_main:
        print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
