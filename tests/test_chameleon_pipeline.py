"""The drafter pipeline on a Chameleon-family target (issue #15), through the real CLIs on the tiny
Lumina-mGPT checkpoint of ``test_chameleon``: ``data_prep.self_generate`` (LANTERN self-generates
Lumina-mGPT's data from COCO captions) → ``vdtrain.fit`` with the after-epoch evaluation → the export
reloads against its target only → ``vdtrain.evaluate`` reproduces AR at T = 0."""

from __future__ import annotations

import dataclasses
import json
import sys
from itertools import product
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from PIL import Image
from test_chameleon import (
    CODEBOOK,
    IMAGE_SIZE,
    WORDS,
    anole_files,
    anole_target,
    lumina_files,
    lumina_target,
)
from test_fit import CONF, run_cli

from vdtrain.config import TargetConfig, UnknownConfigKeyError, register_configs
from vdtrain.data.shards import read_shards, validate_shards
from vdtrain.drafters.base import Drafter
from vdtrain.eval.table import read_results
from vdtrain.targets import load_target
from vdtrain.targets.chameleon import ChameleonSpec
from vdtrain.targets.llamagen import LlamaGenSpec

__all__ = ["anole_files", "lumina_files"]  # fixtures used here by name
pytestmark = pytest.mark.usefixtures("one_thread")

# 16 captions spelled with the tiny tokenizer's words only
CAPTIONS = [" ".join(p) for p in product(["a", "big", "a big", "the"], ["red", "blue"], ["circle", "square"])]
EVAL_PROMPTS = ["a red circle", "big blue square"]


def lumina_overrides(folder: Path) -> list[str]:
    """``target=lumina_mgpt`` pointed at the tiny checkpoint, at its 64 px size and short prompts."""
    return [
        "target=lumina_mgpt",
        f"target.model_dir={folder}",
        f"target.vqgan_ckpt={folder / 'vqgan.ckpt'}",
        f"target.vqgan_config={folder / 'vqgan.yaml'}",
        f"target.image_size={IMAGE_SIZE}",
        "target.prefix_length=24",
    ]


