"""EAGLE-3 drafters: tapped target layers, the fused input, and training-time test that sees only what a tree
step sees."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import safetensors.torch
import torch
from conftest import TINY_GPT, random_gpt, random_vq, tiny_condition
from reference_unroll import dense_unroll, tree_step_mask

from vdtrain.decode.sampling import SamplingConfig
from vdtrain.drafters import Drafter, DrafterConfig
from vdtrain.drafters.losses import unrolled_loss
from vdtrain.drafters.rows import chain_rows, teacher_mask
from vdtrain.drafters.unroll_cache import UnrollCache
from vdtrain.eval.logit_lens import logit_lens
from vdtrain.hub import export_drafter, push_to_hub
from vdtrain.targets import load_target_folder
from vdtrain.targets.base import split_taps
from vdtrain.targets.llamagen import LlamaGenTarget, VQTokenizer

DEEP_GPT = replace(TINY_GPT, n_layer=6)


def deep_target() -> LlamaGenTarget:
    return LlamaGenTarget(
        random_gpt(DEEP_GPT), VQTokenizer(random_vq(), image_size=8), None, "tiny", SamplingConfig()
    )


def eagle3(target, seed: int = 0, **kw) -> Drafter:
    torch.manual_seed(seed)
    drafter = Drafter.make(DrafterConfig.for_target(target, kind="eagle3", **kw), target)
    with torch.no_grad():  # a drafter whose every part matters: no zero-initialised weights
        for p in drafter.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return drafter


def sequence(target, batch: int = 2, seed: int = 3):
    cond = tiny_condition(batch)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, target.vocab_size, (batch, target.num_image_tokens), generator=g)
    return cond, tokens


# --- tapped layers ---------------------------------------------------------------------------------


def reference_states(target, cond, tokens) -> list[torch.Tensor]:
    """Hugging Face's ``hidden_states``: the residual stream before layer 0 and after each layer, the last
    one normalised."""
    gpt = target.gpt
    x = torch.cat([target.prefix_inputs(cond), target.token_embedding(tokens)], dim=1)
    seq = x.shape[1]
    positions = torch.arange(seq)
    from vdtrain.models.kv_cache import LayerInputs
    from vdtrain.targets.base import prefix_causal_mask

    mask = prefix_causal_mask(cond.mask, seq)
    h = x + gpt.pos_embedding[positions] if gpt.config.learned_pos_embedding else x
    rope = gpt.rope[positions.expand(len(cond), -1)]
    states = [h]
    for layer in gpt.layers:
        h = layer(h, LayerInputs(rope, mask))
        states.append(h)
    states[-1] = gpt.norm(h)  # the last entry is after the final norm
    return states


def test_taps_are_the_residual_stream_after_each_layer():
    target = deep_target()
    cond, tokens = sequence(target)
    with torch.no_grad():
        states = reference_states(target, cond, tokens)
        plain = target.sequence_features(cond, tokens)
        hidden, tapped = split_taps(target.sequence_features(cond, tokens, taps=(0, 3, 6)), 32, 3)
    torch.testing.assert_close(hidden, plain)
    for i, k in enumerate((0, 3, 6)):
        torch.testing.assert_close(tapped[..., 32 * i : 32 * (i + 1)], states[k])
    assert target.default_feature_layers() == (2, 3, 6)  # under 8 layers: the final state on top
    with pytest.raises(ValueError, match=r"outside 0 \.\. 6"):
        target.sequence_features(cond, tokens, taps=(7,))


def test_cached_forwards_carry_the_same_taps():
    """prefill + forward_tokens (what decoding runs) tap what the teacher-forced pass taps."""
    target = deep_target()
    cond, tokens = sequence(target, batch=1)
    taps = target.default_feature_layers()
    with torch.no_grad():
        _, full = split_taps(target.sequence_features(cond, tokens, taps), 32, len(taps))
        cache = target.new_cache(1)
        pre = target.prefill(cond, cache, taps)
        n = target.num_image_tokens
        index = torch.arange(n)[None]
        out = target.forward_tokens(
            cond, tokens, index, cache, target.image_slot(index), target.causal_visibility(0, n, "cpu"), taps
        )
    assert pre.taps.shape == (1, target.prefix_length, 3 * 32)
    torch.testing.assert_close(torch.cat([pre.taps, out.taps], 1), full, atol=1e-5, rtol=1e-5)


# --- training-time test ----------------------------------------------------------------------------


def test_unrolled_step_zero_is_teacher_forcing():
    target = deep_target()
    drafter = eagle3(target)
    cond, tokens = sequence(target)
    with torch.no_grad():
        hidden, tapped = split_taps(
            target.sequence_features(cond, tokens, drafter.taps), 32, len(drafter.taps)
        )
        feats = drafter.input_features(hidden, tapped)
        first = drafter.unroll(feats, tokens, cond.mask, 1)[0]
        teacher = drafter.forward_teacher(feats, tokens, cond.mask)
    torch.testing.assert_close(first, teacher, atol=1e-5, rtol=1e-5)


def chain_as_decoding_runs_it(
    drafter, feats, tokens, cond_mask, start: int, depth: int
) -> list[torch.Tensor]:
    """A depth-``depth`` draft chain from row ``start`` the way the engine drafts it: the drafter's cache
    holds rows ``0 .. start`` (target features), each deeper node is one cached row that sees those and its
    own ancestors. Returns f̂ of depths 1 .. depth."""
    prefix = drafter.config.prefix_length
    cache = drafter.new_cache(feats.shape[0], feats.shape[1] + depth)
    seq = feats.shape[1] - 1
    embeds = torch.cat(
        [feats.new_zeros(feats.shape[0], prefix - 1, feats.shape[-1]), drafter.embed(tokens)], 1
    )
    rows = torch.arange(start + 1)
    mask = teacher_mask(cond_mask, seq)[:, :, : start + 1, : start + 1]
    out = drafter(feats[:, : start + 1], embeds[:, : start + 1], rows, mask, cache, rows)
    f_hat, chain = out[:, -1:], [out[:, -1]]
    scratch = seq + 1  # node rows live after the sequence's slots, as draft nodes do
    for d in range(1, depth):
        row = start + d  # the node's feature slot: its RoPE position
        visible = torch.zeros(feats.shape[0], 1, 1, scratch + d, dtype=torch.bool)
        visible[..., : start + 1] = teacher_mask(cond_mask, seq)[:, :, start, : start + 1][:, :, None]
        visible[..., scratch : scratch + d] = True  # the chain's earlier nodes and itself
        out = drafter(
            f_hat,
            embeds[:, row : row + 1],
            torch.tensor([row]),
            visible,
            cache,
            torch.tensor([scratch + d - 1]),
        )
        f_hat = out
        chain.append(out[:, 0])
    return chain


@pytest.mark.parametrize("kind", ["eagle1", "eagle3", "eagle3-tap-norm"])
def test_unrolled_steps_see_exactly_what_a_draft_chain_sees(kind):
    """Row s of unrolled step j equals the depth-(j+1) node of a chain drafted from row s-j with the
    decoding cache: a leak of any later row (target features or tokens) into the unroll breaks this."""
    target = deep_target()
    if kind == "eagle1":
        drafter = Drafter.make(DrafterConfig.for_target(target), target)
    else:
        drafter = eagle3(target, tap_norm=kind == "eagle3-tap-norm")
    cond, tokens = sequence(target)
    prefix = target.prefix_length
    with torch.no_grad():
        hidden, tapped = split_taps(
            target.sequence_features(cond, tokens, drafter.taps), 32, len(drafter.taps)
        )
        feats = drafter.input_features(hidden, tapped)
        steps = drafter.unroll(feats, tokens, cond.mask, 4)
        for start in (prefix - 1, prefix + 3, prefix + 9):
            chain = chain_as_decoding_runs_it(drafter, feats, tokens, cond.mask, start, 4)
            for j, node in enumerate(chain):
                torch.testing.assert_close(steps[j][:, start + j], node, atol=1e-5, rtol=1e-5)


def test_unrolled_rows_do_not_read_the_future():
    """Changing target features after a chain's start, or tokens after its node, leaves the unrolled row."""
    target = deep_target()
    drafter = eagle3(target)
    cond, tokens = sequence(target, batch=1)
    prefix = target.prefix_length
    with torch.no_grad():
        hidden, tapped = split_taps(
            target.sequence_features(cond, tokens, drafter.taps), 32, len(drafter.taps)
        )
        feats = drafter.input_features(hidden, tapped)
        base = drafter.unroll(feats, tokens, cond.mask, 3)
        start, j = prefix + 4, 2
        row = start + j
        bent = feats.clone()
        bent[:, start + 1 :] += 5.0  # target features the chain never reads
        later = tokens.clone()
        later[:, row - prefix + 2 :] = (
            later[:, row - prefix + 2 :] + 1
        ) % target.vocab_size  # row r embeds token r-L+1
        for f, t in ((bent, tokens), (feats, later)):
            moved = drafter.unroll(f, t, cond.mask, 3)
            torch.testing.assert_close(moved[j][:, row], base[j][:, row])
        # ... while the chain's own start feature does matter (the test can fail)
        start_bent = feats.clone()
        start_bent[:, start] += 5.0
        assert not torch.allclose(
            drafter.unroll(start_bent, tokens, cond.mask, 3)[j][:, row], base[j][:, row]
        )


