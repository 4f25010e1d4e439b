"""The EAGLE drafter kinds: ``fc([embed(x_{t+1}); f_t])`` through one decoder layer of the target's family.

``eagle1`` reads the target's last (final-norm) hidden state and regresses the next one, teacher-forced.
``eagle3`` fuses low, middle and high target layers (``fuse``), normalises its output before the head
and is trained on its own unrolled outputs (docs/training.md, "EAGLE-3 drafters").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from vdtrain.drafters.base import Drafter, DraftInputs, fused_taps
from vdtrain.drafters.config import DrafterConfig
from vdtrain.drafters.registry import register
from vdtrain.models.kv_cache import KVCache
from vdtrain.targets.base import Target


class EagleDrafter(Drafter):
    """``fc`` and one decoder layer of the target's family: what both EAGLE kinds share."""

    title: ClassVar[str] = "EAGLE drafter"

    def build(self, config: DrafterConfig) -> None:
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=True)
        self.layer = config.layer_class(config.hidden_size, config.prefix_length, config.grid, config.layer)

    def draft(self, features: torch.Tensor, rows: DraftInputs) -> torch.Tensor:
        """Rows ``fc([embeds; features])`` ([B, S, H] each) through the layer at ``rows.positions`` [B, S]
        → f̂ [B, S, H]."""
        dtype = self.fc.weight.dtype
        next_embeds, features = self.embeds_and_features(rows.embeds.to(dtype), features.to(dtype))
        x = self.fc(torch.cat([next_embeds, features], dim=-1))
        return self.layer(x, rows.positions, rows.mask, rows.cache, rows.slots)

    def embeds_and_features(
        self, next_embeds: torch.Tensor, features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``fc`` reads of the embeddings and the features: as they are (eagle3 may normalise)."""
        return next_embeds, features

    def new_cache(self, batch: int, max_len: int | None = None) -> KVCache:
        return self.layer.new_cache(batch, max_len or self.config.max_seq_len)

    def shape(self) -> str:
        """The width and the decoder layer's hyper-parameters."""
        return f"Layer: hidden size {self.config.hidden_size}, {self.layer.describe()}"


@register("eagle1")
class Eagle1Drafter(EagleDrafter):
    """The target's last hidden state in, its next one regressed, teacher-forced (EAGLE-1)."""

    def card(self) -> str:
        return (
            "A speculative-decoding drafter trained with vdtrain: `fc([embed(x_{t+1}); f_t])` followed"
            f" by one {self.config.family} decoder layer predicts the target's next hidden state, and "
        )


@dataclass(frozen=True)
class Eagle3Options:
    """An EAGLE-3 drafter's settings."""

    feature_layers: tuple[int, ...] = ()  # the target layers fused (hidden_states[k] indices)
    input_norm: bool = False  # RMSNorm on the token embedding and on the features before fc
    tap_norm: bool = False  # RMSNorm on each tapped layer before the fusion (EAGLE-3.1's option)

    def __post_init__(self) -> None:
        # JSON and Hydra hand lists: a tuple compares equal after a round trip
        object.__setattr__(self, "feature_layers", tuple(int(k) for k in self.feature_layers))


@register("eagle3")
class Eagle3Drafter(EagleDrafter):
    """Fused target layers in, trained on its own unrolled outputs (EAGLE-3)."""

    Options: ClassVar[type] = Eagle3Options

    def build(self, config: DrafterConfig) -> None:
        hidden, options = config.hidden_size, config.options
        # as EAGLE-3: a bias-free fusion, a norm before the head
        self.fuse = nn.Linear(len(options.feature_layers) * hidden, hidden, bias=False)
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        if options.tap_norm:
            self.tap_norms = nn.ModuleList(nn.RMSNorm(hidden, eps=1e-6) for _ in options.feature_layers)
        if options.input_norm:  # the embedding (~0.08) and the features (~1.7) put on one scale
            self.embed_norm = nn.RMSNorm(hidden, eps=1e-6)
            self.feature_norm = nn.RMSNorm(hidden, eps=1e-6)
        super().build(config)

    @classmethod
    def options_for(cls, target: Target) -> dict[str, object]:
        """The family's layers, the inputs normalised (as EAGLE-3)."""
        return {"feature_layers": target.default_feature_layers(), "input_norm": True}

    @classmethod
    def check(cls, config: DrafterConfig) -> None:
        layers = config.options.feature_layers
        if not layers:
            raise ValueError("an eagle3 drafter fuses target layers: set feature_layers")
        if min(layers) < 0:
            raise ValueError(f"feature_layers must be >= 0, got {list(layers)}")
        total = config.target_layers
        if total is not None and max(layers) > total:
            raise ValueError(
                f"feature_layers {list(layers)} outside 0 .. {total}: the target has {total} layers"
            )

    @torch.no_grad()
    def start_from(self, target: Target) -> Drafter:
        """The norm starts as the target's final norm, so the first logits are on the head's scale."""
        final_norm = getattr(target.transformer, "norm", None)
        if final_norm is not None:
            self.norm.weight.copy_(final_norm.weight.float())
        return self

    @property
    def taps(self) -> tuple[int, ...]:
        return self.options.feature_layers

    def input_features(self, hidden: torch.Tensor, tapped: torch.Tensor | None) -> torch.Tensor:
        """``fuse`` over the ``tapped`` layers [.., k·H] → [.., H]."""
        if tapped is None:
            raise ValueError(
                f"an eagle3 drafter reads target layers {list(self.taps)}: run the target with taps"
            )
        norms = self.tap_norms if self.options.tap_norm else None
        return fused_taps(tapped, self.fuse, norms, self.config.hidden_size)

    def embeds_and_features(
        self, next_embeds: torch.Tensor, features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.options.input_norm:  # a zero embedding (prefix rows) stays zero
            return self.embed_norm(next_embeds), self.feature_norm(features)
        return next_embeds, features

    def normed(self, hidden: torch.Tensor, offset: torch.Tensor | int = 0) -> torch.Tensor:
        """f̂ through its own norm before the head (at any ``offset``)."""
        return self.norm(hidden.to(self.norm.weight.dtype))

    def unroll_steps(self, ttt_steps: int) -> int:
        return ttt_steps

    def card(self) -> str:
        options = self.options
        norms = "".join(
            note
            for on, note in (
                (options.tap_norm, "each layer RMS-normalised, "),
                (options.input_norm, "the embedding and `g_t` RMS-normalised before `fc`, "),
            )
            if on
        )
        return (
            f"An EAGLE-3 drafter trained with vdtrain: the target's layers {list(options.feature_layers)} "
            "(residual stream after that many decoder layers) are fused into `g_t = fuse([h_k; ...])`, "
            f"{norms}`fc([embed(x_{{t+1}}); g_t])` followed by one {self.config.family} decoder layer and a "
            "norm drafts the next token, trained on its own unrolled outputs (training-time test), and "
        )
