"""The Chameleon decoder (Anole, Lumina-mGPT) with the released HF parameter names and a slot KV cache.

transformers' ``ChameleonForConditionalGeneration`` cannot serve as a target: its ``forward`` sets every
image-token logit to the dtype minimum, and its caches take one position vector for the whole batch, not
per-row slots with a tree-shaped mask. This module computes what ``model.model`` + ``lm_head`` compute
(tests compare the two on the same weights) with explicit RoPE positions, a boolean mask and slots.

Two q/k-norm layouts are released: transformers' ``[heads, head_dim]`` (Anole) and Lumina-mGPT's vendored
``[model_parallel_size, head_dim]``, repeat-interleaved over each shard's heads at run time. The module
keeps the per-head layout; ``chameleon_io.per_head_state`` converts the per-shard one when loading.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vdtrain.models.kv_cache import AttendingCache, KVCache, LayerInputs
from vdtrain.models.taps import with_taps

QK_NORM_EPS = 1e-5  # hard-coded in both official implementations


@dataclass(frozen=True)
class ChameleonConfig:
    vocab_size: int = 65536
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    swin_norm: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    model_parallel_size: int = 1
    qk_norm: bool = True  # False: plain Llama attention (Janus-Pro's language model)

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by {self.num_attention_heads} heads"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{self.num_attention_heads} heads are not a multiple of {self.num_key_value_heads} kv heads"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class HeadNorm(nn.Module):
    """LayerNorm over ``head_dim`` with a separate affine per head (Chameleon's q/k norm)."""

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(heads, head_dim))
        self.bias = nn.Parameter(torch.zeros(heads, head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), None, None, eps=QK_NORM_EPS) * self.weight + self.bias


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [B, S, head_dim] for ``positions`` [B, S], half-split like transformers' Llama RoPE."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.float, device=positions.device)
    inv_freq = 1.0 / (theta ** (steps / head_dim))
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, H, S, D] by ``cos``/``sin`` [B, S, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class Attention(nn.Module):
    def __init__(self, config: ChameleonConfig) -> None:
        super().__init__()
        c = self.config = config
        kv_width = c.num_key_value_heads * c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, kv_width, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, kv_width, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=c.attention_bias)
        if c.qk_norm:
            self.q_norm = HeadNorm(c.num_attention_heads, c.head_dim)
            self.k_norm = HeadNorm(c.num_key_value_heads, c.head_dim)
        else:
            self.q_norm = self.k_norm = nn.Identity()

    def forward(self, x: torch.Tensor, at: LayerInputs) -> torch.Tensor:
        c, (rope, mask, cache, slots) = self.config, at
        bsz, seq, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(bsz, seq, c.num_attention_heads, c.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(bsz, seq, c.num_key_value_heads, c.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            if slots is None:
                raise ValueError("a cached forward needs explicit slots")
            k, v = cache.write(slots, k, v, kv_len=mask.shape[-1])
        groups = c.num_attention_heads // c.num_key_value_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if isinstance(cache, AttendingCache):
            out = cache.attend(q, k, v, mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq, c.hidden_size))


class MLP(nn.Module):
    def __init__(self, config: ChameleonConfig) -> None:
        super().__init__()
        c = config
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm (Chameleon-7B, Anole, Lumina-mGPT) or, with ``swin_norm``, norm after each sublayer."""

    def __init__(self, config: ChameleonConfig) -> None:
        super().__init__()
        self.swin_norm = config.swin_norm
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, at: LayerInputs) -> torch.Tensor:
        if self.swin_norm:
            h = x + self.input_layernorm(self.self_attn(x, at))
            return h + self.post_attention_layernorm(self.mlp(h))
        h = x + self.self_attn(self.input_layernorm(x), at)
        return h + self.mlp(self.post_attention_layernorm(h))


class ChameleonBackbone(nn.Module):
    def __init__(self, config: ChameleonConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        cache: KVCache | None = None,
        slots: torch.Tensor | None = None,
        taps: tuple[int, ...] = (),
    ) -> torch.Tensor:
        """Input embeddings ``x`` [B, S, D] at RoPE ``positions`` ([S] or [B, S]) with boolean ``mask``
        [B, 1, S, K] (True = may attend) → final-norm hidden states [B, S, D], followed by the residual
        stream after each of ``taps`` layers (``with_taps``)."""
        if positions.dim() == 1:
            positions = positions.expand(x.shape[0], -1)
        rope = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        at = LayerInputs(rope, mask, None, slots)
        h = x
        tapped = [h] if 0 in taps else []
        for i, layer in enumerate(self.layers):
            h = layer(h, at.at_layer(cache, i))
            if i + 1 in taps:
                tapped.append(h)
        return with_taps(self.norm(h), tapped, taps, len(self.layers))

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        c, ref = self.config, self.norm.weight
        return KVCache(
            c.num_hidden_layers, batch, c.num_key_value_heads, max_len, c.head_dim, ref.dtype, ref.device
        )


class ChameleonLM(nn.Module):
    """``model.*`` + ``lm_head`` of a released checkpoint (its ``model.vqmodel.*`` is loaded elsewhere)."""

    def __init__(self, config: ChameleonConfig) -> None:
        super().__init__()
        self.config = config
        self.model = ChameleonBackbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