def test_the_o_k_unroll_equals_the_dense_one_rows_loss_and_gradients():
    """UnrollCache (teacher keys + one ancestor diagonal per step) computes what the dense (j+1)·S mask
    computes, with a left-padded caption: every row of every step, the loss and the drafter's gradients."""
    target = deep_target()
    drafter = eagle3(target)
    cond, tokens = sequence(target)
    hidden, tapped = split_taps(
        target.sequence_features(cond, tokens, drafter.taps).detach(), 32, len(drafter.taps)
    )
    results = []
    for unroll in (drafter.unroll, lambda *a: dense_unroll(drafter, *a)):
        drafter.zero_grad()
        steps = unroll(drafter.input_features(hidden, tapped), tokens, cond.mask, 4)
        loss, _ = unrolled_loss(steps, hidden[:, 1:], drafter.normed, drafter.head, cond.mask.shape[1])
        loss.backward()
        results.append((steps, loss, {n: p.grad.clone() for n, p in drafter.named_parameters()}))
    (fast, fast_loss, fast_grads), (dense, dense_loss, dense_grads) = results
    for a, b in zip(fast, dense, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast_loss, dense_loss)
    for name, grad in fast_grads.items():
        torch.testing.assert_close(grad, dense_grads[name], atol=1e-5, rtol=1e-4)


