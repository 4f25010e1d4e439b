"""Fast kernels and their plain twins (``kernels.plain_kernels()``, issue #46): where a rewrite replaced
readable code to save kernels, the plain version stays in the package and computes the same.

- the accepted path: level by level against pointer doubling (``acceptance._follow``);
- a sampled chain's verdict: the general pass over sibling ranks against the chain's shortcut
  (``acceptance._chain_verdict``; also tests/test_batched_acceptance.py);
- a sampled tree's verdict: the same pass against the residuals in closed form
  (``acceptance._sampled_verdict``; also tests/test_batched_acceptance.py);
- the random numbers: hashed at every draw against gathered from a table (``RowRandom``);
- the children ranking by chunks against one sort of the row: tests/test_dynamic_builder.py;
- and whole decodes, which use all three: the same tokens and counts either way.
"""

from __future__ import annotations

from dataclasses import replace
from unittest.mock import patch

import pytest
import torch
from conftest import (
    TINY_GPT,
    TINY_VQ,
    drafter_kind_for,
    random_drafter,
    random_gpt,
    random_vq,
    tiny_condition,
)

from vdtrain.decode import acceptance
from vdtrain.decode.acceptance import _follow_doubling, _follow_levels
from vdtrain.decode.kernels import plain_kernels, plain_twins
from vdtrain.decode.methods import build_method, load_preset
from vdtrain.decode.rng import Purpose, RowRandom
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.targets.llamagen import LlamaGenTarget, VQTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_switch_is_scoped():
    assert not plain_kernels()
    with plain_twins():
        assert plain_kernels()
        with plain_twins(False):
            assert not plain_kernels()
        assert plain_kernels()
    assert not plain_kernels()


def test_the_accepted_path_by_levels_and_by_doubling_agree():
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        batch, size = 3, int(torch.randint(1, 20, (1,), generator=g))
        # Each node's accepted child: a later node or none (−1), as a tree's child table has it.
        later = torch.randint(0, size, (batch, size), generator=g)
        child_of = torch.where(later > torch.arange(size), later, -1)
        relaxed_at = (torch.rand(batch, size, generator=g) < 0.3) & (child_of >= 0)
        for depth in range(1, size + 2):
            for relaxed in (relaxed_at, None):
                plain = _follow_levels(child_of, relaxed, depth)
                for a, b in zip(plain, _follow_doubling(child_of, relaxed, depth), strict=True):
                    assert torch.equal(a, b), (trial, depth, child_of, a, b)


def test_the_plain_random_rows_hash_every_draw_to_the_tables_numbers():
    seeds = torch.tensor([3, -7, 123456789012])
    tabled, plain = RowRandom(seeds, horizon=6), RowRandom(seeds, horizon=6)
    blocks = ((Purpose.ACCEPT, (4,)), (Purpose.BONUS, ()))
    for _ in range(5):
        want = tabled.uniforms(*blocks)
        with plain_twins():
            got = plain.uniforms(*blocks)
        assert all(torch.equal(x, y) for x, y in zip(want, got, strict=True))
        tabled.advance()
        plain.advance()
    assert tabled._tables and not plain._tables  # the plain twin grew no table


# A dynamic tree (greedy and sampled), a Jacobi window (its draws and its chain), a relaxed rule (its path's
# relaxations), a block drafter's chain and its trees (siblings drawn without replacement and i.i.d.).
@pytest.mark.parametrize(
    ("name", "temperature"),
    [
        ("eagle2", 0.0),
        ("eagle2", 1.0),
        ("sjd", 1.0),
        ("lantern", 1.0),
        ("block", 0.0),
        ("block", 1.0),
        ("block_tree", 1.0),
        ("block_tree_iid", 1.0),
        ("sjd_pac", 1.0),
    ],
)
def test_a_decode_with_the_plain_twins_is_the_fast_decode(name, temperature, tmp_path):
    """400 tokens: a row of more chunks (20) than a tree has children (10), so the chunks are ranked."""
    sampling = SamplingConfig(cfg_scale=2.0, temperature=temperature, top_k=300)
    gpt, vq = random_gpt(replace(TINY_GPT, vocab_size=400)), random_vq(replace(TINY_VQ, codebook_size=400))
    target = LlamaGenTarget(gpt, VQTokenizer(vq, image_size=8), None, "tiny", sampling)
    config = load_preset(name, {"acceptance": {"cache_dir": str(tmp_path)}})
    method = build_method(config, target, random_drafter(target, kind=drafter_kind_for(config)), sampling)
    cond = tiny_condition(3)

    def decode():
        return method.generate(cond, [torch.Generator().manual_seed(i) for i in range(3)])

    with (
        patch("vdtrain.decode.acceptance._chain_verdict", wraps=acceptance._chain_verdict) as shortcut,
        patch("vdtrain.decode.acceptance._sampled_verdict", wraps=acceptance._sampled_verdict) as closed_form,
    ):
        fast = decode()
    assert shortcut.called == (name in ("sjd", "block"))  # the chains, and only they, take the shortcut
    sampled_siblings = ("block_tree", "block_tree_iid", "sjd_pac")
    assert closed_form.called == (name in sampled_siblings)  # the sampled trees with siblings
    with plain_twins():
        plain = decode()
    assert torch.equal(plain.tokens, fast.tokens) and plain.stats == fast.stats
