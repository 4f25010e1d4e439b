"""Couplings (``vdtrain.decode.coupling``) leave a draw from the new p and keep the old draft as often as
the paper says; ``RowRandom.keyed`` gives noise fixed per (prompt, position), whatever the step or batch."""

from __future__ import annotations

import torch

from vdtrain.decode.coupling import gumbel_max, maximal_coupling
from vdtrain.decode.rng import Purpose, RowRandom

N = 200_000
P = torch.tensor([0.5, 0.3, 0.2, 0.0])
Q = torch.tensor([0.1, 0.2, 0.3, 0.4])


def _uniforms(seed: int, *shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_maximal_coupling_draws_from_p_and_keeps_sum_min_p_q():
    drafts = torch.multinomial(Q, N, replacement=True, generator=torch.Generator().manual_seed(0))
    out = maximal_coupling(drafts, P.expand(N, -1), Q.expand(N, -1), _uniforms(1, N), _uniforms(2, N))
    law = torch.bincount(out, minlength=4).double() / N
    torch.testing.assert_close(law, P.double(), atol=4e-3, rtol=0)
    kept = (out == drafts).double().mean()
    assert abs(kept - torch.minimum(P, Q).sum()) < 4e-3  # 0.1 + 0.2 + 0.2


def test_maximal_coupling_without_a_draft_draws_from_p():
    drafts = torch.zeros(N, dtype=torch.long)
    out = maximal_coupling(drafts, P.expand(N, -1), torch.zeros(N, 4), _uniforms(1, N), _uniforms(2, N))
    torch.testing.assert_close(torch.bincount(out, minlength=4).double() / N, P.double(), atol=4e-3, rtol=0)


def test_a_stale_q_is_not_a_coupling():
    """Keeping a draft with the test of a q it was not drawn from (SCD's release) changes the law."""
    drafts = torch.full((N,), 3)  # drawn from a point mass on token 3, judged as if from Q
    out = maximal_coupling(drafts, P.expand(N, -1), Q.expand(N, -1), _uniforms(1, N), _uniforms(2, N))
    assert (torch.bincount(out, minlength=4).double() / N - P.double()).abs().max() > 0.05


def test_gumbel_max_draws_from_p_and_couples_nearby_targets():
    u = _uniforms(3, N, 4)
    out = gumbel_max(P.expand(N, -1), u)
    torch.testing.assert_close(torch.bincount(out, minlength=4).double() / N, P.double(), atol=4e-3, rtol=0)
    near = torch.tensor([0.45, 0.35, 0.2, 0.0])
    same = (gumbel_max(near.expand(N, -1), u) == out).double().mean()
    fresh = (gumbel_max(near.expand(N, -1), _uniforms(4, N, 4)) == out).double().mean()
    assert same > 0.9 > 0.5 > fresh  # the same noise keeps the draft; fresh noise would not


def test_keyed_noise_is_fixed_per_position_whatever_the_step_or_batch():
    seeds = torch.tensor([11, 22, 33])
    rng = RowRandom(seeds)
    positions = torch.tensor([[5, 6], [5, 6], [40, 41]])
    first = rng.keyed(Purpose.GUMBEL, positions, 8)
    rng.advance()
    assert torch.equal(rng.keyed(Purpose.GUMBEL, positions, 8), first)  # not the step
    alone = RowRandom(seeds[1:2]).keyed(Purpose.GUMBEL, positions[1:2, 1:], 8)
    assert torch.equal(alone[0, 0], first[1, 1])  # not the batch, nor the other keys asked for
    assert not torch.equal(first[0], first[1])  # another seed, other noise
    assert not torch.equal(first[0, 0], first[0, 1])  # another position, other noise
    assert not torch.equal(rng.keyed(Purpose.DRAFT, positions, 8), first)  # another purpose
    assert ((first >= 0) & (first < 1)).all()
