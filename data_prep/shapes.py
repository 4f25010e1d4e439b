"""Rebuild an embedded world's tokenizer and target from scratch (the shapes world; data_prep.grain
builds the grain world with the same stages).

python -m data_prep.shapes                       # both stages, into checkpoints/shapes/target
python -m data_prep.shapes stages=[target] target.max_minutes=10
python -m data_prep.shapes stages=[target] target.device=cuda target.bf16=true target.workers=16 ...
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, replace
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from vdtrain.cli import user_errors
from vdtrain.models.llamagen_gpt import GPTConfig, LlamaGenGPT
from vdtrain.models.llamagen_io import load_vq
from vdtrain.models.vq import VQConfig, VQModel
from vdtrain.paths import CONF_DIR
from vdtrain.shapes.build import (
    OptimConfig,
    load_init_target,
    save_llamagen_checkpoint,
    target_report,
    tokenizer_report,
    train_target,
    train_tokenizer,
    write_target_folder,
)
from vdtrain.shapes.grow import code_parents, grow_target, split_codebook
from vdtrain.shapes.report import caption_sensitivity, consistency_report, sample_grid
from vdtrain.shapes.scene import rendering_of
from vdtrain.targets.llamagen import LlamaGenTarget
from vdtrain.targets.shapes import load_target_folder

log = logging.getLogger(__name__)


def _vq_config(cfg: DictConfig) -> VQConfig:
    values = OmegaConf.to_container(cfg.tokenizer.vq)
    return replace(VQConfig(), **{**values, "ch_mult": tuple(values["ch_mult"])})


def build_world(cfg: DictConfig) -> None:
    """Run the recipe's stages; each writes its part of the target folder as soon as it ends."""
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    out = Path(hydra.utils.to_absolute_path(cfg.out_dir))
    metrics_path = out / "metrics.json"
    metrics = json.loads(metrics_path.read_text()) if metrics_path.exists() else {}
    vq_config = _vq_config(cfg)
    parent = load_target_folder(hydra.utils.to_absolute_path(cfg.parent)) if cfg.parent else None
    if "tokenizer" in cfg.stages:
        init_vq = split_codebook(parent.tokenizer.vq, cfg.tokenizer.split_codes) if parent else None
        optim = OptimConfig(**cfg.tokenizer.optim)
        vq = train_tokenizer(vq_config, optim, cfg.tokenizer.n_images, cfg.world, init=init_vq)
        save_llamagen_checkpoint(vq, out / "vq.pt")
        metrics["tokenizer"] = tokenizer_report(vq, cfg.tokenizer.report_images, cfg.world)
        metrics["world"] = {
            "name": cfg.world,
            "rendering": asdict(rendering_of(cfg.world)),
            "parent": cfg.parent,
            "split_codes": cfg.tokenizer.split_codes if cfg.parent else None,
            "tokenizer_optim": dict(cfg.tokenizer.optim),
        }
        log.info("tokenizer: %s", metrics["tokenizer"])
        metrics_path.write_text(json.dumps(metrics, indent=2) + "\n")
    if "target" in cfg.stages:
        vq = load_vq(out / "vq.pt", vq_config)
        gpt_config = replace(GPTConfig(), **OmegaConf.to_container(cfg.target.gpt))
        init = (
            load_init_target(hydra.utils.to_absolute_path(cfg.target.init_from), gpt_config)
            if cfg.target.init_from
            else _grown_target(parent, vq, gpt_config, cfg.world)
            if parent
            else None
        )
        earlier = _training_history(metrics.get("target")) if init is not None else []
        sampling = OmegaConf.to_container(cfg.target.sampling)
        stored = getattr(torch, cfg.target.stored_dtype)

        def checkpoint(gpt: LlamaGenGPT, info: dict) -> None:
            partial = {**metrics, "target": {**info, "partial": True}}
            write_target_folder(out, gpt, vq, sampling, partial, world=cfg.world, gpt_dtype=stored)
            log.info("target checkpoint written at step %d", info["train_steps"])

        gpt, train_info = train_target(
            gpt_config,
            vq,
            OptimConfig(**cfg.target.optim),
            n_samples=cfg.target.n_samples,
            max_minutes=cfg.target.max_minutes,
            init=init,
            checkpoint_every=cfg.target.checkpoint_every,
            on_checkpoint=checkpoint,
            device=cfg.target.device,
            bf16=cfg.target.bf16,
            workers=cfg.target.workers,
            world=cfg.world,
        )
        history = [
            *earlier,
            {
                **train_info,
                "init_from": cfg.target.init_from,
                "grown_from": cfg.parent if parent and not cfg.target.init_from else None,
                "max_minutes": cfg.target.max_minutes,
                "optim": dict(cfg.target.optim),
                "n_samples": cfg.target.n_samples,
                "device": cfg.target.device,
                "bf16": cfg.target.bf16,
            },
        ]
        metrics["target"] = {
            "train_steps": sum(run["train_steps"] for run in history),
            "train_minutes": sum(run["train_minutes"] for run in history),
            "train_history": history,
            "stored_dtype": cfg.target.stored_dtype,
            **target_report(gpt, vq, cfg.target.report_samples, cfg.target.device, cfg.world),
        }
        log.info("target: %s", metrics["target"])
        write_target_folder(out, gpt, vq, sampling, metrics, world=cfg.world, gpt_dtype=stored)
        metrics_path.write_text(json.dumps(metrics, indent=2) + "\n")
    if "report" in cfg.stages:
        write_report(out, cfg.report, metrics)


