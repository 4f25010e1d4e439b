"""The drafter: a kind's own modules between the target's borrowed token embedding and head.

``Drafter`` is what every kind shares: the borrowed embedding and head (``attach``: neither parameters of
the drafter nor in its saved weights), the teacher-forced and unrolled passes training runs, decoding's
prefix catch-up, and saving and loading. A kind is a subclass (``vdtrain.drafters.registry.DRAFTERS``)
that names its options dataclass and fills the hooks below: its modules (``build``), how target features
enter it (``input_features``), one drafter call (``draft``), what the head reads (``normed``), its cache,
how it trains (``unroll_steps``, or a loss of its own: ``training_loss``), whether one forward drafts a
block of tokens (``drafts_blocks``, ``block_slots``, ``block_queries``) and its card (``Drafter.make``).

Row ``s`` of a drafter sequence is ``fc([e_{s+1}; f_s])`` and outputs ``f̂_{s+1}`` (``rows.teacher_inputs``;
derived in docs/training.md, "The drafter's sequence alignment"). Every drafter feature, ``f`` in and ``f̂``
out, is [.., H] (the target's width, whatever ``input_features`` fuses); what else a kind needs per row is
a typed part of its rows (``DraftInputs.offset``: Medusa's head, a block's query offset), never channels.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from vdtrain.checkpoint_io import CheckpointError, load_strict, read_state_dict
from vdtrain.config import DrafterTrainConfig
from vdtrain.drafters.config import DrafterConfig
from vdtrain.drafters.registry import DRAFTERS, drafter_class
from vdtrain.drafters.rows import after_prefix_rows, teacher_inputs, teacher_mask
from vdtrain.drafters.unroll_cache import UnrollCache
from vdtrain.export_format import CONFIG_FILE, REPO_ID, WEIGHTS_FILE, download
from vdtrain.models.kv_cache import KVCache
from vdtrain.targets.base import Target, TargetIdentity
from vdtrain.zero_checkpoint import TAG_FILE as ZERO_TAG_FILE
from vdtrain.zero_checkpoint import gather_fp32, is_zero_checkpoint

# ``DrafterModule`` stores the drafter's config under this key of a Lightning checkpoint; its weights
# are the ``drafter.``-prefixed entries of the checkpoint's state dict.
CHECKPOINT_CONFIG_KEY = "drafter_config"
CHECKPOINT_PREFIX = "drafter."


class DraftInputs(NamedTuple):
    """What one drafter call (``Drafter.draft``) reads besides its rows' features."""

    embeds: torch.Tensor  # [B, S, H] the embeddings of the tokens after the rows' features
    positions: torch.Tensor  # [B, S] RoPE positions
    mask: torch.Tensor | None  # [B, 1, S, kv_len]: with a cache, over its first kv_len slots
    cache: KVCache | None  # where the keys and values go (None: attend to the rows alone)
    slots: torch.Tensor | None  # [B, S] or [S] the cache slots of the rows
    # The rows' place past the root: an int for rows of one depth (0: committed rows; d: a depth-d tree
    # node's, whose children lie d + 1 past the root), or [S] the offsets 1 .. S of a block's query rows.
    offset: torch.Tensor | int = 0


class LossInputs(NamedTuple):
    """What a drafter's training loss reads of one batch (``DrafterModule.loss_on`` makes it)."""

    tokens: torch.Tensor  # [B, N] image tokens
    cond_mask: torch.Tensor  # [B, L] the prefix mask
    hidden: torch.Tensor  # [B, L+N, H] the target's final-norm states: what the loss scores against
    hidden_in: torch.Tensor  # [B, L+N, H] what the drafter reads of them (noised where it has no taps)
    tapped: torch.Tensor | None  # [B, L+N, k·H] the tapped layers it reads (noised); None without taps
    # The image indices whose blocks a block drafter's loss trains (``Drafter.training_roots``, drawn
    # outside the compiled loss: a generator is no graph input); None for the other kinds.
    roots: torch.Tensor | None = None


@dataclass(frozen=True)
class NoOptions:
    """A kind with no settings of its own."""


@dataclass
class _Borrowed:
    """The target modules the drafter uses but does not own: held outside ``nn.Module`` registration
    so they are neither in ``parameters()`` nor in ``state_dict()``."""

    embedding: nn.Module
    head: nn.Module
    identity: TargetIdentity


