"""The EAGLE feature drafter: input alignment, frozen borrowed modules, cached decoding, save/load, losses."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_GPT, random_gpt, random_vq, tiny_condition
from torch import nn

from vdtrain.decode.sampling import SamplingConfig
from vdtrain.drafters import Drafter, DrafterConfig
from vdtrain.drafters.head_loss import token_loss
from vdtrain.drafters.losses import (
    feature_loss,
    image_target_mask,
    simulated_tau,
    teacher_loss,
    top_k_agreement,
    trained_rows,
    uniform_feature_noise,
)
from vdtrain.drafters.rows import feature_targets, teacher_inputs, teacher_mask
from vdtrain.targets.llamagen import LlamaGenTarget, VQTokenizer


def make_drafter(target, seed: int = 0) -> Drafter:
    torch.manual_seed(seed)
    return Drafter.make(DrafterConfig.for_target(target), target)


def teacher_batch(target, batch: int = 2, seed: int = 3):
    cond = tiny_condition(batch)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, target.vocab_size, (batch, target.num_image_tokens), generator=g)
    with torch.no_grad():
        hidden = target.forward_sequence(cond, tokens).hidden
    return cond, tokens, hidden


# --- alignment ---------------------------------------------------------------------------------------


def test_drafter_inputs_pair_feature_s_with_the_token_at_s_plus_1():
    L, N, H, B = 3, 4, 5, 2
    # f_s = 100·b + s in every channel; embedding of token v = 1000 + v in every channel
    hidden = (
        (100 * torch.arange(B)[:, None, None] + torch.arange(L + N)[None, :, None])
        .float()
        .expand(B, L + N, H)
    )
    tokens = torch.tensor([[7, 1, 4, 2], [3, 3, 0, 9]])
    embed = nn.Embedding(10, H)
    with torch.no_grad():
        embed.weight.copy_((1000 + torch.arange(10.0))[:, None].expand(10, H))

    features, next_embeds = teacher_inputs(hidden, tokens, L, embed)
    targets = feature_targets(hidden)
    assert features.shape == next_embeds.shape == targets.shape == (B, L + N - 1, H)
    for b in range(B):
        for s in range(L + N - 1):
            assert torch.all(features[b, s] == 100 * b + s)  # f_s
            assert torch.all(targets[b, s] == 100 * b + s + 1)  # f_{s+1}
            if s + 1 < L:  # the next slot is a caption row: the zero dummy embedding
                assert torch.all(next_embeds[b, s] == 0)
            else:  # the next slot holds image token s+1-L
                assert torch.all(next_embeds[b, s] == 1000 + tokens[b, s + 1 - L])
    # the first real token sits on the last prefix row, next to f_{L-1}
    assert torch.all(next_embeds[:, L - 1] == 1000 + tokens[:, :1])
    # a pairing shifted by one (f_s with e_s) is a different tensor
    shifted = torch.cat([torch.zeros(B, L, H), embed(tokens)[:, :-1]], dim=1)
    assert not torch.equal(next_embeds, shifted)


def test_trained_rows_are_the_features_that_predict_image_tokens(tiny_target):
    L, N = tiny_target.prefix_length, tiny_target.num_image_tokens
    mask = image_target_mask(L, N)
    assert mask.shape == (L + N - 1,)
    # row j regresses f_{j+1}; trained: f_{L-1} .. f_{L+N-2}
    assert mask.nonzero().squeeze(1).tolist() == list(range(L - 2, L + N - 2))
    assert not mask[-1]  # f_{L+N-1} predicts nothing
    assert mask.nonzero().squeeze(1).tolist() == list(range(L + N - 1))[trained_rows(L, N)]
    assert len(range(1 + 5 - 1)[trained_rows(1, 5)]) == 4  # a one-row prefix: f_1 .. f_4
    cond, tokens, hidden = teacher_batch(tiny_target)
    assert image_target_mask(cond.mask, N).shape == (2, L + N - 1)
    # the head of the trained targets gives the target's logits for image tokens 0 .. N-1
    logits = tiny_target.head(feature_targets(hidden)[:, mask]).float()
    full = tiny_target.forward_sequence(cond, tokens).logits
    torch.testing.assert_close(logits, full[:, L - 1 : L + N - 1])


# --- borrowed, frozen target modules -------------------------------------------------------------------


def test_drafter_owns_no_target_weights_and_only_it_trains(tiny_target):
    drafter = make_drafter(tiny_target)
    names = [n for n, _ in drafter.named_parameters()]
    assert names and all(n.startswith(("fc.", "layer.")) for n in names)
    assert all(k.startswith(("fc.", "layer.")) for k in drafter.state_dict())
    target_ptrs = {p.data_ptr() for p in tiny_target.parameters()}
    assert not any(p.data_ptr() in target_ptrs for p in drafter.parameters())
    assert drafter.fc.in_features == 2 * tiny_target.hidden_size

    embed_before = tiny_target.token_embedding.weight.clone()
    head_before = tiny_target.head.weight.clone()
    layer_before = drafter.layer.attention.wqkv.weight.clone()
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    cond, tokens, hidden = teacher_batch(tiny_target)
    pred = drafter.forward_teacher(hidden, tokens, cond.mask)
    loss, parts = teacher_loss(
        pred, feature_targets(hidden), drafter.normed, drafter.head, cond.mask.shape[1]
    )
    loss.backward()
    assert set(parts) == {"feature", "cls", "top1", "total"}
    assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.abs().sum() > 0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.layer.parameters())
    for p in (tiny_target.token_embedding.weight, tiny_target.head.weight):
        assert not p.requires_grad and p.grad is None
    opt.step()
    assert torch.equal(tiny_target.token_embedding.weight, embed_before)
    assert torch.equal(tiny_target.head.weight, head_before)
    assert not torch.equal(drafter.layer.attention.wqkv.weight, layer_before)


def test_drafter_needs_an_attached_target_for_embedding_and_head(tiny_target):
    drafter = Drafter.make(DrafterConfig.for_target(tiny_target))
    with pytest.raises(RuntimeError, match="attach"):
        drafter.logits(torch.zeros(1, tiny_target.hidden_size))


# --- cached decoding ------------------------------------------------------------------------------------


def test_cached_drafter_matches_the_teacher_forced_pass(tiny_target):
    drafter = make_drafter(tiny_target).eval()
    cond, tokens, hidden = teacher_batch(tiny_target)
    L = tiny_target.prefix_length
    with torch.no_grad():
        teacher = drafter.forward_teacher(hidden, tokens, cond.mask)
        features, next_embeds = teacher_inputs(hidden, tokens, L, drafter.embed)
        seq = features.shape[1]
        full_mask = teacher_mask(cond.mask, seq)
        cache = drafter.new_cache(2)
        start = 0
        # the prefix rows without a token, then the row carrying image token 0, then uneven chunks
        for size in (L - 1, 1, 1, 3, 5, 4, seq - L - 13):
            idx = torch.arange(start, start + size)
            out = drafter(
                features[:, idx], next_embeds[:, idx], idx, full_mask[:, :, idx, : start + size], cache, idx
            )
            torch.testing.assert_close(out, teacher[:, idx], atol=1e-5, rtol=1e-4)
            start += size
        assert start == seq
    # and the logits come from the target head, in fp32
    logits = drafter.logits(teacher)
    assert logits.dtype == torch.float32 and logits.shape == (2, seq, tiny_target.vocab_size)


# --- config, save and load ------------------------------------------------------------------------------


def test_config_round_trips_through_json(tiny_target):
    config = DrafterConfig.for_target(tiny_target)
    assert config.hidden_size == TINY_GPT.dim and config.layer["n_head"] == TINY_GPT.n_head
    assert (
        config.grid == (4, 4) and config.target["head_fingerprint"] == tiny_target.identity.head_fingerprint
    )
    again = DrafterConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config and isinstance(again.grid, tuple) and isinstance(again.target["grid"], tuple)
    with pytest.raises(ValueError, match="unknown drafter config keys"):
        DrafterConfig.from_dict({**config.to_dict(), "n_layers": 2})


def test_save_load_round_trip_gives_identical_outputs(tiny_target, tmp_path):
    drafter = make_drafter(tiny_target).eval()
    drafter.save_pretrained(tmp_path / "d", metadata={"step": 7})
    saved = json.loads((tmp_path / "d" / "config.json").read_text())
    assert saved["metadata"] == {"step": 7} and Drafter.read_metadata(tmp_path / "d") == {"step": 7}
    from safetensors.torch import load_file

    assert set(load_file(str(tmp_path / "d" / "model.safetensors"))) == set(drafter.state_dict())
    loaded = Drafter.from_pretrained(tmp_path / "d", tiny_target)
    assert loaded.config == drafter.config
    cond, tokens, hidden = teacher_batch(tiny_target)
    with torch.no_grad():
        a = drafter.forward_teacher(hidden, tokens, cond.mask)
        b = loaded.forward_teacher(hidden, tokens, cond.mask)
    assert torch.equal(a, b)
    assert torch.equal(drafter.logits(a), loaded.logits(b))


def other_target(**gpt_overrides) -> LlamaGenTarget:
    seed = gpt_overrides.pop("seed", 0)
    gpt = random_gpt(replace(TINY_GPT, **gpt_overrides), seed=seed)
    return LlamaGenTarget(gpt, VQTokenizer(random_vq(), image_size=8), None, "other", SamplingConfig())


def test_loading_against_the_wrong_target_names_the_field(tiny_target, tmp_path):
    make_drafter(tiny_target).save_pretrained(tmp_path / "d")
    with pytest.raises(ValueError, match="head_fingerprint"):
        Drafter.from_pretrained(tmp_path / "d", other_target(seed=1))
    with pytest.raises(ValueError, match="hidden_size"):
        Drafter.from_pretrained(tmp_path / "d", other_target(dim=48))
    with pytest.raises(ValueError, match="prefix_length"):
        Drafter.from_pretrained(tmp_path / "d", other_target(cls_token_num=6))
    # loading without a target works; attaching the right one later too
    assert Drafter.from_pretrained(tmp_path / "d").attach(tiny_target).attached


# --- losses and training signals ------------------------------------------------------------------------


def test_feature_loss_is_zero_for_identical_inputs_and_respects_the_mask():
    pred = torch.randn(2, 5, 8)
    mask = torch.tensor([False, True, True, True, False])
    assert feature_loss(pred, pred.clone(), mask) == 0
    off_mask = pred.clone()
    off_mask[:, 0] += 5.0
    off_mask[1, 4] -= 3.0
    assert feature_loss(pred, off_mask, mask) == 0
    on_mask = pred.clone()
    on_mask[0, 2] += 0.5  # smooth-L1 in the quadratic zone: 0.5·0.5² per channel
    expected = 0.5 * 0.25 / 6  # one of the 2·3 masked positions
    torch.testing.assert_close(feature_loss(pred, on_mask, mask), torch.tensor(expected))
    big = pred.clone()
    big[0, 2] += 3.0  # linear zone: 3 - 0.5
    torch.testing.assert_close(feature_loss(pred, big, mask), torch.tensor(2.5 / 6))


def test_soft_ce_equals_ce_for_a_one_hot_target():
    pred = torch.randn(2, 3, 7)
    labels = torch.randint(0, 7, (2, 3))
    one_hot = F.one_hot(labels, 7).float()
    ce = F.cross_entropy(pred.reshape(-1, 7), labels.reshape(-1), reduction="none").view(2, 3)
    loss, grad = token_loss(one_hot, pred)
    torch.testing.assert_close(loss, ce)
    torch.testing.assert_close(grad, pred.softmax(-1) - one_hot)


def test_the_acceptance_loss_is_the_rejection_chance_of_speculative_sampling():
    """α = Σ min(p, q) is the chance speculative sampling at T = 1 accepts a token drawn from q: here 0.5
    by hand and the empirical rate of accept-with-prob-min(1, p/q) draws; the loss is 1 − α (or −log α)."""
    p = torch.tensor([[0.5, 0.5, 0.0]])
    q_logits = torch.tensor([[2.0, 0.0, 1.0]])
    q = q_logits.softmax(-1)
    alpha = torch.minimum(p, q).sum()
    torch.testing.assert_close(token_loss(p, q_logits, "acceptance")[0], 1 - alpha[None])
    torch.testing.assert_close(token_loss(p, q_logits, "log_acceptance")[0], -alpha.log()[None])
    g = torch.Generator().manual_seed(0)
    drawn = torch.multinomial(q[0], 200_000, replacement=True, generator=g)
    accepted = torch.rand(200_000, generator=g) < (p[0] / q[0]).clamp(max=1)[drawn]
    assert abs(accepted.float().mean() - alpha) < 0.005
    rejected = token_loss(p, torch.tensor([[0.0, 0.0, -1e4]]), "acceptance")[0]
    assert rejected.item() == pytest.approx(0, abs=1e-6)
    with pytest.raises(ValueError, match="soft_ce"):
        token_loss(p, q_logits, "kl")


def test_top_k_agreement_and_simulated_tau():
    target = torch.tensor([[[0.0, 5.0, 1.0], [3.0, 0.0, 1.0]]])  # argmax 1, 0
    pred = torch.tensor([[[0.0, 2.0, 9.0], [3.0, 1.0, 0.0]]])  # top-1 2, 0; top-2 {2,1}, {0,1}
    assert top_k_agreement(pred, target, None, 1) == 0.5
    assert top_k_agreement(pred, target, None, 2) == 1.0
    assert top_k_agreement(pred, target, torch.tensor([True, False]), 1) == 0.0
    assert simulated_tau([1, 1, 1]) == 4.0
    assert simulated_tau([0.5, 0.5]) == 1.75
    assert simulated_tau(torch.tensor([0.0, 1.0])) == 1.0
    assert simulated_tau([]) == 1.0


def test_uniform_noise_is_bounded_and_seeded():
    x = torch.zeros(4, 64, 16)
    a = uniform_feature_noise(x, 0.1, torch.Generator().manual_seed(0))
    b = uniform_feature_noise(x, 0.1, torch.Generator().manual_seed(0))
    assert torch.equal(a, b) and a.abs().max() <= 0.1 and a.abs().max() > 0.09
    assert abs(a.mean().item()) < 0.01
    assert uniform_feature_noise(x, 0.0) is x


def test_configs_written_before_the_layer_field_still_load(tiny_target):
    """Drafters exported before ``DrafterConfig.layer`` kept LlamaGen's layer fields at the top level."""
    config = DrafterConfig.for_target(tiny_target)
    legacy = {k: v for k, v in config.to_dict().items() if k != "layer"}
    legacy.update(config.layer)
    assert DrafterConfig.from_dict(legacy) == config


def test_layer_overrides_outside_the_familys_settings_are_refused(tiny_target):
    with pytest.raises(ValueError, match=r"cannot override \['num_attention_heads'\] of a llamagen"):
        DrafterConfig.for_target(tiny_target, layer={"num_attention_heads": 2})
    with pytest.raises(ValueError, match=r"\['n_head'\] are not eagle1 options"):
        DrafterConfig.for_target(tiny_target, n_head=2)  # layer settings go in ``layer``
    with pytest.raises(ValueError, match="missing"):
        DrafterConfig.from_dict({**DrafterConfig.for_target(tiny_target).to_dict(), "layer": {"n_head": 2}})
