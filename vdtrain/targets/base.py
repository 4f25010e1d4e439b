"""The target-model interface: the one contract data preparation, training and decoding rely on.

A *target* is the visual AR model being accelerated. Every adapter lays a sequence out the same way:

    slots 0 .. L-1      the condition prefix (``prefix_length`` rows; caption features for LlamaGen)
    slot  L + i         image token i (raster order), once committed

The hidden state at slot ``L - 1 + i`` (after the final norm) predicts image token ``i``; this is the
feature ``f`` an EAGLE drafter regresses. Image token ``i`` is fed with the RoPE position of grid cell
``i`` (``image_index``), whatever slot it is written to, so draft-tree nodes can live in scratch slots.

Attention visibility is given as a boolean ``image_visibility`` [B, S, K] over the first K image slots
(K = kv_len − L): causal for AR, ancestor sets for trees. The adapter adds the prefix columns its
family needs (LlamaGen: the caption mask).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from vdtrain.models.kv_cache import KVCache, LayerInputs
from vdtrain.sampling_config import SamplingConfig


@dataclass(frozen=True)
class TargetIdentity:
    """What a drafter must match: checked on load so a drafter never serves the wrong target."""

    family: str
    name: str
    hidden_size: int
    vocab_size: int
    grid: tuple[int, int]
    prefix_length: int
    head_fingerprint: str
    num_layers: int | None = None  # decoder layers; None in records written before it was kept

    def mismatches(self, other: TargetIdentity) -> list[str]:
        fields = ("family", "hidden_size", "vocab_size", "grid", "prefix_length", "head_fingerprint")
        problems = [
            f"{field}: {getattr(self, field)!r} != {getattr(other, field)!r}"
            for field in fields
            if getattr(self, field) != getattr(other, field)
        ]
        if None not in (self.num_layers, other.num_layers) and self.num_layers != other.num_layers:
            problems.append(f"num_layers: {self.num_layers!r} != {other.num_layers!r}")
        return problems


def fingerprint(weight: torch.Tensor) -> str:
    """A short content hash of a weight tensor (e.g. the output head); ``"no-data"`` for a weight that has
    a shape only (the meta device, or a fake tensor: the memory plan builds targets so)."""
    if weight.device.type == "meta" or is_fake(weight):
        return "no-data"
    data = weight.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


@dataclass
class Condition:
    """Encoded captions: ``features`` [B, L, D_cond] and ``mask`` [B, L] (True = a real token)."""

    features: torch.Tensor
    mask: torch.Tensor
    captions: list[str] | None = None

    def __len__(self) -> int:
        return self.features.shape[0]

    def cat(self, other: Condition) -> Condition:
        """Stack two conditions along the batch (the CFG batch of two: cond rows, then uncond rows)."""
        return Condition(torch.cat([self.features, other.features]), torch.cat([self.mask, other.mask]))

    def select(self, rows: torch.Tensor) -> Condition:
        caps = None if self.captions is None else [self.captions[int(i)] for i in rows]
        return Condition(self.features[rows], self.mask[rows], caps)

    def to(self, device: torch.device | str) -> Condition:
        return Condition(self.features.to(device), self.mask.to(device), self.captions)


def prefix_causal_mask(cond_mask: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The teacher-forcing / prefill mask ``[B, 1, seq_len, seq_len]`` (True = may attend), as LlamaGen
    and Chameleon train: causal; padded prefix keys hidden from every query; the diagonal always visible
    (a padded row attends to itself, so no row is empty)."""
    batch, prefix = cond_mask.shape
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=cond_mask.device).tril()
    mask = mask.expand(batch, seq_len, seq_len).clone()
    mask[:, :, :prefix] &= cond_mask[:, None, :].bool()
    mask |= torch.eye(seq_len, dtype=torch.bool, device=cond_mask.device)
    return mask[:, None]


def prefix_and_image_mask(cond_mask: torch.Tensor, image_visibility: torch.Tensor) -> torch.Tensor:
    """Attention mask [B, 1, S, L + K]: the caption columns of ``cond_mask`` [B, L] for every row, then
    ``image_visibility`` [B or 1, S, K] over the first K image slots (the layout every adapter and the
    drafter share)."""
    batch, steps = cond_mask.shape[0], image_visibility.shape[1]
    prefix = cond_mask[:, None, :].expand(batch, steps, -1)
    return torch.cat([prefix, image_visibility.expand(batch, -1, -1)], dim=-1)[:, None]


