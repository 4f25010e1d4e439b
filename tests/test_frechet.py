"""The Fréchet distance of ``frechet_ar``: its closed form, its invariants, that it sees a diversity
collapse, and its features on the shipped shapes target."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vdtrain.eval.frechet import encoder_features, feature_width, frechet_distance
from vdtrain.eval.quality import QualityConfig, QualityScorer
from vdtrain.shapes.scene import generate
from vdtrain.targets import load_target_folder


def random_covariance(rng: np.random.Generator, d: int) -> np.ndarray:
    m = rng.normal(size=(d, d))
    return m @ m.T / d + 0.1 * np.eye(d)


def analytic_fd(mu1: np.ndarray, s1: np.ndarray, mu2: np.ndarray, s2: np.ndarray) -> float:
    """Through scipy's general square root of Σ1 Σ2: a different route from ``frechet_distance``'s."""
    from scipy.linalg import sqrtm

    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1 + s2 - 2 * sqrtm(s1 @ s2).real))


def test_fd_of_large_gaussian_samples_matches_the_closed_form():
    rng = np.random.default_rng(0)
    d = 4
    mu1, mu2 = rng.normal(size=d), rng.normal(size=d)
    s1, s2 = random_covariance(rng, d), random_covariance(rng, d)
    a = rng.multivariate_normal(mu1, s1, size=200_000)
    b = rng.multivariate_normal(mu2, s2, size=200_000)
    exact = analytic_fd(mu1, s1, mu2, s2)
    assert frechet_distance(a, b) == pytest.approx(exact, rel=0.02)
    # and on exact moments: ours and scipy's square root agree to round-off
    assert frechet_distance(torch.from_numpy(a), torch.from_numpy(b)) == pytest.approx(
        analytic_fd(a.mean(0), np.cov(a.T), b.mean(0), np.cov(b.T)), rel=1e-9
    )


def test_fd_is_zero_on_itself_symmetric_and_finite_on_singular_covariances():
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(50, 6)), rng.normal(size=(40, 6)) + 0.5
    assert frechet_distance(x, x) == pytest.approx(0.0, abs=1e-9)
    assert frechet_distance(x, y) == pytest.approx(frechet_distance(y, x), rel=1e-9)
    few = rng.normal(size=(3, 16))  # N ≤ D: rank-2 covariances, as in a tiny evaluation
    value = frechet_distance(few, rng.normal(size=(3, 16)))
    assert np.isfinite(value) and value > 0
    with pytest.raises(ValueError, match="at least 2"):
        frechet_distance(x[:1], y)


def test_a_diversity_collapse_costs_far_more_than_an_independent_draw():
    rng = np.random.default_rng(2)
    s = random_covariance(rng, 8)
    reference, independent = (rng.multivariate_normal(np.zeros(8), s, size=300) for _ in range(2))
    collapsed = np.repeat(independent[:5], 60, axis=0)  # every sample one of 5 points: same mean roughly
    floor = frechet_distance(reference, independent)
    assert frechet_distance(reference, collapsed) > 10 * floor


@pytest.fixture(scope="module")
def shapes_target():
    return load_target_folder()  # checkpoints/shapes/target


def test_shipped_shapes_target_features_are_finite_and_see_a_collapse(shapes_target):
    images = np.stack([s.image for s in generate(160, seed=7)])  # rendered shapes-world scenes
    tokenizer = shapes_target.tokenizer
    feats = encoder_features(tokenizer, images, batch_size=16)
    assert feats.shape == (160, feature_width(tokenizer)) == (160, 16) and feats.dtype == np.float64
    assert np.isfinite(feats).all() and feats.std(0).min() > 0  # no dead feature
    assert np.allclose(feats[:8], encoder_features(tokenizer, images[:8]), atol=1e-6)  # batch-independent
    # 80 against 80 other scenes: the floor; against 5 of them, each 16 times: a collapse
    floor = frechet_distance(feats[:80], feats[80:])
    collapsed = encoder_features(tokenizer, np.repeat(images[80:85], 16, axis=0))
    assert frechet_distance(feats[:80], collapsed) > 5 * floor

    scorer = QualityScorer(QualityConfig(metrics=["frechet_ar"]), tokenizer=tokenizer)
    value = scorer.score(images[:80], ["unused"] * 80, reference=images[80:])["frechet_ar"]
    assert value.value == pytest.approx(floor)
    assert scorer.score(images[:80], ["unused"] * 80)["frechet_ar"].note.startswith("needs AR's images")


def test_a_tokenizer_without_encoder_latents_is_not_available():
    scorer = QualityScorer(QualityConfig(metrics=["frechet_ar"]))  # no tokenizer, as for non-VQ targets
    value = scorer.score(np.zeros((2, 8, 8, 3), np.uint8), ["a", "b"], reference=np.zeros((2, 8, 8, 3)))
    assert value["frechet_ar"].value is None and "encoder latents" in value["frechet_ar"].note