def checked(result) -> None:
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.fixture(scope="module")
def shards(lumina_files, tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("selfgen")
    captions = work / "captions.txt"
    captions.write_text("\n".join(CAPTIONS) + "\n")
    out = work / "shards"
    args = [f"captions={captions}", f"out_dir={out}", "samples_per_shard=8", "batch_size=8"]
    command = [sys.executable, "-m", "data_prep.self_generate", *lumina_overrides(lumina_files[0]), *args]
    checked(run_cli([*command, "device=cpu", "threads=1"], cwd=work))
    return out


@pytest.fixture(scope="module")
def trained(lumina_files, shards, tmp_path_factory) -> Path:
    """A 4-step fit (one epoch of 16 samples) with validation and the after-epoch EAGLE-2 evaluation."""
    work = tmp_path_factory.mktemp("fit")
    prompts = work / "prompts.txt"
    prompts.write_text("\n".join(EVAL_PROMPTS) + "\n")
    run = work / "run"
    data = [
        "data=coco_self_generated",
        f"data.shards={shards}",
        f"data.val_shards={shards}",  # the training set again: the smoke test only needs val/* to run
        "data.batch_size=4",
        "data.num_workers=0",
        "data.shuffle_buffer=8",
    ]
    evaluation = [
        f"eval.prompts={prompts}",
        "eval.methods=[eagle2]",
        "eval.num_prompts=2",
        "eval.batch_size=2",
    ]
    trainer = ["trainer.max_steps=4", "trainer.threads=1", "trainer.log_every_n_steps=1"]
    command = [sys.executable, "-m", "vdtrain.fit", *lumina_overrides(lumina_files[0]), *data, *evaluation]
    checked(run_cli([*command, *trainer, f"hydra.run.dir={run}"], cwd=work))
    return run


@pytest.mark.slow  # the CLI runs behind it: ~30 s in all on one CPU thread
def test_self_generated_shards_hold_codes_and_forced_end_of_row_tokens(lumina_files, shards):
    assert {w for c in CAPTIONS for w in c.split()} <= set(WORDS)  # no unknown token in any prompt
    samples = list(read_shards(shards))
    assert [s["caption"] for s in samples] == CAPTIONS
    tokens = np.stack([s["tokens"] for s in samples])
    assert tokens.shape == (16, 20)
    grid = tokens.reshape(16, 4, 5)  # 4 rows of 4 codes, each closed by end-of-row (index CODEBOOK)
    assert (grid[..., -1] == CODEBOOK).all()
    assert ((grid[..., :-1] >= 0) & (grid[..., :-1] < CODEBOOK)).all()
    assert len({tuple(t) for t in tokens}) == 16  # sampled at T = 1, one seed per sample
    assert samples[0]["meta"]["sampling"] == {
        "cfg_scale": 3.0,
        "temperature": 1.0,
        "top_k": 2000,
        "top_p": 1.0,
    }
    assert validate_shards(shards, lumina_target(lumina_files[0]).identity).ok


@pytest.mark.slow  # the CLI runs behind it: ~30 s in all on one CPU thread
def test_fit_exports_a_chameleon_drafter_and_evaluates_it_after_the_epoch(trained):
    config = json.loads((trained / "drafter" / "config.json").read_text())
    assert config["family"] == "lumina_mgpt" and config["target"]["family"] == "lumina_mgpt"
    assert config["grid"] == [4, 5] and config["vocab_size"] == CODEBOOK + 1
    layer = config["layer"]  # the tiny Chameleon's settings, not LlamaGen's n_head / multiple_of
    heads = (layer["num_attention_heads"], layer["num_key_value_heads"])
    assert heads == (4, 2) and layer["intermediate_size"] == 96
    assert layer["swin_norm"] is False and "n_head" not in layer
    summary = json.loads((trained / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["val/tau_sim"] >= 1.0
    rows, settings = read_results(trained / "eval" / "epoch000")
    assert settings["step"] == 4 and settings["prompts"].endswith("prompts.txt")
    assert [(r.method, r.temperature, r.identical_to_ar) for r in rows] == [
        ("ar", 0, True),
        ("eagle2", 0, True),
    ]
    metrics = (trained / "logs" / "metrics.csv").read_text().splitlines()  # the callback's numbers, logged
    column = metrics[0].split(",").index("eval/eagle2_T0/S")
    logged = [float(r.split(",")[column]) for r in metrics[1:] if r.split(",")[column]]
    assert logged == [pytest.approx(rows[1].S)] and rows[1].S >= 1.0


@pytest.mark.slow  # the CLI runs behind it: ~30 s in all on one CPU thread
def test_the_export_reloads_against_its_target_only(trained, lumina_files, anole_files):
    drafter = Drafter.from_pretrained(trained / "drafter", lumina_target(lumina_files[0]))
    state = torch.load(trained / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    for name, value in drafter.state_dict().items():
        torch.testing.assert_close(value, state["state_dict"][f"drafter.{name}"], rtol=0, atol=0)
    with pytest.raises(
        ValueError, match=r"does not match target 'tiny-anole': family: 'lumina_mgpt' != 'anole'"
    ):
        Drafter.from_pretrained(trained / "drafter", anole_target(anole_files[0], prefix_length=24))


@pytest.mark.slow  # the CLI runs behind it: ~30 s in all on one CPU thread
def test_evaluate_cli_reproduces_ar_with_the_trained_drafter(trained, lumina_files, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(EVAL_PROMPTS) + "\n")
    out = tmp_path / "eval"
    args = [
        f"drafter={trained / 'drafter'}",
        "methods=[eagle2,eagle1]",
        "temperatures=[0]",
        "num_prompts=2",
        "batch_size=2",
        f"prompts={prompts}",
        "device=cpu",
        "threads=1",
        "plots=false",
        f"out_dir={out}",
    ]
    command = [sys.executable, "-m", "vdtrain.evaluate", *lumina_overrides(lumina_files[0]), *args]
    checked(run_cli(command, cwd=tmp_path))
    rows, settings = read_results(out)
    assert [(r.method, r.temperature, r.identical_to_ar) for r in rows] == [
        ("ar", 0, True),
        ("eagle2", 0, True),
        ("eagle1", 0, True),
    ]
    assert all(r.S >= 1.0 and r.tau >= 1.0 for r in rows)
    assert settings["target"]["family"] == "lumina_mgpt" and settings["num_prompts"] == 2
    for name in ("0000.png", "0001.png"):
        ar = np.asarray(Image.open(out / "images" / "ar_T0" / name))
        assert ar.shape == (IMAGE_SIZE, IMAGE_SIZE, 3)
        assert np.array_equal(np.asarray(Image.open(out / "images" / "eagle2_T0" / name)), ar)


def fit_target(*overrides: str) -> dict:
    """``conf/fit.yaml``'s ``target``, as its typed schema composes it."""
    register_configs()
    with initialize_config_dir(str(CONF), version_base=None):
        return OmegaConf.to_container(compose("fit", overrides=[*overrides, "run_dir=unused"]).target)


@pytest.mark.parametrize(
    ("name", "spec", "foreign"),
    [
        ("lumina_mgpt", ChameleonSpec, "gpt_preset=GPT-B"),
        ("llamagen_t2i_xl_stage1", LlamaGenSpec, "family=anole"),
    ],
)
def test_fit_gives_a_target_its_kinds_keys_and_refuses_another_kinds(name, spec, foreign, lumina_files):
    """fit's typed ``target`` carries the shared keys and its kind's own, every one its spec declares; a
    key of another kind that the user adds is refused, naming the kind and the key."""
    overrides = lumina_overrides(lumina_files[0]) if name == "lumina_mgpt" else [f"target={name}"]
    target = fit_target(*overrides)
    shared = {f.name for f in dataclasses.fields(TargetConfig)}
    assert set(target) - shared == {f.name for f in dataclasses.fields(spec)}
    if name == "lumina_mgpt":
        assert load_target(target).identity.family == "lumina_mgpt"
    key = foreign.split("=")[0]
    with pytest.raises(UnknownConfigKeyError, match=f"kind '{target['kind']}': target.{key}"):
        load_target(fit_target(*overrides, f"+target.{foreign}"))
