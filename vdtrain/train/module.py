"""The Lightning module that trains an EAGLE drafter against a frozen target.

The target is *not* a registered submodule: its weights never enter checkpoints, optimisers or DDP
buckets; the module moves it to its own device. Features come from the target on the fly (``online``,
the default) or from ``feats.npy`` in the shards (``offline``).

Every random choice in a training step (which samples are null-conditioned, the feature noise) is drawn
from a generator seeded by (seed, global step, rank, micro-batch), so a resumed run repeats exactly what
the uninterrupted run would have done.
"""

from __future__ import annotations

import math

import lightning as L
import torch

from vdtrain.config import DrafterTrainConfig, OptimConfig
from vdtrain.drafter import CHECKPOINT_CONFIG_KEY, Drafter
from vdtrain.images import images_to_tensor
from vdtrain.targets.base import Target
from vdtrain.train.losses import (
    drafter_loss,
    image_target_mask,
    simulated_tau,
    top_k_agreement,
    uniform_feature_noise,
)


class NonFiniteLossError(FloatingPointError):
    pass


class _Frozen:
    """Holds the target outside ``nn.Module`` registration."""

    def __init__(self, target: Target) -> None:
        self.target = target


class DrafterModule(L.LightningModule):
    def __init__(
        self,
        target: Target,
        drafter: Drafter,
        train: DrafterTrainConfig,
        optim: OptimConfig,
        features: str = "online",
        p_null: float = 0.1,
        seed: int = 0,
        max_steps: int = 1000,
    ) -> None:
        super().__init__()
        if features not in ("online", "offline"):
            raise ValueError(f"data.features must be 'online' or 'offline', got {features!r}")
        if not 0.0 <= p_null <= 1.0:
            raise ValueError(f"p_null must be in [0, 1], got {p_null}")
        self._frozen = _Frozen(target.eval().requires_grad_(False))
        self.drafter = drafter.attach(target)
        self.train_cfg, self.optim_cfg = train, optim
        self.features, self.p_null, self.seed, self.max_steps = features, p_null, seed, max_steps

    @property
    def target(self) -> Target:
        return self._frozen.target

    def _place_target(self) -> None:
        if self.target.token_embedding.weight.device != self.device:
            self.target.to(self.device)

    def on_fit_start(self) -> None:
        self._place_target()

    def on_validation_start(self) -> None:
        self._place_target()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Store the drafter's config so the ``.ckpt`` alone rebuilds it (``Drafter.from_pretrained``)."""
        checkpoint[CHECKPOINT_CONFIG_KEY] = self.drafter.config.to_dict()

    # --- batches ---------------------------------------------------------------------------------
    def _generator(self, micro_batch: int) -> torch.Generator:
        step_key = (self.seed * 1_000_003 + self.global_step) * 1_009 + self.global_rank
        return torch.Generator(device="cpu").manual_seed(step_key * 101 + micro_batch)

    @torch.no_grad()
    def prepare(
        self, batch: dict, null_rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens [B, N], condition mask [B, L], target hidden [B, L+N, H]).

        Online: the target runs on the captions, with ``null_rows`` null-conditioned, so the drafter's
        inputs *and* its regression targets come from the same (possibly null) condition. Offline: the
        features were computed (and null conditioning decided) by ``data_prep.features``."""
        target = self.target
        if "tokens" in batch:
            tokens = batch["tokens"].long()
        else:
            tokens = target.tokenizer.encode(images_to_tensor(batch["image"].cpu().numpy()).to(self.device))
        if self.features == "offline":
            if "feats" not in batch:
                raise KeyError(
                    "data.features=offline but the shards have no feats.npy (run data_prep.features)"
                )
            mask = batch.get("cond_mask")
            mask = target.encode_captions(batch["caption"]).mask if mask is None else mask.bool()
            return tokens, mask.to(self.device), batch["feats"].to(self.device, torch.float32)
        cond = target.with_null(target.encode_captions(batch["caption"]), null_rows.to(self.device))
        return tokens, cond.mask, target.sequence_features(cond, tokens).float()

    def _null_rows(self, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        return torch.rand(batch_size, generator=generator) < self.p_null

    def loss(self, batch: dict, generator: torch.Generator) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        size = len(batch["caption"])
        tokens, cond_mask, hidden = self.prepare(batch, self._null_rows(size, generator))
        noisy = uniform_feature_noise(hidden, self.train_cfg.feature_noise, generator)
        pred = self.drafter.forward_teacher(noisy, tokens, cond_mask)
        mask = image_target_mask(cond_mask, tokens.shape[1])
        return drafter_loss(pred, hidden[:, 1:], self.drafter.logits, mask, self.train_cfg.w_cls)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        micro = batch_idx % max(1, self.trainer.accumulate_grad_batches)
        loss, parts = self.loss(batch, self._generator(micro))
        if not torch.isfinite(loss):
            raise NonFiniteLossError(
                f"non-finite drafter loss at step {self.global_step} (feature={parts['feature'].item()}, "
                f"cls={parts['cls'].item()}) — lower optim.lr or check the features"
            )
        size = len(batch["caption"])
        for name, value in parts.items():
            self.log(f"train/{name}", value, prog_bar=name in ("total", "top1"), batch_size=size)
        self.log(
            "train/tau_sim_chain1",
            simulated_tau([parts["top1"].item()] * self.train_cfg.val_depth),
            batch_size=size,
        )
        return loss

    # --- validation: per-depth agreement of an unrolled draft ---------------------------------------
    @torch.no_grad()
    def depth_agreement(
        self, tokens: torch.Tensor, cond_mask: torch.Tensor, hidden: torch.Tensor
    ) -> list[float]:
        """Top-1 agreement at draft depths 1..D, unrolling the drafter on its own features.

        Depth d feeds every image row the drafter's depth-(d-1) prediction of its feature (prefix rows
        keep the target's, as after a prefill), with the true tokens: a teacher-forced stand-in for a
        d-step draft chain. Agreement is with the target's argmax at each row.
        """
        prefix = self.target.prefix_length
        mask = image_target_mask(cond_mask, tokens.shape[1])
        target_logits = self.drafter.logits(hidden[:, 1:][mask])
        feats, acc = hidden, []
        for _ in range(self.train_cfg.val_depth):
            pred = self.drafter.forward_teacher(feats, tokens, cond_mask)
            acc.append(top_k_agreement(self.drafter.logits(pred[mask]), target_logits, None, 1).item())
            feats = torch.cat([hidden[:, :prefix], pred[:, prefix - 1 :]], dim=1)
        return acc

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        tokens, cond_mask, hidden = self.prepare(batch, torch.zeros(len(batch["caption"]), dtype=torch.bool))
        pred = self.drafter.forward_teacher(hidden, tokens, cond_mask)
        mask = image_target_mask(cond_mask, tokens.shape[1])
        _, parts = drafter_loss(pred, hidden[:, 1:], self.drafter.logits, mask, self.train_cfg.w_cls)
        acc = self.depth_agreement(tokens, cond_mask, hidden)
        size = len(batch["caption"])
        for name, value in parts.items():
            self.log(f"val/{name}", value, batch_size=size, sync_dist=True)
        for d, a in enumerate(acc, start=1):
            self.log(f"val/top1_depth{d}", a, batch_size=size, sync_dist=True)
        self.log("val/tau_sim", simulated_tau(acc), prog_bar=True, batch_size=size, sync_dist=True)

    # --- optimisation ------------------------------------------------------------------------------
    def configure_optimizers(self):
        o = self.optim_cfg
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)

        def factor(step: int) -> float:
            if step < o.warmup_steps:
                return (step + 1) / o.warmup_steps
            progress = min(1.0, (step - o.warmup_steps) / max(1, self.max_steps - o.warmup_steps))
            return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