@dataclass
class TargetOutput:
    hidden: torch.Tensor  # [B, S, H] after the final norm
    logits: torch.Tensor  # [B, S, V] over image tokens, fp32
    taps: torch.Tensor | None = None  # [B, S, len(taps)·H]: the residual stream after each tapped layer


def tap_kwargs(taps: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """``taps`` for a transformer's ``forward`` only when some are asked for: a decoder written before taps
    existed still serves AR and eagle1 drafters."""
    return {"taps": taps} if taps else {}


def split_taps(states: torch.Tensor, hidden_size: int, taps: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A transformer's output [.., (1 + taps)·H] with ``taps`` layers asked for → (final-norm hidden
    [.., H], tapped layers [.., taps·H], None without taps)."""
    if states.shape[-1] != (1 + taps) * hidden_size:
        raise ValueError(f"states of width {states.shape[-1]} do not hold {taps} taps of {hidden_size}")
    if not taps:
        return states, None
    return states[..., :hidden_size], states[..., hidden_size:]


class ImageTokenizer(nn.Module, ABC):
    """A VQ tokenizer: images in [-1, 1] [B, 3, H, W] ↔ token ids [B, h·w] in raster order."""

    grid: tuple[int, int]
    image_size: int

    @abstractmethod
    def encode(self, images: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def decode(self, tokens: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def codebook(self) -> torch.Tensor:
        """Code vectors [V, d] as the quantiser uses them (for latent-neighbour tables)."""


class DraftLayer(nn.Module, ABC):
    """One decoder layer of a target family, with that family's positional encoding: the layer an
    EAGLE drafter stacks on ``fc`` (``vdtrain.drafters.base``).

    Built from the drafter config alone (``hidden_size``, ``prefix_length``, ``grid`` and the family's
    ``settings``), so a saved drafter rebuilds without its target; ``settings_of`` reads the target's own
    hyper-parameters (from ``target.transformer.config``), the default a new drafter starts from.
    """

    settings_fields: ClassVar[tuple[str, ...]]  # the hyper-parameters ``settings`` holds (all of them)

    @classmethod
    def settings_of(cls, target: Target) -> dict[str, Any]:
        """The hyper-parameters of ``target``'s own decoder layers: the ``settings_fields`` of its
        ``transformer.config``."""
        config = target.transformer.config
        return {name: getattr(config, name) for name in cls.settings_fields}

    @classmethod
    def check(cls, hidden_size: int, grid: tuple[int, int], settings: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` naming what is wrong with ``settings`` for this shape."""
        missing = sorted(set(cls.settings_fields) - set(settings))
        unknown = sorted(set(settings) - set(cls.settings_fields))
        if missing or unknown:
            raise ValueError(
                f"{cls.__name__} settings: missing {missing}, unknown {unknown}; "
                f"expected {list(cls.settings_fields)}"
            )

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None = None,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows ``x`` [B, S, H] at RoPE ``positions`` [B, S] under boolean ``mask`` [B, 1, S, K]; with a
        ``cache`` the keys/values go to ``slots`` and the mask covers the first K cache slots. The family's
        decoder layer (the class after ``DraftLayer`` in a subclass's bases) runs them with the family's
        ``rotary`` and ``layer_mask``."""
        rows = LayerInputs(self.rotary(positions, x.dtype), self.layer_mask(mask, x.dtype), None, slots)
        return super().forward(x, rows.at_layer(cache, 0))

    @abstractmethod
    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        """The family's RoPE at ``positions`` [B, S], as its decoder layer reads it."""

    def layer_mask(self, mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        """The boolean ``mask`` as the family's decoder layer reads it (by default as is)."""
        return mask

    @abstractmethod
    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """A one-layer cache in the layer's dtype and device."""

    @abstractmethod
    def describe(self) -> str:
        """One line for the model card: heads, FFN width and positional encoding."""


class Target(nn.Module, ABC):
    """A frozen visual AR model with its caption encoder and image tokenizer."""

    tokenizer: ImageTokenizer
    sampling_defaults: SamplingConfig
    world: str | None = None  # the embedded world whose scenes it was trained on; None: a released model

    # --- shape of the problem -------------------------------------------------------------------
    @property
    @abstractmethod
    def identity(self) -> TargetIdentity: ...

    @property
    def grid(self) -> tuple[int, int]:
        return self.identity.grid

    @property
    def num_image_tokens(self) -> int:
        h, w = self.grid
        return h * w

    @property
    def prefix_length(self) -> int:
        return self.identity.prefix_length

    @property
    def hidden_size(self) -> int:
        return self.identity.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.identity.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.prefix_length + self.num_image_tokens

    @property
    def num_layers(self) -> int:
        """Decoder layers of the transformer (the range of ``taps``: 0 .. num_layers)."""
        return len(self.transformer.layers)

    def default_feature_layers(self) -> tuple[int, int, int]:
        """The low, middle and high layers an EAGLE-3 drafter fuses (``hidden_states[k]`` indices). From 16
        layers EAGLE-3's choice, the streams entering layers 2, n/2 and n-3; below 16 the high tap is the
        final state ``k = n``: on the 4- and 8-layer worlds the logit lens shows it holds far more of the
        target's decision than ``n - 1`` or ``n - 3`` (docs/training.md, "EAGLE-3 drafters"). A family may
        choose others."""
        n = self.num_layers
        if n >= 16:
            return (2, n // 2, n - 3)
        return (min(2 if n >= 6 else 1, n), max(1, n // 2), n)

    @property
    def device(self) -> torch.device:
        """Where the transformer runs: every input of a forward pass is moved here by the pass itself."""
        return self.token_embedding.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the transformer runs in (``target.dtype``; fp32 unless cast for inference)."""
        return self.token_embedding.weight.dtype

    @property
    @abstractmethod
    def transformer(self) -> nn.Module:
        """The decoder every prefill and verification pass runs through its ``forward`` and whose
        ``new_cache`` allocates the KV cache (what ``compile=true`` wraps)."""

    @abstractmethod
    def use_dtype(self, dtype: torch.dtype) -> Target:
        """Cast the transformer (not the tokenizer or caption encoder) to ``dtype`` for inference; logits
        stay fp32 and the identity is the fp32 checkpoint's."""

    # --- conditioning ---------------------------------------------------------------------------
    @abstractmethod
    def encode_captions(self, captions: list[str]) -> Condition: ...

    @abstractmethod
    def null_condition(self, cond: Condition) -> Condition:
        """The unconditional counterpart of ``cond`` (CFG's second stream, null conditioning)."""

    def with_null(self, cond: Condition, null_rows: torch.Tensor) -> Condition:
        """``cond`` with the rows where ``null_rows`` [B] is True replaced by the null condition."""
        null = self.null_condition(cond)
        pick = null_rows.to(cond.features.device)
        return Condition(
            torch.where(pick[:, None, None], null.features, cond.features),
            torch.where(pick[:, None], null.mask, cond.mask),
            cond.captions,
        )

    # --- modules the drafter shares (frozen) ----------------------------------------------------
    @property
    @abstractmethod
    def token_embedding(self) -> nn.Embedding: ...

    @property
    @abstractmethod
    def head(self) -> nn.Module:
        """Maps final-norm hidden states to image-token logits: an ``nn.Linear``, or a module naming its last
        linear ``final`` and what runs before it ``inner`` (the drafter's training loss runs that linear a
        chunk of rows at a time, ``vdtrain.drafters.head_loss``)."""

    def constrain_logits(self, logits: torch.Tensor, predicts: torch.Tensor) -> torch.Tensor:
        """``logits`` [..., V] of rows predicting image index ``predicts`` [...] with the family's forced
        tokens applied (Lumina-mGPT's end of row); the target's own logits come so already, the engine
        applies it to the drafter's so a drafter never proposes what the target cannot emit. Default:
        nothing is forced."""
        return logits

    def image_slot(self, image_index: torch.Tensor) -> torch.Tensor:
        """The KV-cache slot of image position ``image_index`` (the prefix holds slots ``0 .. L-1``): the one
        slot layout the engine, its builders and the drafter's cache share. Draft nodes take the slots
        after the committed tokens', so their ``image_index`` here is a scratch offset, not a grid cell."""
        return image_index + self.prefix_length

    def rope_positions(self, image_index: torch.Tensor) -> torch.Tensor:
        """Positional index of image tokens for the RoPE table (shared with the drafter)."""
        return image_index + self.prefix_length

    # --- forward passes -------------------------------------------------------------------------
    # One implementation over ``transformer`` (inputs [B, S, H], positions, boolean mask, cache, slots)
    # for every adapter; a family supplies ``prefix_inputs`` and, where tokens are forced,
    # ``constrain_logits``.
    def prefix_inputs(self, cond: Condition) -> torch.Tensor:
        """The transformer's input rows for the condition prefix [B, L, H]: by default the condition's
        features (already embedded prompts); LlamaGen projects its caption features."""
        return cond.features.to(self.dtype)

    def logits(self, hidden: torch.Tensor, predicts: torch.Tensor) -> torch.Tensor:
        """fp32 image-token logits of final-norm ``hidden`` rows predicting image index ``predicts``."""
        return self.constrain_logits(self.head(hidden).float(), predicts)

    def forward_sequence(self, cond: Condition, tokens: torch.Tensor) -> TargetOutput:
        """Teacher-forced pass over prefix + ``tokens`` [B, N] without a cache: outputs for all ``L + N``
        positions."""
        hidden = self.sequence_features(cond, tokens)
        positions = torch.arange(hidden.shape[1], device=hidden.device)
        return TargetOutput(hidden, self.logits(hidden, positions - (self.prefix_length - 1)))

    def sequence_features(
        self, cond: Condition, tokens: torch.Tensor, taps: tuple[int, ...] = ()
    ) -> torch.Tensor:
        """``forward_sequence``'s hidden states [B, L + N, H] without the head: what drafter training
        reads (the head's [B, L + N, V] logits would cost about a sixth of LlamaGen-B's pass); with
        ``taps``, the tapped layers follow along the last dim (``split_taps`` parts them). ``cond`` and
        ``tokens`` may come from anywhere (stored samples, a shard batch): they are moved to the target."""
        cond, tokens = cond.to(self.device), tokens.to(self.device)
        x = torch.cat([self.prefix_inputs(cond), self.token_embedding(tokens)], dim=1)
        seq = x.shape[1]
        positions = torch.arange(seq, device=x.device)
        return self.transformer(x, positions, prefix_causal_mask(cond.mask, seq), **tap_kwargs(taps))

    def new_cache(self, batch: int, extra_slots: int = 0) -> KVCache:
        """A static cache for ``max_seq_len`` slots plus ``extra_slots`` of scratch (draft trees)."""
        return self.transformer.new_cache(batch, self.max_seq_len + extra_slots)

    def prefill(self, cond: Condition, cache: KVCache, taps: tuple[int, ...] = ()) -> TargetOutput:
        """Write the condition prefix into slots ``0 .. L-1``; the last row predicts image token 0.
        ``taps``: layers whose residual stream the output also carries (an EAGLE-3 drafter's inputs)."""
        x = self.prefix_inputs(cond)
        length = x.shape[1]
        slots = torch.arange(length, device=x.device)
        mask = prefix_causal_mask(cond.mask, length)
        states = self.transformer(x, slots, mask, cache, slots, **tap_kwargs(taps))
        hidden, tapped = split_taps(states, self.hidden_size, len(taps))
        return TargetOutput(hidden, self.logits(hidden, slots - (length - 1)), tapped)

    def forward_tokens(
        self,
        cond: Condition,
        tokens: torch.Tensor,
        image_index: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor,
        image_visibility: torch.Tensor,
        taps: tuple[int, ...] = (),
    ) -> TargetOutput:
        """Feed image ``tokens`` [B, S] at grid cells ``image_index`` into cache ``slots``.

        ``image_visibility`` [B, S, K] says which of the first K image slots each token attends to;
        ``taps`` as in ``prefill``.
        """
        mask = prefix_and_image_mask(cond.mask, image_visibility)
        x = self.token_embedding(tokens)
        states = self.transformer(x, self.rope_positions(image_index), mask, cache, slots, **tap_kwargs(taps))
        hidden, tapped = split_taps(states, self.hidden_size, len(taps))
        return TargetOutput(hidden, self.logits(hidden, image_index + 1), tapped)

    def causal_visibility(
        self, start: int, length: int, device: torch.device | str, width: int | None = None
    ) -> torch.Tensor:
        """Visibility [1, length, width] for tokens at image slots ``start ..`` (AR decoding); ``width``
        (default ``start + length``) fixes the shape, e.g. to the whole image so every step has one."""
        q = torch.arange(start, start + length, device=device)[:, None]
        k = torch.arange(start + length if width is None else width, device=device)[None, :]
        return (k <= q)[None]
