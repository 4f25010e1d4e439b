"""Fréchet distance between two image sets in a target's own VQ-encoder feature space.

Caption consistency scores each image alone, so it cannot see a relaxed method that keeps every image
plausible but collapses their diversity; the Fréchet distance between Gaussians fitted to two sets'
features sees it (a narrower covariance or a moved mean both add to it).

Features: the tokenizer encoder's latents before quantisation, normalised per position as the quantiser
compares them, pooled over the grid into mean and standard deviation: 2·d numbers per image (16 for
LlamaGen's VQs). They need no external network or weights, and 16 features are well determined from ~100
images where the encoder's wider activations are not (docs/evaluation.md, "Distribution shift").
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from vdtrain.images import images_to_tensor
from vdtrain.targets.base import ImageTokenizer


def _psd_sqrt(matrix: np.ndarray) -> np.ndarray:
    """The symmetric square root of a symmetric positive semi-definite matrix (eigenvalues below 0,
    round-off, are clipped)."""
    values, vectors = np.linalg.eigh(matrix)
    return (vectors * np.sqrt(np.clip(values, 0.0, None))) @ vectors.T


def frechet_distance(feats_a: np.ndarray | torch.Tensor, feats_b: np.ndarray | torch.Tensor) -> float:
    """FD = |μa − μb|² + tr Σa + tr Σb − 2 tr (Σa^½ Σb Σa^½)^½ between Gaussians fitted to [N, D] features
    (unbiased covariances, float64)."""
    a = np.asarray(feats_a.double() if isinstance(feats_a, torch.Tensor) else feats_a, dtype=np.float64)
    b = np.asarray(feats_b.double() if isinstance(feats_b, torch.Tensor) else feats_b, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"features must be [N, D] with one D, got {a.shape} and {b.shape}")
    if len(a) < 2 or len(b) < 2:
        raise ValueError("a covariance needs at least 2 samples per set")
    cov_a, cov_b = (
        np.atleast_2d(np.cov(a, rowvar=False, ddof=1)),
        np.atleast_2d(np.cov(b, rowvar=False, ddof=1)),
    )
    return gaussian_frechet(a.mean(0), cov_a, b.mean(0), cov_b)


def gaussian_frechet(mean_a: np.ndarray, cov_a: np.ndarray, mean_b: np.ndarray, cov_b: np.ndarray) -> float:
    """The Fréchet distance between two Gaussians.

    The cross term uses tr (Σa Σb)^½ = tr (Σa^½ Σb Σa^½)^½, whose argument is symmetric positive
    semi-definite, so two symmetric eigen-decompositions give it exactly even when N ≤ D makes the
    covariances singular; a general matrix square root (``scipy.linalg.sqrtm``) of the non-symmetric
    Σa Σb can return complex round-off there, and scipy is not a dependency of the package.
    """
    root_a = _psd_sqrt(cov_a)
    middle = root_a @ cov_b @ root_a
    cross = np.sqrt(np.clip(np.linalg.eigvalsh((middle + middle.T) / 2), 0.0, None)).sum()
    value = float(((mean_a - mean_b) ** 2).sum() + np.trace(cov_a) + np.trace(cov_b) - 2 * cross)
    return max(value, 0.0)  # round-off can make FD(x, x) a hair below 0


def moments(feats: np.ndarray | torch.Tensor) -> dict[str, np.ndarray]:
    """What a Gaussian fit needs of [N, D] features, as sums (count, Σx, Σxxᵀ in float64): the moments of
    several sets add up, so each process streams its own and they are reduced (``moments_gaussian``)."""
    x = np.asarray(feats.double() if isinstance(feats, torch.Tensor) else feats, dtype=np.float64)
    return {"n": np.float64(len(x)), "sum": x.sum(0), "outer": x.T @ x}


def moments_gaussian(total: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Mean and unbiased covariance from summed ``moments``."""
    n = float(total["n"])
    if n < 2:
        raise ValueError("a covariance needs at least 2 samples")
    mean = total["sum"] / n
    return mean, (total["outer"] - n * np.outer(mean, mean)) / (n - 1)


def has_encoder_latents(tokenizer: ImageTokenizer) -> bool:
    """Whether ``tokenizer`` is a LlamaGen-family VQ whose pre-quantisation latents we can read."""
    return hasattr(getattr(tokenizer, "vq", None), "encode_latents")


def feature_width(tokenizer: ImageTokenizer) -> int:
    """D of ``encoder_features``: mean and standard deviation of each latent channel."""
    return 2 * tokenizer.vq.config.codebook_embed_dim


@torch.no_grad()
def encoder_features(tokenizer: ImageTokenizer, images: np.ndarray, batch_size: int = 32) -> np.ndarray:
    """uint8 images [N, H, W, 3] → float64 features [N, 2·d]: per image, the mean and the standard
    deviation over the grid of the VQ encoder's pre-quantisation latents (module docstring: why)."""
    if not has_encoder_latents(tokenizer):
        raise ValueError(f"{type(tokenizer).__name__} has no VQ encoder latents (encode_latents)")
    vq = tokenizer.vq
    weight = next(vq.parameters())
    feats = []
    for start in range(0, len(images), batch_size):
        pixels = images_to_tensor(images[start : start + batch_size]).to(weight.device, weight.dtype)
        latents = vq.encode_latents(pixels).flatten(1, 2).double()  # [B, h·w, d]
        if vq.quantize.l2_norm:  # the quantiser compares directions only
            latents = F.normalize(latents, dim=-1)
        feats.append(torch.cat([latents.mean(1), latents.std(1, correction=0)], dim=-1).cpu())
    return torch.cat(feats).numpy()
