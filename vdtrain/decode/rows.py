"""Where a forward's rows go: their image columns and visibility, and the rows of each forward.

A target or drafter forward of a decoding step feeds ``S`` rows per prompt: tokens at image indices,
written to cache slots, each seeing the committed image columns plus a block of its own (a tree, a
chain, scratch columns). The engine and the builders lay rows out only with these functions, so the
layout is written once (docs/decoding.md, "The engine's bookkeeping"). CFG runs every row once per
stream (conditional rows, then null rows): ``per_stream``.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from vdtrain.decode.kernels import shared_arange, shared_eye, step_kernel
from vdtrain.decode.trees import DraftTree, ancestor_matrix
from vdtrain.targets.base import prefix_and_image_mask


class TargetGeometry(Protocol):
    """What the row layout reads of a target: its image and vocabulary sizes and its slot map."""

    @property
    def num_image_tokens(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def grid(self) -> tuple[int, int]: ...

    def image_slot(self, image_index: torch.Tensor) -> torch.Tensor: ...


def per_stream(t: torch.Tensor, streams: int) -> torch.Tensor:
    """``t`` [B, ...] repeated for every CFG stream: [streams·B, ...]; a broadcast view of ``t`` (no
    kernel) where B = 1 or one stream, else a copy. Read it, never write it."""
    return t.expand(streams, *t.shape).flatten(0, 1)


class ImageColumns(NamedTuple):
    """Where rows' visibility lands among the image columns (``image_columns``)."""

    prior: torch.Tensor  # [B, W] committed columns every row sees
    place: torch.Tensor  # [B, S'] the columns of the block

    def rows(self, block_vis: torch.Tensor) -> torch.Tensor:
        """Rows' visibility [B, S, W] from their visibility within the block [B, S, S']."""
        batch, steps, _ = block_vis.shape
        vis = self.prior[:, None, :].expand(batch, steps, -1)  # scattered out of place: no clone first
        return vis.scatter(2, self.place[:, None, :].expand(batch, steps, -1), block_vis)


def image_columns(
    committed_cols: torch.Tensor, block_cols: torch.Tensor, block: int, width: int
) -> ImageColumns:
    """Per row: image columns ``< committed_cols[b]`` visible, and a block of ``block`` columns at
    ``block_cols[b] ..`` whose visibility each row brings; ``width`` columns in all."""
    device = committed_cols.device
    cols = shared_arange(width, device)
    place = block_cols[:, None] + shared_arange(block, device)[None, :]
    return ImageColumns(cols[None, :] < committed_cols[:, None], place)


def visibility(
    committed_cols: torch.Tensor, block_cols: torch.Tensor, block_vis: torch.Tensor, width: int
) -> torch.Tensor:
    """Per row: image columns ``< committed_cols[b]`` visible, plus ``block_vis`` [B, S, S'] placed at
    columns ``block_cols[b] ..``; ``width`` columns in all."""
    return image_columns(committed_cols, block_cols, block_vis.shape[2], width).rows(block_vis)


def chain_visibility(last: torch.Tensor, n_img: int) -> torch.Tensor:
    """Causal rows per prompt at image columns ``last`` [B, width] (``base[b] + i`` for row i): each sees
    the committed columns before it, then the chain up to itself."""
    # Row i sees every column up to its own: the committed ones, then the chain (one compare where
    # placing a causal block among the committed columns took seven kernels).
    cols = shared_arange(n_img - 1 + last.shape[1], last.device)
    return cols[None, None, :] <= last[:, :, None]


class DrafterRows(NamedTuple):
    """A drafter forward's inputs for every CFG stream (``vdtrain.decode.drafting``)."""

    embeds: torch.Tensor  # [R, S, H] embeddings of the next tokens
    positions: torch.Tensor  # [R, S, ·] RoPE positions
    mask: torch.Tensor  # [R, 1, S, L + K] attention mask
    slots: torch.Tensor  # [R, S] drafter cache slots
    predicts: torch.Tensor  # [R, S] image index each row's logits predict
    # The rows' place past the root (``DraftInputs.offset``: Medusa's head, a block's query row): an int
    # for rows of one depth (0: committed rows), or [S] the offsets 1 .. S of a block's query rows.
    offset: torch.Tensor | int = 0


