"""An export's files as a user (or a shared cache) finds them: the weights readable like the rest, and a
block drafter's card tagged and described as what it is (issue 58)."""

from __future__ import annotations

import os

from conftest import random_drafter

from vdtrain.drafters.base import block_kind
from vdtrain.hub import export_drafter


def test_the_weights_have_the_mode_of_the_files_beside_them(tiny_target, tmp_path):
    folder = export_drafter(random_drafter(tiny_target), tmp_path / "export", target=tiny_target)
    modes = {p.name: os.stat(p).st_mode & 0o777 for p in folder.iterdir() if p.is_file()}
    assert modes["model.safetensors"] == modes["config.json"], modes  # safetensors' own writer made 0600


def test_a_block_drafters_card_is_not_tagged_eagle_and_says_whose_heads_it_counts(tiny_target, tmp_path):
    drafter = random_drafter(tiny_target, kind=block_kind())
    card = (export_drafter(drafter, tmp_path / "export", target=tiny_target) / "README.md").read_text()
    front = card.split("---")[1]
    assert "- eagle\n" not in front and "- block-drafting\n" in front
    assert f"its own {drafter.options.heads} attention heads, `options.heads`" in card
    eagle = export_drafter(random_drafter(tiny_target), tmp_path / "eagle", target=tiny_target)
    assert "- eagle\n" in (eagle / "README.md").read_text().split("---")[1]
