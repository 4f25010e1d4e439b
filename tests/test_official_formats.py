"""The released LlamaGen formats: GPT/VQ checkpoint files, the flan-t5 caption encoder, and bad inputs.

Everything is tiny and random, but laid out exactly as the official FoundationVision/LlamaGen release
lays it out (``{"model": sd, "optimizer": ..., "steps": ..., "args": Namespace}`` from the trainer,
``{"module": sd}`` from DeepSpeed, T5 read with ``T5EncoderModel``/``AutoTokenizer`` from a folder).
The real-size key layouts are checked on the ``meta`` device, which allocates nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
from pathlib import Path

import pytest
import torch
from conftest import TINY_GPT, TINY_VQ, random_gpt, random_vq, tiny_condition
from fit_step import bf16_fit_step

from vdtrain.checkpoint_io import CheckpointError, read_state_dict
from vdtrain.decode.ar import generate_ar
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.models.llamagen_gpt import LlamaGenGPT
from vdtrain.models.llamagen_io import gpt_config_from, load_gpt, load_vq, vq_config_from
from vdtrain.models.text_encoders import CaptionTooLongError, HFTextEncoder
from vdtrain.models.vq import VQModel
from vdtrain.targets.llamagen import (
    LlamaGenSpec,
    LlamaGenTarget,
    VQTokenizer,
    build_llamagen_target,
)

pytestmark = pytest.mark.usefixtures("one_thread")

IMAGE_SIZE = 8  # TINY_VQ down-samples 2x: a 4x4 grid = TINY_GPT.block_size

# --- helpers ----------------------------------------------------------------------------------------


def official_args() -> argparse.Namespace:
    """What the official trainer stores under ``"args"``: its parsed command line."""
    return argparse.Namespace(
        gpt_model="GPT-XL", gpt_type="t2i", cls_token_num=120, lr=1e-4, no_compile=False
    )


def save_checkpoint(path: Path, state: dict[str, torch.Tensor], layout: str) -> Path:
    """Write ``state`` the way one of the original trainers does."""
    state = {k: v.detach().clone().contiguous() for k, v in state.items()}
    if layout == "safetensors":
        from safetensors.torch import save_file

        save_file(state, str(path))
        return path
    blob: dict[str, object]
    if layout == "model":  # train_t2i.py
        optimizer = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(2)}}, "param_groups": []}
        blob = {"model": state, "optimizer": optimizer, "steps": 3, "args": official_args()}
    elif layout == "module":  # DeepSpeed
        blob = {"module": state, "global_steps": 3, "ds_version": "0.14.0"}
    elif layout == "state_dict":
        blob = {"state_dict": state}
    elif layout == "flat":
        blob = state
    else:
        raise ValueError(layout)
    torch.save(blob, path)
    return path


def tiny_target_from(gpt: LlamaGenGPT) -> LlamaGenTarget:
    vq = VQTokenizer(random_vq(), IMAGE_SIZE)
    return LlamaGenTarget(gpt, vq, None, "tiny", SamplingConfig())


def cfg_logits(gpt: LlamaGenGPT, tokens: torch.Tensor) -> torch.Tensor:
    """Teacher-forced logits of the conditional and the null-caption streams (uses every weight)."""
    target = tiny_target_from(gpt)
    cond = tiny_condition()
    with torch.no_grad():
        return target.forward_sequence(cond.cat(target.null_condition(cond)), tokens.repeat(2, 1)).logits


def sections(message: str) -> dict[str, str]:
    """``load_strict``'s message → {"missing keys": "...", "unexpected keys": "...", ...}."""
    body = message.split("—", 1)[-1]
    return dict(part.strip().split(": ", 1) for part in body.split("; "))


