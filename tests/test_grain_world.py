"""The grain world: its rendering, how its tokenizer and target grow from the shapes world's, the
regime of the shipped target, and exact decoding on a small grown (redundant-codebook) target."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import TINY_GPT, TINY_VQ, random_drafter, random_gpt, random_vq
from test_engine import (
    MICRO_GPT,
    MICRO_VQ,
    SIGNIFICANCE,
    chi_square_pvalue,
    exact_ar_distribution,
    micro_problem,
    sample_images,
)

from vdtrain.decode.ar import generate_ar
from vdtrain.decode.methods import build_method, load_preset
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.drafters.base import Drafter
from vdtrain.eval.regime import token_confidence
from vdtrain.prompts import shapes_heldout_captions
from vdtrain.shapes.build import save_llamagen_checkpoint
from vdtrain.shapes.grow import code_parents, grow_target, split_codebook
from vdtrain.shapes.scene import HELDOUT_SEED, RENDERINGS, SHADING_SMOOTHING, Rendering, generate
from vdtrain.targets.base import Condition
from vdtrain.targets.llamagen import LlamaGenTarget, VQTokenizer
from vdtrain.targets.shapes import REPO_ROOT, load_target_folder

pytestmark = pytest.mark.usefixtures("one_thread")


# --- rendering ----------------------------------------------------------------------------------------


def test_the_shapes_world_renders_as_it_always_did():
    images = np.stack([s.image for s in generate(64, HELDOUT_SEED)])
    assert hashlib.sha256(images.tobytes()).hexdigest()[:16] == "8a969b903e9caaed"  # pixels before grain


def _unclipped(differences: np.ndarray) -> np.ndarray:
    return differences[np.abs(differences) < 80]


def test_the_grain_world_draws_the_same_scenes_with_content_the_caption_leaves_open():
    shapes, grain = generate(32, HELDOUT_SEED), generate(32, HELDOUT_SEED, world="grain")
    assert [s.caption for s in shapes] == [s.caption for s in grain]
    assert [s.scene for s in shapes] == [s.scene for s in grain]
    diff = np.stack([g.image for g in grain]).astype(float) - np.stack([s.image for s in shapes])
    rendering = RENDERINGS["grain"]
    # Inside a 2x2 texture block neighbours differ by grain alone (std grain·√2); across blocks inside
    # a token's 4x4 patch the texture adds its own; across patches the shading adds what neighbouring
    # patches do not share (correlation exp(-1/(4 s²)) for a blur of s patches). Clipping at black and
    # white takes some of each away.
    inside = diff[:, :, 0::2] - diff[:, :, 1::2]
    across_blocks = diff[:, :, 1::4] - diff[:, :, 2::4]
    across_patches = diff[:, :, 3:-1:4] - diff[:, :, 4::4]
    assert abs(_unclipped(inside).std() / np.sqrt(2) - rendering.grain) < 1.5
    expected_blocks = np.sqrt(2 * (rendering.grain**2 + rendering.texture**2))
    assert abs(_unclipped(across_blocks).std() - expected_blocks) < 0.25 * expected_blocks
    shared = np.exp(-1 / (4 * SHADING_SMOOTHING**2))
    expected_patches = np.sqrt(expected_blocks**2 + 2 * rendering.shading**2 * (1 - shared))
    assert abs(_unclipped(across_patches).std() - expected_patches) < 0.25 * expected_patches
    assert np.array_equal(generate(4, HELDOUT_SEED, world="grain")[3].image, grain[3].image)
    with pytest.raises(ValueError, match="unknown world"):
        generate(1, HELDOUT_SEED, world="fog")
    with pytest.raises(ValueError, match="shading"):
        Rendering(shading=-1.0)


def test_a_checkpoint_stored_as_bf16_loads_as_the_rounded_weights(tmp_path):
    gpt = random_gpt()
    save_llamagen_checkpoint(gpt, tmp_path / "gpt.pt", torch.bfloat16)
    stored = torch.load(tmp_path / "gpt.pt", weights_only=True)["model"]
    for name, value in gpt.state_dict().items():
        assert stored[name].dtype == (torch.bfloat16 if value.is_floating_point() else value.dtype)
        assert torch.equal(stored[name], value.to(stored[name].dtype))


# --- growing from a parent world ---------------------------------------------------------------------


def test_split_codebook_copies_each_code():
    parent = random_vq(replace(TINY_VQ, codebook_size=6))
    child = split_codebook(parent, 3, noise=0.0)
    assert child.config.codebook_size == 18
    book = child.quantize.embedding.weight
    assert torch.equal(book[7], parent.quantize.embedding.weight[1])  # code j·K + c copies code c
    tokens = torch.arange(2, 18).reshape(1, 4, 4)
    assert torch.allclose(child.decode(tokens), parent.decode(tokens % 6), atol=1e-6)


def test_code_parents_find_the_code_each_copy_was_split_from():
    parent = random_vq(replace(TINY_VQ, codebook_size=8, ch_mult=(1, 2, 2)))
    child = split_codebook(parent, 2, noise=0.01)
    parents = code_parents(parent, "shapes", child, "shapes", n_images=64)
    assert (parents == torch.arange(16) % 8).float().mean() >= 0.9


def test_a_grown_target_computes_its_parents_distribution():
    parent_cfg = replace(TINY_GPT, vocab_size=6)
    parent = random_gpt(parent_cfg, std=0.2)
    grown = grow_target(parent, replace(parent_cfg, n_layer=4, vocab_size=12), torch.arange(12) % 6)
    tokens = torch.randint(12, (2, TINY_GPT.block_size))
    cond = torch.randn(2, TINY_GPT.cls_token_num, TINY_GPT.caption_dim)
    mask = torch.ones(2, TINY_GPT.cls_token_num, dtype=torch.bool)
    p_parent = _sequence_probs(parent, tokens % 6, cond, mask)
    p_grown = _sequence_probs(grown, tokens, cond, mask)
    # Each parent code's probability is shared equally by its two copies.
    assert torch.allclose(p_grown.reshape(*p_grown.shape[:-1], 2, 6).sum(-2), p_parent, atol=1e-5)
    assert torch.allclose(p_grown[..., :6], p_grown[..., 6:], atol=1e-6)
    with pytest.raises(ValueError, match="multiple"):
        grow_target(parent, replace(parent_cfg, n_layer=3, vocab_size=12), torch.arange(12) % 6)


def _sequence_probs(gpt, tokens, cond, mask) -> torch.Tensor:
    vq = random_vq(replace(TINY_VQ, codebook_size=gpt.config.vocab_size))
    target = LlamaGenTarget(gpt, VQTokenizer(vq, image_size=8), None, "tiny", SamplingConfig())
    return target.forward_sequence(Condition(cond, mask), tokens).logits.softmax(-1)


# --- exact decoding in the grain regime --------------------------------------------------------------


def grain_micro() -> tuple[LlamaGenTarget, Condition]:
    """The enumerable micro problem grown as the grain world grows: every code split in two, twice the
    layers, then nudged so the copies differ. The target's top token rarely reaches 0.5."""
    parent, cond = micro_problem()
    config = replace(MICRO_GPT, n_layer=2 * MICRO_GPT.n_layer, vocab_size=2 * MICRO_GPT.vocab_size)
    gpt = grow_target(parent.gpt, config, torch.arange(config.vocab_size) % MICRO_GPT.vocab_size)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in gpt.parameters():
            p.add_(0.1 * p.abs().mean() * torch.randn(p.shape, generator=gen))
    vq = split_codebook(random_vq(MICRO_VQ), 2)
    return LlamaGenTarget(gpt, VQTokenizer(vq, image_size=4), None, "grain-micro", SamplingConfig()), cond


