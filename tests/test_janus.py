"""Janus-Pro target on a tiny checkpoint saved by transformers' ``JanusForConditionalGeneration``.

The reference is transformers on the same weights: its language model fed the prompt embeddings and
``prepare_embeddings_for_image_generation`` of the image tokens, its ``generation_head``, its
``generate(generation_mode="image")`` (CFG batch of two, null stream = the prompt with every token but bos
and the image start token replaced by pad) and its VQ decoder. Nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers
from conftest import assert_cached_passes_match_the_sequence_pass, random_drafter
from fit_step import bf16_fit_step

from vdtrain.checkpoint_io import CheckpointError
from vdtrain.config import TargetConfig
from vdtrain.decode.ar import generate_ar
from vdtrain.decode.sampling import SamplingConfig, combine_cfg
from vdtrain.targets import load_target
from vdtrain.targets.base import split_taps
from vdtrain.targets.janus import BOI, BOS, PAD, JanusDraftLayer, JanusTarget

pytestmark = pytest.mark.usefixtures("one_thread")

CODEBOOK = 64
IMAGE_SIZE = 16  # 4x4 tokens: patch 4 for the (unused) SigLIP side, 4x downsampling in the VQ
SPECIAL = [BOS, "<｜end▁of▁sentence｜>", PAD, "<unk>", "<image_placeholder>", BOI, "<end_of_image>"]
CHAT = ["<|User|>", "<|Assistant|>"]
WORDS = [":", "a", "red", "blue", "circle", "square", "big", "on", "the", "left"]
VOCAB = {name: i for i, name in enumerate(SPECIAL + CHAT + WORDS)}
CAPTIONS = ["a red circle", "big blue square on the left"]
CFG = 5.0


def tiny_config() -> transformers.JanusConfig:
    text = {
        "vocab_size": 48,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "bos_token_id": VOCAB[BOS],
        "eos_token_id": 1,
        "pad_token_id": VOCAB[PAD],
    }
    vision = {
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": IMAGE_SIZE,
        "patch_size": 4,
        "projection_dim": 64,
        "num_image_tokens": 16,
    }
    vq = {
        "embed_dim": 8,
        "num_embeddings": CODEBOOK,
        "base_channels": 32,
        "channel_multiplier": [1, 2, 2],
        "num_res_blocks": 1,
        "latent_channels": 32,
        "projection_dim": 64,
        "image_token_embed_dim": 64,
    }
    return transformers.JanusConfig(
        text_config=text, vision_config=vision, vq_config=vq, image_token_id=VOCAB["<image_placeholder>"]
    )


def write_text_tokenizer(path: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_tokens([AddedToken(name) for name in CHAT])
    tok.add_special_tokens([AddedToken(name, special=True) for name in SPECIAL])
    tok.save(str(path))


@pytest.fixture(scope="module")
def janus_files(tmp_path_factory):
    """transformers' layout (``save_pretrained``), random weights scaled so logits differ clearly."""
    torch.manual_seed(0)
    hf = transformers.JanusForConditionalGeneration(tiny_config()).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "vqmodel" in name or "vision_model" in name:
                continue
            p.normal_(std=0.15)
            if name.endswith("norm.weight"):
                p.add_(1.0)
    folder = tmp_path_factory.mktemp("janus_pro")
    hf.save_pretrained(folder)
    write_text_tokenizer(folder / "tokenizer.json")
    return folder, hf


def janus_target(folder: Path, **extra) -> JanusTarget:
    config = {"kind": "janus", "name": "tiny-janus", "model_dir": str(folder), "prefix_length": 16, **extra}
    return load_target(config)


