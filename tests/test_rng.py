"""Counter-based per-row randomness (``RowRandom``) and the samplers built on uniforms."""

from __future__ import annotations

import pytest
import torch
from reference_acceptance import gumbel_topk

from vdtrain.decode import rng as rng_module
from vdtrain.decode.rng import Purpose, RowRandom, inverse_cdf


def _stats():
    """scipy.stats, imported by the tests that use it: the GPU check's selection holds this module's GPU
    test, and a GPU machine may lack scipy."""
    return pytest.importorskip("scipy.stats")


MASK = 0xFFFFFFFF


def reference_uniform(seed: int, step: int, purpose: int, index: int) -> float:
    """The documented hash with Python integers, checking that no product reaches 2^63 (so int64 tensor
    arithmetic is exact, hence the same on every device)."""

    def mix(x: int) -> int:
        x ^= x >> 16
        assert x * rng_module._MUL_A < 1 << 63
        x = (x * rng_module._MUL_A) & MASK
        x ^= x >> 15
        assert x * rng_module._MUL_B < 1 << 63
        x = (x * rng_module._MUL_B) & MASK
        return x ^ (x >> 16)

    seed &= (1 << 64) - 1
    seed_key = mix(mix((seed & MASK) ^ rng_module._SEED_SALT) ^ (seed >> 32))
    key = mix(mix(seed_key ^ (step & MASK)) ^ ((purpose * rng_module._PURPOSE_SALT) & MASK))
    high, low = mix(mix(key ^ 2 * index)) >> 5, mix(mix(key ^ (2 * index + 1))) >> 6
    return (high * (1 << 26) + low) / float(1 << 53)


def test_uniforms_are_the_documented_integer_hash():
    seeds = [0, 1, 12345, -1, -(1 << 63), (1 << 63) - 1]
    rows = RowRandom(torch.tensor(seeds))
    for _ in range(3):
        rows.advance()
    got = rows.uniform(Purpose.ACCEPT, 2, 3)
    assert got.dtype == torch.float64 and got.shape == (len(seeds), 2, 3)
    want = [[reference_uniform(s, 3, Purpose.ACCEPT, i) for i in range(6)] for s in seeds]
    assert got.view(len(seeds), 6).tolist() == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_uniforms_are_the_same_on_a_gpu():
    seeds = torch.arange(5) * 1_000_003 - 7
    cpu, gpu = RowRandom(seeds), RowRandom(seeds.cuda())
    for rows in (cpu, gpu):
        rows.advance(torch.tensor([True, False, True, True, False], device=rows.steps.device))
    assert torch.equal(cpu.uniform(Purpose.BONUS, 64), gpu.uniform(Purpose.BONUS, 64).cpu())


def test_uniforms_are_uniform():
    u = RowRandom(torch.arange(200)).uniform(Purpose.ACCEPT, 1000).flatten()
    assert u.min() >= 0 and u.max() < 1
    assert _stats().kstest(u.numpy(), "uniform").pvalue > 1e-3
    # Consecutive elements jointly uniform on a 16 x 16 grid (no serial correlation).
    cells = (u[:-1] * 16).long() * 16 + (u[1:] * 16).long()
    assert _stats().chisquare(torch.bincount(cells, minlength=256).numpy()).pvalue > 1e-3
    # All 53 bits are used: the low bits of u * 2^53 are fair coins.
    bits = (u * float(1 << 53)).long()
    for shift in (0, 1, 25, 26, 27, 52):
        assert abs(((bits >> shift) & 1).double().mean() - 0.5) < 0.01


def test_rows_steps_and_purposes_give_independent_streams():
    rows = RowRandom(torch.tensor([7, 8]))
    first = rows.uniform(Purpose.ACCEPT, 20_000)
    other_purpose = rows.uniform(Purpose.BONUS, 20_000)
    rows.advance()
    next_step = rows.uniform(Purpose.ACCEPT, 20_000)
    pairs = [(first[0], first[1]), (first[0], other_purpose[0]), (first[0], next_step[0])]
    for a, b in pairs:
        assert not torch.equal(a, b)
        assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1]) < 0.03
    assert torch.equal(
        rows.uniform(Purpose.ACCEPT, 5, 4).flatten(1), next_step[:, :20]
    )  # one stream per step


def test_a_row_sees_the_same_numbers_in_any_batch():
    seeds = torch.tensor([11, 12, 13, 14])
    batch = RowRandom(seeds)
    alone = RowRandom(seeds[2:3])
    active = torch.tensor([True, False, True, True])
    for _ in range(3):  # row 1 finished early: its counter stops, the others' do not depend on it
        batch.advance(active)
        alone.advance()
    assert torch.equal(batch.uniform(Purpose.DRAFT, 6, 5)[2], alone.uniform(Purpose.DRAFT, 6, 5)[0])
    assert batch.steps.tolist() == [3, 0, 3, 3]


