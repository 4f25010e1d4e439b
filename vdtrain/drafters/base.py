"""The drafter: a kind's own modules between the target's borrowed token embedding and head.

What a drafter holds and does is its kind's (``DrafterConfig.kind``, a row of
``vdtrain.drafters.registry.DRAFTERS``): EAGLE's ``fc`` and one decoder layer of the target's family
(``eagle1``, ``eagle3``), or Medusa-style heads (``medusa``). The token embedding and the output head are
*borrowed* from the frozen target (``Drafter.attach``): they are neither parameters of the drafter nor in
its saved weights.

Row ``s`` of a drafter sequence is ``fc([e_{s+1}; f_s])`` and outputs ``f̂_{s+1}``, with a zero embedding
where slot ``s + 1`` is a caption row; ``rows.teacher_inputs`` builds it.
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
from vdtrain.drafters.registry import DRAFTERS, DrafterKind, drafter_kind
from vdtrain.drafters.rows import after_prefix_rows, teacher_inputs, teacher_mask
from vdtrain.drafters.unroll_cache import UnrollCache
from vdtrain.export_format import CONFIG_FILE, REPO_ID, WEIGHTS_FILE, download
from vdtrain.models.kv_cache import KVCache
from vdtrain.targets import draft_layer_class
from vdtrain.targets.base import (
    DraftLayer,
    Target,
    TargetIdentity,
)

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
    kind: str = "eagle1"  # a row of DRAFTERS: eagle1 | eagle3 | medusa
    # The kind's own settings (``DrafterKind.options`` names them and holds their defaults).
    options: dict[str, Any] = field(default_factory=dict)
    # eagle3's keys (``DrafterKind.keys``), kept at the top level as configs written before ``options``
    # have them; another kind keeps these defaults, which are what such configs built.
    feature_layers: tuple[int, ...] = ()  # eagle3: the target layers fused (hidden_states[k] indices)
    input_norm: bool = False  # eagle3: RMSNorm on the token embedding and on the features before fc
    tap_norm: bool = False  # eagle3: RMSNorm on each tapped layer before the fusion (EAGLE-3.1)

    def __post_init__(self) -> None:
        # JSON turns tuples into lists: normalise so a round trip compares equal.
        object.__setattr__(self, "grid", tuple(int(g) for g in self.grid))
        object.__setattr__(self, "layer", dict(self.layer))
        object.__setattr__(self, "feature_layers", tuple(int(k) for k in self.feature_layers))
        kind = drafter_kind(self.kind)
        unknown = sorted(set(self.options) - set(kind.options))
        if unknown:
            raise ValueError(f"{unknown} are not {self.kind} options; its options: {list(kind.options)}")
        object.__setattr__(self, "options", {**kind.options, **self.options})
        if kind.reads_layers != bool(self.feature_layers):
            reads = "fuses target layers (feature_layers)" if kind.reads_layers else "fuses no target layer"
            got = list(self.feature_layers)
            raise ValueError(f"a drafter of kind {self.kind!r} {reads}; got feature_layers {got}")
        foreign = [name for name in _owned_keys() - set(kind.keys) if getattr(self, name) != _DEFAULTS[name]]
        if foreign:
            raise ValueError(f"{foreign} are not {self.kind} choices; its own keys: {list(kind.keys)}")
        if kind.check is not None:
            kind.check(self)
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
    def drafter_kind(self) -> DrafterKind:
        return DRAFTERS[self.kind]

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
        layer: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> DrafterConfig:
        """A new ``kind`` drafter of ``target``'s family, with the target's own layer hyper-parameters.

        ``layer`` may change the family layer's ``settings_fields`` (heads, FFN size, ...), never the
        width. ``options`` set the kind's keys (``DrafterKind.keys``: an eagle3 drafter's
        ``feature_layers``, ``input_norm``, ``tap_norm``) over its defaults for a new drafter
        (``DrafterKind.defaults``: eagle3 fuses the family's choice of layers), and its ``options``
        (``DrafterKind.options``: a medusa drafter's ``heads``).
        """
        ident, owner = target.identity, drafter_kind(kind)
        unknown = sorted(set(options) - set(owner.keys) - set(owner.options))
        if unknown:
            raise ValueError(
                f"{unknown} are not {kind} choices; its own keys: {[*owner.keys, *owner.options]}"
            )
        layer_class = draft_layer_class(ident.family)
        overrides = dict(layer or {})
        unknown = sorted(set(overrides) - set(layer_class.settings_fields))
        if unknown:
            raise ValueError(
                f"cannot override {unknown} of a {ident.family} drafter layer; "
                f"allowed: {list(layer_class.settings_fields)}"
            )
        given = {k: v for k, v in options.items() if v is not None}
        own = {**owner.defaults(target), **{k: v for k, v in given.items() if k in owner.keys}}
        own["options"] = {k: v for k, v in given.items() if k in owner.options}
        return cls(
            hidden_size=ident.hidden_size,
            prefix_length=ident.prefix_length,
            grid=ident.grid,
            vocab_size=ident.vocab_size,
            family=ident.family,
            layer={**layer_class.settings_of(target), **overrides},
            target=dataclasses.asdict(ident),
            kind=kind,
            **own,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (tuples become lists; ``from_dict`` restores them), without the keys other kinds own."""
        out = dataclasses.asdict(self)
        for name in _owned_keys() - set(self.drafter_kind.keys):
            del out[name]
        if not out["options"]:
            del out["options"]
        out["grid"] = list(self.grid)
        if "feature_layers" in out:
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


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DrafterConfig)}