def test_unroll_cache_attention_equals_dense_sdpa_with_grouped_heads():
    """The attention alone, on random queries/keys with 2 KV heads shared by 4 query heads (repeated as
    the layers repeat them) and a padded teacher mask: step j equals SDPA over all steps' keys."""
    g = torch.Generator().manual_seed(0)
    cond_mask = torch.tensor([[False, True, True], [True, True, True]])
    seq, steps = 7, 4
    teacher = teacher_mask(cond_mask, seq)
    cache, keys, values = UnrollCache(), [], []
    for j in range(steps):
        q = torch.randn(2, 4, seq, 8, generator=g)
        k, v = (torch.randn(2, 2, seq, 8, generator=g).repeat_interleave(2, dim=1) for _ in range(2))
        keys.append(k)
        values.append(v)
        dense = torch.nn.functional.scaled_dot_product_attention(
            q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=tree_step_mask(cond_mask, seq, j)
        )
        torch.testing.assert_close(cache.attend(q, k, v, teacher), dense, atol=1e-6, rtol=1e-5)


def test_tree_step_mask_blocks():
    mask = tree_step_mask(torch.ones(1, 2, dtype=torch.bool), 5, 2)[0, 0]
    assert mask.shape == (5, 15)
    # row 4 at step 2: step-0 rows 0..2, step-1 row 3, step-2 row 4
    assert mask[4].nonzero().flatten().tolist() == [0, 1, 2, 5 + 3, 10 + 4]
    assert chain_rows(2, 5, 2).tolist() == [False, False, False, True, True]


# --- saving, loading, refusing ---------------------------------------------------------------------


def test_eagle3_export_reloads_exactly_and_records_its_layers(tmp_path):
    target = deep_target()
    drafter = eagle3(target).eval()
    folder = export_drafter(drafter, tmp_path / "export", target=target, metadata={})
    config = json.loads((folder / "config.json").read_text())
    assert config["kind"] == "eagle3"
    assert config["options"] == {"feature_layers": [2, 3, 6], "input_norm": True, "tap_norm": False}
    assert config["target"]["num_layers"] == 6
    assert "EAGLE-3 drafter" in (folder / "README.md").read_text()
    loaded = Drafter.from_pretrained(folder, target)
    assert loaded.config == drafter.config
    state = drafter.state_dict()
    assert {"fuse.weight", "norm.weight", "embed_norm.weight", "feature_norm.weight"} <= set(state)
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in state.items())
    cond, tokens = sequence(target)
    with torch.no_grad():
        hidden, tapped = split_taps(
            target.sequence_features(cond, tokens, drafter.taps), 32, len(drafter.taps)
        )
        a = drafter.unroll(drafter.input_features(hidden, tapped), tokens, cond.mask, 2)
        b = loaded.unroll(loaded.input_features(hidden, tapped), tokens, cond.mask, 2)
    assert all(
        torch.equal(x, y) and torch.equal(drafter.logits(x), loaded.logits(y))
        for x, y in zip(a, b, strict=True)
    )
    plan = push_to_hub(folder, "someone/eagle3-drafter", dry_run=True)
    assert plan.dry_run and "model.safetensors" in [name for name, _ in plan.files]


