"""Extra caption caches (``python -m data_prep.captions``): a machine without the caption encoder (a GPU
machine, no network) runs a target folder on more captions than the 32 it ships."""

from __future__ import annotations

import shutil

import pytest
import torch
from omegaconf import OmegaConf

from data_prep.captions import run
from vdtrain.prompts import shapes_heldout_captions
from vdtrain.targets import load_target_folder
from vdtrain.targets.caption_cache import CachedCaptions
from vdtrain.targets.shapes import SHIPPED_TARGET


@pytest.fixture()
def folder(tmp_path):
    """The shipped shapes target, weights linked, its caption cache copied."""
    for name in ("gpt.pt", "vq.pt"):
        (tmp_path / name).symlink_to(SHIPPED_TARGET / name)
    for name in ("config.json", "captions.safetensors"):
        shutil.copy(SHIPPED_TARGET / name, tmp_path / name)
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
