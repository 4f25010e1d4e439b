"""Emu3 target on a tiny checkpoint saved by transformers' ``Emu3ForConditionalGeneration``.

The reference is transformers on the same weights: its forward (``lm_head`` over the whole vocabulary),
its ``generate`` with the unbatched CFG of ``negative_prompt_ids`` and the ``prefix_allowed_tokens_fn``
of the Emu3 docs (end-of-row token at every row end, visual tokens elsewhere), and its ``Emu3VQVAE``.
Nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import transformers
from conftest import assert_cached_passes_match_the_sequence_pass, eagle2_and_ar_tokens, random_drafter
from fit_step import bf16_fit_step

from vdtrain.checkpoint_io import CheckpointError
from vdtrain.config import TargetConfig
from vdtrain.decode.ar import generate_ar
from vdtrain.decode.sampling import SamplingConfig, combine_cfg
from vdtrain.targets import load_target
from vdtrain.targets.base import split_taps
from vdtrain.targets.chameleon import FORCED_LOGIT, ChameleonTarget
from vdtrain.targets.emu3 import BOI, BOS, END_OF_ROW, IMAGE_WRAPPER, Emu3DraftLayer

pytestmark = pytest.mark.usefixtures("one_thread")

CODEBOOK = 32
IMAGE_SIZE = 8  # 4x4 codes with the tiny VQ's 2x downsampling: grid (4, 5) with the end-of-row column
SIDE = 4
SPECIAL = ["<|endoftext|>", BOS, "<|extra_204|>", BOI, IMAGE_WRAPPER, "<|image end|>", END_OF_ROW]
SPECIAL += ["<|extra_201|>", "<image>", "<unk>"]
WORDS = ["a", "red", "blue", "circle", "square", "big", "on", "the", "left", ",", ".", "*", "4"]
WORDS += ["masterpiece", "film", "grained", "best", "quality", "lowres", "bad"]
VOCAB = {name: i for i, name in enumerate(SPECIAL + WORDS)}
VOCAB.update({f"<|visual token {c:06d}|>": len(VOCAB) + c for c in range(CODEBOOK)})
CAPTIONS = ["a red circle", "big blue square on the left"]
NEGATIVE = "lowres, bad quality."
CFG = 3.0


def tiny_config() -> transformers.Emu3Config:
    text = {
        "vocab_size": len(VOCAB),
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "bos_token_id": VOCAB[BOS],
        "eos_token_id": VOCAB["<|extra_204|>"],
        "pad_token_id": VOCAB["<|endoftext|>"],
    }
    vq = {
        "codebook_size": CODEBOOK,
        "embed_dim": 4,
        "latent_channels": 4,
        "base_channels": 32,
        "channel_multiplier": [1, 2],
        "num_res_blocks": 1,
        "attn_resolutions": [],
        "hidden_size": 64,  # the middle block's attention width = base_channels * the last multiplier
        "num_attention_heads": 1,
    }
    return transformers.Emu3Config(text_config=text, vq_config=vq, vocabulary_map=VOCAB)


def write_text_tokenizer(path: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = {name: i for name, i in VOCAB.items() if not name.startswith("<|visual")}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(name, special=True) for name in SPECIAL])
    tok.save(str(path))


@pytest.fixture(scope="module")
def emu3_files(tmp_path_factory):
    """transformers' layout (``save_pretrained``), random weights scaled so logits differ clearly."""
    torch.manual_seed(0)
    hf = transformers.Emu3ForConditionalGeneration(tiny_config()).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "vqmodel" in name:
                continue
            p.normal_(std=0.15)
            if name.endswith("norm.weight"):
                p.add_(1.0)
    folder = tmp_path_factory.mktemp("emu3")
    hf.save_pretrained(folder)
    write_text_tokenizer(folder / "tokenizer.json")
    return folder, hf


def emu3_target(folder: Path, **extra) -> ChameleonTarget:
    config = {
        "kind": "emu3",
        "name": "tiny-emu3",
        "model_dir": str(folder),
        "image_size": IMAGE_SIZE,
        "prefix_length": 24,
        "negative_prompt": NEGATIVE,
        **extra,
    }
    return load_target(config)