SAMPLED = SamplingConfig(cfg_scale=2.0, temperature=1.0)


@pytest.fixture(scope="module")
def grain():
    target, cond = grain_micro()
    return target, random_drafter(target, seed=4, std=0.5), cond, exact_ar_distribution(target, cond, SAMPLED)


def marginal(exact: dict[tuple[int, ...], float], positions: tuple[int, ...]) -> dict[tuple[int, ...], float]:
    out: dict[tuple[int, ...], float] = {}
    for image, p in exact.items():
        key = tuple(image[i] for i in positions)
        out[key] = out.get(key, 0.0) + p
    return out


PAIRS = ((0, 1), (2, 3))  # the joint over 8^4 images is too flat to test: no image is expected 5 times


def test_the_grain_micro_target_is_unsure(grain):
    target, _, _, exact = grain
    assert target.vocab_size == 8
    assert max(exact.values()) < 0.002  # no image is likely
    for pair in PAIRS:
        assert max(marginal(exact, pair).values()) < 0.1


@pytest.mark.parametrize("name", ["eagle2", "sjd"])
def test_exact_presets_keep_ar_in_the_grain_regime(grain, name, tmp_path):
    target, drafter, cond, exact = grain
    engine = build_method(
        load_preset(name, {"acceptance": {"cache_dir": str(tmp_path)}}), target, drafter, SAMPLED
    )
    samples = sample_images(engine, cond, 2000, seed=31)
    for pair in PAIRS:
        drawn = [tuple(x[i] for i in pair) for x in samples]
        assert chi_square_pvalue(drawn, marginal(exact, pair)) > SIGNIFICANCE / len(PAIRS)
    greedy = SamplingConfig(cfg_scale=2.0, temperature=0.0)
    many = Condition(torch.randn(6, 2, MICRO_GPT.caption_dim), torch.ones(6, 2, dtype=torch.bool))
    gens = [torch.Generator().manual_seed(i) for i in range(6)]
    ar = generate_ar(target, many, greedy, gens)
    engine = build_method(
        load_preset(name, {"acceptance": {"cache_dir": str(tmp_path)}}), target, drafter, greedy
    )
    assert torch.equal(engine.generate(many, gens).tokens, ar)


