"""The LlamaGen GPT and its target adapter: cached decoding must equal the teacher-forced pass."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import TINY_GPT, random_gpt, tiny_condition

from vdtrain.decode.ar import generate_ar
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.models.llamagen_gpt import LlamaGenGPT, apply_rope, rope_2d_table, rotate_pairs
from vdtrain.targets.base import prefix_causal_mask
from vdtrain.targets.llamagen import LlamaGenTarget, left_pad


def test_rope_prefix_rows_are_zero_so_caption_queries_vanish():
    table = rope_2d_table(grid_size=4, head_dim=8, base=10000.0, prefix_len=3)
    assert table.shape == (3 + 16, 4, 2)
    assert table[:3].abs().sum() == 0
    # image cell (row 1, col 2): first half rotates with the row, second with the column
    cell = table[3 + 1 * 4 + 2]
    assert torch.allclose(cell[0], torch.tensor([torch.cos(torch.tensor(1.0)), torch.sin(torch.tensor(1.0))]))
    assert torch.allclose(cell[2], torch.tensor([torch.cos(torch.tensor(2.0)), torch.sin(torch.tensor(2.0))]))


def test_identity_caption_rope_keeps_caption_queries_and_keys():
    table = rope_2d_table(grid_size=4, head_dim=8, base=10000.0, prefix_len=3, prefix="identity")
    assert torch.equal(table[:3, :, 0], torch.ones(3, 4)) and table[:3, :, 1].abs().sum() == 0
    assert torch.equal(table[3:], rope_2d_table(4, 8, 10000.0, 3)[3:])  # image rows are unchanged
    x = torch.randn(1, 19, 2, 8)  # [B, S, heads, head_dim]
    assert torch.allclose(apply_rope(x, table[None])[:, :3], x[:, :3])  # content-based caption attention
    assert apply_rope(x, rope_2d_table(4, 8, 10000.0, 3)[None])[:, :3].abs().sum() == 0  # LlamaGen's
    with pytest.raises(ValueError, match="caption_rope"):
        rope_2d_table(4, 8, 10000.0, 3, prefix="learned")


def test_rope_in_real_arithmetic_rotates_as_the_complex_product():
    """What ``torch.compile`` traces (``rotate_pairs``) equals the eager complex product to float rounding,
    in fp32 and bf16, over zero caption rows, the identity and the grid's rotations; under tracing
    ``apply_rope`` takes the real form."""
    torch.manual_seed(0)
    table = torch.cat(
        [rope_2d_table(4, 8, 10000.0, 2), rope_2d_table(4, 8, 10000.0, 2, prefix="identity")[:2]]
    )
    rope = table[torch.randint(0, len(table), (3, 20))]  # [B, S, D/2, 2]: every kind of row, batched
    x = torch.randn(3, 20, 5, 8)
    torch.testing.assert_close(rotate_pairs(x, rope), apply_rope(x, rope), rtol=1e-6, atol=1e-6)
    half = x.bfloat16()
    assert rotate_pairs(half, rope).dtype == torch.bfloat16
    torch.testing.assert_close(rotate_pairs(half, rope), apply_rope(half, rope))  # bf16 rounding
    traced = torch.compile(apply_rope, backend="eager", fullgraph=True)
    torch.testing.assert_close(traced(x, rope), rotate_pairs(x, rope), rtol=0, atol=0)
    torch._dynamo.reset()


def test_prefix_mask_hides_padding_but_keeps_the_diagonal():
    cond_mask = torch.tensor([[False, True, True]])
    mask = prefix_causal_mask(cond_mask, 5)[0, 0]
    assert not mask[2, 0] and mask[2, 1] and mask[2, 2]
    assert mask[0, 0]  # a padded row still sees itself
    assert not mask[1, 3]  # causal


def test_left_pad_moves_real_tokens_last_and_zeroes_padding():
    feats = torch.arange(1.0, 5.0)[None, :, None].repeat(1, 1, 2)  # rows 1,2,3,4
    mask = torch.tensor([[True, True, False, False]])
    out, new_mask = left_pad(feats, mask)
    assert new_mask.tolist() == [[False, False, True, True]]
    assert out[0, :, 0].tolist() == [0.0, 0.0, 1.0, 2.0]


@pytest.fixture(params=["llamagen", "learned_pos_embedding"])
def any_target(request, tiny_target):
    if request.param == "llamagen":
        return tiny_target
    gpt = random_gpt(replace(TINY_GPT, learned_pos_embedding=True))
    return LlamaGenTarget(gpt, tiny_target.tokenizer, None, "tiny", tiny_target.sampling_defaults)


def test_the_position_table_is_optional_zero_at_start_and_absent_from_official_checkpoints():
    assert "pos_embedding" not in LlamaGenGPT(TINY_GPT).state_dict()
    with_table = LlamaGenGPT(replace(TINY_GPT, learned_pos_embedding=True))
    assert with_table.pos_embedding.shape == (TINY_GPT.max_seq_len, TINY_GPT.dim)
    assert not with_table.pos_embedding.any()  # starts as LlamaGen
    plain = LlamaGenGPT(TINY_GPT)
    plain.load_state_dict({k: v for k, v in with_table.state_dict().items() if k != "pos_embedding"})
    x, positions = torch.randn(2, 7, TINY_GPT.dim), torch.arange(3, 10)
    torch.testing.assert_close(with_table(x, positions, None), plain(x, positions, None))
    with torch.no_grad():
        with_table.pos_embedding.normal_()
    assert not torch.allclose(with_table(x, positions, None), plain(x, positions, None))


def test_cached_decoding_matches_the_teacher_forced_pass(any_target):
    tiny_target = any_target
    cond = tiny_condition()
    tokens = torch.randint(0, tiny_target.vocab_size, (2, tiny_target.num_image_tokens))
    full = tiny_target.forward_sequence(cond, tokens)
    cache = tiny_target.new_cache(2)
    pre = tiny_target.prefill(cond, cache)
    L = tiny_target.prefix_length
    torch.testing.assert_close(pre.logits, full.logits[:, :L], atol=1e-5, rtol=1e-4)
    # feed the tokens in uneven chunks through the cache
    start = 0
    for size in (1, 3, 5, 7):
        idx = torch.arange(start, start + size)
        out = tiny_target.forward_tokens(
            cond, tokens[:, idx], idx, cache, idx + L, tiny_target.causal_visibility(start, size, "cpu")
        )
        torch.testing.assert_close(out.hidden, full.hidden[:, L + idx], atol=1e-5, rtol=1e-4)
        start += size


def test_ar_greedy_is_argmax_of_teacher_forced_logits(tiny_target):
    cond = tiny_condition()
    sampling = SamplingConfig(cfg_scale=2.5, temperature=0.0)
    tokens = generate_ar(tiny_target, cond, sampling, [None, None])
    both = tiny_target.forward_sequence(cond.cat(tiny_target.null_condition(cond)), tokens.repeat(2, 1))
    L = tiny_target.prefix_length
    lc, lu = both.logits[:, L - 1 : -1].chunk(2)
    assert torch.equal((lu + 2.5 * (lc - lu)).argmax(-1), tokens)


def test_ar_sample_depends_only_on_its_own_seed(tiny_target):
    cond = tiny_condition()
    sampling = SamplingConfig(cfg_scale=2.0, temperature=1.0, top_k=10)
    both = generate_ar(tiny_target, cond, sampling, [torch.Generator().manual_seed(s) for s in (7, 8)])
    alone = generate_ar(
        tiny_target, cond.select(torch.tensor([1])), sampling, [torch.Generator().manual_seed(8)]
    )
    assert torch.equal(both[1], alone[0])
