"""``python -m vdtrain.generate`` on a tiny target folder laid out like the shipped shapes target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TINY_FOLDER_TOKENS
from hydra import compose, initialize_config_dir

from vdtrain.drafters import Drafter, DrafterConfig
from vdtrain.generate import method_alias, run
from vdtrain.prompts import shapes_heldout_captions
from vdtrain.targets import load_target_folder

CONF = Path(__file__).resolve().parents[1] / "conf"


def _config(folder: Path, out: Path, *overrides: str):
    with initialize_config_dir(str(CONF), version_base=None):
        return compose(
            "generate",
            overrides=[
                f"target.folder={folder}",
                f"out_dir={out}",
                "num_prompts=3",
                "batch_size=2",
                *overrides,
            ],
        )


def test_generate_writes_images_and_stats(tiny_folder, tmp_path):
    summary = run(_config(tiny_folder, tmp_path / "run", "seed=5"))
    stats = json.loads((tmp_path / "run" / "stats.json").read_text())
    assert summary["num_samples"] == 3 and summary["sampling"]["cfg_scale"] == 3.0
    assert [s["seed"] for s in stats["samples"]] == [5, 6, 7]
    for s in stats["samples"]:
        assert len(s["tokens"]) == TINY_FOLDER_TOKENS and max(s["tokens"]) < 32
        assert 0.0 <= s["quality"] <= 1.0
        assert (tmp_path / "run" / f"{s['index']:04d}.png").exists()
    assert (tmp_path / "run" / "grid.png").exists()


def test_real_captions_on_the_shapes_target_are_generated_and_left_unscored(tiny_folder, tmp_path):
    shapes = shapes_heldout_captions(2)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join([shapes[0], "A man riding a horse on a beach.", shapes[1]]) + "\n")
    summary = run(_config(tiny_folder, tmp_path / "run", f"prompts={prompts}"))
    samples = json.loads((tmp_path / "run" / "stats.json").read_text())["samples"]
    assert summary["num_samples"] == 3 and summary["num_scored"] == 2
    assert [s["quality"] is None for s in samples] == [False, True, False]
    assert "shapes-world captions only" in samples[1]["quality_unavailable"]
    assert summary["mean_quality"] == (samples[0]["quality"] + samples[2]["quality"]) / 2
    assert "shapes-world captions only" in summary["quality_unavailable"]
    assert all((tmp_path / "run" / f"{i:04d}.png").exists() for i in range(3))


def test_same_seed_same_tokens_whatever_the_batching(tiny_folder, tmp_path):
    run(_config(tiny_folder, tmp_path / "a", "batch_size=3"))
    run(_config(tiny_folder, tmp_path / "b", "batch_size=1", "sampling.top_k=8"))
    run(_config(tiny_folder, tmp_path / "c", "batch_size=1"))
    a, b, c = (json.loads((tmp_path / d / "stats.json").read_text())["samples"] for d in "abc")
    assert [s["tokens"] for s in a] == [s["tokens"] for s in c]
    assert [s["tokens"] for s in a] != [s["tokens"] for s in b]


def test_missing_target_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json is missing"):
        load_target_folder(tmp_path)


def test_unknown_tree_kind_is_refused(tiny_folder, tmp_path):
    target = load_target_folder(tiny_folder)
    Drafter.make(DrafterConfig.for_target(target)).save_pretrained(tmp_path / "drafter")
    overrides = ("decode=eagle2", f"drafter={tmp_path / 'drafter'}", "decode.tree.kind=magic")
    with pytest.raises(ValueError, match="unknown tree kind"):
        run(_config(tiny_folder, tmp_path, *overrides))


def test_method_is_an_alias_of_the_decode_group():
    assert method_alias(["method=eagle2", "seed=1"]) == ["decode=eagle2", "seed=1"]


@pytest.mark.parametrize("method", ["eagle1", "eagle2", "peanut"])
def test_speculative_methods_match_ar_at_temperature_zero(method, tiny_folder, tmp_path):
    target = load_target_folder(tiny_folder)
    Drafter.make(DrafterConfig.for_target(target)).save_pretrained(tmp_path / "drafter")
    greedy = ("sampling.temperature=0", "num_prompts=2")
    ar = run(_config(tiny_folder, tmp_path / "ar", *greedy))
    spec = run(
        _config(
            tiny_folder, tmp_path / method, *greedy, f"decode={method}", f"drafter={tmp_path / 'drafter'}"
        )
    )
    tokens = [json.loads((tmp_path / d / "stats.json").read_text())["samples"] for d in ("ar", method)]
    assert [s["tokens"] for s in tokens[0]] == [s["tokens"] for s in tokens[1]]
    assert ar["S"] == 1.0 and spec["method"] == method and spec["tau"] >= 1.0
    assert spec["target_forwards"] < ar["target_forwards"] or spec["tau"] == 1.0


@pytest.mark.parametrize(
    ("method", "kind"),
    [
        ("lantern", "lantern"),
        ("lantern_pp", "lantern_pp"),
        ("gsd_tree", "gsd"),
        ("peanut_lantern", "lantern"),
    ],
)
def test_relaxed_presets_compose_and_decode(method, kind, tiny_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("VDTRAIN_CACHE", str(tmp_path / "cache"))  # the neighbour table lands here
    target = load_target_folder(tiny_folder)
    Drafter.make(DrafterConfig.for_target(target)).save_pretrained(tmp_path / "drafter")
    overrides = (*method_alias([f"method={method}"]), f"drafter={tmp_path / 'drafter'}")
    summary = run(
        _config(tiny_folder, tmp_path / method, "sampling.temperature=1", "num_prompts=2", *overrides)
    )
    assert summary["method"] == method and summary["decode"]["acceptance"]["kind"] == kind
    assert summary["num_samples"] == 2 and summary["relaxed_acceptances"] >= 0
    assert bool(list((tmp_path / "cache" / "neighbours").glob("*.pt"))) == (kind != "gsd")


@pytest.mark.parametrize(("method", "kind"), [("sjd", "exact"), ("gsd", "gsd")])
def test_jacobi_presets_decode_without_a_drafter(method, kind, tiny_folder, tmp_path):
    overrides = (*method_alias([f"method={method}"]), f"drafter={tmp_path / 'no_drafter_here'}")
    summary = run(
        _config(tiny_folder, tmp_path / method, "sampling.temperature=1", "num_prompts=2", *overrides)
    )
    assert summary["method"] == method and summary["drafter"] is None
    tree = summary["decode"]["tree"]  # the typed method: the preset's keys and its classes' defaults
    assert (tree["kind"], tree["window"], tree["init"]) == ("jacobi", 16, "random")
    assert summary["decode"]["acceptance"]["kind"] == kind
    assert summary["num_samples"] == 2 and summary["drafter_forwards"] == 0.0
    assert summary["mean_depth"] > 1.0 and summary["tau"] >= 1.0


def test_sjd_matches_ar_at_temperature_zero(tiny_folder, tmp_path):
    greedy = ("sampling.temperature=0", "num_prompts=2")
    run(_config(tiny_folder, tmp_path / "ar", *greedy))
    sjd = ("decode=sjd", "decode.tree.init=horizontal_sample", f"drafter={tmp_path / 'none'}")
    run(_config(tiny_folder, tmp_path / "sjd", *greedy, *sjd))
    tokens = [json.loads((tmp_path / d / "stats.json").read_text())["samples"] for d in ("ar", "sjd")]
    assert [s["tokens"] for s in tokens[0]] == [s["tokens"] for s in tokens[1]]


@pytest.mark.parametrize(
    ("method", "kind", "extra"),
    [
        ("vvs", "similarity", ()),
        ("vvs", "similarity", ("decode.schedule.t_sim=-1",)),  # every allowed step is skipped
        ("vvs_uniform", "uniform", ()),
    ],
    ids=["vvs", "vvs_t_sim_-1", "vvs_uniform"],
)
def test_vvs_presets_decode_and_report_skipped_steps(method, kind, extra, tiny_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("VDTRAIN_CACHE", str(tmp_path / "cache"))  # the neighbour table lands here
    target = load_target_folder(tiny_folder)
    Drafter.make(DrafterConfig.for_target(target)).save_pretrained(tmp_path / "drafter")
    overrides = (*method_alias([f"method={method}"]), f"drafter={tmp_path / 'drafter'}", *extra)
    summary = run(
        _config(tiny_folder, tmp_path / method, "sampling.temperature=1", "num_prompts=2", *overrides)
    )
    assert summary["method"] == method and summary["decode"]["schedule"]["kind"] == kind
    assert summary["decode"]["acceptance"]["kind"] == "lantern" and summary["num_samples"] == 2
    assert summary["target_forwards"] == 1 + summary["verified_steps"]  # skipped steps cost none
    if kind == "uniform" or extra:
        assert summary["skipped_steps"] > 0 and summary["TPF"] > summary["tau"]
    stats = json.loads((tmp_path / method / "stats.json").read_text())
    assert all(len(s["tokens"]) == TINY_FOLDER_TOKENS for s in stats["samples"])


@pytest.mark.parametrize("count", [0, -2])
def test_no_prompts_is_refused_before_the_target_loads(count, tmp_path, monkeypatch):
    import vdtrain.targets

    def never(*_, **__):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(vdtrain.targets, "target_for_run", never)  # generate imports it when it runs
    with pytest.raises(ValueError, match=f"num_prompts must be at least 1, got {count}"):
        run(_config(tmp_path / "no_target", tmp_path / "run", f"num_prompts={count}"))
    assert not (tmp_path / "run").exists()


class _Stop(Exception):
    """Ends a generate run once its method is decided: the test reads that, not the images."""


@pytest.mark.parametrize(
    ("overrides", "key", "value"),
    [
        (["method=eagle2"], "tree.total_tokens", 90),  # the preset's default is 59
        (["method=lantern"], "acceptance.delta", 0.2),  # the preset's default is 0.1
        (["method=eagle2", "decode.tree.total_tokens=59"], "tree.total_tokens", 59),  # the command line's
        (["method=lantern", "decode.acceptance.k=5"], "acceptance.delta", 0.2),  # another key given
    ],
)
def test_generate_decodes_a_world_with_its_own_knobs_and_drafter(
    overrides, key, value, monkeypatch, tmp_path
):
    """conf/target/grain.yaml's knobs applied in evaluate only: generate used a 59-node tree and delta 0.1."""
    from omegaconf import OmegaConf

    from vdtrain.decode import methods

    decided, typed = [], methods.decode_config

    def decide(node):
        decided.append(typed(node))
        raise _Stop

    monkeypatch.setattr(methods, "decode_config", decide)
    with initialize_config_dir(str(CONF), version_base=None):
        cfg = compose(
            "generate",
            overrides=["target=grain", f"out_dir={tmp_path}", *method_alias(overrides)],
            return_hydra_config=True,
        )
    with pytest.raises(_Stop):
        run(cfg)
    assert OmegaConf.select(OmegaConf.structured(decided[0]), key) == value
    assert cfg.drafter == "checkpoints/grain/drafter"  # the world's own, not the shapes drafter