def test_rows_from_generators_use_their_seeds():
    gens = [torch.Generator().manual_seed(s) for s in (5, 6, (1 << 64) - 3)]
    rows = RowRandom.from_generators(gens)
    assert rows.steps.tolist() == [0, 0, 0]
    assert torch.equal(
        rows.uniform(Purpose.ACCEPT, 4), RowRandom(torch.tensor([5, 6, -3])).uniform(Purpose.ACCEPT, 4)
    )
    torch.manual_seed(0)
    a = RowRandom.from_generators([None, None]).uniform(Purpose.ACCEPT, 3)
    torch.manual_seed(0)
    b = RowRandom.from_generators([None, None]).uniform(Purpose.ACCEPT, 3)
    assert torch.equal(a, b) and not torch.equal(a[0], a[1])


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="LongTensor"):
        RowRandom(torch.zeros(3))
    with pytest.raises(ValueError, match="purpose"):
        RowRandom(torch.zeros(3, dtype=torch.long)).uniform(-1, 2)
    with pytest.raises(ValueError, match="shape"):
        RowRandom(torch.zeros(3, dtype=torch.long)).uniform(Purpose.ACCEPT, 1 << 31)


# --- samplers ---------------------------------------------------------------------------------------------


def test_inverse_cdf_follows_p_and_never_returns_a_zero_mass_token():
    p = torch.tensor([0.0, 0.3, 0.0, 0.5, 0.2, 0.0], dtype=torch.float64)
    u = RowRandom(torch.arange(1)).uniform(Purpose.BONUS, 50_000)[0]
    draws = inverse_cdf(p.expand(len(u), -1), u)
    counts = torch.bincount(draws, minlength=6).double()
    assert counts[p == 0].sum() == 0
    assert _stats().chisquare(counts[p > 0].numpy(), (p[p > 0] * len(u)).numpy()).pvalue > 1e-3
    # Not normalised: the same draws from a multiple of p.
    assert torch.equal(inverse_cdf(p.expand(len(u), -1) * 3.7, u), draws)


def test_inverse_cdf_at_the_ends_of_the_unit_interval():
    p = torch.tensor(
        [[0.0, 0.4, 0.6, 0.0], [0.0, 0.0, 0.0, 0.0], [1e-300, 0.0, 0.0, 0.0]], dtype=torch.float64
    )
    lowest, highest = torch.zeros(3, dtype=torch.float64), torch.full((3,), 1 - 2.0**-53, dtype=torch.float64)
    assert inverse_cdf(p, lowest).tolist() == [1, 0, 0]
    assert inverse_cdf(p, highest).tolist() == [2, 0, 0]  # the last token with mass; no mass at all: 0
    # Rounding pushing u · total onto the total falls back to the first index reaching the total.
    total_rounds_up = torch.tensor([[0.1, 0.2, 0.7, 0.0]], dtype=torch.float64)
    assert inverse_cdf(total_rounds_up, torch.tensor([1 - 2.0**-53], dtype=torch.float64)).tolist() == [2]


def test_gumbel_topk_samples_without_replacement():
    q = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0], dtype=torch.float64)
    rows = 40_000
    u = RowRandom(torch.arange(rows)).uniform(Purpose.DRAFT, len(q))
    picks = gumbel_topk(q.log().expand(rows, -1), u, 2)
    assert (picks[:, 0] != picks[:, 1]).all() and not (picks == 4).any()
    # P(first = i, second = j) = q_i q_j / (1 - q_i).
    support = 4
    want = torch.tensor(
        [[q[i] * q[j] / (1 - q[i]) if i != j else 0.0 for j in range(support)] for i in range(support)],
        dtype=torch.float64,
    )
    counts = torch.bincount(picks[:, 0] * support + picks[:, 1], minlength=support * support).double()
    keep = want.flatten() > 0
    assert counts[~keep].sum() == 0
    assert _stats().chisquare(counts[keep].numpy(), (want.flatten()[keep] * rows).numpy()).pvalue > 1e-3
    # Zero-mass tokens come last when k exceeds the support.
    assert (gumbel_topk(q.log().expand(rows, -1)[:100], u[:100], 5)[:, 4] == 4).all()


def test_blocks_drawn_together_equal_blocks_drawn_apart():
    rows = RowRandom(torch.tensor([3, -5, 1 << 40]))
    rows.advance(torch.tensor([True, False, True]))
    accept, bonus, draft = rows.uniforms((Purpose.ACCEPT, (7,)), (Purpose.BONUS, ()), (Purpose.DRAFT, (3, 4)))
    assert torch.equal(accept, rows.uniform(Purpose.ACCEPT, 7))
    assert torch.equal(bonus, rows.uniform(Purpose.BONUS, 1)[:, 0])
    assert torch.equal(draft, rows.uniform(Purpose.DRAFT, 3, 4))


def test_a_horizon_gathers_the_same_uniforms_from_its_tables_and_reseeds_them():
    seeds = torch.tensor([3, -7, 123456789012])
    hashed, tabled = RowRandom(seeds), RowRandom(seeds, horizon=6)
    blocks = ((Purpose.ACCEPT, (4,)), (Purpose.BONUS, ()))
    for step in range(5):
        for x, y in zip(hashed.uniforms(*blocks), tabled.uniforms(*blocks), strict=True):
            assert torch.equal(x, y)
        active = torch.tensor([True, step % 2 == 0, True])  # rows advance apart
        hashed.advance(active)
        tabled.advance(active)
    for rng in (hashed, tabled):
        rng.reseed(torch.tensor([1, 2, 3]))
    assert torch.equal(hashed.uniform(Purpose.ACCEPT, 4), tabled.uniform(Purpose.ACCEPT, 4))
