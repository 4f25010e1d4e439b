"""``python -m vdtrain.evaluate`` and its runner: rows against AR, saved images, tables, plots, quality
metrics that say when they are not available, vendored prompt sets."""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import random_gpt, random_vq
from hydra import compose, initialize_config_dir
from PIL import Image

from vdtrain.decode.methods import load_preset, preset_names
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.drafters import Drafter, DrafterConfig
from vdtrain.eval.frechet import encoder_features, frechet_distance
from vdtrain.eval.plots import plot_tradeoff, write_plots
from vdtrain.eval.quality import REAL_IMAGE_METRICS, SHAPES_METRICS, QualityConfig, QualityScorer
from vdtrain.eval.runner import FLOOR_SEED_OFFSET, evaluate
from vdtrain.eval.table import EvalRow, QualityValue, read_results, to_markdown, write_tables
from vdtrain.evaluate import run
from vdtrain.prompts import prompt_set, prompts_for_run, shapes_heldout_captions
from vdtrain.targets import load_target_folder
from vdtrain.targets.llamagen import LlamaGenTarget, VQTokenizer

CONF = Path(__file__).resolve().parents[1] / "conf"
PROMPTS = shapes_heldout_captions(3)


def hashed_caption_features(captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """A stand-in caption encoder for the tiny target: fixed random features per caption."""
    gens = [torch.Generator().manual_seed(zlib.crc32(c.encode())) for c in captions]
    features = torch.stack([torch.randn(5, 12, generator=g) for g in gens])
    return features, torch.ones(len(captions), 5, dtype=torch.bool)


@pytest.fixture(scope="module")
def target() -> LlamaGenTarget:
    """A 4×4-token, 8 px target: every method decodes it in a fraction of a second."""
    tokenizer = VQTokenizer(random_vq(), image_size=8)
    return LlamaGenTarget(
        random_gpt(), tokenizer, hashed_caption_features, "tiny", SamplingConfig(cfg_scale=2.0)
    )


@pytest.fixture(scope="module")
def drafter(target) -> Drafter:
    torch.manual_seed(0)
    drafter = Drafter.make(DrafterConfig.for_target(target))
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return drafter.attach(target).eval()


@pytest.fixture(scope="module")
def evaluated(target, drafter, tmp_path_factory):
    image_dir = tmp_path_factory.mktemp("images")
    result = evaluate(
        target, drafter, PROMPTS, ["eagle2", "gsd"], [0, 1], batch_size=2, image_dir=image_dir, progress=False
    )
    return result, image_dir


def rows_by_key(result):
    return {(r.method, r.temperature): r for r in result.rows}


def test_exact_method_reproduces_ar_at_temperature_zero_and_relaxed_ones_are_left_out(evaluated):
    result, _ = evaluated
    rows = rows_by_key(result)
    assert list(rows) == [("ar", 0.0), ("eagle2", 0.0), ("ar", 1.0), ("eagle2", 1.0), ("gsd", 1.0)]
    assert rows["ar", 0.0].identical_to_ar and rows["eagle2", 0.0].identical_to_ar
    assert np.array_equal(result.images["eagle2", 0.0], result.images["ar", 0.0])
    assert rows["gsd", 1.0].identical_to_ar is None


def test_the_untimed_warm_up_changes_no_sample(target, drafter, evaluated):
    cold = evaluate(target, drafter, PROMPTS, ["eagle2", "gsd"], [0, 1], batch_size=2, progress=False,
                    warmup=False)  # fmt: skip
    warm, _ = evaluated
    for key, images in warm.images.items():  # T = 1 too: the warm-up draws from generators of its own
        assert np.array_equal(cold.images[key], images)
    assert [(r.S, r.tau, r.TPF) for r in cold.rows] == [(r.S, r.tau, r.TPF) for r in warm.rows]


def test_rows_carry_speedups_statistics_maps_and_images(evaluated):
    result, _ = evaluated
    rows = rows_by_key(result)
    for t in (0.0, 1.0):
        assert rows["ar", t].speedup == 1.0 and rows["ar", t].speedup_with_vq_decode == 1.0
        assert rows["ar", t].S == 1.0 and rows["ar", t].method_seconds == rows["ar", t].ar_seconds
        assert rows["eagle2", t].ar_seconds == rows["ar", t].method_seconds
    for row in result.rows:
        assert row.speedup > 0 and row.speedup_with_vq_decode > 0 and row.method_seconds > 0
    assert rows["eagle2", 0.0].tau >= 1.0 and rows["gsd", 1.0].mean_depth > 1.0
    for key, maps in result.position_maps.items():
        assert set(maps) == {"accepted_length", "tree_depth"} and maps["tree_depth"].shape == (4, 4), key
        assert result.images[key].shape == (3, 8, 8, 3) and result.images[key].dtype == np.uint8
    assert result.prompts == PROMPTS


def test_consistency_is_not_available_for_images_outside_the_shapes_world(evaluated):
    result, _ = evaluated
    quality = result.rows[0].quality["shapes_consistency"]  # shapes captions, but 8 px images
    assert quality.value is None and "64×64" in quality.note
    assert "not available" in to_markdown(result.rows)


def test_every_row_has_its_frechet_distance_to_ar_and_ar_its_noise_floor(target, evaluated):
    result, _ = evaluated
    rows = rows_by_key(result)
    fd = {key: row.quality["frechet_ar"].value for key, row in rows.items()}
    assert all(v is not None and np.isfinite(v) and v >= 0 for v in fd.values())
    assert fd["ar", 0.0] == fd["eagle2", 0.0] == 0.0  # greedy: other seeds and exact methods give AR's images

    def features(images: np.ndarray) -> np.ndarray:
        return encoder_features(target.tokenizer, images)

    # the runner reads features a batch of prompts at a time (a unit), here all at once: float32 round-off
    def close(value: float) -> object:
        return pytest.approx(value, rel=1e-4)

    ar = features(result.images["ar", 1.0])
    for method in ("eagle2", "gsd"):  # against AR's images of the same prompts, seeds and temperature
        assert fd[method, 1.0] == close(frechet_distance(features(result.images[method, 1.0]), ar))
    # AR's row: against AR once more with seeds offset by FLOOR_SEED_OFFSET (3 prompts, tiny target)
    other = evaluate(target, None, PROMPTS, [], [1], seed=FLOOR_SEED_OFFSET, batch_size=2, progress=False,
                     quality=QualityConfig(metrics=[]))  # fmt: skip
    assert fd["ar", 1.0] == close(frechet_distance(ar, features(other.images["ar", 1.0])))
    assert fd["ar", 1.0] > 0 and other.rows[0].quality == {}
    assert "frechet_ar" in to_markdown(result.rows)


def test_images_are_saved_per_method_and_temperature(evaluated):
    result, image_dir = evaluated
    assert sorted(p.name for p in image_dir.iterdir()) == [
        "ar_T0",
        "ar_T1",
        "eagle2_T0",
        "eagle2_T1",
        "gsd_T1",
    ]
    for (method, t), images in result.images.items():
        folder = image_dir / f"{method}_T{t:g}"
        assert sorted(p.name for p in folder.iterdir()) == ["0000.png", "0001.png", "0002.png"]
        assert np.array_equal(np.asarray(Image.open(folder / "0002.png")), images[2])


def test_tables_are_written_and_read_back(evaluated, tmp_path):
    result, _ = evaluated
    write_tables(result.rows, tmp_path, {"command": "test", "device": "cpu"})
    rows, settings = read_results(tmp_path)
    assert rows == result.rows and settings == {"command": "test", "device": "cpu"}
    assert (tmp_path / "results.md").read_text() == to_markdown(result.rows)
    assert "quality/shapes_consistency" in (tmp_path / "results.csv").read_text().splitlines()[0]


def test_plots_are_written_as_png(evaluated, tmp_path):
    result, _ = evaluated
    unscored = [replace(r, quality={}) for r in result.rows]
    assert plot_tradeoff(unscored, tmp_path / "none.png") is None  # no measured quality: no plot
    scored = [replace(r, quality={"clip_score": QualityValue(20.0 + i)}) for i, r in enumerate(result.rows)]
    paths = write_plots(replace(result, rows=scored), tmp_path)
    names = ["tradeoff", "position_maps_T0", "samples_T0", "position_maps_T1", "samples_T1"]
    assert [p.name for p in paths] == [f"{n}.png" for n in names]
    for path in paths:
        assert path.stat().st_size > 1000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prompt_i_gets_seed_plus_i_whatever_its_batch(target):
    one = evaluate(target, None, PROMPTS, [], [1], seed=4, batch_size=1, progress=False)
    three = evaluate(target, None, PROMPTS, ["ar"], [1], seed=4, batch_size=3, progress=False)
    assert [r.method for r in three.rows] == ["ar"]
    assert np.array_equal(one.images["ar", 1.0], three.images["ar", 1.0])


def test_bad_inputs_are_clear_errors(target, drafter):
    with pytest.raises(ValueError, match="unknown method preset 'nope'"):
        evaluate(target, drafter, PROMPTS, ["nope"], [0], progress=False)
    with pytest.raises(ValueError, match=r"\['eagle1'\] need a drafter"):
        evaluate(target, None, PROMPTS, ["eagle1", "sjd"], [0], progress=False)
    with pytest.raises(ValueError, match="no prompts"):
        evaluate(target, drafter, [], ["eagle1"], [0], progress=False)
    with pytest.raises(ValueError, match="unknown quality metrics"):
        QualityScorer(QualityConfig(metrics=["fidelity"]))


def test_a_preset_takes_overrides():  # which presets are exact: tests/test_method_registry.py
    assert load_preset("eagle2", {"tree": {"top_k": 4}}).tree.top_k == 4


# --- quality metrics ----------------------------------------------------------------------------------


def test_missing_weights_and_packages_are_not_available_with_the_reason(tmp_path):
    config = QualityConfig(
        metrics=["clip_score", "fid", "hpsv2", "shapes_consistency"],
        clip_model=str(tmp_path / "no_clip"),
        fid_reference=str(tmp_path),
    )
    images = np.zeros((2, 64, 64, 3), np.uint8)
    values = QualityScorer(config).score(images, ["a cat", "a dog"])
    assert all(v.value is None and v.note for v in values.values())
    assert (
        values["clip_score"].note
        == f"CLIP weights not found at {tmp_path / 'no_clip'} (set quality.clip_model)"
    )
    assert (
        "quality.fid_inception" in values["fid"].note
        or "torch_fidelity is not installed" in values["fid"].note
    )
    assert "quality.hpsv2_checkpoint" in values["hpsv2"].note or "hpsv2" in values["hpsv2"].note
    assert values["shapes_consistency"].note.startswith("defined for shapes-world captions only")


def test_default_metrics_follow_the_prompts():
    scorer = QualityScorer()
    assert scorer.metrics_for(PROMPTS) == SHAPES_METRICS == ["shapes_consistency", "frechet_ar"]
    assert QualityScorer(QualityConfig(metrics=["shapes_consistency"])).metrics_for(PROMPTS) == [
        "shapes_consistency"
    ]  # frechet_ar switched off
    assert scorer.metrics_for(["a photo of a cat"]) == REAL_IMAGE_METRICS
    values = scorer.score(np.zeros((1, 64, 64, 3), np.uint8), ["a photo of a cat"])
    assert list(values) == REAL_IMAGE_METRICS and values["clip_score"].note.endswith(
        "(set quality.clip_model)"
    )


def tiny_clip(folder: Path) -> Path:
    """A random 1-layer CLIP with a 54-token vocabulary, saved as transformers saves real ones."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = {t: i for i, t in enumerate([*letters, *(c + "</w>" for c in letters), "<|startoftext|>"])}
    vocab["<|endoftext|>"] = len(vocab)
    folder.mkdir()
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"))
    tower = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    text = {**tower, "vocab_size": len(vocab), "bos_token_id": len(vocab) - 2, "eos_token_id": len(vocab) - 1}
    config = CLIPConfig(
        text_config=text, vision_config={**tower, "image_size": 32, "patch_size": 8}, projection_dim=8
    )
    CLIPModel(config).save_pretrained(folder)
    pixels = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=pixels, tokenizer=tokenizer).save_pretrained(folder)
    return folder


def test_clip_score_runs_from_a_local_clip_folder(tmp_path):
    torch.manual_seed(0)
    folder = tiny_clip(tmp_path / "clip")
    images = np.random.default_rng(0).integers(0, 256, (3, 64, 64, 3), dtype=np.uint8)
    config = QualityConfig(metrics=["clip_score"], clip_model=str(folder), batch_size=2)
    score = QualityScorer(config).score(images, ["a red circle", "stripes", "x" * 300])["clip_score"]
    assert score.value is not None and 0.0 <= score.value <= 100.0 and score.note == ""


# --- prompt sets and the command line -----------------------------------------------------------------


def test_vendored_prompt_sets_load_by_name():
    assert len(prompt_set("partiprompts")) == 1632 and prompt_set("partiprompts")[0] == "bond"
    coco = prompt_set("coco2017_val")
    assert len(coco) == 5000 and len(set(coco)) > 4900
    assert prompts_for_run("coco2017_val", 3) == coco[:3]
    assert prompts_for_run(None, 2) == shapes_heldout_captions(2)
    coco30k = prompt_set("coco2014_val_30k")
    assert len(coco30k) == 30000 and coco30k[0].startswith("This wire metal rack")
    with pytest.raises(ValueError, match="unknown prompt set"):
        prompt_set("drawbench")


def _config(*overrides: str):
    """The CLI's config; no timing rounds (tests/test_timing.py tests them): a tiny target's decode takes
    tens of seconds on a loaded CPU."""
    with initialize_config_dir(str(CONF), version_base=None):
        return compose("evaluate", overrides=["speed_repeats=0", *overrides])


def test_default_setting_is_every_preset_at_both_temperatures():
    cfg = _config()
    # VVS's variants, and the block presets: a block drafter's
    left_out = {"vvs_uniform", "vvs_release", "block", "block_tree", "block_tree_iid"}
    assert list(cfg.methods) == sorted(set(preset_names()) - left_out)
    assert list(cfg.temperatures) == [0, 1]
    assert cfg.num_prompts == 100 and _config("eval=fast").methods == ["eagle2"]
    for name, prompts, n in (("coco30k", "coco2014_val_30k", 30000), ("coco5k", "coco2017_val", 5000)):
        paper = _config(f"eval={name}")  # a group sets keys the base config has too
        assert (paper.prompts, paper.num_prompts, list(paper.temperatures)) == (prompts, n, [1])
        assert list(paper.quality.metrics) == ["fid", "clip_score"] and not paper.acceptance.enabled


def test_cli_writes_tables_plots_and_images(tiny_folder, tmp_path):
    drafter = Drafter.make(DrafterConfig.for_target(load_target_folder(tiny_folder)))
    drafter.save_pretrained(tmp_path / "drafter")
    out = tmp_path / "run"
    cfg = _config(
        "eval=fast",
        f"target.folder={tiny_folder}",
        f"drafter={tmp_path / 'drafter'}",
        "methods=[eagle1]",
        "num_prompts=2",
        "batch_size=2",
        f"out_dir={out}",
    )
    result = run(cfg)
    rows, settings = read_results(out)
    assert [(r.method, r.temperature, r.identical_to_ar) for r in rows] == [
        ("ar", 0, True),
        ("eagle1", 0, True),
    ]
    assert rows == result.rows and 0.0 <= rows[0].quality["shapes_consistency"].value <= 1.0
    assert settings["device"].startswith("cpu") and settings["command"].startswith(
        "python -m vdtrain.evaluate"
    )
    assert settings["config"]["methods"] == ["eagle1"] and settings["num_prompts"] == 2
    assert sorted(p.name for p in (out / "images" / "eagle1_T0").iterdir()) == ["0000.png", "0001.png"]
    for name in ("tradeoff", "position_maps_T0", "samples_T0"):
        assert (out / "plots" / f"{name}.png").stat().st_size > 1000


def test_cli_refuses_a_missing_drafter_and_unknown_methods(tmp_path):
    with pytest.raises(ValueError, match="need a drafter"):
        run(_config("drafter=null", "methods=[eagle2]", f"out_dir={tmp_path}"))
    with pytest.raises(ValueError, match="unknown method preset 'magic'"):
        run(_config("methods=[magic]", f"out_dir={tmp_path}"))


def test_export_then_reload_then_evaluate_reproduces_the_numbers(target, drafter, evaluated, tmp_path):
    """The Hub export loses nothing that decoding depends on: same rows, same images, both temperatures."""
    from vdtrain.hub import export_drafter

    folder = export_drafter(drafter, tmp_path / "export", target=target)
    reloaded = Drafter.from_pretrained(folder, target)
    again = evaluate(target, reloaded, PROMPTS, ["eagle2", "gsd"], [0, 1], batch_size=2, progress=False)
    original, _ = evaluated
    for before, after in zip(original.rows, again.rows, strict=True):
        assert before.measured() == after.measured()
    for key, images in original.images.items():
        assert np.array_equal(images, again.images[key]), key


def test_speed_columns_name_their_device_and_a_cpu_says_what_that_means():
    from vdtrain.eval.table import CPU_NOTE, EvalRow, to_markdown

    def row(device: str) -> EvalRow:
        return EvalRow("eagle2", 1.0, 2.0, 3.1, 2.4, 3.0, 0.18, 0.2, 1.0, 0.18, device=device)

    cpu = to_markdown([row("cpu (x86_64, 2 threads)")])
    assert "latency speedup (cpu)" in cpu and "with VQ decode (cpu)" in cpu
    assert "Speeds measured on cpu (x86_64, 2 threads)." in cpu and CPU_NOTE in cpu
    gpu = to_markdown([row("cuda:0 (NVIDIA H200)")])
    assert "latency speedup (cuda:0)" in gpu and CPU_NOTE not in gpu
    assert "latency speedup |" in to_markdown([row("")])  # rows read from older results.json


def test_a_row_scores_a_metric_or_nan():
    quality = {"fid": QualityValue(3.5), "clip": QualityValue(None)}
    row = EvalRow("ar", 1.0, 1, 1, 0, 1, 1, 1, 1, 1, quality=quality)
    assert row.score("fid") == 3.5
    assert math.isnan(row.score("clip")) and math.isnan(row.score("missing"))


def _two_drafters(tiny_folder, tmp_path) -> tuple[Path, Path]:
    """An eagle1 and a block drafter of the tiny target, saved as export folders."""
    from vdtrain.drafters.base import block_kind

    tiny = load_target_folder(tiny_folder)
    eagle, block = tmp_path / "eagle", tmp_path / "block"
    Drafter.make(DrafterConfig.for_target(tiny)).save_pretrained(eagle)
    Drafter.make(DrafterConfig.for_target(tiny, kind=block_kind())).save_pretrained(block)
    return eagle, block


def test_each_preset_decodes_with_the_target_drafter_of_the_kind_it_needs(tiny_folder, tmp_path):
    """eagle and block presets in one table: each takes the target's own drafter that can serve it."""
    eagle, block = _two_drafters(tiny_folder, tmp_path)
    out = tmp_path / "run"
    cfg = _config(
        "eval=fast",
        f"target.folder={tiny_folder}",
        f"++target.drafter={eagle}",
        f"++target.more_drafters=[{block}]",
        "methods=[eagle1,block]",
        "temperatures=[0]",
        "num_prompts=1",
        "batch_size=1",
        "plots=false",
        "acceptance.enabled=false",
        f"out_dir={out}",
    )
    run(cfg)
    rows, settings = read_results(out)
    assert [(r.method, r.identical_to_ar) for r in rows] == [("ar", True), ("eagle1", True), ("block", True)]
    assert settings["drafters"] == {"eagle1": str(eagle), "block": str(block)}


def test_a_given_drafter_is_checked_against_every_preset_before_any_decode(tiny_folder, tmp_path):
    """A user's eagle drafter asked to serve a block preset is refused before AR or eagle1 decodes, and
    the refusal names the target's drafter that would serve it."""
    eagle, block = _two_drafters(tiny_folder, tmp_path)
    out = tmp_path / "run"
    cfg = _config(
        "eval=fast",
        f"target.folder={tiny_folder}",
        f"++target.more_drafters=[{block}]",
        f"drafter={eagle}",
        "methods=[eagle1,block]",
        "num_prompts=1",
        f"out_dir={out}",
    )
    with pytest.raises(ValueError, match=f"drafter={eagle} cannot decode block: .*drafter={block}"):
        run(cfg)
    assert not (out / "units").exists() or not any((out / "units").iterdir())
    assert not (out / "images").exists()