def test_a_targets_own_knobs_set_its_presets():
    from vdtrain.eval.runner import method_configs
    from vdtrain.targets.registry import parse_target_config

    overrides = {"lantern": {"acceptance": {"delta": 0.3}}, "eagle2": {"tree": {"total_tokens": 30}}}
    shared, _, _ = parse_target_config({"kind": "folder", "decode": overrides})
    lantern, eagle2, sjd = method_configs(["lantern", "eagle2", "sjd"], shared.decode)
    assert lantern.acceptance.delta == 0.3 and lantern.acceptance.k == load_preset("lantern").acceptance.k
    assert eagle2.tree.total_tokens == 30
    assert sjd == load_preset("sjd")


# --- the shipped grain target and drafter ---------------------------------------------------------------

GRAIN = REPO_ROOT / "checkpoints" / "grain"


@pytest.fixture(scope="module")
def shipped_grain():
    with torch.no_grad():
        yield load_target_folder(GRAIN / "target")


def test_the_shipped_grain_target_is_as_unsure_as_a_real_visual_ar_model(shipped_grain):
    """The issue's regime on 8 held-out captions (docs/grain_world.md): median top-1 after CFG 0.26
    (goal <= 0.3), 26 % of tokens below 0.2 (goal 30 %) and 43 % in the conditional stream, against the
    shapes target's 1.0."""
    regime = token_confidence(shipped_grain, shapes_heldout_captions(8), seed=5000)
    assert shipped_grain.world == "grain" and shipped_grain.identity.num_layers >= 8
    conditional, guided = regime["conditional"], regime["after_cfg"]
    assert guided["top1_median"] < 0.3 and guided["share_top1_below_0.2"] >= 0.2
    assert conditional["top1_median"] < 0.25 and conditional["share_top1_below_0.2"] >= 0.35
    assert conditional["mean_entropy_nats"] > 2.5


@pytest.mark.parametrize(
    ("folder", "kind", "min_tau"), [("drafter", "eagle1", 1.3), ("drafter_eagle3", "eagle3", 1.2)]
)
def test_the_shipped_grain_drafters_decode_ars_tokens(shipped_grain, folder, kind, min_tau):
    target = shipped_grain
    drafter = Drafter.from_pretrained(GRAIN / folder, target)
    assert drafter.config.kind == kind
    greedy = SamplingConfig(cfg_scale=3.0, temperature=0.0)
    cond = target.encode_captions(shapes_heldout_captions(2))
    with torch.no_grad():
        ar = generate_ar(target, cond, greedy, [None] * 2)
        engine = build_method(load_preset("eagle2"), target, drafter, greedy)
        result = engine.generate(cond, [None] * 2)
    assert torch.equal(result.tokens, ar)
    assert sum(s.tau for s in result.stats) / 2 > min_tau  # the trained drafter really drafts


def test_knobs_are_chosen_on_validation_captions_not_held_out_ones():
    from vdtrain.prompts import prompts_for_run

    # the 96 of the second LANTERN sweep against the 512 of the GPU calibration (docs/grain_world.md)
    validation = prompts_for_run("shapes_validation", 96)
    assert len(set(validation)) == 96 and not set(validation) & set(shapes_heldout_captions(512))