def _owned_keys() -> set[str]:
    """The ``DrafterConfig`` keys some kind owns."""
    return {key for kind in DRAFTERS.values() for key in kind.keys}


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
    """Its kind's modules (``DrafterKind.modules``); the target's embedding and head are borrowed via
    ``attach``."""

    def __init__(self, config: DrafterConfig, target: Target | None = None) -> None:
        super().__init__()
        self.config = config
        self.kind = config.drafter_kind
        for name, module in self.kind.modules(config).items():
            self.add_module(name, module)
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

    def start_from(self, target: Target) -> Drafter:
        """A new drafter's initialisation from its target, as its kind does it (``DrafterKind.start_from``:
        an eagle3 drafter's norm starts as the target's final norm)."""
        if self.kind.start_from is not None:
            self.kind.start_from(self, target)
        return self

    @property
    def taps(self) -> tuple[int, ...]:
        """The target layers whose residual stream this drafter reads (``Target.forward_*``'s ``taps``);
        empty for a kind that reads only the final-norm hidden state."""
        return self.config.feature_layers

    def input_features(self, hidden: torch.Tensor, tapped: torch.Tensor | None) -> torch.Tensor:
        """The target's contribution to drafter rows: from ``hidden`` [.., H] and the ``tapped`` layers
        [.., k·H] (None without taps), as the kind reads them. Every target feature enters the drafter
        through here."""
        return self.kind.input_features(self, hidden, tapped)

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
        """The target head applied to drafter features ``f̂`` (as the kind hands them to it, ``normed``);
        fp32 image-token logits."""
        return self.head_logits(self.normed(hidden))

    def normed(self, hidden: torch.Tensor) -> torch.Tensor:
        """Drafter features ``f̂`` as the head reads them (``DrafterKind.head_input``): eagle1's as is (it
        regresses final-norm states), eagle3's through its own norm, medusa's through the next head."""
        return self.kind.head_input(self, hidden)

    @property
    def head(self) -> nn.Module:
        """The borrowed, frozen target head (final-norm states → image-token logits)."""
        return self._require().head

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The borrowed target head alone: fp32 logits of final-norm states (the target's, in training)."""
        head = self.head
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
        """One drafter call on rows pairing ``features`` [B, S, F] with ``next_embeds`` [B, S, H] at RoPE
        ``positions`` ([S] or [B, S]) → ``f̂`` [B, S, F] (the kind's ``forward``; F = H but for medusa).

        Like ``LlamaGenGPT.forward``: with a ``cache`` the keys/values go to ``slots`` and ``mask``
        [B, 1, S, kv_len] covers the first ``kv_len`` cache slots.
        """
        if positions.dim() == 1:
            positions = positions.expand(features.shape[0], -1)
        return self.kind.forward(self, features, next_embeds, positions, mask, cache, slots)

    def forward_teacher(
        self, target_hidden: torch.Tensor, tokens: torch.Tensor, cond_mask: torch.Tensor
    ) -> torch.Tensor:
        """Teacher-forced ``f̂`` for slots ``1 .. L+N-1`` [B, L+N-1, H]; targets: ``target_hidden[:, 1:]``."""
        features, next_embeds = teacher_inputs(target_hidden, tokens, self.config.prefix_length, self.embed)
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

    def new_cache(self, batch: int, max_len: int | None = None) -> KVCache | None:
        """The kind's cache for ``batch`` rows of ``max_len`` slots; None for a kind that attends to
        nothing."""
        return self.kind.new_cache(self, batch, max_len or self.config.max_seq_len)

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