def test_a_drafter_of_another_target_is_refused_naming_the_targets_own(tiny_folder, tiny_target, tmp_path):
    from conftest import random_drafter

    from vdtrain.target_settings import load_drafter

    target = load_target_folder(tiny_folder)
    random_drafter(tiny_target).save_pretrained(tmp_path / "other")
    with pytest.raises(
        ValueError, match=r"does not match .*; this target's own drafter is drafter=ckpts/own"
    ):
        load_drafter(tmp_path / "other", target, "ckpts/own")


def test_the_grid_shows_every_line_of_a_long_caption():
    """Captions were cut after four lines; a COCO caption of 300 characters wraps to about 15."""
    import textwrap

    import numpy as np

    from vdtrain.images import captioned_grid

    caption = " ".join(["a red circle above a small blue square on a grey floor"] * 6)
    lines = textwrap.wrap(caption, 21)  # the width a 64-px image at scale 2 wraps at
    grid = np.asarray(captioned_grid([np.full((64, 64, 3), 255, np.uint8)], [caption]).convert("L"))
    below = grid[128 + 2 + 12 * (len(lines) - 1) :, :128]  # where the last line is drawn
    assert len(lines) > 4 and (below < 128).any()


def test_a_drafter_given_to_a_method_that_uses_none_is_named_in_a_warning(
    tiny_folder, tmp_path, caplog, monkeypatch
):
    """generate's default method is AR: a drafter on the command line would be silently ignored."""
    from vdtrain import generate

    for line, warned in ((["drafter=some/drafter"], True), ([], False)):  # [] : the target's own, not given
        monkeypatch.setattr(generate, "command_line", lambda cfg, line=line: line)
        cfg = _config(tiny_folder, tmp_path / str(warned), "num_prompts=1", *line)
        caplog.clear()
        with caplog.at_level("WARNING", logger="vdtrain.generate"):
            run(cfg)
        assert ("drafter=some/drafter is not used: method ar drafts with no drafter" in caplog.text) == warned
