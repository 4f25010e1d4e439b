"""The Lightning module that trains a drafter against a frozen target.

How is its kind's (``Drafter.unroll_steps``): teacher-forced feature regression (eagle1), or its own unrolled
outputs (training-time test, ``Drafter.unroll``: eagle3), with a feature loss or logits only, or a loss of
the kind's own (``Drafter.training_loss``: a block drafter's).

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
from lightning.pytorch.callbacks import Timer
from omegaconf import DictConfig, OmegaConf

from vdtrain.config import DataConfig, DrafterTrainConfig, OptimConfig, TrainerConfig
from vdtrain.drafters.base import CHECKPOINT_CONFIG_KEY, Drafter, LossInputs
from vdtrain.drafters.head_loss import CLS_LOSSES
from vdtrain.drafters.losses import simulated_tau, teacher_loss, uniform_feature_noise, unrolled_loss
from vdtrain.images import images_to_tensor
from vdtrain.targets.base import Target, split_taps
from vdtrain.train.agreement import unrolled_agreement


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
        *,
        features: str = DataConfig.features,
        p_null: float = DataConfig.p_null,
        seed: int = 0,
        max_steps: int = TrainerConfig.max_steps,
        max_minutes: float | None = None,
        compile: bool = TrainerConfig.compile,
    ) -> None:
        super().__init__()
        if features not in ("online", "offline"):
            raise ValueError(f"data.features must be 'online' or 'offline', got {features!r}")
        if train.cls_loss not in CLS_LOSSES:
            raise ValueError(f"drafter.cls_loss must be one of {list(CLS_LOSSES)}, got {train.cls_loss!r}")
        if not 0.0 <= p_null <= 1.0:
            raise ValueError(f"p_null must be in [0, 1], got {p_null}")
        if isinstance(train, DictConfig):  # the compiled loss reads it: a DictConfig's reads break the graph
            train = DrafterTrainConfig(**OmegaConf.to_container(train, resolve=True))
        if train.guided_scale is not None:
            if not drafter.trains_guided:
                raise ValueError(
                    f"drafter.guided_scale is the block kind's; drafter.kind={drafter.config.kind} trains "
                    "each sample in its own stream (set drafter.guided_scale=null)"
                )
            if features != "online":
                raise ValueError(
                    "drafter.guided_scale needs both streams of every sample: data.features=online (stored "
                    "features hold the one stream data_prep.features chose)"
                )
        self._frozen = _Frozen(target.eval().requires_grad_(False))
        self.drafter = drafter.attach(target)
        self.train_cfg, self.optim_cfg = train, optim
        self.features, self.p_null, self.seed, self.max_steps = features, p_null, seed, max_steps
        self.max_minutes = max_minutes
        # trainer.compile; the compiled drafter_loss is made at the first step (nn.Module has a `compile`)
        self.compile_step, self._compiled = compile, None

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

    def input_dtype(self) -> torch.dtype:
        """The dtype of the drafter's inputs that ``trainer.precision`` implies: half under ``bf16-*`` and
        ``16-*`` (autocast computes in it anyway; fp32 states would double their bytes), else fp32."""
        precision = str(self._trainer.precision) if self._trainer is not None else "32-true"
        return {"bf16": torch.bfloat16, "16": torch.float16}.get(precision.split("-")[0], torch.float32)

    def prepare(
        self, batch: dict, null_rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens [B, N], condition mask [B, L], target states [B, L+N, H] in ``input_dtype``: the
        final-norm hidden, followed by the layers the drafter taps, ``split_taps`` parts them). ``null_rows``
        None (online features): every sample in both streams, conditional then null, as a CFG decode
        batches them ([2B, ..]; the captions and images encoded once).

        The target runs under ``inference_mode`` (no autograd state, no version counters). Its outputs are
        inference tensors, which autograd refuses to save for backward, and the drafter's first layers
        save their inputs: so they leave it through one copy made outside, the dtype cast (or a clone).
        """
        with torch.inference_mode():
            tokens, mask, states = self._target_pass(batch, null_rows)
        dtype = self.input_dtype()
        return tokens.clone(), mask.clone(), states.to(dtype) if states.dtype != dtype else states.clone()

    def _target_pass(
        self, batch: dict, null_rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``prepare``'s three tensors in the target's (or the stored features') own dtype.

        Online: the target runs on the captions, with ``null_rows`` null-conditioned, so the drafter's
        inputs *and* its regression targets come from the same (possibly null) condition. Offline: the
        features and the condition mask they were computed under (null conditioning decided) come from
        ``data_prep.features``; neither the target nor its caption encoder runs."""
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
            parts = batch["feats"].shape[-1] // target.hidden_size
            if parts != 1 + len(self.drafter.taps):
                raise ValueError(
                    f"data.features=offline: the shards store {parts - 1} tapped layers beside the last "
                    f"state, the drafter reads {list(self.drafter.taps)}: run data_prep.features "
                    f"feature_layers={list(self.drafter.taps)}"
                )
            mask = batch["feats_mask"].to(self.device, torch.bool)  # the features' own: no caption encoder
            return tokens, mask, batch["feats"].to(self.device)
        captions = target.encode_captions(batch["caption"])
        if null_rows is None:  # the CFG batch
            cond, tokens = captions.cat(target.null_condition(captions)), tokens.repeat(2, 1)
        else:
            cond = target.with_null(captions, null_rows.to(self.device))
        return tokens, cond.mask, target.sequence_features(cond, tokens, self.drafter.taps)

    def _null_rows(self, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        return torch.rand(batch_size, generator=generator) < self.p_null

    def training_inputs(
        self, batch: dict, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``prepare``'s tensors for a step: each sample in its own stream (null-conditioned with
        ``p_null``; none without a ``generator``, as validation scores), or with ``drafter.guided_scale``
        every sample twice, conditional then null ([2B, ..]): the loss combines the two as CFG does."""
        if self.train_cfg.guided_scale is not None:
            return self.prepare(batch, None)
        size = len(batch["caption"])
        none = torch.zeros(size, dtype=torch.bool)
        return self.prepare(batch, none if generator is None else self._null_rows(size, generator))

    def loss(self, batch: dict, generator: torch.Generator) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        tokens, cond_mask, states = self.training_inputs(batch, generator)
        return self.loss_on(tokens, cond_mask, states, generator, self.train_cfg.feature_noise)

    def loss_on(
        self,
        tokens: torch.Tensor,
        cond_mask: torch.Tensor,
        states: torch.Tensor,
        generator: torch.Generator | None,
        noise: float,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The drafter's loss on ``prepare``'s output (``states`` [B, L+N, (1 + taps)·H]), with noise
        ``U(-noise, noise)`` on what the drafter reads of the target (its taps, else the last state): the
        ``drafter_loss`` (compiled where asked), with the roots a block drafter's loss trains drawn here."""
        hidden, tapped = split_taps(states, self.target.hidden_size, len(self.drafter.taps))
        if tapped is None:
            hidden_in = uniform_feature_noise(hidden, noise, generator)
        else:
            hidden_in, tapped = hidden, uniform_feature_noise(tapped, noise, generator)
        roots = self.drafter.training_roots(tokens.shape[1], generator, tokens.device)
        batch = LossInputs(tokens, cond_mask, hidden, hidden_in, tapped, roots)
        if self.compile_step and self._compiled is None:
            self._compiled = torch.compile(self.drafter_loss)
        step = self.drafter_loss if self._compiled is None else self._compiled
        return step(batch)

    def drafter_loss(self, batch: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The drafter's passes and its loss on ``batch``: the part of a training step ``trainer.compile``
        compiles, in one graph (tests/test_train_speed.py pins its graph breaks at 0)."""
        own = self.drafter.training_loss(batch, self.train_cfg)
        if own is not None:  # the kind's own loss (the block kind's)
            return own
        steps = self.drafter_passes(batch.tokens, batch.cond_mask, batch.hidden_in, batch.tapped)
        return self.score(steps, batch.hidden, batch.cond_mask.shape[1])

    def drafter_passes(
        self,
        tokens: torch.Tensor,
        cond_mask: torch.Tensor,
        hidden_in: torch.Tensor,
        tapped: torch.Tensor | None,
    ) -> list[torch.Tensor]:
        """f̂ [B, L+N-1, H] of each drafter pass: teacher-forced (one), or the kind's unrolled steps."""
        drafter = self.drafter
        feats = drafter.input_features(hidden_in, tapped)
        steps = drafter.unroll_steps(self.train_cfg.ttt_steps)
        if steps is None:
            return [drafter.forward_teacher(feats, tokens, cond_mask)]
        return drafter.unroll(feats, tokens, cond_mask, steps)

    def score(
        self, steps: list[torch.Tensor], hidden: torch.Tensor, prefix_length: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of the passes ``steps`` against the target's states ``hidden`` [B, L+N, H]: feature
        regression + soft CE (EAGLE-1), or the unrolled steps' (with a feature loss or logits only)."""
        cfg, drafter = self.train_cfg, self.drafter
        if drafter.unroll_steps(cfg.ttt_steps) is None:
            return teacher_loss(
                steps[0],
                hidden[:, 1:],
                drafter.normed,
                drafter.head,
                prefix_length,
                w_cls=cfg.w_cls,
                cls_loss=cfg.cls_loss,
                chunks=cfg.loss_chunks,
            )
        return unrolled_loss(
            steps,
            hidden[:, 1:],
            drafter.normed,
            drafter.head,
            prefix_length,
            decay=cfg.ttt_decay,
            w_feature=cfg.w_feature if drafter.feature_loss else 0.0,
            cls_loss=cfg.cls_loss,
            chunks=cfg.loss_chunks,
        )

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
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        """The training loss on held-out data, and top-1 agreement at draft depths 1..``val_depth`` of the
        drafter unrolled as a tree step runs it (``vdtrain.train.agreement``), for the conditional stream
        and (online features) the null stream every CFG step also drafts: ``val/null_*``."""
        size = len(batch["caption"])
        streams = self.training_inputs(batch, None)  # guided: conditional then null, else conditional
        _, parts = self.loss_on(*streams, None, 0.0)
        for name, value in parts.items():
            self.log(f"val/{name}", value, batch_size=size, sync_dist=True)
        tokens, cond_mask, states = (t[:size] for t in streams)
        self._log_agreement("val/", tokens, cond_mask, states, size, prog_bar=True)
        if self.features == "online":  # stored features hold one stream, decided by data_prep.features
            if self.train_cfg.guided_scale is not None:  # the null stream is already there
                _, null_mask, null_states = (t[size:] for t in streams)
            else:
                _, null_mask, null_states = self.prepare(batch, torch.ones(size, dtype=torch.bool))
            self._log_agreement("val/null_", tokens, null_mask, null_states, size)

    def _log_agreement(
        self,
        prefix: str,
        tokens: torch.Tensor,
        cond_mask: torch.Tensor,
        states: torch.Tensor,
        size: int,
        prog_bar: bool = False,
    ) -> None:
        hidden, tapped = split_taps(states, self.target.hidden_size, len(self.drafter.taps))
        acc = unrolled_agreement(self.drafter, hidden, tapped, tokens, cond_mask, self.train_cfg.val_depth)
        for d, a in enumerate(acc, start=1):
            self.log(f"{prefix}top1_depth{d}", a, batch_size=size, sync_dist=True)
        self.log(f"{prefix}tau_sim", simulated_tau(acc), prog_bar=prog_bar, batch_size=size, sync_dist=True)

    # --- optimisation ------------------------------------------------------------------------------
    def budget_spent(self) -> float:
        """The share of ``trainer.max_minutes`` the run has used, so the cosine ends when the time budget
        does if that comes before ``max_steps`` (a run stopped by the clock otherwise keeps its peak rate).
        Lightning's Timer keeps the elapsed time in checkpoints, so a resumed run continues the schedule."""
        if self.max_minutes is None or self._trainer is None:
            return 0.0
        timer = next((c for c in self.trainer.callbacks if isinstance(c, Timer)), None)
        return 0.0 if timer is None else timer.time_elapsed() / (60.0 * self.max_minutes)

    def configure_optimizers(self):
        o = self.optim_cfg
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        # One fused kernel per step on a GPU; not under 16-mixed, whose gradient scaler must unscale
        # before Lightning clips (a fused AdamW unscales inside its step).
        fused = (
            self.device.type == "cuda" and self._trainer is not None and self.trainer.precision != "16-mixed"
        )
        optimizer = torch.optim.AdamW(
            params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay, fused=fused or None
        )

        def factor(step: int) -> float:
            if step < o.warmup_steps:
                return (step + 1) / o.warmup_steps
            progress = (step - o.warmup_steps) / max(1, self.max_steps - o.warmup_steps)
            progress = min(1.0, max(progress, self.budget_spent()))
            return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