class Drafter(nn.Module):
    """What every kind shares; a kind subclasses it (``DRAFTERS``). ``Drafter.make(config)`` makes the class
    of ``config.kind``; the target's embedding and head are borrowed via ``attach``."""

    title: ClassVar[str]  # the model card's title: "<title> for `<target>`"
    method: ClassVar[str] = "eagle2"  # the decode preset its model card samples with
    card_tags: ClassVar[tuple[str, ...]] = ("eagle",)  # the model card's tags for the kind's design
    Options: ClassVar[type] = NoOptions  # its settings (DrafterConfig.options), a frozen dataclass
    feature_loss: ClassVar[bool] = True  # f̂ regresses the target's next feature (``w_cls`` / ``w_feature``)
    # One forward drafts a block of tokens (``block_slots``, ``block_queries``): a block tree's drafter.
    drafts_blocks: ClassVar[bool] = False
    # Options whose parts start at zero: fit's ``drafter.init_from`` may add them to a drafter saved without
    # them (``fit_parts.grown``), which then drafts what it drafted until it trains.
    grows: ClassVar[frozenset[str]] = frozenset()
    # The validation estimate of S that fit's best.ckpt keeps by default (FitConfig.best_metric null).
    best_metric: ClassVar[str] = "val/tau_sim"
    # its own loss reads ``DrafterTrainConfig.guided_scale``: a batch of both streams, conditional half first
    trains_guided: ClassVar[bool] = False

    @classmethod
    def make(cls, config: DrafterConfig, target: Target | None = None) -> Drafter:
        """A drafter of ``config.kind``'s class (``DRAFTERS``), or of ``cls`` where ``cls`` is a kind's own
        subclass (a test's variant, say); with ``target`` attached."""
        return (drafter_class(config.kind) if cls is Drafter else cls)(config, target)

    def __init__(self, config: DrafterConfig, target: Target | None = None) -> None:
        if not isinstance(self, drafter_class(config.kind)):
            raise ValueError(
                f"a {type(self).__name__} cannot be built from a {config.kind} drafter's config: "
                "make one with Drafter.make(config)"
            )
        super().__init__()
        self.config = config
        self.build(config)
        self._borrowed: _Borrowed | None = None
        self.metadata: dict[str, Any] = {}  # what ``from_pretrained`` found saved next to the weights
        if target is not None:
            self.attach(target)

    @property
    def options(self) -> Any:
        """This drafter's settings: an instance of its kind's ``Options``."""
        return self.config.options

    # --- what a kind fills in ---------------------------------------------------------------------
    def build(self, config: DrafterConfig) -> None:
        """Register the kind's own modules (their names are the saved weights' prefixes)."""
        raise NotImplementedError

    @classmethod
    def options_for(cls, target: Target) -> dict[str, Any]:
        """A new drafter's options for ``target``, before any given (``DrafterConfig.for_target``)."""
        return {}

    @classmethod
    def check(cls, config: DrafterConfig) -> None:
        """Refuse a config this kind cannot build, naming what is wrong."""

    def start_from(self, target: Target) -> Drafter:
        """A new drafter's initialisation from its target (nothing by default)."""
        return self

    @property
    def taps(self) -> tuple[int, ...]:
        """The target layers whose residual stream this drafter reads (``Target.forward_*``'s ``taps``);
        empty for a kind that reads only the final-norm hidden state."""
        return ()

    def input_features(self, hidden: torch.Tensor, tapped: torch.Tensor | None) -> torch.Tensor:
        """The target's contribution to drafter rows, from ``hidden`` [.., H] and the ``tapped`` layers
        [.., k·H] (None without taps): every target feature enters the drafter here. By default the
        final-norm ``hidden`` as is."""
        return hidden

    def draft(self, features: torch.Tensor, rows: DraftInputs) -> torch.Tensor:
        """One drafter call on ``features`` [B, S, H] at ``rows`` → f̂ [B, S, H] (``forward``'s contract)."""
        raise NotImplementedError

    def normed(self, hidden: torch.Tensor, offset: torch.Tensor | int = 0) -> torch.Tensor:
        """Drafter features ``f̂`` of rows at ``offset`` (``DraftInputs.offset``) as the head reads them: by
        default as they are (a drafter that regresses final-norm states)."""
        return hidden

    def new_cache(self, batch: int, max_len: int | None = None) -> KVCache | None:
        """The kind's cache for ``batch`` rows of ``max_len`` slots (default the whole sequence); None (the
        default) for a kind that attends to nothing."""
        return None

    def unroll_steps(self, ttt_steps: int) -> int | None:
        """Training: None trains teacher-forced (one pass, ``forward_teacher``); else the number of
        unrolled passes (``unroll``), given ``drafter.ttt_steps``."""
        return None

    def training_roots(
        self, num_tokens: int, generator: torch.Generator | None, device: torch.device
    ) -> torch.Tensor | None:
        """``LossInputs.roots``: what a kind's own loss draws per step with ``generator`` (None in
        validation), drawn before the compiled loss runs. None (the default): nothing."""
        return None

    def training_loss(
        self, batch: LossInputs, train: DrafterTrainConfig
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        """A kind's own training loss and its logged parts on ``batch`` (``DrafterModule.drafter_loss`` calls
        it first, compiled like every kind's: fixed shapes, no graph break). None (the default): the
        teacher-forced or unrolled passes (``unroll_steps``) and their loss."""
        return None

    @property
    def block_slots(self) -> int:
        """Tokens one forward drafts as a block (``block_queries``) where the kind ``drafts_blocks``; 0 (the
        default): a kind that drafts one depth per call."""
        return 0

    def block_queries(self, roots: torch.Tensor, count: int) -> torch.Tensor:
        """The features [R, count, H] of a block's ``count`` query rows from the roots' features ``roots``
        [R, H]: each carries its root's (the rows' ``offset`` 1 .. ``count`` tells them apart); one forward
        over them drafts the tokens 1 .. ``count`` past the root's child (a block tree's,
        ``vdtrain.decode.builders.block``). Only a kind with ``block_slots`` has them."""
        if count >= max(self.block_slots, 1):
            if not self.drafts_blocks:
                raise ValueError(
                    f"a {self.config.kind} drafter drafts no blocks: train one that does (drafter.kind=block)"
                )
            raise ValueError(f"a block of {count + 1} tokens exceeds the drafter's {self.block_slots} slots")
        return roots[:, None].expand(-1, count, -1)

    def card(self) -> str:
        """The model card's design sentence, up to "and the target's head ..." (``hub``)."""
        raise NotImplementedError

    def shape(self) -> str:
        """The model card's shape line."""
        raise NotImplementedError

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

    def logits(self, hidden: torch.Tensor, offset: torch.Tensor | int = 0) -> torch.Tensor:
        """The target head applied to drafter features ``f̂`` of rows at ``offset`` (as the kind hands them to
        it, ``normed``); fp32 image-token logits."""
        return self.head_logits(self.normed(hidden, offset))

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
        *,
        offset: torch.Tensor | int = 0,
    ) -> torch.Tensor:
        """One drafter call on rows pairing ``features`` [B, S, H] with ``next_embeds`` [B, S, H] at RoPE
        ``positions`` ([S] or [B, S]) and ``offset`` past the root (``DraftInputs.offset``) → ``f̂``
        [B, S, H] (the kind's ``draft``).

        Like ``LlamaGenGPT.forward``: with a ``cache`` the keys/values go to ``slots`` and ``mask``
        [B, 1, S, kv_len] covers the first ``kv_len`` cache slots.
        """
        if positions.dim() == 1:
            positions = positions.expand(features.shape[0], -1)
        return self.draft(features, DraftInputs(next_embeds, positions, mask, cache, slots, offset))

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
        for step in range(steps):  # step j's rows stand for depth-j nodes: offset j
            outs.append(self(inputs, embeds, positions, mask, cache, positions, offset=step))
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

    # --- saving and loading -----------------------------------------------------------------------
    def save_pretrained(
        self, folder: str | os.PathLike[str], metadata: Mapping[str, Any] | None = None
    ) -> Path:
        """Write ``config.json`` (the ``DrafterConfig``, plus optional JSON ``metadata``) and
        ``model.safetensors`` (the drafter's own weights only)."""
        from safetensors.torch import save

        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        config = self.config.to_dict()
        if metadata is not None:
            config["metadata"] = dict(metadata)
        (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        # clone: some entries are views of one fused weight (LlamaGen's w1 / w3), and safetensors
        # refuses tensors that share memory
        state = {k: v.detach().to("cpu").clone() for k, v in self.state_dict().items()}
        # written as bytes through an ordinary open: safetensors' own save_file makes the file 0600, unlike
        # config.json and the card beside it (0644 under the usual umask), which a shared cache then hides
        (path / WEIGHTS_FILE).write_bytes(save(state))
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
        """A drafter from an export folder, a Lightning ``.ckpt`` of ``vdtrain.fit`` (a file, or the folder
        DeepSpeed ZeRO writes, whose partitions are gathered into the full fp32 drafter) or a Hub repo id.

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
        elif is_zero_checkpoint(path):
            config, state, metadata = _read_zero_checkpoint(path)
        elif path.exists():
            config, state, metadata = _read_export(path)
        elif REPO_ID.fullmatch(str(source)):
            config, state, metadata = _read_export(download(str(source), revision, cache_dir))
        else:
            raise FileNotFoundError(
                f"no drafter at {str(path)!r}: not an export folder, a .ckpt file or a Hub repo id "
                "(owner/name)"
            )
        drafter = cls.make(config)
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


def fused_taps(
    tapped: torch.Tensor, fuse: nn.Linear, norms: nn.ModuleList | None, hidden_size: int
) -> torch.Tensor:
    """The ``tapped`` target layers [.., k·H], each through its RMS norm where ``norms`` are given, fused by
    ``fuse`` into [.., H]: how a kind that reads taps (eagle3, block) turns them into a feature."""
    tapped = tapped.to(fuse.weight.dtype)
    if norms is not None:
        parts = tapped.split(hidden_size, dim=-1)
        tapped = torch.cat([norm(part) for norm, part in zip(norms, parts, strict=True)], -1)
    return fuse(tapped)


def block_kind() -> str:
    """The first registered kind that drafts blocks (``Drafter.drafts_blocks``): the one a block tree is
    given where no drafter is (benchmarks, tests)."""
    kinds = [name for name, kind in DRAFTERS.items() if kind.drafts_blocks]
    if not kinds:
        raise ValueError(f"no registered drafter kind drafts blocks: {list(DRAFTERS)}")
    return kinds[0]


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
            f" (nor is it a DeepSpeed ZeRO checkpoint: no {ZERO_TAG_FILE} file or <tag>/*_states.pt)"
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
    return _checkpoint_drafter(path, blob, blob.get("state_dict", {}))


def _read_zero_checkpoint(path: Path) -> tuple[DrafterConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """The drafter inside a DeepSpeed ZeRO checkpoint folder of ``vdtrain.fit``: Lightning's client state
    (the config, the step) from its model-states file, the fp32 weights gathered from every rank's
    partition (``vdtrain.zero_checkpoint``)."""
    weights, client = gather_fp32(path)
    config, params, metadata = _checkpoint_drafter(path, client, weights)
    return config, _parameters_as_state_dict(Drafter.make(config), params, path), metadata


def _parameters_as_state_dict(
    drafter: Drafter, params: dict[str, torch.Tensor], path: Path
) -> dict[str, torch.Tensor]:
    """ZeRO's partitions hold parameters by their module names; a state dict may name them otherwise
    (LlamaGen's fused ``w13`` is saved as the released ``w1`` / ``w3``): ``params`` set into ``drafter``'s
    parameters, and its state dict with the buffers ``params`` also holds."""
    slots = dict(drafter.named_parameters())
    missing = sorted(set(slots) - set(params))
    if missing:
        raise CheckpointError(
            f"drafter ({path}): the ZeRO checkpoint lacks parameters {missing[:12]} of a "
            f"{drafter.config.kind} drafter"
        )
    with torch.no_grad():
        for name, slot in slots.items():
            if params[name].shape != slot.shape:
                raise CheckpointError(
                    f"drafter ({path}): {name} is {tuple(params[name].shape)} in the ZeRO checkpoint, "
                    f"{tuple(slot.shape)} in the drafter its config builds"
                )
            slot.copy_(params[name])
    rest = {k: v for k, v in params.items() if k not in slots}  # buffers (load_strict checks the names)
    return {**drafter.state_dict(), **rest}


def _checkpoint_drafter(
    path: Path, blob: Mapping[str, Any], weights: Mapping[str, torch.Tensor]
) -> tuple[DrafterConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """Config, ``drafter.*`` weights and step of a ``DrafterModule`` checkpoint's contents ``blob`` (the
    config stored by the module under ``CHECKPOINT_CONFIG_KEY``) and its module weights ``weights``."""
    if CHECKPOINT_CONFIG_KEY not in blob:
        raise CheckpointError(
            f"{str(path)!r} carries no drafter config (no {CHECKPOINT_CONFIG_KEY!r}; it was written before "
            "vdtrain stored one, or not by vdtrain.fit): load the run's exported drafter folder instead"
        )
    prefix = CHECKPOINT_PREFIX
    state = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
    step = {"file": path.name, "global_step": blob.get("global_step"), "epoch": blob.get("epoch")}
    return DrafterConfig.from_dict(blob[CHECKPOINT_CONFIG_KEY]), state, {"checkpoint": step}