def image_tokens(batch: int, seed: int) -> torch.Tensor:
    """Random codes in the target's token space: rows of codes, each closed by the end-of-row index."""
    codes = torch.randint(0, CODEBOOK, (batch, SIDE, SIDE), generator=torch.Generator().manual_seed(seed))
    return torch.cat([codes, torch.full_like(codes[..., :1], CODEBOOK)], dim=-1).flatten(1)


def hf_logits(hf, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' final-norm hidden states and full-vocabulary logits of one unpadded row."""
    with torch.no_grad():
        hidden = hf.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        return hidden, hf.lm_head(hidden)


# --- layout and logits ---------------------------------------------------------------------------------


def test_loads_the_released_layout_and_builds_the_prompts(emu3_files):
    target = emu3_target(emu3_files[0])
    ident = target.identity
    assert (ident.family, ident.vocab_size, ident.grid) == ("emu3", CODEBOOK + 1, (SIDE, SIDE + 1))
    assert ident.hidden_size == 64 and target.lm.config.qk_norm is False
    assert target.vocab_ids.tolist() == [VOCAB[f"<|visual token {c:06d}|>"] for c in range(CODEBOOK)] + [
        VOCAB[END_OF_ROW]
    ]
    image_prefix = [VOCAB[BOI], VOCAB["4"], VOCAB["*"], VOCAB["4"], VOCAB[IMAGE_WRAPPER]]
    suffix = [VOCAB[w] for w in ["masterpiece", ",", "film", "grained", ",", "best", "quality", "."]]
    words = [VOCAB[w] for w in ["a", "red", "circle"]]
    assert target.prompt_ids("a red circle") == [VOCAB[BOS], *words, *suffix, *image_prefix]
    null = [VOCAB[BOS], *(VOCAB[w] for w in ["lowres", ",", "bad", "quality", "."]), *image_prefix]
    assert target.layout.null_prompt == tuple(null)
    cond = target.null_condition(target.encode_captions(CAPTIONS))
    assert cond.mask.sum(1).tolist() == [len(null)] * 2


def test_both_cfg_streams_match_transformers_logits(emu3_files):
    folder, hf = emu3_files
    target = emu3_target(folder)
    cond = target.encode_captions(CAPTIONS)
    tokens = image_tokens(2, seed=1)
    streams = {"c": target.forward_sequence(cond, tokens)}
    streams["u"] = target.forward_sequence(target.null_condition(cond), tokens)
    length, n, ids = target.prefix_length, target.num_image_tokens, target.vocab_ids
    codes = ids[:CODEBOOK]
    free = torch.arange(n) % (SIDE + 1) != SIDE  # image indices whose token is sampled, not forced
    for row, caption in enumerate(CAPTIONS):
        prompts = {"c": target.prompt_ids(caption), "u": list(target.layout.null_prompt)}
        mine, theirs = {}, {}
        for name, prompt in prompts.items():
            hidden, logits = hf_logits(hf, prompt + ids[tokens[row]].tolist())
            out, start = streams[name], length - len(prompt)
            assert (out.hidden[row, start:] - hidden).abs().max() <= 1e-5
            assert (target.image_head(out.hidden[row, start:]) - logits[:, ids]).abs().max() <= 1e-5
            # the rows predicting image tokens: end of row forced at row ends and suppressed elsewhere
            rows = out.logits[row, length - 1 : length - 1 + n]
            assert (rows[~free, :CODEBOOK] == FORCED_LOGIT).all() and (rows[~free, CODEBOOK] == 0).all()
            assert (rows[free, CODEBOOK] == FORCED_LOGIT).all()
            mine[name], theirs[name] = rows[free, :CODEBOOK], logits[len(prompt) - 1 : -1][free]
            assert (mine[name] - theirs[name][:, codes]).abs().max() <= 1e-5
        # raw-logit CFG, u + s(c - u), scales each stream's 1e-5 by at most 1 + 2s
        reference = theirs["u"] + CFG * (theirs["c"] - theirs["u"])
        error = combine_cfg(mine["c"], mine["u"], CFG) - reference[:, codes]
        assert error.abs().max() <= (1 + 2 * CFG) * 1e-5
        # transformers' UnbatchedClassifierFreeGuidanceLogitsProcessor combines log-softmaxes over the
        # whole vocabulary: raw-logit CFG plus one constant per row, so the same distribution
        lsm = torch.log_softmax
        released = lsm(theirs["u"], -1) + CFG * (lsm(theirs["c"], -1) - lsm(theirs["u"], -1))
        shift = (released - reference)[:, codes]
        assert (shift - shift[:, :1]).abs().max() <= 1e-4


def test_transformers_module_names_load_too(emu3_files, tmp_path):
    """A state dict under transformers 5's module names (``model.text_model.*``, ``lm_head``,
    ``model.vqmodel.*``) instead of the released file's."""
    from safetensors.torch import save_file

    folder, hf = emu3_files
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.startswith("model.text_model.") for k in state) and "lm_head.weight" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    assert emu3_target(tmp_path).identity == emu3_target(folder).identity


