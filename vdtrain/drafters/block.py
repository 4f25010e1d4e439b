"""A block drafter (issue #48): one forward drafts the next ``slots`` image tokens of the row.

Its rows are EAGLE rows, ``[embed(x_{s+1}); f_s]``, through a narrow decoder layer of its own (``width``
wide, 2-D RoPE over the image grid) and back into the target's space as a residual on the row's
feature: ``f̂ = f + W_out(h)``, read by the target's head. The engine catches it up on committed tokens
like an eagle1 drafter, so the catch-up row of the root predicts the block's first token. A *block*
adds ``slots − 1`` query rows in one forward (``block_queries``): query ``j`` drafts the token ``j``
past that one, sits at its position, carries the root's feature, the embedding of the committed token
above it (zero in the first row) and its offset ``j`` (the rows' ``DraftInputs.offset``, 0 for a
committed row), and sees the committed rows and the queries before it. The layer's input is
``[embed; f; one-hot(offset)]``, the one-hot made here from the integer offset (all zero for a committed
row), so the engine's one-call-per-depth trees draft with it too.
docs/training.md, "Block drafters", gives the design and what it borrows;
``vdtrain/decode/builders/block.py`` drafts with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from vdtrain.config import DrafterTrainConfig
from vdtrain.drafters import losses
from vdtrain.drafters.base import Drafter, DraftInputs, LossInputs, fused_taps
from vdtrain.drafters.config import DrafterConfig
from vdtrain.drafters.head_loss import head_token_loss, split_head
from vdtrain.drafters.registry import register
from vdtrain.drafters.rows import after_prefix_rows, teacher_mask
from vdtrain.models.kv_cache import AttendingCache, KVCache, LayerInputs
from vdtrain.models.llamagen_gpt import GPTConfig, TransformerBlock, attention_bias


@dataclass(frozen=True)
class BlockOptions:
    """A block drafter's settings (docs/training.md, "Block drafters"; issue #55's search chose them)."""

    slots: int = 8  # tokens one block drafts: the root's catch-up row, then slots − 1 query rows
    width: int = 64  # the layers' width (the target's features are projected into it and back)
    heads: int = 4  # its attention heads (head dim width / heads, a multiple of 4 for 2-D RoPE)
    train_roots: int = 32  # blocks trained per sample and step (their roots drawn at random)
    layers: int = 1  # decoder layers of that width, each a drafter forward's kernels
    # target layers (hidden_states[k], as eagle3's) fused into each committed row's feature, so the keys the
    # queries attend to carry several depths (DFlash); (): the final-norm state only
    feature_layers: tuple[int, ...] = ()
    query_state: bool = False  # a learned state per offset added to the query rows' feature (P-EAGLE)

    def __post_init__(self) -> None:
        # JSON and Hydra hand lists: a tuple compares equal after a round trip
        object.__setattr__(self, "feature_layers", tuple(int(k) for k in self.feature_layers))


class GridLayers(nn.Module):
    """``layers`` LlamaGen decoder blocks ``width`` wide with a 2-D RoPE table over the drafter's grid (any
    height and width: a Lumina-mGPT grid holds its end-of-row column); the caption rows unrotated.
    Indexed by the engine's row positions, ``prefix_length + image index``."""

    def __init__(
        self, width: int, heads: int, layers: int, prefix_length: int, grid: tuple[int, int]
    ) -> None:
        super().__init__()
        config = GPTConfig(
            dim=width,
            n_layer=1,
            n_head=heads,
            multiple_of=32,
            token_dropout_p=0.0,
            resid_dropout_p=0.0,
            ffn_dropout_p=0.0,
            class_dropout_prob=0.0,
        )
        self.blocks = nn.ModuleList(TransformerBlock(config) for _ in range(layers))
        self.heads, self.head_dim = heads, config.head_dim
        self.register_buffer("rope", grid_rope(prefix_length, grid, config.head_dim), persistent=False)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | AttendingCache | None = None,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rows = LayerInputs(self.rope[positions], attention_bias(mask, x.dtype), None, slots)
        for index, block in enumerate(self.blocks):
            x = block(x, rows.at_layer(cache, index))
        return x

    def _apply(self, fn, recurse: bool = True):
        # The RoPE table follows the device but stays fp32 (rotations are computed in fp32).
        table = self.rope
        super()._apply(fn, recurse)
        self.rope = table.to(self.rope.device)
        return self


