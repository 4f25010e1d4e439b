"""Speculative decoding on Chameleon-family targets (issue #15): EAGLE drafters on Anole and Lumina-mGPT.

- Every exact preset gives AR's tokens at T = 0 on the tiny released-layout targets of test_chameleon,
  with a random drafter of the target's own family (a Chameleon decoder layer).
- Every exact preset samples AR's distribution at T = 1 on targets small enough to enumerate every image,
  Lumina-mGPT's forced end-of-row column included.
- Drafts respect the forced tokens: the drafter proposes Lumina-mGPT's end of row exactly where the
  target forces it, and nowhere else.
- ``compile=true`` wraps a Chameleon target's decoder like LlamaGen's GPT.
"""

from __future__ import annotations

import pytest
import test_chameleon
import torch
from conftest import drafter_kind_for, one_per_part, random_drafter
from test_chameleon import CODEBOOK, anole_target, lumina_target
from test_engine import SIGNIFICANCE, chi_square_pvalue, exact_ar_distribution, sample_images
from test_exactness import EXACT_PRESETS, method
from test_graphs import _comparable as comparable

from vdtrain.decode.ar import generate_ar
from vdtrain.decode.builders.dynamic import DynamicTreeBuilder, DynamicTreeConfig
from vdtrain.decode.compiled import DecodeOptions, compile_decoding
from vdtrain.decode.engine import SpeculativeEngine
from vdtrain.decode.graphs import record_fx
from vdtrain.decode.methods import load_preset
from vdtrain.decode.profiling import count_steps
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.models.chameleon import ChameleonConfig, ChameleonLM
from vdtrain.models.chameleon_vqgan import ChameleonVQConfig, ChameleonVQGAN
from vdtrain.targets.chameleon import (
    ChameleonDraftLayer,
    ChameleonLayout,
    ChameleonTarget,
    ChameleonTokenizer,
    Guidance,
)

pytestmark = pytest.mark.usefixtures("one_thread")

CAPTIONS = ["a red circle", "big blue square"]
# AR, a drafter tree and a Jacobi window on Lumina-mGPT (its forced column); a tree on Anole (3 streams).
RECORDED_CASES = [
    ("lumina_mgpt", "ar"),
    ("lumina_mgpt", "eagle2"),
    ("lumina_mgpt", "sjd"),
    ("anole", "eagle2"),
]
anole_files = test_chameleon.anole_files  # the tiny released-layout checkpoints, as fixtures here
lumina_files = test_chameleon.lumina_files


def test_a_chameleon_target_gets_a_chameleon_drafter_layer(lumina_files):
    target = lumina_target(lumina_files[0])
    drafter = random_drafter(target)
    assert isinstance(drafter.layer, ChameleonDraftLayer)
    lm = target.lm.config
    assert drafter.config.layer["num_key_value_heads"] == lm.num_key_value_heads == 2
    assert drafter.config.layer["intermediate_size"] == lm.intermediate_size
    # Its parameters are a Chameleon layer's, under the released names.
    names = {k for k in drafter.state_dict() if k.startswith("layer.")}
    assert {
        "layer.self_attn.q_norm.weight",
        "layer.mlp.gate_proj.weight",
        "layer.input_layernorm.weight",
    } <= names
    # Teacher forcing runs over the target's features.
    cond = target.encode_captions(CAPTIONS)
    tokens = generate_ar(target, cond, SamplingConfig(cfg_scale=3.0, temperature=0.0), [None, None])
    hidden = target.forward_sequence(cond, tokens).hidden
    assert drafter.forward_teacher(hidden, tokens, cond.mask).shape == hidden[:, 1:].shape


# Every exact preset on Lumina-mGPT (its forced end-of-row column is the harder case), each part on Anole.
FAMILY_PRESETS = [("anole", n) for n in one_per_part(EXACT_PRESETS)]
FAMILY_PRESETS += [("lumina_mgpt", n) for n in EXACT_PRESETS]


