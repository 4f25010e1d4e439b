"""LAION-COCO (or any img2dataset download) → VQ-token shards for drafter training.

First download the images with img2dataset (https://github.com/rom1504/img2dataset), from the
LAION-COCO metadata (parquet files with ``URL`` and ``top_caption``; read them with
``vdtrain.prompts.load_table`` to inspect or filter):

    img2dataset --url_list laion-coco/ --input_format parquet \
        --url_col URL --caption_col top_caption \
        --output_format webdataset --output_folder laion_coco_wds \
        --image_size 256 --resize_mode center_crop --processes_count 16 --thread_count 64

(``--output_format files`` writes folders of ``{key}.jpg`` + ``{key}.txt``; both layouts are read.)
Then encode them with the target's tokenizer:

    python -m data_prep.laion_coco target=llamagen_t2i_xl_stage1 target.gpt_ckpt=... \
        target.vq_ckpt=... target.text_encoder_path=... input=laion_coco_wds out_dir=data/laion_coco
    python -m data_prep.laion_coco input=../shared/data/coco_mini/train2017 out_dir=data/coco_mini  # shapes

Images are centre-cropped and resized to the target's image size (LlamaGen's preprocessing); images
that do not decode or have no caption are skipped with a warning, and so is an input tar that cannot be
read (``on_bad_tar=skip``; listed under ``skipped_parts``; ``on_bad_tar=error`` stops instead).
Resumable: re-run the same command (a shard whose every input was skipped is tried again).
"""

from __future__ import annotations

import json

import hydra
from omegaconf import DictConfig

from vdtrain.cli import user_errors
from vdtrain.data.prepare import prepare_laion_coco
from vdtrain.paths import CONF_DIR
from vdtrain.targets import target_for_run


def run(cfg: DictConfig) -> dict:
    target = target_for_run(cfg)
    manifest = prepare_laion_coco(
        target,
        cfg.input,
        cfg.out_dir,
        samples_per_shard=cfg.samples_per_shard,
        batch_size=cfg.batch_size,
        store_cond=cfg.store_cond,
        overwrite=cfg.overwrite,
        on_bad_tar=cfg.on_bad_tar,
    )
    return {
        "out_dir": cfg.out_dir,
        "num_samples": manifest["num_samples"],
        "shards": len(manifest["shards"]),
        "skipped_parts": manifest["skipped_parts"],
    }


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="data_prep/laion_coco")
@user_errors("data_prep.laion_coco")
def main(cfg: DictConfig) -> None:
    print(json.dumps(run(cfg), indent=2))


if __name__ == "__main__":
    main()