def test_cached_passes_match_the_sequence_pass(emu3_files):
    target = emu3_target(emu3_files[0])
    assert_cached_passes_match_the_sequence_pass(
        target, target.encode_captions(CAPTIONS), image_tokens(2, seed=2)
    )


# --- generation -----------------------------------------------------------------------------------------


def emu3_prefix_fn(width: int, visual: list[int]):
    """The Emu3 docs' ``prefix_allowed_tokens_fn``, for the image rows (offsets from <|image token|>)."""

    def allowed(batch_id: int, input_ids: torch.Tensor) -> list[int]:
        position = torch.nonzero(input_ids == VOCAB[IMAGE_WRAPPER], as_tuple=True)[0][0]
        offset = input_ids.shape[0] - position
        return [VOCAB[END_OF_ROW]] if offset % (width + 1) == 0 else visual

    return allowed


def test_greedy_ar_matches_transformers_image_generation(emu3_files):
    folder, hf = emu3_files
    target = emu3_target(folder)
    tokens = generate_ar(
        target, target.encode_captions(CAPTIONS), SamplingConfig(cfg_scale=CFG, temperature=0.0), [None] * 2
    )
    ids = target.vocab_ids
    to_target = {int(bpe): i for i, bpe in enumerate(ids)}
    null = torch.tensor([target.layout.null_prompt])
    n = target.num_image_tokens
    for row, caption in enumerate(CAPTIONS):
        prompt = torch.tensor([target.prompt_ids(caption)])
        out = hf.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            negative_prompt_ids=null,
            negative_prompt_attention_mask=torch.ones_like(null),
            guidance_scale=CFG,
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            prefix_allowed_tokens_fn=emu3_prefix_fn(SIDE, ids[:CODEBOOK].tolist()),
            pad_token_id=VOCAB["<|endoftext|>"],
        )
        assert [to_target[int(t)] for t in out[0, prompt.shape[1] :]] == tokens[row].tolist()
    assert len(set(tokens.flatten().tolist())) > 3  # not a degenerate model
    assert (tokens.view(2, SIDE, SIDE + 1)[..., -1] == CODEBOOK).all()
    codes = tokens.view(2, SIDE, SIDE + 1)[..., :-1]
    with torch.no_grad():
        official = hf.model.vqmodel.decode(codes)
    images = target.tokenizer.decode(tokens)
    assert images.shape == (2, 3, IMAGE_SIZE, IMAGE_SIZE)
    torch.testing.assert_close(images, official.clamp(-1, 1), rtol=0, atol=1e-5)


def test_vq_encode_matches_transformers_and_adds_the_end_of_row_column(emu3_files):
    folder, hf = emu3_files
    target = emu3_target(folder)
    images = torch.rand(2, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(3)) * 2 - 1
    with torch.no_grad():
        official = hf.model.vqmodel.encode(images, torch.tensor([[IMAGE_SIZE, IMAGE_SIZE]] * 2)).image_tokens
    expected = torch.cat([torch.stack(official), torch.full((2, SIDE, 1), CODEBOOK)], dim=-1).flatten(1)
    assert torch.equal(target.tokenizer.encode(images), expected)
    book = target.tokenizer.codebook()
    assert book.shape == (CODEBOOK + 1, 4)
    assert torch.equal(book[:CODEBOOK], hf.model.vqmodel.quantize.embedding.weight)