def expected_gpt_shapes(c) -> dict[str, tuple[int, ...]]:
    """The official t2i GPT state dict: name → shape (no RoPE table)."""
    shapes: dict[str, tuple[int, ...]] = {
        "cls_embedding.cap_proj.fc1.weight": (c.dim, c.caption_dim),
        "cls_embedding.cap_proj.fc2.weight": (c.dim, c.dim),
        "cls_embedding.uncond_embedding": (c.cls_token_num, c.caption_dim),
        "tok_embeddings.weight": (c.vocab_size, c.dim),
        "norm.weight": (c.dim,),
        "output.weight": (c.vocab_size, c.dim),
    }
    qkv = (c.n_head + 2 * c.kv_heads) * c.head_dim
    for i in range(c.n_layer):
        shapes |= {
            f"layers.{i}.attention.wqkv.weight": (qkv, c.dim),
            f"layers.{i}.attention.wo.weight": (c.dim, c.dim),
            f"layers.{i}.feed_forward.w1.weight": (c.ffn_hidden, c.dim),
            f"layers.{i}.feed_forward.w3.weight": (c.ffn_hidden, c.dim),
            f"layers.{i}.feed_forward.w2.weight": (c.dim, c.ffn_hidden),
            f"layers.{i}.attention_norm.weight": (c.dim,),
            f"layers.{i}.ffn_norm.weight": (c.dim,),
        }
    return shapes


# The grammar of the official VQ key names.
_CONV = r"(weight|bias)"
_RES = r"res\.\d+\.(norm1|conv1|norm2|conv2|nin_shortcut)\." + _CONV
_ATTN = r"attn\.\d+\.(norm|q|k|v|proj_out)\." + _CONV
_MID = r"mid\.(0|2)\.(norm1|conv1|norm2|conv2)\." + _CONV + r"|mid\.1\.(norm|q|k|v|proj_out)\." + _CONV
VQ_KEY = re.compile(
    rf"encoder\.conv_blocks\.\d+\.({_RES}|{_ATTN}|downsample\.conv\.{_CONV})"
    rf"|decoder\.conv_blocks\.\d+\.({_RES}|{_ATTN}|upsample\.conv\.{_CONV})"
    rf"|(encoder|decoder)\.({_MID})"
    rf"|(encoder|decoder)\.(conv_in|norm_out|conv_out)\.{_CONV}"
    rf"|(quant_conv|post_quant_conv)\.{_CONV}"
    r"|quantize\.embedding\.weight|quantize\.codebook_used"
)


# --- the real-size layouts, on the meta device ------------------------------------------------------


def test_gpt_xl_preset_matches_the_official_sizes():
    c = gpt_config_from("GPT-XL", {})
    assert (c.dim, c.n_layer, c.n_head, c.ffn_hidden) == (1280, 36, 20, 3584)
    assert (c.caption_dim, c.cls_token_num, c.vocab_size, c.block_size) == (2048, 120, 16384, 256)


def test_gpt_xl_on_meta_has_exactly_the_official_keys_and_shapes():
    c = gpt_config_from("GPT-XL", {})
    with torch.device("meta"):
        gpt = LlamaGenGPT(c)
    state = gpt.state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == expected_gpt_shapes(c)
    assert tuple(state["layers.0.attention.wqkv.weight"].shape) == (3840, 1280)
    assert tuple(state["cls_embedding.uncond_embedding"].shape) == (120, 2048)
    assert "rope" not in state and not any("rope" in k or "freqs_cis" in k for k in state)
    # uncond_embedding is a buffer of the official model, not a trained parameter
    assert "cls_embedding.uncond_embedding" not in dict(gpt.named_parameters())
    n_params = sum(p.numel() for p in gpt.parameters())
    assert 770e6 < n_params < 785e6, n_params  # "775M" in the LlamaGen paper


