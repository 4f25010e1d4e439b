"""The teacher-forced caption-sensitivity probe of the shapes target (``vdtrain.shapes.report``)."""

from __future__ import annotations

import numpy as np
import pytest

from vdtrain.shapes import report
from vdtrain.shapes.report import CAPTION_EDITS, caption_sensitivity, edit_scene
from vdtrain.shapes.scene import HELDOUT_SEED, describe, generate, object_colours_for, parse_caption
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


def test_report_top_k_overrides_the_targets_default(tiny_folder) -> None:
    target = load_target_folder(tiny_folder)
    assert target.sampling_defaults.top_k != 1
    kwargs = {"n_captions": 2, "cfg_scales": (3.0,), "seed": 0, "batch_size": 2}
    _, greedy, _ = report.consistency_report(target, temperature=0.0, **kwargs)
    _, top_1, _ = report.consistency_report(target, temperature=1.0, top_k=1, **kwargs)
    _, sampled, _ = report.consistency_report(target, temperature=1.0, **kwargs)
    # top_k 1 at T = 1 keeps only the mode: the same images as greedy decoding, unlike plain sampling.
    assert np.array_equal(top_1[3.0], greedy[3.0])
    assert not np.array_equal(sampled[3.0], greedy[3.0])