@pytest.mark.parametrize(("family", "name"), FAMILY_PRESETS)
def test_exact_methods_give_the_ar_tokens_at_t0(name, family, anole_files, lumina_files, tmp_path):
    target = anole_target(anole_files[0]) if family == "anole" else lumina_target(lumina_files[0])
    sampling = SamplingConfig(cfg_scale=3.0, temperature=0.0)
    cond = target.encode_captions(CAPTIONS)
    expected = generate_ar(target, cond, sampling, [None, None])
    drafter = random_drafter(target, kind=drafter_kind_for(load_preset(name)))
    engine = method(name, target, drafter, sampling, tmp_path)
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    assert torch.equal(engine.generate(cond, gens).tokens, expected)


# --- T = 1 on targets whose images can all be enumerated ------------------------------------------------

BOS, BOI, SIZE, NEWLINE, WORDS = 0, 8, 9, 10, (11, 12)
IMAGE_IDS = (5, 4, 6)  # codes 0, 1, 2 at BPE ids out of order, as the released vocabulary has them


def enumerable_target(family: str, seed: int = 2) -> ChameleonTarget:
    """A Chameleon target with a 3-code VQGAN and a 2x2 latent grid: 3^4 Anole images, or Lumina-mGPT's
    2x3 grid with a forced end-of-row column (4^6 sequences, 3^4 of them possible)."""
    config = ChameleonConfig(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(seed)
    lm = ChameleonLM(config)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            p.normal_(std=0.4)
            if name.endswith("norm.weight"):
                p.add_(1.0)
    vq = ChameleonVQGAN(
        ChameleonVQConfig(
            embed_dim=4,
            num_embeddings=3,
            latent_channels=32,
            base_channels=32,
            num_res_blocks=1,
            resolution=32,
        )
    )
    lumina = family == "lumina_mgpt"
    prefix = (BOI, SIZE, SIZE) if lumina else (BOI,)
    layout = ChameleonLayout(
        family,
        (2, 2),
        BOS,
        prefix,
        prefix if lumina else (BOS, BOI),
        NEWLINE if lumina else None,
        "{text}",
        Guidance(() if lumina else (1.2,)),
    )
    return ChameleonTarget(
        lm,
        ChameleonTokenizer(vq, 32, newline_column=lumina),
        layout,
        torch.tensor(IMAGE_IDS),
        None,
        name=f"enumerable-{family}",
        prefix_length=6,
        sampling_defaults=SamplingConfig(cfg_scale=3.0),
    )


@pytest.fixture(scope="module", params=["anole", "lumina_mgpt"])
def enumerable(request):
    target = enumerable_target(request.param)
    cond = target.condition_from_ids([[BOS, *WORDS, *target.layout.image_prefix]])
    sampling = SamplingConfig(cfg_scale=3.0, temperature=1.0)
    exact = exact_ar_distribution(target, cond, sampling)
    return target, cond, sampling, {x: p for x, p in exact.items() if p > 0}


def test_the_enumerable_lumina_target_forces_its_end_of_row_column():
    target = enumerable_target("lumina_mgpt")
    cond = target.condition_from_ids([[BOS, *WORDS, BOI, SIZE, SIZE]])
    exact = exact_ar_distribution(target, cond, SamplingConfig(cfg_scale=3.0, temperature=1.0))
    possible = [x for x, p in exact.items() if p > 0]
    assert len(possible) == 3**4 and abs(sum(exact.values()) - 1.0) < 1e-5
    assert all(x[2] == x[5] == 3 and max(x[:2] + x[3:5]) < 3 for x in possible)


# FAMILY_PRESETS again; the fixture's param is the family.
@pytest.mark.parametrize(("enumerable", "name"), FAMILY_PRESETS, indirect=["enumerable"])
def test_exact_methods_keep_the_ar_distribution_at_t1(enumerable, name, tmp_path):
    target, cond, sampling, exact = enumerable
    drafter = random_drafter(target, std=0.4, kind=drafter_kind_for(load_preset(name)))
    engine = method(name, target, drafter, sampling, tmp_path)
    if name == "ar":
        c = type(cond)(cond.features.expand(2000, -1, -1), cond.mask.expand(2000, -1))
        gens = [torch.Generator().manual_seed(7_000_000 + i) for i in range(2000)]
        samples = [tuple(x) for x in engine.generate(c, gens).tokens.tolist()]
    else:
        samples = sample_images(engine, cond, 2000, seed=31)
    assert set(samples) <= set(exact)  # no impossible image, forced column included
    assert chi_square_pvalue(samples, exact) > SIGNIFICANCE


def test_the_distribution_test_rejects_a_lossy_method(enumerable, tmp_path):
    """Power: LANTERN++ with a loose λ accepts drafts the target would not sample as often."""
    target, cond, sampling, exact = enumerable
    engine = method(
        "lantern_pp",
        target,
        random_drafter(target, std=0.4),
        sampling,
        tmp_path,
        acceptance={"kind": "lantern_pp", "lam": 10.0, "k": 2, "cache_dir": str(tmp_path)},
    )
    samples = sample_images(engine, cond, 2000, seed=31)
    assert chi_square_pvalue(samples, exact) < SIGNIFICANCE


# --- forced tokens in drafts ----------------------------------------------------------------------------


def test_drafts_hold_the_end_of_row_token_exactly_where_the_target_forces_it(lumina_files):
    target = lumina_target(lumina_files[0])
    sampling = SamplingConfig(cfg_scale=3.0, temperature=1.0)
    engine = SpeculativeEngine(
        target,
        random_drafter(target),
        DynamicTreeBuilder(DynamicTreeConfig(top_k=4, depth=4, total_tokens=20)),
        sampling,
    )
    trees = []
    build = engine.builder.build

    def recording(eng, state):
        tree = build(eng, state)
        trees.append((tree, state.committed.clone()))
        return tree

    engine.builder.build = recording
    cond = target.encode_captions(CAPTIONS)
    engine.generate(cond, [torch.Generator().manual_seed(i) for i in range(2)])
    newline, width = CODEBOOK, target.grid[1]
    checked = 0
    for tree, committed in trees:
        index = committed[:, None] - 1 + tree.depths  # image index of each node
        drafted = tree.valid & (tree.depths > 0) & (index < target.num_image_tokens)
        forced = index % width == width - 1
        assert (tree.tokens[drafted & forced] == newline).all()
        assert (tree.tokens[drafted & ~forced] != newline).all()
        checked += int((drafted & forced).sum())
    assert checked > 0


# --- compile ----------------------------------------------------------------------------------------------


def test_compile_wraps_the_chameleon_decoder_and_keeps_the_tokens(lumina_files):
    target = lumina_target(lumina_files[0])
    drafter = random_drafter(target)
    sampling = SamplingConfig(cfg_scale=3.0, temperature=0.0)
    cond = target.encode_captions(CAPTIONS)
    builder = DynamicTreeBuilder(DynamicTreeConfig(top_k=4, depth=3, total_tokens=16))
    eager = SpeculativeEngine(target, drafter, builder, sampling).generate(cond, [None, None]).tokens
    torch._dynamo.reset()
    backend = compile_decoding(target, drafter, backend="eager")  # traced by dynamo; no kernels to build
    assert target.lm.model._vdtrain_compiled and drafter._vdtrain_compiled
    options = DecodeOptions(compile_steps=backend)
    engine = SpeculativeEngine(target, drafter, builder, sampling, options=options)
    compiled = engine.generate(cond, [None, None]).tokens
    assert torch.equal(compiled, eager)


# --- whole steps recorded (CUDA graphs, the GPU default) -------------------------------------------------


@pytest.mark.parametrize(("family", "name"), RECORDED_CASES)
def test_a_recorded_chameleon_step_replays_the_eager_decode(
    family, name, anole_files, lumina_files, tmp_path
):
    """Issue #45's fifth bug: Lumina-mGPT's forced end-of-row row was written from a host scalar, which a
    capture refuses. Recorded on the CPU stand-in (``record_fx`` refuses what a capture refuses), the steps
    record and two decodes replay what eager steps decode, as test_graphs checks on LlamaGen."""
    target = anole_target(anole_files[0]) if family == "anole" else lumina_target(lumina_files[0])
    sampling = SamplingConfig(cfg_scale=3.0, temperature=1.0)
    drafter = random_drafter(target)
    replays = []

    def counted(step, stream):
        result, replay, ran = record_fx(step, stream)
        return result, lambda: replays.append(replay()), ran

    eager = method(name, target, drafter, sampling, tmp_path)
    recorded = method(name, target, drafter, sampling, tmp_path, options=DecodeOptions(step_recorder=counted))
    cond = target.encode_captions(CAPTIONS)
    for seed in (10, 20):
        want = eager.generate(cond, [torch.Generator().manual_seed(seed + i) for i in range(2)])
        got = recorded.generate(cond, [torch.Generator().manual_seed(seed + i) for i in range(2)])
        assert torch.equal(got.tokens, want.tokens), f"{family} {name}: decode {seed}"
        assert comparable(got.stats, name) == comparable(want.stats, name)
    assert len(replays) >= 2, f"{family} {name}: {len(replays)} replays"


# --- step budget --------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["eagle1", "eagle2", "peanut", "sjd", "sjd_pac", "vvs"])
def test_the_step_budget_holds_on_a_chameleon_target(name, lumina_files, tmp_path):
    """Issue #14's budget (tests/test_step_budget.py) with Lumina-mGPT's forced tokens in the loop: at
    most 2 host syncs per step and about as many ATen ops for 4 prompts as for 1."""
    target = lumina_target(lumina_files[0])
    sampling = SamplingConfig(cfg_scale=3.0, temperature=1.0)
    engine = method(name, target, random_drafter(target), sampling, tmp_path)
    ops = {}
    for batch in (1, 4):
        cond = target.encode_captions((CAPTIONS * 2)[:batch])
        gens = [torch.Generator().manual_seed(i) for i in range(batch)]
        counts, _ = count_steps(engine, cond, gens, as_if_gpu=True)
        assert counts.max_syncs <= 2, f"{name} B={batch}: {counts.max_syncs} host syncs in a step"
        ops[batch] = counts.mean_ops
    assert ops[4] <= 1.2 * ops[1], f"{name}: {ops[4]:.0f} ATen ops per step at B=4 vs {ops[1]:.0f} at B=1"


def test_a_chameleon_eagle3_unroll_in_o_k_equals_the_dense_one(lumina_files):
    """UnrollCache through the Chameleon attention (2 KV heads, qk-norm): every unrolled row equals the
    dense (j+1)·S mask's."""
    from reference_unroll import dense_unroll

    from vdtrain.drafters import Drafter, DrafterConfig
    from vdtrain.targets.base import split_taps

    target = lumina_target(lumina_files[0])
    torch.manual_seed(0)
    drafter = Drafter.make(DrafterConfig.for_target(target, kind="eagle3"), target)
    cond = target.encode_captions(CAPTIONS)
    tokens = generate_ar(target, cond, SamplingConfig(temperature=0.0), [None, None])
    with torch.no_grad():
        hidden, tapped = split_taps(
            target.sequence_features(cond, tokens, drafter.taps).float(),
            target.hidden_size,
            len(drafter.taps),
        )
        feats = drafter.input_features(hidden, tapped)
        fast, dense = (
            drafter.unroll(feats, tokens, cond.mask, 3),
            dense_unroll(drafter, feats, tokens, cond.mask, 3),
        )
    for a, b in zip(fast, dense, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