def test_vq16_on_meta_has_the_official_keys_and_shapes():
    c = vq_config_from("VQ-16", {})
    assert c.downsample == 16 and (c.codebook_size, c.codebook_embed_dim) == (16384, 8)
    with torch.device("meta"):
        vq = VQModel(c)
    shapes = {k: tuple(v.shape) for k, v in vq.state_dict().items()}
    bad = [k for k in shapes if not VQ_KEY.fullmatch(k)]
    assert not bad, bad
    assert shapes["quantize.embedding.weight"] == (16384, 8)
    assert shapes["quantize.codebook_used"] == (65536,)
    assert "quantize.codebook_used" not in dict(vq.named_parameters())
    assert shapes["quant_conv.weight"] == (8, 256, 1, 1)
    assert shapes["post_quant_conv.weight"] == (256, 8, 1, 1)
    assert shapes["encoder.conv_in.weight"] == (128, 3, 3, 3)
    assert shapes["encoder.conv_blocks.2.res.0.nin_shortcut.weight"] == (256, 128, 1, 1)
    assert shapes["encoder.conv_blocks.3.downsample.conv.weight"] == (256, 256, 3, 3)
    assert shapes["encoder.conv_blocks.4.attn.1.q.weight"] == (512, 512, 1, 1)
    assert shapes["encoder.mid.1.proj_out.weight"] == (512, 512, 1, 1)
    assert shapes["encoder.conv_out.weight"] == (256, 512, 3, 3)
    assert shapes["decoder.conv_in.weight"] == (512, 256, 3, 3)
    assert shapes["decoder.conv_blocks.0.attn.2.proj_out.weight"] == (512, 512, 1, 1)  # 3 res per level
    assert shapes["decoder.conv_blocks.1.res.0.nin_shortcut.weight"] == (256, 512, 1, 1)
    assert shapes["decoder.conv_blocks.3.upsample.conv.weight"] == (128, 128, 3, 3)
    assert shapes["decoder.conv_out.weight"] == (3, 128, 3, 3)
    # no down-sampling after the last encoder level, no up-sampling after the last decoder level
    assert not any(
        k.startswith(("encoder.conv_blocks.4.downsample", "decoder.conv_blocks.4.upsample")) for k in shapes
    )
    assert not any(
        ".attn." in k for k in shapes if k.startswith(("encoder.conv_blocks.3", "decoder.conv_blocks.1"))
    )
    n_params = sum(p.numel() for p in vq.parameters())
    assert 70e6 < n_params < 74e6, n_params  # VQ-16 is a ~72M tokenizer


# --- round trips through the official file layouts --------------------------------------------------


@pytest.mark.parametrize("layout", ["model", "module", "state_dict", "flat", "safetensors"])
def test_gpt_round_trip(tmp_path, layout):
    gpt = random_gpt(seed=3)
    suffix = ".safetensors" if layout == "safetensors" else ".pt"
    path = save_checkpoint(tmp_path / f"gpt{suffix}", gpt.state_dict(), layout)

    torch.manual_seed(1234)  # the fresh model inside load_gpt starts from other weights
    loaded = load_gpt(path, TINY_GPT)
    assert not loaded.training
    for key, value in gpt.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    tokens = torch.randint(
        0, TINY_GPT.vocab_size, (2, TINY_GPT.block_size), generator=torch.Generator().manual_seed(5)
    )
    assert torch.equal(cfg_logits(loaded, tokens), cfg_logits(gpt.eval(), tokens))