def grid_rope(
    prefix_length: int, grid: tuple[int, int], head_dim: int, base: float = 10000.0
) -> torch.Tensor:
    """(cos, sin) [prefix_length + h·w, head_dim // 2, 2]: half of each head's pairs turn with the row,
    half with the column (LlamaGen's 2-D RoPE, for a grid of any shape); caption rows unrotated."""
    quarter = head_dim // 4
    inv_freq = 1.0 / (base ** (torch.arange(quarter).float() * 2 / (head_dim // 2)))
    rows, cols = grid
    row = torch.outer(torch.arange(rows).float(), inv_freq)[:, None].expand(-1, cols, -1)
    col = torch.outer(torch.arange(cols).float(), inv_freq)[None].expand(rows, -1, -1)
    angles = torch.cat([row, col], -1).flatten(0, 1)
    table = torch.stack([angles.cos(), angles.sin()], -1)
    prefix = torch.zeros(prefix_length, head_dim // 2, 2)
    prefix[..., 0] = 1.0
    return torch.cat([prefix, table])


class _ContextThenQueries(AttendingCache):
    """Training's two passes through a layer: the committed rows (causal), then every block's query
    rows, which attend to the committed rows' keys and their own. Out of place, so gradients flow."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def write(
        self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None:  # the committed rows: kept for the queries
            self.k, self.v = k, v
            return k, v
        return torch.cat([self.k, k], 2), torch.cat([self.v, v], 2)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class _TrainingCache:
    """One ``_ContextThenQueries`` per layer, made as the first pass reaches it."""

    def __init__(self) -> None:
        self.layers: dict[int, _ContextThenQueries] = {}

    def layer(self, index: int) -> _ContextThenQueries:
        return self.layers.setdefault(index, _ContextThenQueries())


def training_roots(
    num_tokens: int, count: int, generator: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    """The image indices of the roots whose blocks a step trains: ``count`` of ``0 .. N − 3`` (a block
    drafts at least one query token), drawn with ``generator``, evenly spaced without one (validation)."""
    choices = max(1, num_tokens - 2)
    count = min(count, choices)
    if generator is None:
        roots = torch.linspace(0, choices - 1, count).round().long()
    else:
        roots = torch.randperm(choices, generator=generator)[:count].sort().values
    return roots.to(device)


def guided_states(states: torch.Tensor, scale: float) -> torch.Tensor:
    """CFG on states the head reads: ``s·c + (1 − s)·u`` of a [2B, ..] batch (conditional half first). The
    head is affine, so its logits are the guided ``u + s·(c − u)`` of the two streams' logits."""
    cond, uncond = states.chunk(2)
    return uncond + scale * (cond - uncond)


class TeacherBlocks(NamedTuple):
    """One teacher-forced pass: every committed row, then the blocks of some roots."""

    rows: torch.Tensor  # [B, L+N-1, H] the committed rows' outputs (row s drafts slot s + 1)
    queries: torch.Tensor  # [B, R, J, H] block r's query row j (drafting ``drafted[r, j]``)
    drafted: torch.Tensor  # [R, J] the image index each query row drafts (>= N: past the image)


@register("block")
class BlockDrafter(Drafter):
    """EAGLE rows through a narrow 2-D layer, plus a block's query rows in the same forward."""

    title: ClassVar[str] = "Block drafter"
    method: ClassVar[str] = "block"
    card_tags: ClassVar[tuple[str, ...]] = ("block-drafting",)  # not EAGLE's one token per forward
    Options: ClassVar[type] = BlockOptions
    drafts_blocks: ClassVar[bool] = True
    grows: ClassVar[frozenset[str]] = frozenset({"feature_layers", "query_state"})  # zero-initialised parts
    best_metric: ClassVar[str] = "val/tau_block"  # the chain a block drafts, not tau_sim's depth unroll
    trains_guided: ClassVar[bool] = True

    def build(self, config: DrafterConfig) -> None:
        """The projection into the layer (its last ``slots − 1`` input columns read the one-hot of a query
        row's offset), the layer, a norm and the projection back (zero at the start: a row first
        drafts what its own feature predicts). No input norms: ``fc`` learns the scales of the embedding
        and the feature, and a drafter forward is two kernels shorter."""
        hidden, o = config.hidden_size, config.options
        self.fc = nn.Linear(2 * hidden + o.slots - 1, o.width)
        self.layer = GridLayers(o.width, o.heads, o.layers, config.prefix_length, config.grid)
        if o.feature_layers:  # zero at the start: the feature is the final state's until it learns
            self.fuse = nn.Linear(len(o.feature_layers) * hidden, hidden, bias=False)
            self.tap_norms = nn.ModuleList(nn.RMSNorm(hidden, eps=1e-6) for _ in o.feature_layers)
            nn.init.zeros_(self.fuse.weight)
        if o.query_state:
            self.query_states = nn.Parameter(torch.zeros(o.slots - 1, hidden))
        self.out_norm = nn.RMSNorm(o.width, eps=1e-6)
        self.out = nn.Linear(o.width, hidden)
        # Row j: the one-hot ``fc`` reads for offset j (row 0, a committed row's: zero). A buffer, not saved,
        # so a forward indexes it instead of building it.
        self.register_buffer("offset_one_hots", torch.eye(o.slots)[:, 1:], persistent=False)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    @classmethod
    def check(cls, config: DrafterConfig) -> None:
        o = config.options
        if o.slots < 2:
            raise ValueError(f"a block drafter needs slots >= 2 (the root's row and a query), got {o.slots}")
        if o.width < 4 or o.heads < 1 or o.width % (4 * o.heads):
            raise ValueError(
                f"a block drafter's width must be a multiple of 4 x heads (2-D RoPE splits each head in "
                f"row and column halves of pairs), got width {o.width}, heads {o.heads}"
            )
        if o.train_roots < 1:
            raise ValueError(f"a block drafter trains at least one block per sample, got {o.train_roots}")
        if o.layers < 1:
            raise ValueError(f"a block drafter has at least one layer, got layers={o.layers}")
        total = config.target_layers
        taps = o.feature_layers
        if taps and (min(taps) < 0 or (total is not None and max(taps) > total)):
            raise ValueError(
                f"feature_layers {list(taps)} outside 0 .. {total}: the target has {total} layers"
            )

    @property
    def taps(self) -> tuple[int, ...]:
        return self.options.feature_layers

    def input_features(self, hidden: torch.Tensor, tapped: torch.Tensor | None) -> torch.Tensor:
        """The final-norm state, plus the ``tapped`` layers [.., k·H] (each RMS-normalised) fused, where the
        drafter reads taps."""
        if not self.taps:
            return hidden
        if tapped is None:
            raise ValueError(
                f"this block drafter reads target layers {list(self.taps)}: run the target with taps"
            )
        fused = fused_taps(tapped, self.fuse, self.tap_norms, self.config.hidden_size)
        return hidden.to(fused.dtype) + fused

    def block_queries(self, roots: torch.Tensor, count: int) -> torch.Tensor:
        """The root's feature for every query row, plus the learned state of its offset with
        ``query_state``."""
        queries = super().block_queries(roots, count)
        if self.options.query_state:
            queries = queries + self.query_states[:count].to(queries.dtype)
        return queries

    @property
    def block_slots(self) -> int:
        return self.options.slots

    def draft(self, features: torch.Tensor, rows: DraftInputs) -> torch.Tensor:
        """Rows ``f`` [B, S, H] at ``rows.offset`` with the ``rows.embeds`` [B, S, H] at their positions
        → ``f̂`` [B, S, H]: committed rows (offset 0) and a block's query rows alike (``rows.cache`` may be
        an ``AttendingCache``)."""
        dtype = self.fc.weight.dtype
        embeds, features = rows.embeds.to(dtype), features.to(dtype)
        x = self.fc(torch.cat([embeds, features, self._offset_one_hot(rows.offset, features)], -1))
        h = self.layer(x, rows.positions, rows.mask, rows.cache, rows.slots)
        return features + self.out(self.out_norm(h))

    def _offset_one_hot(self, offset: torch.Tensor | int, features: torch.Tensor) -> torch.Tensor:
        """[.., slots − 1] per row of ``features``: for a block's query rows (``offset`` a tensor of their
        offsets ``j``) the one-hot of ``j``; zero for EAGLE rows (an int ``offset``: committed rows, or a
        one-call-per-depth tree's). ``fc`` was built for that width."""
        table = self.offset_one_hots.to(features.dtype)
        rows = table[0] if isinstance(offset, int) else table[offset]
        return rows.expand(*features.shape[:-1], table.shape[-1])

    def new_cache(self, batch: int, max_len: int | None = None) -> KVCache:
        ref, layer = self.fc.weight, self.layer
        length = max_len or self.config.max_seq_len
        return KVCache(len(layer.blocks), batch, layer.heads, length, layer.head_dim, ref.dtype, ref.device)

    # --- training ---------------------------------------------------------------------------------
    def teacher_blocks(
        self, states: torch.Tensor, tokens: torch.Tensor, cond_mask: torch.Tensor, roots: torch.Tensor
    ) -> TeacherBlocks:
        """The committed rows of ``states`` [B, L+N, H] (the kind's features) on ``tokens``
        [B, N], causal as decoding's catch-up writes them, then the block of each root in ``roots`` [R]
        (image indices) as ``BlockTreeBuilder`` drafts it: query row ``j`` drafts token ``t = r + 1 + j``
        at row position ``L + t − 2`` with the root row's output and the token above ``t`` where
        committed, and sees the rows up to the root's and the block's rows 1 .. j."""
        cols = self.config.grid[1]
        prefix, num = cond_mask.shape[1], tokens.shape[1]
        seq, device, batch = prefix + num - 1, states.device, len(tokens)
        embeds = after_prefix_rows(self.embed(tokens), prefix)
        positions = torch.arange(seq, device=device)
        teacher = teacher_mask(cond_mask, seq)
        cache = _TrainingCache()
        rows = self(states[:, :-1], embeds, positions, teacher, cache, positions)
        j = torch.arange(1, self.options.slots, device=device)
        drafted = roots[:, None] + 1 + j  # [R, J]
        root_rows = prefix + roots - 1  # the row that pairs f at the root's predecessor with the root
        queries = self.block_queries(rows[:, root_rows].flatten(0, 1), len(j))
        queries = queries.unflatten(0, (batch, len(roots))).flatten(1, 2)  # [B, R·J, H]
        above = drafted - cols
        committed = (above >= 0) & (above <= roots[:, None])
        above_embeds = self.embed(tokens[:, above.clamp(0, num - 1).flatten()])
        above_embeds = above_embeds * committed.flatten()[None, :, None]
        query_pos = prefix + drafted.clamp_max(num + 1).flatten() - 2
        seen = teacher[:, 0, root_rows].repeat_interleave(len(j), 1)  # [B, R·J, seq]: the root row's
        causal = torch.ones(len(j), len(j), dtype=torch.bool, device=device).tril()
        block = torch.block_diag(*[causal] * len(roots))
        mask = torch.cat([seen, block.expand(batch, -1, -1)], -1)[:, None]
        offsets = j.repeat(len(roots))  # [R·J]: row j of each block
        out = self(queries, above_embeds, query_pos.expand(batch, -1), mask, cache, query_pos, offset=offsets)
        return TeacherBlocks(rows, out.unflatten(1, (len(roots), len(j))), drafted)

    def training_roots(
        self, num_tokens: int, generator: torch.Generator | None, device: torch.device
    ) -> torch.Tensor:
        """``train_roots`` roots per step (``training_roots``), drawn outside the compiled loss."""
        return training_roots(num_tokens, self.options.train_roots, generator, device)

    def training_loss(
        self, batch: LossInputs, train: DrafterTrainConfig
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The committed rows' EAGLE-1 loss (feature regression + ``w_cls`` · the token loss: they draft
        each block's first token) plus ``Σ_j decay^j · loss_j`` over the query rows of the blocks of
        ``batch.roots``, against the target's distribution at the token each drafts. Parts: the loss terms,
        ``top1`` (the first slot), ``top1_slot{j}`` and ``tau_block``, the chain estimate from the per-slot
        agreement.

        With ``train.guided_scale`` s the batch holds every sample twice, conditional then null, and the
        token terms are also scored on the guided logits ``u + s·(c − u)`` of drafter and target, which is
        what a CFG decode verifies: the agreement parts are then the guided ones (each stream's own chain
        estimate: ``stream_tau_block``).

        Fixed shapes, so it compiles in one graph: every query row is scored, those that draft past the
        image (a root near its end) with weight 0 and their target row clamped into it."""
        tokens, cond_mask, hidden, hidden_in, tapped, roots = batch
        if roots is None:
            raise ValueError("a block drafter's loss needs LossInputs.roots (Drafter.training_roots)")
        prefix, num = cond_mask.shape[1], tokens.shape[1]
        states = self.input_features(hidden_in, tapped)
        rows, queries, drafted = self.teacher_blocks(states, tokens, cond_mask, roots)
        total, parts = losses.teacher_loss(
            rows, hidden[:, 1:], self.normed, self.head, prefix,
            w_cls=train.w_cls, cls_loss=train.cls_loss, chunks=train.loss_chunks,
        )  # fmt: skip
        valid = (drafted < num).flatten()  # [R·J] the query rows that draft an image token
        slot_of = (drafted - roots[:, None]).flatten() - 1  # j of each query row
        target = hidden[:, prefix + drafted.clamp_max(num - 1).flatten() - 1]  # [B, R·J, H]: what predicts it
        drafts = self.normed(queries.flatten(1, 2))
        block_loss, hits = self._block_token_loss(drafts, target, valid, slot_of, train)
        total = total + block_loss
        parts |= self._slot_agreement(parts["top1"], hits, valid, slot_of, drafted.shape[1])
        parts["block"] = block_loss.detach()
        if train.guided_scale is not None:
            if split_head(self.head)[0] is not None:
                raise ValueError(
                    "drafter.guided_scale combines the streams' states before the head, which gives the "
                    "guided logits only for an affine head; this target's head has layers before its last"
                )
            scale, trained = train.guided_scale, losses.trained_rows(prefix, num)
            row_losses, row_hits = head_token_loss(
                guided_states(self.normed(rows[:, trained]), scale).flatten(0, 1)[:, None],
                guided_states(hidden[:, 1:][:, trained], scale).flatten(0, 1),
                self.head, train.cls_loss, train.loss_chunks,
            )  # fmt: skip
            guided_block, guided_hits = self._block_token_loss(
                guided_states(drafts, scale), guided_states(target, scale), valid, slot_of, train
            )
            guided = train.w_cls * row_losses.mean() + guided_block
            total = total + guided
            parts["stream_tau_block"] = parts["tau_block"]
            parts |= self._slot_agreement(
                row_hits.float().mean(), guided_hits, valid, slot_of, drafted.shape[1]
            )
            parts["top1"] = row_hits.float().mean()
            parts["guided"] = guided.detach()
        parts["total"] = total.detach()
        return total, parts

    def _block_token_loss(
        self,
        drafts: torch.Tensor,
        target: torch.Tensor,
        valid: torch.Tensor,
        slot_of: torch.Tensor,
        train: DrafterTrainConfig,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The query rows' ``Σ_j decay^j · loss_j`` (mean over the valid rows) and their top-1 hits [B, R·J],
        from the drafter's ``drafts`` and the target's ``target`` [B, R·J, H] as the head reads them."""
        size = len(drafts)
        per_row, hits = head_token_loss(
            drafts.flatten(0, 1)[:, None], target.flatten(0, 1), self.head, train.cls_loss, train.loss_chunks
        )
        weights = valid * train.ttt_decay ** slot_of.float()
        loss = (per_row.view(size, -1) * weights).sum() / (size * valid.sum())
        return loss, hits.view(size, -1).float()

    @staticmethod
    def _slot_agreement(
        first: torch.Tensor, hits: torch.Tensor, valid: torch.Tensor, slot_of: torch.Tensor, slots: int
    ) -> dict[str, torch.Tensor]:
        """``top1_slot{j}`` of the query rows' ``hits`` [B, R·J] and ``tau_block``, the chain estimate from
        the first slot's agreement ``first`` and theirs (``losses.simulated_tau``)."""
        parts, agreement = {}, [first]
        for k in range(1, slots + 1):
            at = (slot_of == k) & valid
            parts[f"top1_slot{k}"] = (hits * at).sum() / (len(hits) * at.sum()).clamp_min(1)
            agreement.append(parts[f"top1_slot{k}"])
        parts["tau_block"] = 1 + torch.stack(agreement).float().cumprod(0).sum()
        return parts

    # --- the model card ---------------------------------------------------------------------------
    def card(self) -> str:
        o = self.options
        return (
            f"A block drafter trained with vdtrain: one forward drafts the next {o.slots} image tokens. "
            f"EAGLE rows `[embed(x_{{t+1}}); f_t]` through one {o.width}-wide decoder layer with 2-D RoPE, "
            "read back as a residual on the row's feature; the root's row drafts the first token and "
            f"{o.slots - 1} query rows (the root's feature, the committed token above, a one-hot of the "
            "offset) the rest in the same forward, and "
        )

    def shape(self) -> str:
        o = self.options
        ffn = self.layer.blocks[0].feed_forward.w2.in_features
        n_head = self.config.layer.get("n_head")  # the family's EAGLE layer's: this kind does not build it
        unused = f"; config.json's `layer.n_head` {n_head}: the EAGLE layer's, unused here" if n_head else ""
        return (
            f"Layer: width {o.width} (its own {o.heads} attention heads, `options.heads`{unused}; "
            f"SwiGLU {ffn}, 2-D RoPE) between the target's width {self.config.hidden_size}; "
            f"{o.slots} slots per block; "
            f"{sum(p.numel() for p in self.parameters()) / 1e3:.0f}k parameters"
        )
