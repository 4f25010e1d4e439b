"""LlamaGen's text-to-image GPT, with the official checkpoint's parameter names.

The module tree (``cls_embedding.cap_proj.fc1``, ``layers.3.attention.wqkv`` ...) mirrors the official
release so its ``state_dict`` loads unchanged. Two behaviours of the original are kept because the
released weights depend on them (docs/targets.md, "LlamaGen t2i"): the 2D RoPE table has zero rows for
the caption prefix (captions reach image tokens through their values only), and the left-padded caption's
padded keys are masked for every query, each position attending to itself. A layer is few kernels
(docs/decoding.md, "Kernels per step"): native RMSNorm, RoPE as one complex product (real arithmetic under
``torch.compile``: ``apply_rope``), one ``w1‖w3`` GEMM, the mask an additive bias made once per forward."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vdtrain.models.kv_cache import AttendingCache, KVCache, LayerInputs
from vdtrain.models.taps import with_taps


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - (n % k)


@dataclass(frozen=True)
class GPTConfig:
    dim: int = 1280
    n_layer: int = 36
    n_head: int = 20
    n_kv_head: int | None = None
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    token_dropout_p: float = 0.1
    attn_dropout_p: float = 0.0
    resid_dropout_p: float = 0.1
    ffn_dropout_p: float = 0.1
    caption_dim: int = 2048
    class_dropout_prob: float = 0.1
    vocab_size: int = 16384
    cls_token_num: int = 120
    block_size: int = 256  # image tokens: a square grid of sqrt(block_size) per side
    # RoPE rows of the caption prefix. "zero" is LlamaGen's: caption queries and keys vanish, so image
    # tokens read a uniform average of caption values. "identity" leaves them unrotated (no position,
    # content-based attention to the caption); the shapes target uses it (docs/shapes_world.md).
    caption_rope: str = "zero"
    # A learned embedding per sequence position (caption rows and image grid), added to the inputs and
    # zero at initialisation. Not in LlamaGen, whose only position signal is RoPE (relative): off by
    # default, and official checkpoints have no such key. The shapes target uses it: a 4-layer toy
    # trained on a CPU barely learns where on the grid it is from RoPE alone (docs/shapes_world.md).
    learned_pos_embedding: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def grid_size(self) -> int:
        side = math.isqrt(self.block_size)
        if side * side != self.block_size:
            raise ValueError(f"block_size={self.block_size} is not a square number of image tokens")
        return side

    @property
    def ffn_hidden(self) -> int:
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return find_multiple(hidden, self.multiple_of)

    @property
    def max_seq_len(self) -> int:
        return self.cls_token_num + self.block_size


# The official size presets (layers, heads, width). t2i releases use XL.
GPT_PRESETS: dict[str, dict[str, int]] = {
    "GPT-B": {"n_layer": 12, "n_head": 12, "dim": 768},
    "GPT-L": {"n_layer": 24, "n_head": 16, "dim": 1024},
    "GPT-XL": {"n_layer": 36, "n_head": 20, "dim": 1280},
    "GPT-XXL": {"n_layer": 48, "n_head": 24, "dim": 1536},
    "GPT-XXXL": {"n_layer": 48, "n_head": 40, "dim": 2560},
    "GPT-1B": {"n_layer": 22, "n_head": 32, "dim": 2048},
    "GPT-3B": {"n_layer": 24, "n_head": 32, "dim": 3200},
    "GPT-7B": {"n_layer": 32, "n_head": 32, "dim": 4096},
}


CAPTION_ROPE = ("zero", "identity")


def rope_2d_table(
    grid_size: int, head_dim: int, base: float, prefix_len: int, prefix: str = "zero"
) -> torch.Tensor:
    """(cos, sin) per position: ``[prefix_len + grid², head_dim // 2, 2]``; the prefix rows are zero
    (LlamaGen) or the identity rotation (``prefix="identity"``).

    Half of each head rotates with the row index and half with the column index.
    """
    if prefix not in CAPTION_ROPE:
        raise ValueError(f"caption_rope must be one of {CAPTION_ROPE}, got {prefix!r}")
    quarter = head_dim // 4
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim // 2, 2)[:quarter].float() / (head_dim // 2)))
    angles = torch.outer(torch.arange(grid_size).float(), inv_freq)  # [grid, quarter]
    rows = angles[:, None, :].expand(-1, grid_size, -1)
    cols = angles[None, :, :].expand(grid_size, -1, -1)
    grid = torch.cat([rows, cols], dim=-1).flatten(0, 1)  # [grid², head_dim // 2]
    table = torch.stack([grid.cos(), grid.sin()], dim=-1)
    prefix_rows = torch.zeros(prefix_len, head_dim // 2, 2)
    if prefix == "identity":
        prefix_rows[..., 0] = 1.0
    return torch.cat([prefix_rows, table])


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, S, H, D] by ``rope`` [B, S, D/2, 2] (adjacent pairs, computed in fp32): the pair
    (a, b) times cos + i·sin. Eager, as one complex product: one kernel (a GPU step is bound by launches).
    Under ``torch.compile``, in real arithmetic (``rotate_pairs``): Inductor generates no code for complex
    operators and would run the product outside its fused kernels; it fuses the real form into one."""
    if torch.compiler.is_compiling():
        return rotate_pairs(x, rope)
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    turned = pairs * torch.view_as_complex(rope)[:, :, None]
    return torch.view_as_real(turned).flatten(3).type_as(x)


def rotate_pairs(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """``apply_rope``'s rotation in real arithmetic: (a, b) → (a·cos − b·sin, a·sin + b·cos), in fp32."""
    a, b = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = (part[:, :, None] for part in rope.unbind(-1))
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(3).type_as(x)


def attention_bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (True = may attend) as the additive bias (0 / -inf) attention adds, made once per
    forward: given the boolean mask, attention converts it again in every layer. The bias is the mask's
    log (log 1 = 0, log 0 = -inf exactly): one kernel in the default float dtype."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.log(mask).to(dtype)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` whose weight takes its input's dtype. Under bf16 autocast a trained layer's activations
    are bf16 while its weights stay fp32, and torch's fused kernel refuses the pair (a warning and a slower
    composite); in one dtype (decoding, the frozen target) it is ``nn.RMSNorm`` itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight is not None and weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


class MLP(nn.Module):
    def __init__(self, in_features: int, hidden_features: int, out_features: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features, bias=False)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CaptionEmbedder(nn.Module):
    """Projects caption features to the model width; holds the learned null caption."""

    def __init__(self, caption_dim: int, dim: int, uncond_prob: float, token_num: int) -> None:
        super().__init__()
        self.cap_proj = MLP(caption_dim, dim, dim)
        # A buffer (not a parameter) in the official release, so it is in the state dict but never trained.
        self.register_buffer("uncond_embedding", torch.randn(token_num, caption_dim) / caption_dim**0.5)
        self.uncond_prob = uncond_prob

    def forward(self, caption: torch.Tensor, drop: torch.Tensor | None = None) -> torch.Tensor:
        """``drop`` [B] bool replaces those captions by the null caption (class dropout / CFG)."""
        if drop is not None:
            caption = torch.where(drop[:, None, None], self.uncond_embedding.to(caption.dtype), caption)
        return self.cap_proj(caption)


class FeedForward(nn.Module):
    """SwiGLU, ``w2(silu(w1 x) · w3 x)``, with ``w1`` and ``w3`` stacked in one ``w13`` GEMM (one kernel for
    two). Its state dict holds the official ``w1`` / ``w3`` (views of ``w13``; joined again on load), so
    released checkpoints and saved drafters load unchanged."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.w13 = nn.Linear(config.dim, 2 * config.ffn_hidden, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden, config.dim, bias=False)
        self.ffn_dropout = nn.Dropout(config.ffn_dropout_p)
        self._register_state_dict_hook(_split_w13)
        self._register_load_state_dict_pre_hook(_join_w13)
        self.register_load_state_dict_post_hook(_name_w13_as_released)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.ffn_dropout(self.w2(F.silu(gate) * up))


def _split_w13(module: nn.Module, state: dict, prefix: str, _metadata: object) -> None:
    w1, w3 = state.pop(prefix + "w13.weight").chunk(2)
    state[prefix + "w1.weight"], state[prefix + "w3.weight"] = w1, w3


def _join_w13(state: dict, prefix: str, *_: object) -> None:
    if prefix + "w1.weight" in state and prefix + "w3.weight" in state:
        state[prefix + "w13.weight"] = torch.cat(
            [state.pop(prefix + "w1.weight"), state.pop(prefix + "w3.weight")]
        )


def _name_w13_as_released(_module: nn.Module, keys: nn.modules.module._IncompatibleKeys) -> None:
    """A missing ``w13`` is reported as the two released keys it stands for."""
    for key in [k for k in keys.missing_keys if k.endswith("w13.weight")]:
        keys.missing_keys.remove(key)
        keys.missing_keys += [key.replace("w13", "w1"), key.replace("w13", "w3")]


class Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wqkv = nn.Linear(config.dim, (config.n_head + 2 * config.kv_heads) * config.head_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.resid_dropout = nn.Dropout(config.resid_dropout_p)

    def forward(self, x: torch.Tensor, at: LayerInputs) -> torch.Tensor:
        c, (rope, mask, cache, slots) = self.config, at
        bsz, seqlen, _ = x.shape
        kv_size = c.kv_heads * c.head_dim
        qk, v = self.wqkv(x).split([c.dim + kv_size, kv_size], dim=-1)
        qk = apply_rope(qk.view(bsz, seqlen, c.n_head + c.kv_heads, c.head_dim), rope)  # one rotation
        q, k = (t.transpose(1, 2) for t in qk.split([c.n_head, c.kv_heads], dim=2))
        v = v.view(bsz, seqlen, c.kv_heads, c.head_dim).transpose(1, 2)
        if cache is not None:
            if slots is None or mask is None:
                raise ValueError("a cached forward needs explicit slots and an attention mask")
            k, v = cache.write(slots, k, v, kv_len=mask.shape[-1])
        if c.kv_heads != c.n_head:
            k = k.repeat_interleave(c.n_head // c.kv_heads, dim=1)
            v = v.repeat_interleave(c.n_head // c.kv_heads, dim=1)
        if isinstance(cache, AttendingCache):
            out = cache.attend(q, k, v, mask)
        else:
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=mask is None,
                dropout_p=c.attn_dropout_p if self.training else 0.0,
            )
        return self.resid_dropout(self.wo(out.transpose(1, 2).reshape(bsz, seqlen, c.dim)))


class TransformerBlock(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, eps=config.norm_eps)

    def forward(self, x: torch.Tensor, at: LayerInputs) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), at)
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaGenGPT(nn.Module):
    """The t2i transformer: caption prefix of ``cls_token_num`` rows, then the image tokens."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.cls_embedding = CaptionEmbedder(
            config.caption_dim, config.dim, config.class_dropout_prob, config.cls_token_num
        )
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.tok_dropout = nn.Dropout(config.token_dropout_p)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        rope = rope_2d_table(
            config.grid_size, config.head_dim, config.rope_base, config.cls_token_num, config.caption_rope
        )
        self.register_buffer("rope", rope, persistent=False)
        if config.learned_pos_embedding:
            self.pos_embedding = nn.Parameter(torch.zeros(config.max_seq_len, config.dim))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """The official initialisation: N(0, 0.02) for linears and embeddings, a zero output head (and a
        zero position table, so a model starts as LlamaGen's)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
        nn.init.zeros_(self.output.weight)
        if self.config.learned_pos_embedding:
            nn.init.zeros_(self.pos_embedding)

    def embed_caption(self, caption: torch.Tensor, drop: torch.Tensor | None = None) -> torch.Tensor:
        return self.cls_embedding(caption, drop)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None = None,
        slots: torch.Tensor | None = None,
        taps: tuple[int, ...] = (),
    ) -> torch.Tensor:
        """Input embeddings ``x`` [B, S, dim] at RoPE ``positions`` ([S] or [B, S]) → final-norm hidden,
        followed along the last dim by the residual stream after each of ``taps`` layers
        (``with_taps``)."""
        if positions.dim() == 1:
            positions = positions.expand(x.shape[0], -1)
        at = LayerInputs(self.rope[positions], attention_bias(mask, x.dtype), None, slots)
        if self.config.learned_pos_embedding:
            x = x + self.pos_embedding[positions].to(x.dtype)
        h = self.tok_dropout(x)
        tapped = [h] if 0 in taps else []
        for i, layer in enumerate(self.layers):
            h = layer(h, at.at_layer(cache, i))
            if i + 1 in taps:
                tapped.append(h)
        return with_taps(self.norm(h), tapped, taps, len(self.layers))

    def new_cache(self, batch: int, max_len: int | None = None) -> KVCache:
        c = self.config
        ref = self.tok_embeddings.weight
        return KVCache(
            c.n_layer, batch, c.kv_heads, max_len or c.max_seq_len, c.head_dim, ref.dtype, ref.device
        )