@pytest.mark.parametrize("show_usage", [True, False])
def test_vq_round_trip_in_the_official_layout(tmp_path, show_usage):
    vq = random_vq(seed=4)
    state = vq.state_dict()
    assert "quantize.codebook_used" in state  # the official file always carries the usage buffer
    state["quantize.codebook_used"] = torch.arange(65536.0)
    path = tmp_path / "vq_ds16_t2i.pt"
    torch.save({"model": state}, path)

    torch.manual_seed(999)
    config = dataclasses.replace(TINY_VQ, codebook_show_usage=show_usage)
    loaded = load_vq(path, config)
    assert not loaded.training
    if show_usage:
        assert torch.equal(loaded.quantize.codebook_used, state["quantize.codebook_used"])
    else:
        assert "quantize.codebook_used" not in loaded.state_dict()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, state[key]), key

    images = torch.rand(2, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        tokens = vq.encode(images)
        assert tokens.shape == (2, 4, 4)
        assert torch.equal(loaded.encode(images), tokens)
        assert torch.equal(loaded.decode(tokens), vq.decode(tokens))


# --- the caption encoder and the whole target, from files -------------------------------------------

T5_WORDS = [
    "a",
    "an",
    "the",
    "red",
    "green",
    "blue",
    "yellow",
    "big",
    "small",
    "square",
    "circle",
    "triangle",
    "star",
    "on",
    "of",
    "to",
    "left",
    "right",
    "above",
    "below",
    "next",
    "and",
    "with",
    "photo",
    "picture",
]
CAPTION_DIM = 16
E2E_GPT = dataclasses.replace(TINY_GPT, caption_dim=CAPTION_DIM, cls_token_num=8)


def make_t5_folder(folder: Path) -> Path:
    """A tiny random flan-t5 look-alike: encoder weights + a fast tokenizer (``</s>`` eos, ``<pad>``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2} | {w: i + 3 for i, w in enumerate(T5_WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", padding_side="right"
    )
    config = T5Config(
        vocab_size=len(vocab),
        d_model=CAPTION_DIM,
        d_kv=8,
        d_ff=32,
        num_layers=2,
        num_heads=2,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    torch.manual_seed(0)
    T5EncoderModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def t5_folder(tmp_path_factory) -> Path:
    return make_t5_folder(tmp_path_factory.mktemp("flan-t5-tiny"))


@pytest.fixture(scope="module")
def checkpoint_files(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("llamagen")
    gpt_path = save_checkpoint(
        folder / "t2i_XL_stage1_256.pt", random_gpt(E2E_GPT, seed=2).state_dict(), "model"
    )
    vq_path = folder / "vq_ds16_t2i.pt"
    torch.save({"model": random_vq(seed=2).state_dict()}, vq_path)
    return gpt_path, vq_path


def e2e_spec(gpt_path: Path, vq_path: Path, t5_folder: Path | None, **changes) -> LlamaGenSpec:
    vq = dataclasses.asdict(TINY_VQ)
    vq["ch_mult"] = list(vq["ch_mult"])  # as it comes out of a yaml config
    spec = LlamaGenSpec(
        name="tiny-t2i",
        gpt_ckpt=str(gpt_path),
        vq_ckpt=str(vq_path),
        gpt_preset=None,
        gpt=dataclasses.asdict(E2E_GPT),
        vq_preset=None,
        vq=vq,
        image_size=IMAGE_SIZE,
        text_encoder_path=None if t5_folder is None else str(t5_folder),
        text_encoder_kind="t5",
    )
    return dataclasses.replace(spec, **changes)


def test_build_target_end_to_end_with_a_t5_folder(t5_folder, checkpoint_files):
    from transformers import AutoTokenizer, T5EncoderModel

    target = build_llamagen_target(e2e_spec(*checkpoint_files, t5_folder))
    assert target.prefix_length == 8 and target.num_image_tokens == 16 and target.vocab_size == 24

    captions = ["a red square", "big blue circle on the left"]
    cond = target.encode_captions(captions)
    assert cond.features.shape == (2, 8, CAPTION_DIM) and cond.mask.shape == (2, 8)
    assert cond.captions == captions

    tokenizer = AutoTokenizer.from_pretrained(t5_folder, local_files_only=True)
    encoder = T5EncoderModel.from_pretrained(t5_folder, local_files_only=True).eval()
    for row, caption in enumerate(captions):
        ids = tokenizer(caption, return_tensors="pt")["input_ids"]
        n = ids.shape[1]
        assert ids[0, -1].item() == tokenizer.eos_token_id and n == len(caption.split()) + 1
        # left-padded: the real tokens (caption + </s>) last, padding rows zero
        assert cond.mask[row].tolist() == [False] * (8 - n) + [True] * n
        assert torch.count_nonzero(cond.features[row, : 8 - n]) == 0
        with torch.no_grad():
            reference = encoder(input_ids=ids).last_hidden_state[0]
        torch.testing.assert_close(cond.features[row, 8 - n :], reference, atol=1e-5, rtol=1e-5)

    sampling = SamplingConfig(cfg_scale=2.0, temperature=0)
    tokens = generate_ar(target, cond, sampling, [None] * len(captions))
    assert tokens.shape == (2, target.num_image_tokens) and tokens.dtype == torch.long
    assert tokens.min() >= 0 and tokens.max() < target.vocab_size
    assert torch.equal(generate_ar(target, cond, sampling, [None, None]), tokens)  # greedy is deterministic
    images = target.tokenizer.decode(tokens)
    assert images.shape == (2, 3, IMAGE_SIZE, IMAGE_SIZE) and images.abs().max() <= 1


def test_llamagen_targets_clean_captions_before_t5_and_the_shapes_target_does_not(
    t5_folder, checkpoint_files, tiny_folder
):
    from vdtrain.targets.shapes import load_target_folder

    messy = "<b>A RED</b> Square https://shop.com/red"
    target = build_llamagen_target(e2e_spec(*checkpoint_files, t5_folder))  # the default: llamagen
    cond, clean = target.encode_captions([messy]), target.encode_captions(["a red square"])
    assert cond.captions == [messy]  # the condition keeps the caption as given
    assert torch.equal(cond.features, clean.features) and torch.equal(cond.mask, clean.mask)
    raw = build_llamagen_target(e2e_spec(*checkpoint_files, t5_folder, text_preprocessing="none"))
    assert not torch.equal(raw.encode_captions([messy]).features, clean.features)
    with pytest.raises(ValueError, match="unknown text_preprocessing 'lower'"):
        build_llamagen_target(e2e_spec(*checkpoint_files, t5_folder, text_preprocessing="lower"))

    shapes = load_target_folder(tiny_folder)  # MiniLM captions go in as written
    encoder = shapes.caption_encoder.fallback("an uncached caption")  # loaded where the cache lacks one
    assert encoder.preprocess(" A <b>red</b> circle ") == "A <b>red</b> circle"


def test_caption_width_must_match_the_gpt(t5_folder, tmp_path):
    narrow = dataclasses.replace(E2E_GPT, caption_dim=12)
    gpt_path = save_checkpoint(tmp_path / "gpt.pt", random_gpt(narrow).state_dict(), "model")
    vq_path = tmp_path / "vq.pt"
    torch.save({"model": random_vq().state_dict()}, vq_path)
    spec = e2e_spec(gpt_path, vq_path, t5_folder, gpt=dataclasses.asdict(narrow))
    with pytest.raises(ValueError, match=r"16 != .*caption_dim 12"):
        build_llamagen_target(spec)


# --- bad input ---------------------------------------------------------------------------------------


def test_missing_checkpoint_names_the_path(tmp_path, checkpoint_files):
    missing = tmp_path / "no_such_dir" / "t2i_XL_stage1_256.pt"
    with pytest.raises(CheckpointError, match=re.escape(str(missing))):
        load_gpt(missing, TINY_GPT)
    with pytest.raises(CheckpointError, match=re.escape(str(missing))):
        load_vq(missing, TINY_VQ)
    _, vq_path = checkpoint_files
    with pytest.raises(CheckpointError, match=re.escape(str(missing))):
        build_llamagen_target(e2e_spec(missing, vq_path, None))


def test_renamed_key_names_the_missing_and_the_unexpected_key(tmp_path):
    state = random_gpt().state_dict()
    state["final_norm.weight"] = state.pop("norm.weight")
    path = save_checkpoint(tmp_path / "gpt.pt", state, "model")
    with pytest.raises(CheckpointError) as err:
        load_gpt(path, TINY_GPT)
    parts = sections(str(err.value))
    assert parts["missing keys"] == "norm.weight"
    assert parts["unexpected keys"] == "final_norm.weight"
    assert str(path) in str(err.value)


def test_wrong_depth_preset_names_the_missing_layer(tmp_path):
    path = save_checkpoint(tmp_path / "gpt.pt", random_gpt().state_dict(), "model")  # 2 layers
    with pytest.raises(CheckpointError) as err:
        load_gpt(path, dataclasses.replace(TINY_GPT, n_layer=3))
    parts = sections(str(err.value))
    assert "layers.2.attention.wqkv.weight" in parts["missing keys"]
    assert "layers.2.feed_forward.w1.weight" in parts["missing keys"]
    assert "unexpected keys" not in parts
    # and the other way round: a deeper file into a shallower model
    deep = save_checkpoint(
        tmp_path / "deep.pt", random_gpt(dataclasses.replace(TINY_GPT, n_layer=3)).state_dict(), "model"
    )
    with pytest.raises(CheckpointError, match=r"unexpected keys: .*layers\.2\.attention\.wqkv\.weight"):
        load_gpt(deep, TINY_GPT)


def test_shape_mismatch_is_named(tmp_path):
    path = save_checkpoint(tmp_path / "gpt.pt", random_gpt().state_dict(), "module")
    with pytest.raises(CheckpointError) as err:
        load_gpt(path, dataclasses.replace(TINY_GPT, vocab_size=32))
    parts = sections(str(err.value))
    assert "tok_embeddings.weight: file (24, 32) vs model (32, 32)" in parts["shape mismatches"]
    assert "output.weight: file (24, 32) vs model (32, 32)" in parts["shape mismatches"]
    assert "missing keys" not in parts and "unexpected keys" not in parts
    # the VQ codebook too (VQ-16's is 16384 x 8)
    vq_path = tmp_path / "vq.pt"
    torch.save({"model": random_vq().state_dict()}, vq_path)
    with pytest.raises(
        CheckpointError, match=re.escape("quantize.embedding.weight: file (24, 4) vs model (24, 8)")
    ):
        load_vq(vq_path, dataclasses.replace(TINY_VQ, codebook_embed_dim=8))


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_truncated_or_corrupt_file_is_a_checkpoint_error(tmp_path, suffix):
    layout = "safetensors" if suffix == ".safetensors" else "model"
    good = save_checkpoint(tmp_path / f"good{suffix}", random_gpt().state_dict(), layout)
    truncated = tmp_path / f"truncated{suffix}"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=re.escape(str(truncated))):
        load_gpt(truncated, TINY_GPT)
    garbage = tmp_path / f"garbage{suffix}"
    garbage.write_bytes(b"<html>404 Not Found</html>\n" * 8)  # what a failed download leaves behind
    with pytest.raises(CheckpointError, match=re.escape(str(garbage))):
        read_state_dict(garbage)


def test_file_without_a_state_dict_is_a_checkpoint_error(tmp_path):
    path = tmp_path / "steps_only.pt"
    torch.save({"steps": 3, "optimizer": {"state": {}, "param_groups": []}}, path)
    with pytest.raises(CheckpointError, match="holds no state dict"):
        read_state_dict(path)


def test_missing_text_encoder_folder_names_the_folder(tmp_path, checkpoint_files):
    folder = tmp_path / "flan-t5-xl"
    with pytest.raises(FileNotFoundError, match=re.escape(str(folder))):
        HFTextEncoder(folder, kind="t5", max_length=120)
    with pytest.raises(FileNotFoundError, match=re.escape(str(folder))):
        build_llamagen_target(e2e_spec(*checkpoint_files, folder))


LONG_CAPTION = "a big red square on the left of a small blue circle above the green star"


def test_caption_longer_than_max_length_is_refused_on_request(t5_folder):
    encoder = HFTextEncoder(t5_folder, kind="t5", max_length=8, on_overflow="error")
    with pytest.raises(CaptionTooLongError, match="8-token"):
        encoder(["a red square", LONG_CAPTION])
    features, mask = encoder(["a red square"])  # short captions still pass
    assert features.shape == (1, 8, CAPTION_DIM) and mask.sum() == 4


def test_caption_longer_than_max_length_is_truncated_with_a_warning(t5_folder, caplog):
    encoder = HFTextEncoder(t5_folder, kind="t5", max_length=8, on_overflow="truncate")
    with caplog.at_level(logging.WARNING, logger="vdtrain.models.text_encoders"):
        features, mask = encoder([LONG_CAPTION, "a red square"])
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "truncating" in r.getMessage()]
    assert len(warnings) == 1 and "1 caption(s) exceed the 8-token" in warnings[0].getMessage()
    assert features.shape == (2, 8, CAPTION_DIM) and mask.shape == (2, 8)
    assert mask[0].all() and mask[1].sum() == 4
    with caplog.at_level(logging.WARNING, logger="vdtrain.models.text_encoders"):
        caplog.clear()
        encoder(["a red square"])
    assert not caplog.records  # no warning when nothing is cut


@pytest.mark.filterwarnings("ignore:target.dtype=bf16 on the CPU")
def test_fit_trains_a_step_on_the_bf16_target(t5_folder, checkpoint_files):
    bf16_fit_step(build_llamagen_target(e2e_spec(*checkpoint_files, t5_folder)), ["a red square", "a circle"])