def _grown_target(parent: LlamaGenTarget, vq: VQModel, config: GPTConfig, world: str) -> LlamaGenGPT:
    """The parent world's target grown to ``config``, each new code standing in for its parent code."""
    parents = code_parents(parent.tokenizer.vq, parent.world or "shapes", vq, world)
    log.info(
        "grown from %s: %d child codes over %d parent codes",
        parent.name,
        len(parents),
        parents.unique().numel(),
    )
    return grow_target(parent.gpt, config, parents)


def _training_history(target_metrics: dict | None) -> list[dict]:
    """The training runs behind a saved target, so continued training reports its total."""
    if not target_metrics:
        return []
    if "train_history" in target_metrics:
        return target_metrics["train_history"]
    return [{"train_steps": target_metrics["train_steps"], "train_minutes": target_metrics["train_minutes"]}]


def write_report(folder: Path, cfg: DictConfig, metrics: dict) -> None:
    """Caption-consistency at each CFG scale vs random tokens and VQ reconstructions, sample grids, and
    the teacher-forced caption sensitivity."""
    target = load_target_folder(folder)
    scores, images, captions = consistency_report(
        target, cfg.n_captions, tuple(cfg.cfg_scales), cfg.temperature, cfg.seed, cfg.batch_size, cfg.top_k
    )
    docs = Path(hydra.utils.to_absolute_path(cfg.docs_dir))
    docs.mkdir(parents=True, exist_ok=True)
    for scale, imgs in images.items():
        sample_grid(imgs, captions).save(docs / f"samples_cfg{scale:g}.png")
    sensitivity = caption_sensitivity(target, cfg.sensitivity_scenes, cfg.seed, cfg.batch_size)
    report = {
        "consistency": scores,
        "caption_sensitivity": sensitivity,
        "settings": OmegaConf.to_container(cfg),
        "tokenizer": metrics.get("tokenizer"),
        "target": metrics.get("target"),
    }
    (docs / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    log.info("consistency: %s", scores)
    log.info("caption sensitivity (nats per image): %s", sensitivity)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="shapes_world")
@user_errors("data_prep.shapes")
def main(cfg: DictConfig) -> None:
    build_world(cfg)


if __name__ == "__main__":
    main()
