"""Janus-Pro's image-generation path with transformers' parameter names (``JanusForConditionalGeneration``).

Image generation runs the Llama language model between two image-only modules, not the text vocabulary:
``generation_embeddings`` (codebook × 8) then ``generation_aligner`` (Linear, GELU, Linear to the LM
width) embed an image token; ``generation_head`` (Linear, GELU, Linear) maps the LM's final-norm hidden
state to codebook logits. The language model is Chameleon's decoder without q/k norms (``qk_norm=False``),
which is Llama. The understanding path (SigLIP ``vision_model``, ``aligner``, ``lm_head``) is not loaded.

The VQ is LlamaGen's VQ-16 (``vdtrain.models.vq``) under other names; ``janus_io`` reads the released
files.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vdtrain.models.chameleon import ChameleonBackbone, ChameleonConfig
from vdtrain.models.vq import VQConfig


@dataclass(frozen=True)
class JanusConfig:
    """What image generation needs from a ``JanusConfig`` ``config.json`` (``janus_io.janus_config``)."""

    lm: ChameleonConfig
    codebook_size: int  # vq_config.num_embeddings
    code_dim: int  # vq_config.embed_dim: the generation embedding's width
    aligner_depth: int  # vq_config.num_hidden_layers: Linear layers in generation_aligner
    head_width: int  # vq_config.projection_dim: generation_head's inner width
    grid: int  # image tokens per side: vision image_size // patch_size (vq_config.num_patches)
    vq: VQConfig

    @property
    def image_size(self) -> int:
        return self.grid * self.vq.downsample


class GenerationAligner(nn.Module):
    """``fc1`` then GELU + Linear per further layer: code vectors → LM inputs."""

    def __init__(self, code_dim: int, width: int, depth: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(code_dim, width)
        self.hidden_layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc1(x)
        for layer in self.hidden_layers:
            x = layer(F.gelu(x))
        return x


class GenerationHead(nn.Module):
    """``proj_out``, GELU, ``vision_head``: final-norm hidden states → codebook logits."""

    def __init__(self, width: int, inner: int, codebook_size: int) -> None:
        super().__init__()
        self.proj_out = nn.Linear(width, inner)
        self.vision_head = nn.Linear(inner, codebook_size)

    def inner(self, hidden: torch.Tensor) -> torch.Tensor:
        """Everything before the last linear (the drafter's chunked loss runs that one itself)."""
        return F.gelu(self.proj_out(hidden))

    @property
    def final(self) -> nn.Linear:
        return self.vision_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.vision_head(self.inner(hidden))


class JanusGenerator(nn.Module):
    """``model.{language_model, generation_*}`` of a released checkpoint, with a slot KV cache."""

    def __init__(self, config: JanusConfig) -> None:
        super().__init__()
        self.config = config
        width = config.lm.hidden_size
        self.language_model = ChameleonBackbone(config.lm)
        self.generation_embeddings = nn.Embedding(config.codebook_size, config.code_dim)
        self.generation_aligner = GenerationAligner(config.code_dim, width, config.aligner_depth)
        self.generation_head = GenerationHead(width, config.head_width, config.codebook_size)

    def embed_image_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """What transformers' ``prepare_embeddings_for_image_generation`` feeds the LM."""
        return self.generation_aligner(self.generation_embeddings(tokens))
