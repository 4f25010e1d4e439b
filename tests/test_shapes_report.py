"""Probes of what the shapes target has learnt (``vdtrain.shapes.report``): caption and grid position."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from vdtrain.models.llamagen_gpt import LlamaGenGPT
from vdtrain.shapes import report
from vdtrain.shapes.report import CAPTION_EDITS, caption_sensitivity, edit_scene, position_probe
from vdtrain.shapes.scene import HELDOUT_SEED, describe, generate, object_colours_for, parse_caption
from vdtrain.targets.llamagen import LlamaGenTarget
from vdtrain.targets.shapes import load_target_folder


@pytest.mark.parametrize("edit", CAPTION_EDITS)
def test_an_edit_changes_exactly_one_attribute_and_keeps_the_scene_legal(edit: str) -> None:
    rng = np.random.default_rng(0)
    scenes = [s.scene for s in generate(200, HELDOUT_SEED) if len(s.scene.objects) == 1][:20]
    for scene in scenes:
        edited = edit_scene(scene, edit, rng)
        before = parse_caption(describe(scene, np.random.default_rng(1)))
        after = parse_caption(describe(edited, np.random.default_rng(1)))
        fields = {
            "background colour": (before.background.colours[0], after.background.colours[0]),
            "object cell": (before.objects[0].cell, after.objects[0].cell),
            "object colour": (before.objects[0].colour, after.objects[0].colour),
            "object shape": (before.objects[0].shape, after.objects[0].shape),
            "object size": (before.objects[0].size, after.objects[0].size),
        }
        assert fields[edit][0] != fields[edit][1]
        assert all(old == new for name, (old, new) in fields.items() if name != edit)
        assert edited.objects[0].colour in object_colours_for(edited.background)


def test_sensitivity_compares_each_image_under_two_captions_phrased_alike(tiny_folder, monkeypatch) -> None:
    target = load_target_folder(tiny_folder)
    result = caption_sensitivity(target, n_scenes=4, batch_size=2)
    assert set(result) == set(CAPTION_EDITS)
    assert all(np.isfinite(r["nats"]) and 0 <= r["true_caption_preferred"] <= 1 for r in result.values())
    assert any(r["nats"] != 0 for r in result.values())  # a random target still reads its caption
    # An edit that changes nothing costs exactly nothing: the true and edited captions share a phrasing.
    monkeypatch.setattr(report, "edit_scene", lambda scene, edit, rng: scene)
    unchanged = caption_sensitivity(target, n_scenes=4, batch_size=2)
    assert all(r == {"nats": 0.0, "true_caption_preferred": 0.0} for r in unchanged.values())


def test_the_position_probe_reads_positions_only_from_a_target_that_carries_them(tiny_folder) -> None:
    target = load_target_folder(tiny_folder)
    plain = position_probe(target, n_images=8, batch_size=4)
    assert plain["row_error_guessing_the_mean"] == pytest.approx(4.0)  # 16 rows, uniform
    gpt = target.gpt
    config = replace(gpt.config, learned_pos_embedding=True)
    # A table that spells out row and column in two directions and dwarfs everything else in the stream.
    index = torch.arange(gpt.config.block_size)
    table = torch.zeros(config.max_seq_len, config.dim)
    table[:, 0] = 100.0
    table[config.cls_token_num :, 1] = 5.0 * (index // 16)
    table[config.cls_token_num :, 2] = 5.0 * (index % 16)
    with_table = LlamaGenGPT(config)
    with_table.load_state_dict({**gpt.state_dict(), "pos_embedding": table})
    placed = position_probe(
        LlamaGenTarget(
            with_table.eval(), target.tokenizer, target.caption_encoder, "t", target.sampling_defaults
        ),
        n_images=8,
        batch_size=4,
    )
    for axis in ("row", "column"):
        assert placed[f"{axis}_error"] < 0.5 * placed[f"{axis}_error_guessing_the_mean"]
        assert placed[f"{axis}_error"] < plain[f"{axis}_error"]
