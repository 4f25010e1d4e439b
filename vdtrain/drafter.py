"""The EAGLE-style feature drafter: fc over ``[embed(x_{t+1}); f_t]`` + one decoder layer of the target's.

The drafter owns ``fc = Linear(2H → H)`` and ONE decoder layer: the family's ``DraftLayer``
(``vdtrain.targets.draft_layers()``), which also brings the family's positional encoding. The token
embedding and the output head are *borrowed* from the frozen target (``Drafter.attach``): they are neither
parameters of the drafter nor in its saved weights. Two kinds (``DrafterConfig.kind``): ``eagle1`` reads
the target's last hidden state; ``eagle3`` fuses low, middle and high layers (``fuse``) and normalises its
output before the head (docs/training.md, "EAGLE-3 drafters").

Row ``s`` of a drafter sequence is ``fc([e_{s+1}; f_s])`` and outputs ``f̂_{s+1}``, with a zero embedding
where slot ``s + 1`` is a caption row; ``drafter_rows.drafter_inputs`` is the only place that builds it.
The alignment, positions and mask are derived in docs/training.md, "The drafter's sequence alignment".
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vdtrain.checkpoint_io import CheckpointError, load_strict, read_state_dict
from vdtrain.drafter_rows import after_prefix_rows, drafter_inputs, teacher_mask
from vdtrain.export_format import CONFIG_FILE, REPO_ID, WEIGHTS_FILE, download
from vdtrain.models.kv_cache import KVCache
from vdtrain.targets import draft_layer_class
from vdtrain.targets.base import (
    DraftLayer,
    Target,
    TargetIdentity,
)
from vdtrain.unroll_cache import UnrollCache

# Top-level keys of LlamaGen drafter configs written before ``DrafterConfig.layer`` (still read).
LLAMAGEN_LAYER_FIELDS = (
    "n_head",
    "n_kv_head",
    "multiple_of",
    "ffn_dim_multiplier",
    "norm_eps",
    "rope_base",
    "caption_rope",
)
# ``DrafterModule`` stores the drafter's config under this key of a Lightning checkpoint; its weights
# are the ``drafter.``-prefixed entries of the checkpoint's state dict.
CHECKPOINT_CONFIG_KEY = "drafter_config"
CHECKPOINT_PREFIX = "drafter."
KINDS = ("eagle1", "eagle3")


@dataclass(frozen=True)
class DrafterConfig:
    """The drafter's shape plus what it must match in its target (``target`` = the identity dict).

    ``layer`` holds the hyper-parameters of the target family's ``DraftLayer`` (``settings_fields``):
    heads and FFN width for LlamaGen, heads, FFN and norms for Chameleon.
    """

    hidden_size: int
    prefix_length: int
    grid: tuple[int, int]
    vocab_size: int
    family: str = "llamagen"
    layer: dict[str, Any] = field(default_factory=dict)
    target: dict[str, Any] = field(default_factory=dict)
    kind: str = "eagle1"  # eagle1: the target's last hidden state; eagle3: fused layers (feature_layers)
    feature_layers: tuple[int, ...] = ()  # eagle3: the target layers fused (hidden_states[k] indices)
    # eagle3 architecture choices; the defaults are what configs written before them built
    input_norm: bool = False  # RMSNorm on the token embedding and on the features before fc (EAGLE-3)
    tap_norm: bool = False  # RMSNorm on each tapped layer before the fusion (EAGLE-3.1)

    def __post_init__(self) -> None:
        # JSON turns tuples into lists: normalise so a round trip compares equal.
        object.__setattr__(self, "grid", tuple(int(g) for g in self.grid))
        object.__setattr__(self, "layer", dict(self.layer))
        object.__setattr__(self, "feature_layers", tuple(int(k) for k in self.feature_layers))
        if self.kind not in KINDS:
            raise ValueError(f"drafter kind must be one of {list(KINDS)}, got {self.kind!r}")
        if (self.kind == "eagle3") != bool(self.feature_layers):
            raise ValueError(
                "an eagle3 drafter fuses target layers (feature_layers) and an eagle1 drafter none; got "
                f"kind {self.kind!r} with feature_layers {list(self.feature_layers)}"
            )
        if self.kind != "eagle3" and (self.input_norm or self.tap_norm):
            raise ValueError(f"input_norm and tap_norm are eagle3 choices; this drafter is {self.kind!r}")
        if any(k < 0 for k in self.feature_layers):
            raise ValueError(f"feature_layers must be >= 0, got {list(self.feature_layers)}")
        if self.target:
            target = dict(self.target)
            if "grid" in target:
                target["grid"] = tuple(int(g) for g in target["grid"])
            object.__setattr__(self, "target", target)
        if len(self.grid) != 2:
            raise ValueError(f"grid must be (height, width), got {self.grid}")
        if self.prefix_length < 1:
            raise ValueError(f"prefix_length must be >= 1, got {self.prefix_length}")
        self.layer_class.check(self.hidden_size, self.grid, self.layer)
        if self.target:
            # The recorded identity must agree with the shape the drafter was built for.
            record = {
                "family": self.family,
                "hidden_size": self.hidden_size,
                "vocab_size": self.vocab_size,
                "grid": self.grid,
                "prefix_length": self.prefix_length,
            }
            bad = [
                f"{k}: {v!r} vs target {self.target.get(k)!r}"
                for k, v in record.items()
                if self.target.get(k) != v
            ]
            if bad:
                raise ValueError(
                    "drafter config disagrees with its recorded target identity: " + "; ".join(bad)
                )
            layers = self.target.get("num_layers")
            if self.feature_layers and layers is not None and max(self.feature_layers) > layers:
                raise ValueError(
                    f"feature_layers {list(self.feature_layers)} outside 0 .. {layers}: the target has "
                    f"{layers} layers"
                )

    @property
    def layer_class(self) -> type[DraftLayer]:
        return draft_layer_class(self.family)

    @property
    def num_image_tokens(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def max_seq_len(self) -> int:
        return self.prefix_length + self.num_image_tokens

    def identity(self) -> TargetIdentity | None:
        return TargetIdentity(**self.target) if self.target else None

    @classmethod
    def for_target(
        cls,
        target: Target,
        kind: str = "eagle1",
        feature_layers: tuple[int, ...] | None = None,
        input_norm: bool = True,
        tap_norm: bool = False,
        **layer_overrides: Any,
    ) -> DrafterConfig:
        """The drafter of ``target``'s family, with the target's own layer hyper-parameters.

        ``layer_overrides`` may change the family layer's ``settings_fields`` (heads, FFN size, ...),
        never the width. An ``eagle3`` drafter fuses ``feature_layers``, by default the family's choice
        (``Target.default_feature_layers``), and normalises its inputs as ``input_norm`` and ``tap_norm``
        say (an eagle1 drafter ignores them: it reads final-norm states).
        """
        ident = target.identity
        if kind == "eagle3" and feature_layers is None:
            feature_layers = target.default_feature_layers()
        layer_class = draft_layer_class(ident.family)
        unknown = sorted(set(layer_overrides) - set(layer_class.settings_fields))
        if unknown:
            raise ValueError(
                f"cannot override {unknown} of a {ident.family} drafter layer; "
                f"allowed: {list(layer_class.settings_fields)}"
            )
        return cls(
            hidden_size=ident.hidden_size,
            prefix_length=ident.prefix_length,
            grid=ident.grid,
            vocab_size=ident.vocab_size,
            family=ident.family,
            layer={**layer_class.settings_of(target), **layer_overrides},
            target=dataclasses.asdict(ident),
            kind=kind,
            feature_layers=tuple(feature_layers or ()),
            input_norm=input_norm and kind == "eagle3",
            tap_norm=tap_norm and kind == "eagle3",
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (tuples become lists; ``from_dict`` restores them)."""
        out = dataclasses.asdict(self)
        out["grid"] = list(self.grid)
        out["feature_layers"] = list(self.feature_layers)
        if "grid" in out["target"]:
            out["target"]["grid"] = list(out["target"]["grid"])
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DrafterConfig:
        if not isinstance(data, Mapping):
            raise ValueError(f"a drafter config is a JSON object, got {type(data).__name__}")
        data = _nest_legacy_layer(data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown drafter config keys {unknown}; known: {sorted(known)}")
        try:
            return cls(**data)
        except TypeError as err:  # a required key missing, or a value of the wrong type (a number for grid)
            raise ValueError(f"incomplete or mistyped drafter config: {err}") from err


def _nest_legacy_layer(data: Mapping[str, Any]) -> dict[str, Any]:
    """Configs written before ``layer`` existed kept LlamaGen's layer fields at the top level."""
    data = dict(data)
    if "layer" not in data and data.get("family", "llamagen") == "llamagen":
        legacy = [name for name in LLAMAGEN_LAYER_FIELDS if name in data]
        if legacy:
            data["layer"] = {name: data.pop(name) for name in legacy}
    return data


@dataclass
class _Borrowed:
    """The target modules the drafter uses but does not own: held outside ``nn.Module`` registration
    so they are neither in ``parameters()`` nor in ``state_dict()``."""

    embedding: nn.Module
    head: nn.Module
    identity: TargetIdentity


class Drafter(nn.Module):
    """``fc`` + one decoder layer; the target's embedding and head are borrowed via ``attach``."""

    def __init__(self, config: DrafterConfig, target: Target | None = None) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        if config.kind == "eagle3":  # as EAGLE-3: a bias-free fusion, a norm before the head
            self.fuse = nn.Linear(len(config.feature_layers) * hidden, hidden, bias=False)
            self.norm = nn.RMSNorm(hidden, eps=1e-6)
        if config.tap_norm:
            self.tap_norms = nn.ModuleList(nn.RMSNorm(hidden, eps=1e-6) for _ in config.feature_layers)
        if config.input_norm:  # the embedding (~0.08) and the features (~1.7) put on one scale
            self.embed_norm = nn.RMSNorm(hidden, eps=1e-6)
            self.feature_norm = nn.RMSNorm(hidden, eps=1e-6)
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.layer = config.layer_class(hidden, config.prefix_length, config.grid, config.layer)
        self._borrowed: _Borrowed | None = None
        self.metadata: dict[str, Any] = {}  # what ``from_pretrained`` found saved next to the weights
        if target is not None:
            self.attach(target)

    # --- the borrowed target modules --------------------------------------------------------------
    def attach(self, target: Target) -> Drafter:
        """Borrow ``target``'s frozen token embedding and head after checking it is the right target."""
        ident = target.identity
        if ident.hidden_size != self.config.hidden_size:
            raise ValueError(
                f"drafter hidden_size {self.config.hidden_size} != target hidden_size {ident.hidden_size} "
                f"(target {ident.name!r})"
            )
        expected = self.config.identity()
        if expected is None:  # a config built by hand: check the shape it was built for
            expected = dataclasses.replace(
                ident,
                family=self.config.family,
                vocab_size=self.config.vocab_size,
                grid=self.config.grid,
                prefix_length=self.config.prefix_length,
            )
        problems = expected.mismatches(ident)
        if self.taps and max(self.taps) > target.num_layers:
            problems.append(
                f"feature_layers {list(self.taps)} need {max(self.taps)} layers, the target has "
                f"{target.num_layers}"
            )
        if problems:
            raise ValueError(
                f"drafter was trained for target {expected.name!r} and does not match target "
                f"{ident.name!r}: " + "; ".join(problems)
            )
        embedding, head = target.token_embedding, target.head
        # Frozen by contract; made explicit so no optimiser can ever move them.
        embedding.requires_grad_(False)
        head.requires_grad_(False)
        self._borrowed = _Borrowed(embedding, head, ident)
        return self

    @torch.no_grad()
    def start_from(self, target: Target) -> Drafter:
        """A new drafter's initialisation from its target: an eagle3 drafter's norm starts as the target's
        final norm (``transformer.norm``), so its first logits are on the head's scale."""
        final_norm = getattr(target.transformer, "norm", None)
        if self.config.kind == "eagle3" and final_norm is not None:
            self.norm.weight.copy_(final_norm.weight.float())
        return self

    @property
    def taps(self) -> tuple[int, ...]:
        """The target layers whose residual stream this drafter reads (``Target.forward_*``'s ``taps``);
        empty for eagle1, which reads the final-norm hidden state."""
        return self.config.feature_layers

    def input_features(self, hidden: torch.Tensor, tapped: torch.Tensor | None) -> torch.Tensor:
        """The target's contribution to drafter rows [.., H]: ``hidden`` (eagle1), or the fusion of the
        ``tapped`` layers [.., k·H] (eagle3). Every target feature enters the drafter through here."""
        if not self.taps:
            return hidden
        if tapped is None:
            raise ValueError(
                f"an eagle3 drafter reads target layers {list(self.taps)}: run the target with taps"
            )
        tapped = tapped.to(self.fuse.weight.dtype)
        if self.config.tap_norm:
            parts = tapped.split(self.config.hidden_size, dim=-1)
            tapped = torch.cat([norm(part) for norm, part in zip(self.tap_norms, parts, strict=True)], -1)
        return self.fuse(tapped)

    @property
    def attached(self) -> bool:
        return self._borrowed is not None

    def _require(self) -> _Borrowed:
        if self._borrowed is None:
            raise RuntimeError("the drafter has no target attached: call drafter.attach(target) first")
        return self._borrowed

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The target's token embedding of image ``tokens``."""
        return self._require().embedding(tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target head applied to drafter features ``f̂`` (normalised first by an eagle3 drafter);
        fp32 image-token logits."""
        return self.head_logits(self.normed(hidden))

    def normed(self, hidden: torch.Tensor) -> torch.Tensor:
        """Drafter features as the head reads them: an eagle3 drafter's own norm; eagle1's f̂ as is (it
        regresses final-norm states)."""
        if self.config.kind == "eagle3":
            return self.norm(hidden.to(self.norm.weight.dtype))
        return hidden

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The borrowed target head alone: fp32 logits of final-norm states (the target's, in training)."""
        head = self._require().head
        weight = next(head.parameters(), None)
        if weight is not None:
            hidden = hidden.to(weight.dtype)
        return head(hidden).float()

    # --- forward passes ---------------------------------------------------------------------------
    def forward(
        self,
        features: torch.Tensor,
        next_embeds: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None = None,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows ``fc([next_embeds; features])`` at RoPE ``positions`` ([S] or [B, S]) → ``f̂`` [B, S, H].

        Like ``LlamaGenGPT.forward``: with a ``cache`` the keys/values go to ``slots`` and ``mask``
        [B, 1, S, kv_len] covers the first ``kv_len`` cache slots.
        """
        dtype = self.fc.weight.dtype
        next_embeds, features = next_embeds.to(dtype), features.to(dtype)
        if self.config.input_norm:  # a zero embedding (prefix rows) stays zero
            next_embeds, features = self.embed_norm(next_embeds), self.feature_norm(features)
        x = self.fc(torch.cat([next_embeds, features], dim=-1))
        if positions.dim() == 1:
            positions = positions.expand(x.shape[0], -1)
        return self.layer(x, positions, mask, cache, slots)

    def forward_teacher(
        self, target_hidden: torch.Tensor, tokens: torch.Tensor, cond_mask: torch.Tensor
    ) -> torch.Tensor:
        """Teacher-forced ``f̂`` for slots ``1 .. L+N-1`` [B, L+N-1, H]; targets: ``target_hidden[:, 1:]``."""
        features, next_embeds = drafter_inputs(target_hidden, tokens, self.config.prefix_length, self.embed)
        seq = features.shape[1]
        positions = torch.arange(seq, device=features.device)
        return self(features, next_embeds, positions, teacher_mask(cond_mask, seq))

    def unroll(
        self, features: torch.Tensor, tokens: torch.Tensor, cond_mask: torch.Tensor, steps: int
    ) -> list[torch.Tensor]:
        """Training-time test: ``f̂`` [B, L+N-1, H] of unrolled steps ``0 .. steps-1`` (draft depths
        ``1 .. steps``), teacher-forced on the true ``tokens``.

        ``features`` [B, L+N, H]: the target's, through ``input_features``. Step 0 is ``forward_teacher``;
        step ``j`` feeds row ``s`` the drafter's own step ``j-1`` output at row ``s-1`` (its prediction of
        ``f_s``), and ``UnrollCache`` lets it see exactly what the matching tree node sees: the teacher
        keys of the chain's start and one ancestor per earlier step, O(k) in the unroll depth.
        Only the rows of ``chain_rows`` are drafts decoding makes."""
        seq = features.shape[1] - 1
        embeds = after_prefix_rows(self.embed(tokens), self.config.prefix_length)
        positions = torch.arange(seq, device=features.device)
        mask, cache = teacher_mask(cond_mask, seq), UnrollCache()
        inputs, outs = features[:, :-1], []
        for _ in range(steps):
            outs.append(self(inputs, embeds, positions, mask, cache, positions))
            inputs = torch.cat([outs[-1][:, :1], outs[-1][:, :-1]], dim=1)  # row s ← step output at s-1
        return outs

    def forward_prefix(
        self, prefix_hidden: torch.Tensor, first_tokens: torch.Tensor, cond_mask: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """Decoding's catch-up on the prefix: rows ``0 .. L-1`` (the last embeds image token 0
        ``first_tokens`` [B, 1]) into cache slots ``0 .. L-1``, as in training → f̂ [B, L, H]."""
        length = prefix_hidden.shape[1]
        slots = torch.arange(length, device=prefix_hidden.device)
        next_embeds = after_prefix_rows(self.embed(first_tokens), length)
        return self(prefix_hidden, next_embeds, slots, teacher_mask(cond_mask, length), cache, slots)

    def new_cache(self, batch: int, max_len: int | None = None) -> KVCache:
        return self.layer.new_cache(batch, max_len or self.config.max_seq_len)

    # --- saving and loading -----------------------------------------------------------------------
    def save_pretrained(
        self, folder: str | os.PathLike[str], metadata: Mapping[str, Any] | None = None
    ) -> Path:
        """Write ``config.json`` (the ``DrafterConfig``, plus optional JSON ``metadata``) and
        ``model.safetensors`` (the drafter's own weights only)."""
        from safetensors.torch import save_file

        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        config = self.config.to_dict()
        if metadata is not None:
            config["metadata"] = dict(metadata)
        (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        # clone: some entries are views of one fused weight (LlamaGen's w1 / w3), and safetensors
        # refuses tensors that share memory
        state = {k: v.detach().to("cpu").clone() for k, v in self.state_dict().items()}
        save_file(state, str(path / WEIGHTS_FILE))
        return path

    @classmethod
    def from_pretrained(
        cls,
        source: str | os.PathLike[str],
        target: Target | None = None,
        *,
        revision: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> Drafter:
        """A drafter from an export folder, a Lightning ``.ckpt`` of ``vdtrain.fit`` or a Hub repo id.

        A repo id (``owner/name``; ``revision`` and ``cache_dir`` apply to it only) is fetched with
        ``huggingface_hub`` and honours ``HF_HUB_OFFLINE`` and the local cache. With ``target`` the
        recorded target identity is checked (an error names every field that differs), the target's
        embedding and head are attached and the drafter moves to its device and dtype (a bf16 target gets
        a bf16 drafter). ``drafter.metadata`` is what was saved with the weights (training summary,
        config, command; a ``.ckpt``'s step).
        """
        path = Path(source).expanduser()
        if path.is_file() and path.suffix == ".ckpt":
            config, state, metadata = _read_lightning_checkpoint(path)
        elif path.exists():
            config, state, metadata = _read_export(path)
        elif REPO_ID.fullmatch(str(source)):
            config, state, metadata = _read_export(download(str(source), revision, cache_dir))
        else:
            raise FileNotFoundError(
                f"no drafter at {str(path)!r}: not an export folder, a .ckpt file or a Hub repo id "
                "(owner/name)"
            )
        drafter = cls(config)
        load_strict(drafter, state, f"drafter ({source})")
        drafter.metadata = metadata
        if target is not None:
            try:
                drafter.attach(target)
            except ValueError as err:
                raise ValueError(f"cannot use drafter {str(source)!r}: {err}") from err
            weight = target.token_embedding.weight
            drafter.to(weight.device, weight.dtype)
        return drafter.eval()

    @staticmethod
    def read_metadata(folder: str | os.PathLike[str]) -> dict[str, Any]:
        """The ``metadata`` saved next to the config (empty if none)."""
        return _read_config_json(Path(folder) / CONFIG_FILE).get("metadata", {})


def _read_config_json(config_file: Path) -> dict[str, Any]:
    """A drafter folder's ``config.json`` as a dict; a ``CheckpointError`` naming the file otherwise."""
    try:
        data = json.loads(config_file.read_text(encoding="utf-8"))
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(
            f"{str(config_file)!r} is not valid JSON ({err}); re-export the drafter or download it again"
        ) from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{str(config_file)!r} holds a {type(data).__name__}, not a drafter config")
    return data


def _read_export(folder: Path) -> tuple[DrafterConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """Config, weights and metadata of an export folder (``save_pretrained``'s layout)."""
    config_file = folder / CONFIG_FILE
    if not config_file.is_file():
        hint = (
            " (a DeepSpeed checkpoint folder: convert it with Lightning's "
            "convert_zero_checkpoint_to_fp32_state_dict first)"
            if folder.suffix == ".ckpt"
            else ""
        )
        raise FileNotFoundError(f"no drafter at {str(folder)!r}: {CONFIG_FILE} is missing{hint}")
    data = _read_config_json(config_file)
    metadata = data.pop("metadata", {})
    try:
        config = DrafterConfig.from_dict(data)
    except ValueError as err:
        raise CheckpointError(f"{str(config_file)!r} is not a usable drafter config: {err}") from err
    return config, read_state_dict(folder / WEIGHTS_FILE), metadata


def _read_lightning_checkpoint(path: Path) -> tuple[DrafterConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """The drafter inside a ``DrafterModule`` checkpoint: its config (stored by the module under
    ``CHECKPOINT_CONFIG_KEY``), its ``drafter.*`` weights, and the step as metadata."""
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated or foreign file: say which one
        raise CheckpointError(f"cannot read checkpoint {str(path)!r}: {err}") from err
    if CHECKPOINT_CONFIG_KEY not in blob:
        raise CheckpointError(
            f"{str(path)!r} carries no drafter config (no {CHECKPOINT_CONFIG_KEY!r}; it was written before "
            "vdtrain stored one, or not by vdtrain.fit): load the run's exported drafter folder instead"
        )
    prefix = CHECKPOINT_PREFIX
    state = {k[len(prefix) :]: v for k, v in blob["state_dict"].items() if k.startswith(prefix)}
    step = {"file": path.name, "global_step": blob.get("global_step"), "epoch": blob.get("epoch")}
    return DrafterConfig.from_dict(blob[CHECKPOINT_CONFIG_KEY]), state, {"checkpoint": step}