def drafter_rows(
    embeds: torch.Tensor,
    positions: torch.Tensor,
    stream_mask: torch.Tensor,
    token_index: torch.Tensor,
    slots: torch.Tensor,
    image_vis: torch.Tensor,
    streams: int,
    *,
    offset: int = 0,
) -> DrafterRows:
    """Drafter rows from per-prompt ``positions``, ``token_index``, ``slots`` and ``image_vis`` (the
    ``embeds`` [R, S, H] already per stream), for every CFG stream of ``stream_mask``, at ``offset`` past
    the root (``DrafterRows.offset``)."""
    mask = prefix_and_image_mask(stream_mask, per_stream(image_vis, streams))
    positions = per_stream(positions, streams)
    return DrafterRows(
        embeds, positions, mask, per_stream(slots, streams), per_stream(token_index + 1, streams), offset
    )


@step_kernel
def tree_rows(tree: DraftTree, committed: torch.Tensor, geometry: TargetGeometry, streams: int):
    """The plain verification forward's rows (tokens, image indices, slots, visibility), every stream:
    the trees alone (their roots are the only unseen tokens)."""
    n_img = geometry.num_image_tokens
    base = committed - 1  # image slot of the root
    anc = tree.ancestors if tree.ancestors is not None else ancestor_matrix(tree.parents, tree.depth_bound)
    anc = anc & tree.valid[:, None, :]
    anc |= shared_eye(tree.size, anc.device)
    vis = visibility(base, base, anc, n_img - 1 + tree.size)
    # Padding nodes may lie past the image; clamp their (ignored) positions into the RoPE table.
    index = (base[:, None] + tree.depths).clamp_max(n_img - 1)
    slots = geometry.image_slot(base[:, None] + shared_arange(tree.size, base.device))
    return tuple(per_stream(t, streams) for t in (tree.tokens, index, slots, vis))


def post_verified_rows(
    tree: DraftTree,
    lead: torch.Tensor,
    out: torch.Tensor,
    committed: torch.Tensor,
    chain: int,
    geometry: TargetGeometry,
    streams: int,
):
    """A post-verifying forward's rows, every stream: row ``b`` is [the ``lead[b]`` committed tokens
    the target has not seen (causal) ⊕ its tree (sees the whole chain, its ancestors, itself) ⊕
    padding (sees itself; its slots lie past the tree, never read)], ``chain + T`` rows in all."""
    size, device, n_img = tree.size, committed.device, geometry.num_image_tokens
    width_rows = chain + size
    base = committed - 1 - lead  # image index of the first token the target has not seen
    anc = ancestor_matrix(tree.parents) & tree.valid[:, None, :]
    anc |= shared_eye(size, device)
    j = shared_arange(width_rows, device)
    u = lead[:, None]
    in_chain, in_tree = j[None] < u, (j[None] >= u) & (j[None] < u + size)
    node = (j[None] - u).clamp(0, size - 1)  # [B, S]: tree node of row j
    tree_block = anc.gather(1, node[:, :, None].expand(-1, -1, size))  # [B, S, T]: row j's ancestors
    tree_vis = tree_block.gather(2, node[:, None, :].expand(-1, width_rows, -1))  # columns alike
    col_in_tree, col_in_chain = in_tree[:, None, :], in_chain[:, None, :]
    vis = in_chain[:, :, None] & col_in_chain & (j[None, None, :] <= j[None, :, None])
    vis |= in_tree[:, :, None] & (col_in_chain | (col_in_tree & tree_vis))
    vis |= ~(in_chain | in_tree)[:, :, None] & (j[None, None, :] == j[None, :, None])
    chain_tokens = out.gather(1, (base[:, None] + j[None]).clamp_max(out.shape[1] - 1))
    tokens = torch.where(in_chain, chain_tokens, torch.where(in_tree, tree.tokens.gather(1, node), 0))
    index = torch.where(in_tree, base[:, None] + u + tree.depths.gather(1, node), base[:, None] + j[None])
    index = index.clamp_max(n_img - 1)
    slots = geometry.image_slot(base[:, None] + j[None])
    vis = visibility(base, base, vis, n_img - 1 + width_rows)
    return tuple(per_stream(t, streams) for t in (tokens, index, slots, vis))
