"""Chameleon-family targets (Anole, Lumina-mGPT) on tiny checkpoints saved in the released layouts.

The reference is transformers' Chameleon (``model.model`` + ``lm_head``, its forward masks image logits)
on the same weights, with the official pipelines' guidance and forced tokens written out here from the
released code (Meta's ``InBatchInstructCFGLogitsProcessor``; Lumina-mGPT's unbatched CFG and
``MultiModalLogitsProcessor``). Nothing is downloaded.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import transformers
from fit_step import bf16_fit_step
from safetensors.torch import save_file

from vdtrain.checkpoint_io import CheckpointError
from vdtrain.decode.ar import generate_ar
from vdtrain.decode.sampling import SamplingConfig, combine_cfg, probabilities
from vdtrain.models.chameleon_io import load_vqgan_meta, vqgan_config_hf
from vdtrain.models.chameleon_vocab import image_code_of_name, image_token_ids, image_token_name
from vdtrain.models.chameleon_vqgan import ChameleonVQGAN
from vdtrain.targets import load_target
from vdtrain.targets.base import split_taps
from vdtrain.targets.chameleon import FORCED_LOGIT, ChameleonTarget

pytestmark = pytest.mark.usefixtures("one_thread")

CODEBOOK = 8192
VOCAB = 8960  # the released special ids (boi 8197, newline 8803, sizes 8804+n) plus a few words
IMAGE_SIZE = 64  # 4x4 codes with the released 16x downsampling
WORDS = [
    "Generate",
    "an",
    "image",
    "of",
    "64x64",
    "according",
    "to",
    "the",
    "following",
    "prompt",
    ":",
    "a",
    "red",
    "blue",
    "circle",
    "square",
    "big",
]
VQ = {
    "embed_dim": 8,
    "num_embeddings": CODEBOOK,
    "latent_channels": 32,
    "base_channels": 32,
    "channel_multiplier": [1, 1, 2, 2, 4],
    "num_res_blocks": 1,
    "resolution": IMAGE_SIZE,
    "attn_resolutions": [8],
}


def tiny_vocabulary(seed: int = 0) -> dict[str, int]:
    """Released special ids; image names shuffled over ids 4..8195, so only a by-name mapping is right."""
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "<eoss>": 8196, "<racm3:break>": 8197}
    codes = list(range(CODEBOOK))
    random.Random(seed).shuffle(codes)
    vocab.update({image_token_name(c): 4 + i for i, c in enumerate(codes)})
    vocab.update({f"<reserved{i - 4:05d}>": i for i in range(8198, 8900)})
    vocab.update({w: 8900 + i for i, w in enumerate(WORDS)})
    return vocab


def bpe_ids(newline: bool) -> torch.Tensor:
    """Target index → BPE id, spelled out from the token names (code c is ``image_token_name(c)``), plus
    Lumina-mGPT's end-of-row token: the reference the adapter's own table is checked against."""
    vocab = tiny_vocabulary()
    ids = [vocab[image_token_name(c)] for c in range(CODEBOOK)]
    return torch.tensor(ids + ([8803] if newline else []))


def write_text_tokenizer(path: Path, vocab: dict[str, int]) -> None:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken("<reserved08706>", special=True)])
    tok.save(str(path))


def tiny_hf(model_parallel_size: int, swin_norm: bool = False, seed: int = 0):
    """transformers' Chameleon with random weights; q/k norms built per shard, as Lumina-mGPT releases
    them, then repeat-interleaved into transformers' per-head layout."""
    config = transformers.ChameleonConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        model_parallel_size=model_parallel_size,
        swin_norm=swin_norm,
        vq_config=VQ,
        vocabulary_map=tiny_vocabulary(),
    )
    torch.manual_seed(seed)
    hf = transformers.ChameleonForConditionalGeneration(config).eval()
    shards = {}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(std=0.15)
            if name.endswith("layernorm.weight") or (name.endswith("norm.weight") and "vqmodel" not in name):
                p.add_(1.0)
        for i, layer in enumerate(hf.model.layers):
            for norm, heads in (("q_norm", 4), ("k_norm", 2)):
                module = getattr(layer.self_attn, norm)
                for part in ("weight", "bias"):
                    shard = torch.randn(model_parallel_size, 16) * 0.3 + (part == "weight")
                    getattr(module, part).copy_(shard.repeat_interleave(heads // model_parallel_size, 0))
                    shards[f"model.layers.{i}.self_attn.{norm}.{part}"] = shard
    return hf, shards


def random_decoder_state(prefix: str, seed: int = 1) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    vq = ChameleonVQGAN(vqgan_config_hf(VQ))
    return {f"{prefix}{k}": v.clone() for k, v in vq.decoder.state_dict().items()}


@pytest.fixture(scope="module")
def anole_files(tmp_path_factory):
    """Anole's HF format: transformers' keys and shapes plus ``model.vqmodel.decoder.*``."""
    folder = tmp_path_factory.mktemp("anole")
    hf, _ = tiny_hf(model_parallel_size=1)
    hf.config.save_pretrained(folder)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    save_file({**state, **random_decoder_state("model.vqmodel.decoder.")}, folder / "model.safetensors")
    write_text_tokenizer(folder / "tokenizer.json", hf.config.vocabulary_map)
    return folder, hf


@pytest.fixture(scope="module")
def lumina_files(tmp_path_factory):
    """Lumina-mGPT's vendored format ([model_parallel_size, head_dim] q/k norms) and Meta's VQGAN."""
    folder = tmp_path_factory.mktemp("lumina")
    hf, shards = tiny_hf(model_parallel_size=2, seed=3)
    hf.config.save_pretrained(folder)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    save_file({**state, **shards}, folder / "model.safetensors")
    write_text_tokenizer(folder / "tokenizer.json", hf.config.vocabulary_map)
    vq_state = {
        k.removeprefix("model.vqmodel."): v for k, v in state.items() if k.startswith("model.vqmodel.")
    }
    vq_state.update(random_decoder_state("decoder.", seed=4))
    vq_state["loss.discriminator.main.0.weight"] = torch.zeros(2)  # training-only keys of the release
    torch.save({"state_dict": vq_state}, folder / "vqgan.ckpt")
    ddconfig = {
        "double_z": False,
        "z_channels": VQ["latent_channels"],
        "resolution": IMAGE_SIZE,
        "in_channels": 3,
        "out_ch": 3,
        "ch": VQ["base_channels"],
        "ch_mult": VQ["channel_multiplier"],
        "num_res_blocks": VQ["num_res_blocks"],
        "attn_resolutions": VQ["attn_resolutions"],
        "dropout": 0.0,
    }
    params = {"embed_dim": VQ["embed_dim"], "n_embed": CODEBOOK, "ddconfig": ddconfig}
    (folder / "vqgan.yaml").write_text(json.dumps({"model": {"params": params}}))  # JSON is YAML
    return folder, hf


def anole_target(folder: Path, **extra) -> ChameleonTarget:
    config = {"kind": "chameleon", "name": "tiny-anole", "family": "anole", "model_dir": str(folder)}
    return load_target({"image_size": IMAGE_SIZE, "prefix_length": 12, **config, **extra})


def lumina_target(folder: Path, **extra) -> ChameleonTarget:
    config = {
        "kind": "chameleon",
        "name": "tiny-lumina",
        "family": "lumina_mgpt",
        "model_dir": str(folder),
        "vqgan_ckpt": str(folder / "vqgan.ckpt"),
        "vqgan_config": str(folder / "vqgan.yaml"),
    }
    return load_target({"image_size": IMAGE_SIZE, "prefix_length": 24, **config, **extra})


@torch.no_grad()
def hf_logits(hf, ids: list[int], offset: int = 0) -> torch.Tensor:
    """Full-vocabulary logits [S, V] of transformers' ``model.model`` + ``lm_head`` at RoPE positions
    ``offset ..`` (our left padding shifts absolute positions)."""
    x = torch.tensor([ids])
    positions = torch.arange(offset, offset + len(ids))[None]
    hidden = hf.model(input_ids=x, position_ids=positions).last_hidden_state
    return hf.lm_head(hidden)[0].float()


def pad_of(target: ChameleonTarget, prompt: list[int]) -> int:
    return target.prefix_length - len(prompt)


# --- vocabulary -------------------------------------------------------------------------------------


def test_image_token_names_spell_codes_with_letters():
    assert image_code_of_name("IMGIMGBCZ") == 12
    assert image_code_of_name("IMGIMGAZ") == 0
    assert image_code_of_name(image_token_name(8191)) == 8191
    assert image_code_of_name("<racm3:break>") is None
    assert image_code_of_name("IMGIMGK1Z") is None


def test_image_ids_follow_names_not_offsets():
    vocab = tiny_vocabulary()
    ids = image_token_ids(vocab, CODEBOOK)
    assert ids[12].item() == vocab["IMGIMGBCZ"]
    assert sorted(ids.tolist()) == list(range(4, 4 + CODEBOOK))
    assert (ids != torch.arange(4, 4 + CODEBOOK)).any()  # the shuffled names: an offset would be wrong
    del vocab["IMGIMGBCZ"]
    with pytest.raises(ValueError, match=r"missing e\.g\. 'IMGIMGBCZ'"):
        image_token_ids(vocab, CODEBOOK)


# --- loading the released layouts -------------------------------------------------------------------


def test_anole_loads_its_hf_layout_and_matches_transformers(anole_files):
    folder, hf = anole_files
    target = anole_target(folder)
    ids = bpe_ids(newline=False)
    assert target.identity.family == "anole" and target.grid == (4, 4) and target.vocab_size == CODEBOOK
    prompt = target.prompt_ids("a red circle")
    assert prompt == [
        0,
        8900 + WORDS.index("a"),
        8900 + WORDS.index("red"),
        8900 + WORDS.index("circle"),
        8197,
    ]
    tokens = torch.randint(
        0, CODEBOOK, (1, target.num_image_tokens), generator=torch.Generator().manual_seed(0)
    )
    out = target.forward_sequence(target.encode_captions(["a red circle"]), tokens)
    ref = hf_logits(
        hf,
        prompt + ids[tokens[0]].tolist(),
        offset=pad_of(target, prompt),
    )
    pad = pad_of(target, prompt)
    torch.testing.assert_close(out.logits[0, pad:], ref[:, ids], rtol=0, atol=1e-5)


def test_lumina_loads_per_shard_norms_and_matches_transformers(lumina_files):
    folder, hf = lumina_files
    from safetensors.torch import load_file

    assert load_file(folder / "model.safetensors")["model.layers.0.self_attn.q_norm.weight"].shape == (2, 16)
    target = lumina_target(folder)
    ids = bpe_ids(newline=True)
    assert target.grid == (4, 5) and target.vocab_size == CODEBOOK + 1
    prompt = target.prompt_ids("a red circle")
    assert prompt[0] == 0 and prompt[-4] == 8710 and prompt[-3:] == [8197, 8806, 8806]
    codes = torch.randint(0, CODEBOOK, (1, 4, 4), generator=torch.Generator().manual_seed(1))
    tokens = torch.cat([codes, torch.full((1, 4, 1), CODEBOOK)], -1).flatten(1)  # rows end in newline
    out = target.forward_sequence(target.encode_captions(["a red circle"]), tokens)
    pad = pad_of(target, prompt)
    ref = hf_logits(hf, prompt + ids[tokens[0]].tolist(), offset=pad)[:, ids]
    rows = out.logits[0, pad:]
    free = target.forced_tokens(torch.arange(-len(prompt) + 1, target.num_image_tokens + 1)) < 0
    torch.testing.assert_close(rows[free, :CODEBOOK], ref[free, :CODEBOOK], rtol=0, atol=1e-5)


def test_lumina_prompt_is_the_whole_official_template(lumina_files):
    """Lumina-mGPT's text-to-image turn: the instruction with the image size, a newline, the caption and
    the end-of-turn token, then boi and the height and width tokens (64 px = 2 patches of 32)."""
    target = lumina_target(lumina_files[0])
    texts: list[str] = []
    encode = target.encode_text
    target.encode_text = lambda text: texts.append(text) or encode(text)
    prompt = target.prompt_ids("a red circle")
    instruction = "Generate an image of 64x64 according to the following prompt:"
    assert texts == [f"{instruction}\na red circle<reserved08706>"]
    words = [*WORDS[:10], ":", "a", "red", "circle"]  # the word-level tokenizer splits off the colon
    assert prompt == [0, *(8900 + WORDS.index(w) for w in words), 8710, 8197, 8806, 8806]


def test_lumina_norm_layout_is_checked(lumina_files, tmp_path):
    folder, _ = lumina_files
    from safetensors.torch import load_file

    state = load_file(folder / "model.safetensors")
    state["model.layers.1.self_attn.k_norm.weight"] = torch.ones(3, 16)
    for name in ("config.json", "tokenizer.json", "vqgan.ckpt", "vqgan.yaml"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"k_norm.weight: Lumina-mGPT layout expects \[model_parallel_size=2"
    ):
        lumina_target(tmp_path)


def test_anole_without_a_decoder_is_refused(anole_files, tmp_path):
    _folder, hf = anole_files
    hf.config.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"no model\.vqmodel\.decoder"):
        anole_target(tmp_path)


def test_swin_norm_variant_matches_transformers(tmp_path):
    hf, _ = tiny_hf(model_parallel_size=1, swin_norm=True, seed=5)
    hf.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    save_file({**state, **random_decoder_state("model.vqmodel.decoder.")}, tmp_path / "model.safetensors")
    target = anole_target(tmp_path)
    ids = bpe_ids(newline=False)
    prompt = [0, 8900, 8901, 8197]
    out = target.forward_sequence(target.condition_from_ids([prompt]), torch.tensor([[5, 6, 7]]))
    ref = hf_logits(
        hf,
        prompt + ids[[5, 6, 7]].tolist(),
        offset=pad_of(target, prompt),
    )
    torch.testing.assert_close(out.logits[0, -7:], ref[:, ids], rtol=0, atol=1e-5)


def test_left_padding_changes_nothing_but_rounding(anole_files):
    """RoPE is relative: a left-padded prompt gives the unpadded, position-0 logits."""
    folder, hf = anole_files
    target = anole_target(folder)
    ids = bpe_ids(newline=False)
    prompt = target.prompt_ids("a blue square")
    out = target.forward_sequence(target.encode_captions(["a blue square"]), torch.tensor([[1, 2]]))
    ref = hf_logits(hf, prompt + ids[[1, 2]].tolist())  # positions from 0
    torch.testing.assert_close(out.logits[0, -7:], ref[:, ids], rtol=0, atol=1e-4)


# --- cached passes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["anole", "lumina"])
def test_cached_passes_match_the_sequence_pass(family, anole_files, lumina_files):
    target = anole_target(anole_files[0]) if family == "anole" else lumina_target(lumina_files[0])
    cond = target.encode_captions(["a red circle", "big blue square"])
    tokens = target.tokenizer.encode(torch.rand(2, 3, IMAGE_SIZE, IMAGE_SIZE) * 2 - 1)
    full = target.forward_sequence(cond, tokens)
    cache = target.new_cache(2)
    L = target.prefix_length
    first = target.prefill(cond, cache)
    torch.testing.assert_close(first.logits, full.logits[:, :L], rtol=0, atol=1e-5)
    for start, stop in ((0, 1), (1, 7), (7, target.num_image_tokens)):  # one token, then chunks
        index = torch.arange(start, stop)
        out = target.forward_tokens(
            cond,
            tokens[:, start:stop],
            index,
            cache,
            index + L,
            target.causal_visibility(start, stop - start, "cpu"),
        )
        torch.testing.assert_close(out.logits, full.logits[:, L + start : L + stop], rtol=0, atol=1e-5)
        torch.testing.assert_close(out.hidden, full.hidden[:, L + start : L + stop], rtol=0, atol=1e-5)


# --- guidance and forced tokens ----------------------------------------------------------------------


def official_lumina_scores(
    hf, prompt: list[int], image_bpe: list[int], w: int, scale: float, pad: int
) -> torch.Tensor:
    """Lumina-mGPT's scores [N, V] for every image position: unbatched CFG with a context that starts at
    the image start token, then the forced end-of-row tokens and the image-token restriction. Each
    context is placed at the RoPE positions our left padding (``pad`` rows) gives it."""
    start = prompt.index(8197)
    cond = hf_logits(hf, prompt + image_bpe, offset=pad)[len(prompt) - 1 : -1]
    uncond = hf_logits(hf, prompt[start:] + image_bpe, offset=pad + start)[len(prompt) - start - 1 : -1]
    scores = scale * (cond - uncond) + uncond
    image_ids = torch.zeros(VOCAB, dtype=torch.bool)
    image_ids[4:8196] = True
    for j in range(len(image_bpe)):
        if (j + 1) % (w + 1) == 0:
            scores[j] = torch.where(torch.arange(VOCAB) == 8803, 0.0, -torch.inf)
        else:
            scores[j] = scores[j].masked_fill(~image_ids, -torch.inf)
    return scores


def test_lumina_cfg_and_forced_tokens_give_the_official_distribution(lumina_files):
    folder, hf = lumina_files
    target = lumina_target(folder)
    ids = bpe_ids(newline=True)
    cond = target.encode_captions(["a red circle"])
    tokens = target.tokenizer.encode(torch.rand(1, 3, IMAGE_SIZE, IMAGE_SIZE) * 2 - 1)
    assert (tokens.view(4, 5)[:, -1] == CODEBOOK).all()
    L, N = target.prefix_length, target.num_image_tokens
    c = target.forward_sequence(cond, tokens).logits[0, L - 1 : L + N - 1]
    u = target.forward_sequence(target.null_condition(cond), tokens).logits[0, L - 1 : L + N - 1]
    sampling = SamplingConfig(cfg_scale=3.0, temperature=1.0, top_k=50)
    ours = probabilities(c, u, sampling)
    prompt = target.prompt_ids("a red circle")
    image_bpe = ids[tokens[0]].tolist()
    scores = official_lumina_scores(hf, prompt, image_bpe, w=4, scale=3.0, pad=pad_of(target, prompt))
    official = probabilities(scores, None, SamplingConfig(temperature=1.0, top_k=50))[:, ids]
    torch.testing.assert_close(ours, official, rtol=0, atol=1e-5)
    forced = target.forced_tokens(torch.arange(N))
    assert forced.tolist() == [-1, -1, -1, -1, CODEBOOK] * 4
    assert (ours[forced >= 0, CODEBOOK] == 1.0).all()
    assert (ours[forced < 0, CODEBOOK] == 0.0).all()
    # Forced rows are the same finite row in both streams, so guidance keeps them exact.
    assert (c[forced >= 0] == u[forced >= 0]).all() and c.min() == FORCED_LOGIT


def test_anole_instruct_guidance_reduces_to_cfg_for_text_prompts(anole_files):
    folder, hf = anole_files
    target = anole_target(folder)
    ids = bpe_ids(newline=False)
    assert target.sampling_defaults == SamplingConfig(cfg_scale=3.0, temperature=0.7, top_k=0, top_p=0.9)
    cond = target.encode_captions(["a red circle"])
    tokens = torch.arange(target.num_image_tokens)[None] * 37 % CODEBOOK
    L, N = target.prefix_length, target.num_image_tokens
    streams = [
        target.forward_sequence(s, tokens).logits[0, L - 1 : L + N - 1] for s in target.guidance_streams(cond)
    ]
    mixed = target.guidance.combine(streams, target.sampling_defaults.cfg_scale)
    assert torch.equal(mixed, combine_cfg(streams[0], streams[2], target.sampling_defaults.cfg_scale))
    # Meta's three streams on transformers' logits: full prompt, image-only prompt, [bos, boi].
    img = ids[tokens[0]].tolist()
    prompt = target.prompt_ids("a red circle")
    full = hf_logits(hf, prompt + img, offset=pad_of(target, prompt))[len(prompt) - 1 : -1]
    image_only = hf_logits(hf, [0, 8197, *img], offset=L - 2)[1:-1]
    torch.testing.assert_close(streams[0], full[:, ids], rtol=0, atol=1e-5)
    torch.testing.assert_close(streams[1], image_only[:, ids], rtol=0, atol=1e-5)
    official = image_only + 1.2 * (image_only - image_only) + 3.0 * (full - image_only)
    # u + 3(f - u) scales each stream's 1e-5 by at most 1 + 2·3.
    torch.testing.assert_close(mixed, official[:, ids], rtol=0, atol=7e-5)


# --- generation ---------------------------------------------------------------------------------------


def official_greedy(hf, prompt: list[int], n: int, family: str, w: int, length: int) -> list[int]:
    """The official pipelines' T = 0 image tokens (BPE ids), one full forward per token, at the RoPE
    positions of prompts left-padded to ``length``."""
    seq, out, pad = list(prompt), [], length - len(prompt)
    for _ in range(n):
        cond = hf_logits(hf, seq, offset=pad)[-1]
        if family == "anole":
            uncond = hf_logits(hf, [0, 8197, *seq[len(prompt) :]], offset=length - 2)[-1]
            scores = uncond + 1.2 * (uncond - uncond) + 3.0 * (cond - uncond)
            scores[:4] = scores[8196:] = -torch.inf
        else:
            scores = official_lumina_scores(hf, prompt, [*seq[len(prompt) :], 0], w, 3.0, pad)[-1]
        out.append(int(scores.argmax()))
        seq.append(out[-1])
    return out


@pytest.mark.parametrize("family", ["anole", "lumina"])
def test_greedy_ar_matches_the_official_pipeline(family, anole_files, lumina_files):
    folder, hf = anole_files if family == "anole" else lumina_files
    target = anole_target(folder) if family == "anole" else lumina_target(folder)
    ids = bpe_ids(newline=family == "lumina")
    captions = ["a red circle", "big blue square"]
    sampling = SamplingConfig(cfg_scale=3.0, temperature=0.0)
    tokens = generate_ar(target, target.encode_captions(captions), sampling, [None, None])
    for row, caption in enumerate(captions):
        expected = official_greedy(
            hf, target.prompt_ids(caption), target.num_image_tokens, family, 4, target.prefix_length
        )
        assert ids[tokens[row]].tolist() == expected
    images = target.tokenizer.decode(tokens)
    assert images.shape == (2, 3, IMAGE_SIZE, IMAGE_SIZE)


# --- tokenizer ------------------------------------------------------------------------------------------


def test_vqgan_encoder_matches_transformers_and_both_release_formats_agree(anole_files, lumina_files):
    folder, hf = lumina_files
    target = lumina_target(folder)
    images = torch.rand(2, 3, IMAGE_SIZE, IMAGE_SIZE) * 2 - 1
    with torch.no_grad():
        ref = hf.model.vqmodel.encode(images).image_tokens.view(2, 4, 4)
    assert torch.equal(target.tokenizer.vqgan.encode(images), ref)
    meta = load_vqgan_meta(folder / "vqgan.ckpt", folder / "vqgan.yaml")
    ours = target.tokenizer.vqgan.state_dict()
    assert meta.state_dict().keys() == ours.keys()
    assert all(torch.equal(v, ours[k]) for k, v in meta.state_dict().items())
    tokens = target.tokenizer.encode(images)
    assert tokens.shape == (2, 20) and (tokens.view(2, 4, 5)[..., :4] == ref).all()
    assert target.tokenizer.codebook().shape == (CODEBOOK + 1, 8)
    assert target.tokenizer.decode(tokens).shape == (2, 3, IMAGE_SIZE, IMAGE_SIZE)
    with pytest.raises(ValueError, match="non-code tokens"):
        target.tokenizer.decode(torch.full((1, 20), CODEBOOK))
    anole = anole_target(anole_files[0])
    assert anole.tokenizer.encode(images).shape == (2, 16) and anole.tokenizer.codebook().shape == (
        CODEBOOK,
        8,
    )


def test_caption_overflow(anole_files):
    with pytest.raises(ValueError, match="prefix_length 2 < 3, the shortest anole prompt"):
        anole_target(anole_files[0], prefix_length=2)
    with pytest.raises(CheckpointError, match="text tokenizer not found"):
        anole_target(anole_files[0], tokenizer_file=str(anole_files[0] / "missing.json"))
    target = anole_target(anole_files[0], prefix_length=5)
    with pytest.raises(ValueError, match="exceeds the 3 that prefix_length 5 leaves"):
        target.encode_captions(["a big red blue circle"])
    cut = anole_target(anole_files[0], prefix_length=5, caption_overflow="truncate")
    assert cut.prompt_ids("a big red blue circle") == [
        0,
        8900 + WORDS.index("a"),
        8900 + WORDS.index("big"),
        8900 + WORDS.index("red"),
        8197,
    ]


@pytest.mark.parametrize("name", ["anole", "lumina_mgpt"])
def test_shipped_target_configs_build_with_local_files(name, anole_files, lumina_files):
    import yaml

    config = yaml.safe_load((Path(__file__).parents[1] / "conf" / "target" / f"{name}.yaml").read_text())
    folder = (anole_files if name == "anole" else lumina_files)[0]
    config.update(model_dir=str(folder), image_size=IMAGE_SIZE, prefix_length=24)
    if name == "lumina_mgpt":
        config.update(vqgan_ckpt=str(folder / "vqgan.ckpt"), vqgan_config=str(folder / "vqgan.yaml"))
    target = load_target(config)
    expected = {"anole": (3.0, 0.7, 0, 0.9), "lumina_mgpt": (3.0, 1.0, 2000, 1.0)}[name]
    s = target.sampling_defaults
    assert (s.cfg_scale, s.temperature, s.top_k, s.top_p) == expected
    assert target.identity.family == name


def test_self_generate_samples_lumina_rows_with_forced_newlines(lumina_files, tmp_path):
    from vdtrain.data.prepare import prepare_self_generate

    target = lumina_target(lumina_files[0])
    sampling = SamplingConfig(cfg_scale=3.0, temperature=1.0, top_k=2000)
    manifest = prepare_self_generate(
        target,
        ["a red circle", "big blue square", "a square"],
        tmp_path,
        sampling=sampling,
        store_cond=True,
        progress=False,
    )
    assert manifest["num_samples"] == 3
    tokens = generate_ar(target, target.encode_captions(["a red circle"] * 4), sampling, [None] * 4)
    grid = tokens.view(4, 4, 5)
    assert (grid[..., -1] == CODEBOOK).all() and (grid[..., :-1] < CODEBOOK).all()
    assert len(set(tokens[:, 0].tolist())) > 1  # sampled, not greedy


DRAFTER_FREE_EXACT = ["sjd", "sjd_pac"]


@pytest.mark.parametrize("name", DRAFTER_FREE_EXACT)
@pytest.mark.parametrize("family", ["anole", "lumina"])
def test_drafter_free_exact_methods_give_the_ar_tokens_at_t0(
    name, family, anole_files, lumina_files, tmp_path
):
    from vdtrain.decode.methods import build_method, load_preset

    target = anole_target(anole_files[0]) if family == "anole" else lumina_target(lumina_files[0])
    sampling = SamplingConfig(cfg_scale=3.0, temperature=0.0)
    cond = target.encode_captions(["a red circle", "big blue square"])
    expected = generate_ar(target, cond, sampling, [None, None])
    config = load_preset(name, {"acceptance": {"cache_dir": str(tmp_path)}})
    engine = build_method(config, target, None, sampling)
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    assert torch.equal(engine.generate(cond, gens).tokens, expected)


def test_bf16_inference_keeps_identity_and_fp32_logits(lumina_files):
    target = lumina_target(lumina_files[0])
    identity = target.identity
    target.use_dtype(torch.bfloat16)
    assert target.dtype == torch.bfloat16 and target.identity == identity
    cond = target.encode_captions(["a red circle"])
    out = target.prefill(cond, target.new_cache(1))
    assert out.hidden.dtype == torch.bfloat16 and out.logits.dtype == torch.float32
    tokens = generate_ar(target, cond, SamplingConfig(cfg_scale=3.0, temperature=0.0), [None])
    assert (tokens.view(4, 5)[:, -1] == CODEBOOK).all()


def test_taps_are_transformers_hidden_states(anole_files):
    """What an EAGLE-3 drafter reads: the residual stream after k layers is transformers'
    ``hidden_states[k]``, for every k."""
    folder, hf = anole_files
    target = anole_target(folder)
    prompt = target.prompt_ids("a red circle")
    tokens = torch.randint(
        0, CODEBOOK, (1, target.num_image_tokens), generator=torch.Generator().manual_seed(0)
    )
    taps = tuple(range(target.num_layers + 1))
    with torch.no_grad():
        states = target.sequence_features(target.encode_captions(["a red circle"]), tokens, taps)
        pad = pad_of(target, prompt)
        ids = torch.tensor([prompt + bpe_ids(newline=False)[tokens[0]].tolist()])
        positions = torch.arange(pad, pad + ids.shape[1])[None]
        ref = hf.model(input_ids=ids, position_ids=positions, output_hidden_states=True).hidden_states
    _, tapped = split_taps(states, target.hidden_size, len(taps))
    assert len(ref) == len(taps)
    for k in taps:
        got = tapped[0, pad:, k * target.hidden_size : (k + 1) * target.hidden_size]
        torch.testing.assert_close(got, ref[k][0], rtol=0, atol=1e-5, msg=f"layer {k}")


@pytest.mark.filterwarnings("ignore:target.dtype=bf16 on the CPU")
@pytest.mark.parametrize("family", ["anole", "lumina_mgpt"])
def test_fit_trains_a_step_on_the_bf16_target(family, anole_files, lumina_files):
    target = anole_target(anole_files[0]) if family == "anole" else lumina_target(lumina_files[0])
    bf16_fit_step(target, ["a red circle", "a blue square"])
