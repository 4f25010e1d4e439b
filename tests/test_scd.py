"""SCD: SJD's Jacobi window with coupled drafts (``coupling: maximal | gumbel``), and SJD-PAC's tree with
Gumbel-coupled continuation or point-mass fresh drafts; all lossless.

T = 0: token identity with AR. T = 1: the whole-image, per-position and adjacent-pair chi-square tests
under one Bonferroni bound (``image_statistics``) on three enumerable targets, one with forced tokens
(Lumina-mGPT's end-of-row column); and the same tests reject the authors' release rule that keeps a
surviving draft's old q. Batch independence: ``test_exactness`` runs every preset, these included.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_condition
from image_statistics import bonferroni_pvalue
from test_engine import SIGNIFICANCE, make_target, sample_images
from test_jacobi import grid3  # noqa: F401  (module fixtures)
from test_sjd_pac import lumina_forced, sharp3x3  # noqa: F401

from vdtrain.decode.ar import generate_ar
from vdtrain.decode.builders.jacobi import JacobiTreeConfig, JacobiWindowBuilder
from vdtrain.decode.builders.sjd_pac import SjdPacBuilder, SjdPacTreeConfig
from vdtrain.decode.engine import SpeculativeEngine
from vdtrain.decode.methods import load_preset, tree_builder
from vdtrain.decode.sampling import SamplingConfig

BUILDERS = {
    "scd": lambda: JacobiWindowBuilder(JacobiTreeConfig(window=6, coupling="maximal")),
    "scd_gumbel": lambda: JacobiWindowBuilder(JacobiTreeConfig(window=6, coupling="gumbel")),
    "sjd_pac_gumbel": lambda: SjdPacBuilder(
        SjdPacTreeConfig(tokens_per_forward=9, width=2, levels=3, coupling="gumbel")
    ),
    "sjd_pac_point_q": lambda: SjdPacBuilder(
        SjdPacTreeConfig(tokens_per_forward=9, width=2, levels=3, fresh_q="point")
    ),
}


@pytest.mark.parametrize("name", ["scd", "scd_gumbel", "sjd_pac_gumbel"])
@pytest.mark.parametrize("cfg_scale", [1.0, 2.5])
def test_the_presets_give_ar_tokens_at_t0(name, cfg_scale):
    target = make_target()
    cond = tiny_condition()
    sampling = SamplingConfig(cfg_scale=cfg_scale, temperature=0.0)
    engine = SpeculativeEngine(target, None, tree_builder(load_preset(name).tree), sampling)
    result = engine.generate(cond, [torch.Generator().manual_seed(i) for i in range(2)])
    assert torch.equal(result.tokens, generate_ar(target, cond, sampling, [None, None]))
    assert all(sum(st.committed_per_step) == target.num_image_tokens - 1 for st in result.stats)


@pytest.mark.parametrize("fixture", ["grid3", "sharp3x3", "lumina_forced"])
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_coupled_drafts_keep_the_ar_distribution(name, fixture, request):
    target, cond, sampling, exact = request.getfixturevalue(fixture)
    engine = SpeculativeEngine(target, None, BUILDERS[name](), sampling)
    samples = sample_images(engine, cond, 6000, seed=1)
    assert set(samples) <= set(exact)  # forced tokens included
    assert bonferroni_pvalue(samples, exact) > SIGNIFICANCE


class KeepTheOldQ(JacobiWindowBuilder):
    """The release's rule: a draft that survives the maximal coupling keeps the q it was drawn from as its
    proposal, where the paper's Algorithm 3 (and ours) stores the p it is now a draw from."""

    def observe(self, outcome):
        super().observe(outcome)
        tree, verdict, verified, p_nodes = outcome.tree, outcome.verdict, outcome.verified, outcome.p_nodes
        win, last = self._windows, tree.size - 1
        k = torch.arange(self.window)[None]
        nodes = (verdict.accepted[:, None] + 1 + k).clamp_max(last)
        old = tree.tokens.gather(1, (nodes + 1).clamp_max(last))
        drawn_from = tree.q.gather(1, nodes[..., None].expand(-1, -1, p_nodes.shape[-1]))
        survived = verified[:, None] & (k < win.count[:, None] - 1) & (win.tokens == old)
        win.q = torch.where(survived[..., None], drawn_from.to(win.q.dtype), win.q)


def test_the_distribution_test_rejects_the_releases_old_q(request):
    target, cond, sampling, exact = request.getfixturevalue("sharp3x3")
    engine = SpeculativeEngine(
        target, None, KeepTheOldQ(JacobiTreeConfig(window=6, coupling="maximal")), sampling
    )
    assert bonferroni_pvalue(sample_images(engine, cond, 6000, seed=2), exact) < SIGNIFICANCE