def test_an_emu3_target_gets_a_llama_drafter_layer(emu3_files):
    target = emu3_target(emu3_files[0])
    drafter = random_drafter(target)
    assert isinstance(drafter.layer, Emu3DraftLayer)
    assert drafter.config.layer == {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "attention_bias": False,
        "mlp_bias": False,
    }
    assert not any("q_norm" in k or "k_norm" in k for k in drafter.state_dict())
    assert "Emu3" in drafter.layer.describe()


def test_eagle2_with_a_random_drafter_gives_the_ar_tokens_at_t0(emu3_files, tmp_path):
    target = emu3_target(emu3_files[0])
    assert torch.equal(*eagle2_and_ar_tokens(target, target.encode_captions(CAPTIONS), CFG, tmp_path))


# --- configs and errors ---------------------------------------------------------------------------------


def test_shipped_config_builds_with_local_files_and_fit_defaults(emu3_files):
    import yaml

    config = yaml.safe_load((Path(__file__).parents[1] / "conf" / "target" / "emu3.yaml").read_text())
    config.update(model_dir=str(emu3_files[0]), image_size=IMAGE_SIZE, prefix_length=64)
    # fit composes the target over TargetConfig, which fills in the keys every kind shares
    target = load_target({**dataclasses.asdict(TargetConfig()), **config})
    s = target.sampling_defaults
    assert (s.cfg_scale, s.temperature, s.top_k, s.top_p) == (3.0, 1.0, 2048, 1.0)
    assert target.identity.family == "emu3" and target.guidance.image_scales == ()
    assert target.sampling_defaults.cfg_scale == 3.0
    # the release's negative prompt (words this tiny vocabulary lacks become <unk>)
    assert target.layout.null_prompt[:2] == (VOCAB[BOS], VOCAB["lowres"])


def test_missing_tokenizer_and_bad_sizes_are_named(emu3_files, tmp_path):
    folder = emu3_files[0]
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    with pytest.raises(CheckpointError, match="tokenizer"):
        emu3_target(tmp_path)
    with pytest.raises(ValueError, match="multiple"):
        emu3_target(folder, image_size=9)


def test_caption_overflow(emu3_files):
    long = " ".join(["red"] * 20)
    with pytest.raises(ValueError, match="prefix_length"):
        emu3_target(emu3_files[0]).encode_captions([long])
    ids = emu3_target(emu3_files[0], caption_overflow="truncate").prompt_ids(long)
    assert len(ids) == 24 and ids[0] == VOCAB[BOS] and ids[-1] == VOCAB[IMAGE_WRAPPER]


def test_taps_are_transformers_hidden_states(emu3_files):
    """What an EAGLE-3 drafter reads: the residual stream after k layers is transformers'
    ``hidden_states[k]``, for every k."""
    folder, hf = emu3_files
    target = emu3_target(folder)
    tokens = image_tokens(1, seed=2)
    prompt = target.prompt_ids(CAPTIONS[0])
    taps = tuple(range(target.num_layers + 1))
    with torch.no_grad():
        states = target.sequence_features(target.encode_captions(CAPTIONS[:1]), tokens, taps)
        ids = torch.tensor([prompt + target.vocab_ids[tokens[0]].tolist()])
        ref = hf.model(input_ids=ids, output_hidden_states=True).hidden_states
    _, tapped = split_taps(states, target.hidden_size, len(taps))
    start, width = target.prefix_length - len(prompt), target.hidden_size
    assert len(ref) == len(taps)
    for k in taps:
        assert (tapped[0, start:, k * width : (k + 1) * width] - ref[k][0]).abs().max() <= 1e-5


@pytest.mark.filterwarnings("ignore:target.dtype=bf16 on the CPU")
def test_fit_trains_a_step_on_the_bf16_target(emu3_files):
    bf16_fit_step(emu3_target(emu3_files[0]), CAPTIONS)
