"""Growing a world's tokenizer and target from a smaller world's, keeping what the parent knows.

The grain world starts from the shapes world: each shapes code is split into near-copies (a redundant
codebook), and the 4-layer target becomes an 8-layer one that computes the same function at step 0.
Training then only has to learn what the grain world adds (grain, light, which copy of a code), which
a 2-core CPU can afford; the caption binding the shapes target took ~300 minutes to learn is kept.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from vdtrain.images import images_to_tensor
from vdtrain.models.llamagen_gpt import GPTConfig, LlamaGenGPT
from vdtrain.models.vq import VQModel
from vdtrain.shapes.scene import TRAIN_SEED, generate


def split_codebook(parent: VQModel, factor: int, noise: float = 0.02, seed: int = 0) -> VQModel:
    """``parent`` with every code repeated ``factor`` times (code ``j·K + c`` copies code ``c``), each copy
    nudged by ``noise`` so training can pull the copies apart."""
    if factor < 1:
        raise ValueError(f"tokenizer.split_codes must be >= 1, got {factor}")
    k = parent.config.codebook_size
    child = VQModel(replace(parent.config, codebook_size=k * factor))
    state = parent.state_dict()
    book = parent.quantize.embedding.weight.detach().repeat(factor, 1)
    gen = torch.Generator().manual_seed(seed)
    scale = book.norm(dim=-1, keepdim=True)
    state["quantize.embedding.weight"] = book + noise * scale * torch.randn(book.shape, generator=gen)
    child.load_state_dict(state)
    return child


@torch.no_grad()
def code_parents(
    parent_vq: VQModel, parent_world: str, child_vq: VQModel, child_world: str, n_images: int = 2048
) -> torch.Tensor:
    """[K_child] the parent code each child code most often stands in for: both tokenizers encode the
    same training scenes, each rendered in its own world, and positions are matched. A child code that
    never appears keeps the copy it was split from (``split_codebook``'s layout)."""
    k_parent, k_child = parent_vq.config.codebook_size, child_vq.config.codebook_size
    counts = torch.zeros(k_child, k_parent)
    for start in range(0, n_images, 256):
        n = min(256, n_images - start)
        old = generate(start + n, TRAIN_SEED, world=parent_world)[start:]
        new = generate(start + n, TRAIN_SEED, world=child_world)[start:]
        p = parent_vq.encode(images_to_tensor([s.image for s in old])).flatten()
        c = child_vq.encode(images_to_tensor([s.image for s in new])).flatten()
        counts.index_put_((c, p), torch.ones(len(c)), accumulate=True)
    parents = counts.argmax(1)
    unseen = counts.sum(1) == 0
    parents[unseen] = torch.arange(k_child)[unseen] % k_parent
    return parents


def grow_target(parent: LlamaGenGPT, config: GPTConfig, parents: torch.Tensor) -> LlamaGenGPT:
    """An ``config.n_layer``-layer target equal to ``parent`` at the level of parent codes.

    Layer ``i·m`` is the parent's layer ``i``; the ``m - 1`` layers after it are copies whose output
    projections (attention ``wo``, FFN ``w2``) start at zero, so they add nothing until trained. Each
    child code embeds and scores as its parent code: a parent's probability is shared by its children.
    """
    old = parent.config
    if config.n_layer % old.n_layer:
        raise ValueError(f"cannot grow {old.n_layer} layers into {config.n_layer}: not a multiple")
    same = ("dim", "n_head", "multiple_of", "caption_dim", "cls_token_num", "block_size")
    if any(getattr(config, f) != getattr(old, f) for f in same):
        raise ValueError(f"a grown target keeps its parent's {same}: {config} vs {old}")
    if len(parents) != config.vocab_size:
        raise ValueError(f"{len(parents)} code parents for a vocabulary of {config.vocab_size}")
    m = config.n_layer // old.n_layer
    state = {k: v for k, v in parent.state_dict().items() if not k.startswith("layers.")}
    state["tok_embeddings.weight"] = state["tok_embeddings.weight"][parents]
    state["output.weight"] = state["output.weight"][parents]
    for key, value in parent.state_dict().items():
        if not key.startswith("layers."):
            continue
        _, index, rest = key.split(".", 2)
        for j in range(m):
            zero = j > 0 and rest in ("attention.wo.weight", "feed_forward.w2.weight")
            state[f"layers.{int(index) * m + j}.{rest}"] = torch.zeros_like(value) if zero else value.clone()
    grown = LlamaGenGPT(config)
    grown.load_state_dict(state)
    return grown.eval()