def test_a_target_with_other_layers_is_refused(tmp_path):
    target = deep_target()
    folder = eagle3(target).save_pretrained(tmp_path / "drafter")
    shallow = LlamaGenTarget(
        random_gpt(replace(DEEP_GPT, n_layer=4)),
        VQTokenizer(random_vq(), image_size=8),
        None,
        "tiny",
        SamplingConfig(),
    )
    with pytest.raises(ValueError, match="num_layers: 6 != 4"):
        Drafter.from_pretrained(folder, shallow)


def test_feature_layers_past_the_target_are_refused():
    target = deep_target()
    with pytest.raises(ValueError, match=r"outside 0 \.\. 6"):
        DrafterConfig.for_target(target, kind="eagle3", feature_layers=(2, 7))
    with pytest.raises(ValueError, match=r"\['feature_layers'\] are not eagle1 options"):
        DrafterConfig.for_target(target, kind="eagle1", feature_layers=(2,))
    eagle1 = DrafterConfig.for_target(target).to_dict()
    with pytest.raises(ValueError, match=r"\['feature_layers'\] are not eagle1 options"):
        DrafterConfig.from_dict({**eagle1, "feature_layers": [2]})  # the layout before options
    assert DrafterConfig.from_dict({**eagle1, "feature_layers": [], "input_norm": False}).kind == "eagle1"
    with pytest.raises(ValueError, match="kind must be one of"):
        DrafterConfig.for_target(target, kind="eagle2")


def test_an_eagle1_config_written_before_kinds_still_loads():
    target = deep_target()
    config = DrafterConfig.for_target(target).to_dict()
    config.pop("kind")
    assert "feature_layers" not in config  # eagle3's key: an eagle1 config does not write it
    config["target"].pop("num_layers")
    assert DrafterConfig.from_dict(config).kind == "eagle1"
    Drafter.make(DrafterConfig.from_dict(config)).attach(target)


def test_the_input_norms_make_the_drafter_blind_to_the_scale_of_its_inputs():
    """EAGLE-3 normalises the embedding and the features before fc, EAGLE-3.1 also each tap: scaling
    a tapped layer, or the features, by any factor then changes no drafter row."""
    target = deep_target()
    drafter = eagle3(target, tap_norm=True)
    cond, tokens = sequence(target)
    with torch.no_grad():
        hidden, tapped = split_taps(
            target.sequence_features(cond, tokens, drafter.taps), 32, len(drafter.taps)
        )
        scaled = tapped.clone()
        scaled[..., 32:64] *= 7.0  # the second tap only
        fused = drafter.input_features(hidden, tapped)
        torch.testing.assert_close(drafter.input_features(hidden, scaled), fused)
        rows = drafter.forward_teacher(fused, tokens, cond.mask)
        torch.testing.assert_close(drafter.forward_teacher(10.0 * fused, tokens, cond.mask), rows)


def test_a_drafter_config_written_before_the_norms_reloads_unchanged(tmp_path):
    """An eagle3 export whose config predates input_norm and tap_norm (the first shipped shapes eagle3
    drafter was one), and kept its options at the top level as every config before the kinds' own
    options did, builds the architecture it was trained as: no norms, the same weights,
    rows = layer(fc([e; f]))."""
    target = deep_target()
    trained = eagle3(target, input_norm=False, tap_norm=False)
    folder = trained.save_pretrained(tmp_path / "old")
    config = json.loads((folder / "config.json").read_text())
    config["feature_layers"] = config.pop("options")["feature_layers"]
    (folder / "config.json").write_text(json.dumps(config))
    drafter = Drafter.from_pretrained(folder)
    assert (drafter.options.input_norm, drafter.options.tap_norm) == (False, False)
    assert drafter.options.feature_layers == trained.options.feature_layers
    assert set(drafter.state_dict()) == set(safetensors.torch.load_file(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    h = target.hidden_size
    feats, embeds = torch.randn(2, 5, h, generator=g), torch.randn(2, 5, h, generator=g)
    positions = torch.arange(5)
    with torch.no_grad():
        old = drafter.layer(drafter.fc(torch.cat([embeds, feats], -1)), positions.expand(2, -1), None)
        torch.testing.assert_close(drafter(feats, embeds, positions, None), old)
        torch.testing.assert_close(trained(feats, embeds, positions, None), old)


def test_the_logit_lens_reads_every_layer_and_ends_at_the_target_itself(tiny_folder):
    """What the default taps are chosen by (benchmarks.logit_lens): one agreement per hidden_states[k],
    k = 0 .. n; the final state is the target's own decision."""
    target = load_target_folder(tiny_folder)
    lens = logit_lens(target, ["a red circle", "a blue square"], seed=0, batch_size=2)
    assert len(lens) == target.num_layers + 1 and lens[-1] == 1.0
    assert all(0.0 <= a <= 1.0 for a in lens)