def hf_hidden(hf, ids: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' final-norm hidden states of prompt ``ids`` then image ``tokens`` (one row)."""
    with torch.no_grad():
        x = hf.get_input_embeddings()(torch.tensor([ids]))
        if tokens:
            x = torch.cat([x, hf.prepare_embeddings_for_image_generation(torch.tensor([tokens]))], dim=1)
        return hf.model.language_model(inputs_embeds=x).last_hidden_state[0]


def hf_null_ids(ids: list[int]) -> list[int]:
    """transformers' unconditional prompt: every token but bos and boi becomes pad."""
    return [t if t in (VOCAB[BOS], VOCAB[BOI]) else VOCAB[PAD] for t in ids]


# --- layout and logits ---------------------------------------------------------------------------------


def test_loads_the_released_layout_and_matches_transformers_logits(janus_files):
    folder, hf = janus_files
    keys = set(json.loads((folder / "config.json").read_text()))
    assert {"text_config", "vq_config", "vision_config"} <= keys
    target = janus_target(folder)
    ident = target.identity
    assert (ident.family, ident.vocab_size, ident.grid) == ("janus_pro", CODEBOOK, (4, 4))
    assert ident.hidden_size == 64
    assert target.prompt_ids("a red circle") == [
        VOCAB[BOS],
        VOCAB["<|User|>"],
        VOCAB[":"],
        VOCAB["a"],
        VOCAB["red"],
        VOCAB["circle"],
        VOCAB["<|Assistant|>"],
        VOCAB[":"],
        VOCAB[BOI],
    ]
    cond = target.encode_captions(CAPTIONS)
    tokens = torch.randint(0, CODEBOOK, (2, 16), generator=torch.Generator().manual_seed(1))
    out = target.forward_sequence(cond, tokens)
    null_out = target.forward_sequence(target.null_condition(cond), tokens)
    length = target.prefix_length
    for row, caption in enumerate(CAPTIONS):
        ids = target.prompt_ids(caption)
        start = length - len(ids)
        for stream, prompt in ((out, ids), (null_out, hf_null_ids(ids))):
            hidden = hf_hidden(hf, prompt, tokens[row].tolist())
            with torch.no_grad():
                logits = hf.model.generation_head(hidden)
            assert (stream.hidden[row, start:] - hidden).abs().max() <= 1e-5
            assert (stream.logits[row, start:] - logits).abs().max() <= 1e-5
        # the CFG variant, as transformers' ClassifierFreeGuidanceLogitsProcessor combines the streams
        with torch.no_grad():
            c = hf.model.generation_head(hf_hidden(hf, ids, tokens[row].tolist()))
            u = hf.model.generation_head(hf_hidden(hf, hf_null_ids(ids), tokens[row].tolist()))
        mine = combine_cfg(out.logits[row, start:], null_out.logits[row, start:], CFG)
        # u + s(c - u) scales each stream's 1e-5 by at most 1 + 2s
        assert (mine - (u + CFG * (c - u))).abs().max() <= (1 + 2 * CFG) * 1e-5


def test_null_stream_keeps_the_prompt_length_and_mask(janus_files):
    target = janus_target(janus_files[0])
    cond = target.encode_captions(CAPTIONS)
    null = target.null_condition(cond)
    assert torch.equal(null.mask, cond.mask)
    embed = target.generator.language_model.embed_tokens
    for row, caption in enumerate(CAPTIONS):
        ids = hf_null_ids(target.prompt_ids(caption))
        expected = embed(torch.tensor(ids))
        torch.testing.assert_close(null.features[row, -len(ids) :], expected, rtol=0, atol=0)
        assert (null.features[row, : -len(ids)] == 0).all()


def test_cached_passes_match_the_sequence_pass(janus_files):
    target = janus_target(janus_files[0])
    tokens = torch.randint(0, CODEBOOK, (2, 16), generator=torch.Generator().manual_seed(2))
    assert_cached_passes_match_the_sequence_pass(target, target.encode_captions(CAPTIONS), tokens)


# --- generation -----------------------------------------------------------------------------------------


def test_greedy_ar_matches_transformers_image_generation(janus_files):
    folder, hf = janus_files
    target = janus_target(folder)
    tokens = generate_ar(
        target, target.encode_captions(CAPTIONS), SamplingConfig(cfg_scale=CFG, temperature=0.0), [None] * 2
    )
    generation = transformers.GenerationConfig(
        bos_token_id=VOCAB[BOS],
        pad_token_id=VOCAB[PAD],
        generation_kwargs={"boi_token_id": VOCAB[BOI]},
        guidance_scale=CFG,
        do_sample=False,
    )
    for row, caption in enumerate(CAPTIONS):
        ids = torch.tensor([target.prompt_ids(caption)])
        expected = hf.generate(
            ids, attention_mask=torch.ones_like(ids), generation_mode="image", generation_config=generation
        )
        assert tokens[row].tolist() == expected[0].tolist()
    assert len(set(tokens.flatten().tolist())) > 2  # not a degenerate model
    with torch.no_grad():
        official = hf.model.vqmodel.decode(tokens)
    images = target.tokenizer.decode(tokens)
    assert images.shape == (2, 3, IMAGE_SIZE, IMAGE_SIZE)
    torch.testing.assert_close(images, official.clamp(-1, 1), rtol=0, atol=1e-5)


def test_vq_encoder_matches_transformers_and_quantises_like_the_release(janus_files):
    folder, hf = janus_files
    target = janus_target(folder)
    images = torch.rand(2, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(3)) * 2 - 1
    vq = target.tokenizer.vq
    with torch.no_grad():
        official = hf.model.vqmodel.quant_conv(hf.model.vqmodel.encoder(images)).permute(0, 2, 3, 1)
        latents = vq.encode_latents(images)
    torch.testing.assert_close(latents, official, rtol=0, atol=1e-5)
    # DeepSeek's (LlamaGen's) quantiser compares L2-normalised latents with the normalised codebook;
    # transformers' JanusVQVAEVectorQuantizer skips both normalisations when encoding.
    normalize = torch.nn.functional.normalize
    book = normalize(hf.model.vqmodel.quantize.embedding.weight, dim=-1)
    nearest = torch.cdist(normalize(official, dim=-1).flatten(1, 2), book[None]).argmin(-1)
    assert torch.equal(target.tokenizer.encode(images), nearest)


def test_a_janus_target_gets_a_llama_drafter_layer(janus_files):
    target = janus_target(janus_files[0])
    drafter = random_drafter(target)
    assert isinstance(drafter.layer, JanusDraftLayer)
    assert drafter.config.layer == {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
    }
    names = {k for k in drafter.state_dict() if k.startswith("layer.")}
    assert "layer.self_attn.q_proj.weight" in names
    assert not any("q_norm" in k or "k_norm" in k for k in names)


def test_eagle2_with_a_random_drafter_gives_the_ar_tokens_at_t0(janus_files, tmp_path):
    target = janus_target(janus_files[0])
    tokens = torch.randint(0, CODEBOOK, (2, 16), generator=torch.Generator().manual_seed(2))
    assert_cached_passes_match_the_sequence_pass(target, target.encode_captions(CAPTIONS), tokens)


# --- configs and errors ---------------------------------------------------------------------------------


def test_shipped_config_builds_with_local_files_and_fit_defaults(janus_files):
    import yaml

    config = yaml.safe_load((Path(__file__).parents[1] / "conf" / "target" / "janus_pro.yaml").read_text())
    config.update(model_dir=str(janus_files[0]), prefix_length=16)
    # fit composes the target over TargetConfig, which fills in the keys every kind shares
    target = load_target({**dataclasses.asdict(TargetConfig()), **config})
    s = target.sampling_defaults
    assert (s.cfg_scale, s.temperature, s.top_k, s.top_p) == (5.0, 1.0, 0, 1.0)
    assert target.identity.family == "janus_pro" and target.tokenizer.image_size == IMAGE_SIZE


def test_missing_tokenizer_and_inconsistent_configs_are_named(janus_files, tmp_path):
    folder = janus_files[0]
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    with pytest.raises(CheckpointError, match="tokenizer"):
        janus_target(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["vision_config"]["num_image_tokens"] = 576
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="num_image_tokens"):
        janus_target(tmp_path)


def test_caption_overflow(janus_files):
    long = " ".join(["red"] * 20)
    with pytest.raises(ValueError, match="prefix_length"):
        janus_target(janus_files[0]).encode_captions([long])
    ids = janus_target(janus_files[0], caption_overflow="truncate").prompt_ids(long)
    assert len(ids) == 16 and ids[0] == VOCAB[BOS] and ids[-1] == VOCAB[BOI]


def test_bf16_inference_keeps_identity_and_fp32_logits(janus_files):
    target = janus_target(janus_files[0])
    identity = target.identity
    target.use_dtype(torch.bfloat16)
    assert target.dtype == torch.bfloat16 and target.identity == identity
    cond = target.encode_captions(["a red circle"])
    out = target.prefill(cond, target.new_cache(1))
    assert out.hidden.dtype == torch.bfloat16 and out.logits.dtype == torch.float32
    tokens = generate_ar(target, cond, SamplingConfig(cfg_scale=CFG, temperature=0.0), [None])
    assert tokens.shape == (1, 16)


def test_taps_are_transformers_hidden_states(janus_files):
    """What an EAGLE-3 drafter reads: the residual stream after k layers is transformers'
    ``hidden_states[k]``, for every k."""
    folder, hf = janus_files
    target = janus_target(folder)
    tokens = torch.randint(0, CODEBOOK, (1, 16), generator=torch.Generator().manual_seed(1))
    ids = target.prompt_ids(CAPTIONS[0])
    taps = tuple(range(target.num_layers + 1))
    with torch.no_grad():
        states = target.sequence_features(target.encode_captions(CAPTIONS[:1]), tokens, taps)
        x = hf.get_input_embeddings()(torch.tensor([ids]))
        x = torch.cat([x, hf.prepare_embeddings_for_image_generation(tokens)], dim=1)
        ref = hf.model.language_model(inputs_embeds=x, output_hidden_states=True).hidden_states
    _, tapped = split_taps(states, target.hidden_size, len(taps))
    start, width = target.prefix_length - len(ids), target.hidden_size
    assert len(ref) == len(taps)
    for k in taps:
        assert (tapped[0, start:, k * width : (k + 1) * width] - ref[k][0]).abs().max() <= 1e-5


@pytest.mark.filterwarnings("ignore:target.dtype=bf16 on the CPU")
def test_fit_trains_a_step_on_the_bf16_target(janus_files):
    bf16_fit_step(janus_target(janus_files[0]), CAPTIONS)
