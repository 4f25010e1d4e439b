"""The Hub export (``vdtrain.hub``, ``python -m vdtrain.export``, fit's end-of-training export): the
export folder, ``Drafter.from_pretrained`` from a folder, a Lightning ``.ckpt`` and a Hub repo id,
validation, and the (dry-run) push. Nothing touches the network: the Hub client is replaced wherever it
could be called."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from unittest import mock

import pytest
import torch
import yaml
from conftest import TINY_GPT, TINY_VQ, random_gpt, random_vq
from huggingface_hub import ModelCard
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file, save_file
from test_drafter import make_drafter, other_target, teacher_batch
from test_fit import CONF, REPO, fit_config, run_cli, sub_env

from vdtrain import export_format, hub
from vdtrain.checkpoint_io import CheckpointError
from vdtrain.config import TargetConfig
from vdtrain.data.shards import MANIFEST, SCHEMA_VERSION
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.drafters import Drafter, DrafterConfig
from vdtrain.drafters.base import CHECKPOINT_CONFIG_KEY
from vdtrain.eval.table import EvalRow, QualityValue, to_markdown, write_tables
from vdtrain.export import export, resolve_source
from vdtrain.fit import fit
from vdtrain.hub import (
    ExportError,
    MissingTokenError,
    export_drafter,
    push_to_hub,
    run_metadata,
    training_command,
    validate_export,
)
from vdtrain.targets import load_target
from vdtrain.targets.llamagen import LlamaGenTarget, VQTokenizer
from vdtrain.targets.shapes import REPO_ROOT

FILES = ["README.md", "config.json", "model.safetensors"]
REPO_ID = "someone/tiny-drafter"
FIT_COMMAND = "python -m vdtrain.fit trainer.max_steps=2"


def refuse(*args, **kwargs):
    raise AssertionError("the Hugging Face Hub client must not be used here")


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    monkeypatch.setattr(hub, "HfApi", refuse)
    monkeypatch.setattr(export_format, "snapshot_download", refuse)
    for name in (*hub.TOKEN_ENV, "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(export_format.constants, "HF_TOKEN_PATH", str(tmp_path / "no_saved_login" / "token"))


@pytest.fixture
def export_dir(tiny_target, tmp_path) -> Path:
    metadata = {"fit": {"steps": 7, "minutes": 0.5, "samples_per_s": 3.0, "val/tau_sim": 2.5}}
    return export_drafter(
        make_drafter(tiny_target).eval(),
        tmp_path / "export",
        target=tiny_target,
        training_command=FIT_COMMAND,
        metadata=metadata,
    )


def assert_same_weights(a: Drafter, b: Drafter) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key].cpu(), sb[key].cpu()), key


# --- export and from_pretrained ------------------------------------------------------------------------
def test_export_reloads_with_identical_weights_and_outputs(tiny_target, tmp_path):
    drafter = make_drafter(tiny_target).eval()
    metadata = {"fit": {"steps": 7, "minutes": 0.5, "samples_per_s": 3.0, "val/tau_sim": 2.5}, "config": {}}
    folder = export_drafter(
        drafter, tmp_path / "export", target=tiny_target, training_command=FIT_COMMAND, metadata=metadata
    )
    assert sorted(p.name for p in folder.iterdir()) == FILES
    assert set(load_file(folder / "model.safetensors")) == set(drafter.state_dict())  # no borrowed weights
    config = json.loads((folder / "config.json").read_text())
    assert config["target"]["head_fingerprint"] == tiny_target.identity.head_fingerprint
    assert config["metadata"] == {**metadata, "training_command": FIT_COMMAND}

    loaded = Drafter.from_pretrained(folder, tiny_target)
    assert loaded.config == drafter.config and loaded.metadata == config["metadata"]
    assert_same_weights(drafter, loaded)
    cond, tokens, hidden = teacher_batch(tiny_target)
    with torch.no_grad():
        a = drafter.forward_teacher(hidden, tokens, cond.mask)
        b = loaded.forward_teacher(hidden, tokens, cond.mask)
    assert torch.equal(a, b) and torch.equal(drafter.logits(a), loaded.logits(b))

    card = (folder / "README.md").read_text()
    assert card.startswith("---\n") and "\nlibrary_name: vdtrain\n" in card.split("\n---\n")[0]
    for text in (
        "- speculative-decoding",
        "- eagle",
        "- llamagen",
        "Drafter.from_pretrained(",
        "python -m vdtrain.evaluate drafter=<path>",
        FIT_COMMAND,
        tiny_target.identity.head_fingerprint,
        "Trained for 7 steps",
        "No evaluation was run",
    ):
        assert text in card, text


def test_export_is_deterministic_and_re_exports_identically(export_dir, tiny_target, tmp_path):
    again = export_drafter(
        export_dir, tmp_path / "again", target=tiny_target
    )  # metadata kept from the folder
    for name in FILES:
        assert (export_dir / name).read_bytes() == (again / name).read_bytes(), name


def test_export_refuses_to_replace_a_readme_it_did_not_write(tiny_target, tmp_path, caplog):
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("# my notes\n")
    drafter = make_drafter(tiny_target)
    with pytest.raises(ExportError, match="not a vdtrain model card") as info:
        export_drafter(drafter, out, target=tiny_target)
    assert str(out / "README.md") in str(info.value) and "overwrite_card" in str(info.value)
    assert sorted(p.name for p in out.iterdir()) == ["README.md"]  # nothing written
    assert (out / "README.md").read_text() == "# my notes\n"
    export_drafter(drafter, out, target=tiny_target, overwrite_card=True)
    assert "\nlibrary_name: vdtrain\n" in (out / "README.md").read_text()
    with caplog.at_level(logging.WARNING, logger="vdtrain.hub"):  # its own card is replaced, with a word
        export_drafter(drafter, out, target=tiny_target, training_command=FIT_COMMAND)
    assert any("replacing the model card" in r.getMessage() for r in caplog.records)


def test_export_writes_no_absolute_local_paths(tiny_target, tmp_path):
    run = tmp_path / "home" / "me" / "runs" / "2024-01-01"
    shapes = REPO_ROOT / "checkpoints" / "shapes" / "target"
    metadata = {
        "fit": {"run_dir": str(run), "steps": 3, "minutes": 0.1},
        "config": {
            "run_dir": str(run),
            "target": {"kind": "folder", "folder": str(shapes)},
            "data": {"shards": "~/data/laion", "source": "shards"},
        },
    }
    command = f"python -m vdtrain.fit run_dir={run} 'logger.name=my run' data.shards=/data/laion"
    folder = export_drafter(
        make_drafter(tiny_target),
        tmp_path / "e",
        target=tiny_target,
        metadata=metadata,
        training_command=command,
    )
    text = (folder / "config.json").read_text() + (folder / "README.md").read_text()
    assert str(tmp_path) not in text and "/data/laion" not in text and "~" not in text
    saved = Drafter.read_metadata(folder)
    assert saved["fit"]["run_dir"] == saved["config"]["run_dir"] == "<local>/2024-01-01"
    assert saved["config"]["target"]["folder"] == "checkpoints/shapes/target"  # repo-relative, loadable
    assert saved["config"]["data"] == {"shards": "<local>/laion", "source": "shards"}
    expected = (
        "python -m vdtrain.fit 'run_dir=<local>/2024-01-01' 'logger.name=my run' 'data.shards=<local>/laion'"
    )
    assert saved["training_command"] == expected
    assert hub.redact_local_paths(saved) == saved  # a re-export changes nothing


def test_model_card_carries_the_evaluation_table(tiny_target, tmp_path):
    row = EvalRow("eagle2", 1.0, 2.0, 3.1, 2.4, 3.0, 1.8, 1.6, 1.0, 1.8)
    command = f"python -m vdtrain.evaluate drafter={tmp_path}/run/drafter num_prompts=4"
    write_tables([row], tmp_path / "eval" / "latest", {"num_prompts": 4, "device": "cpu", "command": command})
    drafter = make_drafter(tiny_target)
    folder = export_drafter(drafter, tmp_path / "e", target=tiny_target, eval_results=tmp_path / "eval")
    card = (folder / "README.md").read_text()
    assert to_markdown([row]).rstrip() in card and "`num_prompts=4`" in card
    assert "'drafter=<local>/drafter' num_prompts=4" in card and str(tmp_path) not in card
    assert "No evaluation was run" not in card
    with pytest.raises(FileNotFoundError, match=r"no results\.json"):
        export_drafter(drafter, tmp_path / "f", target=tiny_target, eval_results=tmp_path / "nothing")


def test_card_front_matter_is_hub_metadata(tiny_target, tmp_path):
    """The Hub reads license, base_model, datasets, pipeline_tag, tags and the evaluation's S, τ and
    quality (a model-index) back from the front matter; the hand-written body stays below it."""
    quality = {"shapes_consistency": QualityValue(0.91), "clip_score": QualityValue(None, "no weights")}
    row = EvalRow("eagle2", 1.0, 2.0, 3.1, 2.4, 3.0, 1.8, 1.6, 1.0, 1.8, quality=quality)
    write_tables([row], tmp_path / "eval", {"num_prompts": 4})
    metadata = {
        "config": {"target": {"kind": "janus", "hub_id": "deepseek-ai/Janus-Pro-7B"}},
        "data": {"source": "shards", "kind": "laion_coco"},
    }
    folder = export_drafter(
        make_drafter(tiny_target),
        tmp_path / "e",
        target=tiny_target,
        metadata=metadata,
        eval_results=tmp_path / "eval",
    )
    data = ModelCard.load(folder / "README.md").data
    assert (data.library_name, data.license, data.pipeline_tag) == ("vdtrain", "apache-2.0", "text-to-image")
    assert data.base_model == "deepseek-ai/Janus-Pro-7B" and data.datasets == ["laion/laion-coco"]
    assert {"vdtrain", "speculative-decoding", tiny_target.identity.family} <= set(data.tags)
    figures = {(r.metric_type, r.metric_name): r.metric_value for r in data.eval_results}
    assert figures == {
        ("S", "S (eagle2, T=1)"): 2.0,
        ("tau", "tau (eagle2, T=1)"): 3.1,
        ("shapes_consistency", "shapes_consistency (eagle2, T=1)"): 0.91,
    }
    assert "## Evaluation" in ModelCard.load(folder / "README.md").text
    assert hub.validate_export(folder, tiny_target) == []


def test_an_embedded_world_card_has_no_base_model(tiny_target, tmp_path):
    """The shapes and grain targets exist only in this repository (target.hub_id null): no base_model,
    no Hub dataset for procedural or self-generated data, and no model-index without an evaluation."""
    metadata = {"config": {"target": {"kind": "folder", "hub_id": None}}, "data": {"kind": "self_generate"}}
    folder = export_drafter(make_drafter(tiny_target), tmp_path / "e", target=tiny_target, metadata=metadata)
    data = ModelCard.load(folder / "README.md").data
    assert data.base_model is None and data.datasets is None and data.eval_results is None
    assert data.license == "apache-2.0" and data.pipeline_tag == "text-to-image"


def test_every_target_config_names_its_hub_repo():
    """base_model comes from conf/target/*.yaml: each release target names its official repo."""
    for file in sorted((REPO_ROOT / "conf" / "target").glob("*.yaml")):
        hub_id = yaml.safe_load(file.read_text())["hub_id"]
        assert (hub_id is None) == (file.stem in ("shapes", "grain")), file.name


def test_the_card_says_what_the_drafter_trained_on(tiny_target, tmp_path):
    """A drafter trained on the target's own samples says so, with how they were drawn, read from the
    shard set's manifest while its local folder is still known (the exported config only has <local>)."""
    shards = tmp_path / "home" / "shards"
    shards.mkdir(parents=True)
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "kind": "self_generate",
        "target": {},
        "fields": ["tokens", "caption"],
        "shapes": {"tokens": [256]},
        "shards": [],
        "num_samples": 4096,
        "source": {
            "captions": str(tmp_path / "captions.txt"),
            "method": "ar",
            "sampling": {"cfg_scale": 3.0, "temperature": 1.0, "top_k": 0, "top_p": 1.0},
            "seed": 0,
        },
    }
    (shards / MANIFEST).write_text(json.dumps(manifest))
    data = {"source": "shards", "shards": str(shards), "p_null": 0.1}
    metadata = {"fit": {"steps": 512, "minutes": 2.0, "samples_per_s": 68.26666666}, "config": {"data": data}}
    folder = export_drafter(make_drafter(tiny_target), tmp_path / "e", target=tiny_target, metadata=metadata)
    card = (folder / "README.md").read_text()
    expected = (
        "Data: 4,096 images the target drew itself (`python -m data_prep.self_generate`: ar, CFG 3.0, T 1.0, "
        "top-k 0, seed 0) from the captions of `captions.txt`; 8,192 samples seen (2.0 epochs); "
        "10% of rows null-conditioned."
    )
    assert expected in card and str(tmp_path) not in card
    shutil.rmtree(shards)
    again = export_drafter(folder, tmp_path / "again", target=tiny_target)  # the export kept what it read
    assert expected in (again / "README.md").read_text()
    lost = export_drafter(make_drafter(tiny_target), tmp_path / "lost", target=tiny_target, metadata=metadata)
    assert "a shard set whose manifest was not readable at export" in (lost / "README.md").read_text()


def vocab_target(vocab: int) -> LlamaGenTarget:
    gpt = random_gpt(replace(TINY_GPT, vocab_size=vocab))
    vq = random_vq(replace(TINY_VQ, codebook_size=vocab))
    return LlamaGenTarget(gpt, VQTokenizer(vq, image_size=8), None, "wide-vocab", SamplingConfig())


@pytest.mark.parametrize(
    ("make_other", "field", "name"),
    [
        (lambda: other_target(seed=1), "head_fingerprint", "other"),
        (lambda: other_target(dim=48), "hidden_size", "other"),
        (lambda: vocab_target(30), "vocab_size", "wide-vocab"),
    ],
)
def test_a_mismatched_target_is_refused_naming_what_differs(export_dir, make_other, field, name):
    other = make_other()
    with pytest.raises(ValueError) as info:
        Drafter.from_pretrained(export_dir, other)
    message = str(info.value)
    assert field in message and repr(name) in message and str(export_dir) in message
    if field != "hidden_size":  # the hidden size is refused before the identity is compared
        assert "trained for target 'tiny'" in message
    problems = validate_export(export_dir, other)
    assert len(problems) == 1 and problems[0].startswith(f"does not reload for target {name!r}")
    with pytest.raises(ValueError, match=field):
        export_drafter(export_dir, export_dir.parent / "other", target=other)


def test_a_hub_repo_id_is_fetched_with_snapshot_download(export_dir, tiny_target, tmp_path, monkeypatch):
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(export_dir)

    monkeypatch.setattr(export_format, "snapshot_download", fake_snapshot_download)
    loaded = Drafter.from_pretrained(REPO_ID, tiny_target, revision="v1", cache_dir=tmp_path / "cache")
    assert calls == [
        (
            REPO_ID,
            {
                "revision": "v1",
                "cache_dir": tmp_path / "cache",
                "allow_patterns": list(export_format.EXPORT_FILES),
            },
        )
    ]
    assert_same_weights(loaded, Drafter.from_pretrained(export_dir))


def test_a_hub_repo_id_resolves_from_the_cache_offline_and_says_when_it_cannot(
    export_dir, tmp_path, monkeypatch
):
    monkeypatch.setattr(export_format.constants, "HF_HUB_OFFLINE", True)
    repo = tmp_path / "cache" / "models--someone--tiny-drafter"
    shutil.copytree(export_dir, repo / "snapshots" / "0123abc")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    loaded = Drafter.from_pretrained(REPO_ID, cache_dir=tmp_path / "cache")
    assert_same_weights(loaded, Drafter.from_pretrained(export_dir))
    with pytest.raises(FileNotFoundError, match="not in the local cache") as info:
        Drafter.from_pretrained("someone/not-cached", cache_dir=tmp_path / "cache")
    assert "HF_HUB_OFFLINE is set" in str(info.value) and "'someone/not-cached'" in str(info.value)
    with pytest.raises(FileNotFoundError, match="no drafter at"):
        Drafter.from_pretrained(tmp_path / "no" / "such" / "folder")


# --- a short fit run: its checkpoint, the end-of-training hook, the CLI --------------------------------
@pytest.fixture(scope="module")
def fit_run(tiny_folder, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("fit") / "run"
    with mock.patch.object(hub, "HfApi", refuse):  # the end-of-training push is a dry run by default
        fit(fit_config(tiny_folder, run, "trainer.max_steps=2", f"push.repo_id={REPO_ID}"))
    return run


@pytest.fixture(scope="module")
def folder_target(tiny_folder):
    return load_target({"kind": "folder", "folder": str(tiny_folder)})


def test_a_fit_checkpoint_reloads_and_exports(fit_run, folder_target, tmp_path):
    ckpt = fit_run / "checkpoints" / "last.ckpt"
    final = Drafter.from_pretrained(fit_run / "drafter", folder_target)
    assert torch.load(ckpt, weights_only=True)[CHECKPOINT_CONFIG_KEY] == final.config.to_dict()
    from_ckpt = Drafter.from_pretrained(ckpt, folder_target)
    assert from_ckpt.metadata["checkpoint"]["file"] == "last.ckpt"
    assert from_ckpt.metadata["checkpoint"]["global_step"] == 2
    assert_same_weights(from_ckpt, final)

    metadata = {**run_metadata(fit_run), **from_ckpt.metadata}
    folder = export_drafter(ckpt, tmp_path / "export", target=folder_target, metadata=metadata)
    assert_same_weights(Drafter.from_pretrained(folder, folder_target), final)
    card = (folder / "README.md").read_text()
    assert "`last.ckpt` (step 2)" in card and "Trained for 2 steps" in card


def test_a_fit_drafter_folder_still_finds_its_run_without_a_local_path(fit_run):
    assert not Path(Drafter.read_metadata(fit_run / "drafter")["fit"]["run_dir"]).is_absolute()
    assert str(fit_run) not in (fit_run / "drafter" / "config.json").read_text()
    assert resolve_source(str(fit_run / "drafter")) == (fit_run / "drafter", fit_run)


def test_a_checkpoint_without_the_drafter_config_is_a_clear_error(fit_run, tmp_path):
    blob = torch.load(fit_run / "checkpoints" / "last.ckpt", weights_only=True)
    del blob[CHECKPOINT_CONFIG_KEY]
    torch.save(blob, tmp_path / "old.ckpt")
    with pytest.raises(CheckpointError, match="carries no drafter config"):
        Drafter.from_pretrained(tmp_path / "old.ckpt")


def test_fit_ends_with_a_valid_export_and_a_dry_run_push(fit_run, folder_target):
    folder = fit_run / "drafter"
    assert validate_export(folder, folder_target) == []
    exported = Drafter.from_pretrained(folder, folder_target)
    assert (
        exported.metadata["fit"]["steps"] == 2 and exported.metadata["config"]["push"]["repo_id"] == REPO_ID
    )
    card = (folder / "README.md").read_text()
    assert "Data: procedural images of the target's world" in card and "10% of rows null-conditioned" in card


def test_export_cli_composes_exports_and_plans_the_push(fit_run, tiny_folder, tmp_path, capsys, no_network):
    overrides = [f"source={fit_run}", f"target.folder={tiny_folder}", f"push.repo_id={REPO_ID}"]
    with initialize_config_dir(str(CONF), version_base=None):
        cfg = compose("export", overrides=[*overrides, f"out_dir={tmp_path / 'out'}"])
        no_run = compose("export", overrides=[f"source={fit_run / 'checkpoints' / 'nowhere'}"])
    folder, plan = export(cfg)
    out = capsys.readouterr().out
    assert "validation: passed" in out and "dry run: would push 3 files" in out
    assert plan.dry_run and plan.private and [n for n, _ in plan.files] == FILES
    assert Drafter.read_metadata(folder)["fit"]["steps"] == 2
    assert_same_weights(Drafter.from_pretrained(folder), Drafter.from_pretrained(fit_run / "drafter"))
    with pytest.raises(ValueError, match="set out_dir"):
        export(no_run)


def test_export_cli_runs_as_a_module(tiny_folder, folder_target, tmp_path):
    torch.manual_seed(0)
    Drafter.make(DrafterConfig.for_target(folder_target)).save_pretrained(tmp_path / "drafter")
    args = [f"source={tmp_path / 'drafter'}", f"target.folder={tiny_folder}", f"out_dir={tmp_path / 'out'}"]
    command = [sys.executable, "-m", "vdtrain.export", *args, "push.repo_id=someone/x"]
    env = {**sub_env(), "PYTHONPATH": str(REPO)}  # runs in tmp_path, whatever vdtrain install there is
    result = run_cli(command, tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "validation: passed" in result.stdout and "dry run: would push 3 files" in result.stdout
    assert validate_export(tmp_path / "out", folder_target) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "out"]  # no Hydra files in the cwd


def test_the_training_command_is_recovered_from_hydras_record(tmp_path):
    (tmp_path / ".hydra").mkdir()
    record = {
        "hydra": {
            "overrides": {
                "hydra": ["hydra.run.dir=runs/x", "hydra.mode=RUN"],
                "task": ["trainer.max_steps=5", "logger.name=my run"],
            },
            "job": {"name": "fit"},
        }
    }
    (tmp_path / ".hydra" / "hydra.yaml").write_text(json.dumps(record))  # JSON is YAML
    expected = "python -m vdtrain.fit trainer.max_steps=5 'logger.name=my run' hydra.run.dir=runs/x"
    assert training_command(tmp_path) == expected
    assert training_command(tmp_path / "elsewhere") is None


# --- validation and the push ---------------------------------------------------------------------------
def leak_the_embedding(folder: Path, target) -> None:
    state = load_file(folder / "model.safetensors")
    state["tok_embeddings.weight"] = target.token_embedding.weight.detach().clone()
    save_file(state, folder / "model.safetensors")


def drop_a_weight(folder: Path, target) -> None:
    state = load_file(folder / "model.safetensors")
    del state["fc.bias"]
    save_file(state, folder / "model.safetensors")


def forget_the_identity(folder: Path, target) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "target": {}}))


BREAKAGES = {
    "missing weights": (lambda f, t: (f / "model.safetensors").unlink(), "model.safetensors is missing"),
    "missing card": (lambda f, t: (f / "README.md").unlink(), "README.md is missing"),
    "frozen key": (leak_the_embedding, "frozen target weights ['tok_embeddings.weight']"),
    "missing key": (drop_a_weight, "missing keys: fc.bias"),
    "no identity": (forget_the_identity, "records no target identity"),
    "card without front matter": (lambda f, t: (f / "README.md").write_text("# a drafter\n"), "front matter"),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_a_broken_export_fails_validation_naming_the_problem(export_dir, tiny_target, breakage, no_network):
    assert validate_export(export_dir, tiny_target) == []
    breaks, expected = BREAKAGES[breakage]
    breaks(export_dir, tiny_target)
    problems = validate_export(export_dir, tiny_target)
    assert len(problems) == 1 and expected in problems[0], problems
    with pytest.raises(ExportError, match="not a valid export") as info:
        push_to_hub(export_dir, REPO_ID, dry_run=True)
    assert expected in str(info.value)


def _config_with(export_dir: Path, **changes) -> str:
    config = json.loads((export_dir / "config.json").read_text())
    return json.dumps({k: v for k, v in {**config, **changes}.items() if v is not None})


BROKEN_CONFIGS = {
    "truncated": (lambda d: (d / "config.json").read_text()[:40], "is not valid JSON"),
    "not utf-8": (lambda d: b"\xff\xfe{}", "is not valid JSON"),
    "a list": (lambda d: "[1, 2]", "holds a list, not a drafter config"),
    "missing key": (lambda d: _config_with(d, hidden_size=None), "missing 1 required positional argument"),
    "wrong type": (lambda d: _config_with(d, grid=4), "incomplete or mistyped drafter config"),
}


@pytest.mark.parametrize("broken", sorted(BROKEN_CONFIGS))
def test_a_broken_config_json_is_a_checkpoint_error_naming_the_file(export_dir, broken):
    make, expected = BROKEN_CONFIGS[broken]
    content = make(export_dir)
    config = export_dir / "config.json"
    config.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(CheckpointError, match=expected) as info:
        Drafter.from_pretrained(export_dir)
    assert str(config) in str(info.value)
    problems = validate_export(export_dir)
    assert len(problems) == 1 and "config.json" in problems[0]


def test_dry_run_push_lists_the_files_without_network(export_dir, no_network, monkeypatch):
    plan = push_to_hub(export_dir, REPO_ID, dry_run=True)
    sizes = {name: (export_dir / name).stat().st_size for name in FILES}
    assert plan.repo_id == REPO_ID and plan.private and plan.dry_run and plan.url is None
    assert dict(plan.files) == sizes and [n for n, _ in plan.files] == FILES
    assert plan.token_source == "none"
    text = plan.describe()
    assert text.startswith(f"dry run: would push 3 files ({sum(sizes.values()):,} bytes) to private Hub repo")
    assert all(name in text for name in FILES)
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", "hf_env")
    public = push_to_hub(export_dir, REPO_ID, private=False, dry_run=True)
    assert public.token_source == "HUGGING_FACE_HUB_TOKEN" and "public" in public.describe()
    with pytest.raises(ValueError, match="Repo id"):
        push_to_hub(export_dir, "not a repo id", dry_run=True)


def test_a_real_push_without_a_token_is_a_clear_error(export_dir, no_network):
    with pytest.raises(MissingTokenError, match="HF_TOKEN") as info:
        push_to_hub(export_dir, REPO_ID)
    assert "no Hugging Face token" in str(info.value) and REPO_ID in str(info.value)
    assert "hf auth login" in str(info.value)


def test_the_token_saved_by_hf_auth_login_is_used(export_dir, no_network, monkeypatch, tmp_path):
    saved = tmp_path / "hf_home" / "token"
    saved.parent.mkdir()
    saved.write_text("hf_saved\n")  # what `hf auth login` writes
    monkeypatch.setattr(export_format.constants, "HF_TOKEN_PATH", str(saved))
    assert hub.find_token() == ("hf_saved", "saved login")
    assert push_to_hub(export_dir, REPO_ID, dry_run=True).token_source == "saved login"
    monkeypatch.setenv("HF_TOKEN", "hf_env")  # the environment comes first, as in huggingface_hub
    assert hub.find_token() == ("hf_env", "HF_TOKEN")
    assert hub.find_token("hf_arg") == ("hf_arg", "argument")


def test_a_real_push_creates_the_repo_and_uploads_the_export(export_dir, no_network, monkeypatch):
    calls = []

    class FakeApi:
        def __init__(self, token):
            calls.append(("token", token))

        def create_repo(self, repo_id, **kwargs):
            calls.append(("create_repo", repo_id, kwargs))

        def upload_folder(self, **kwargs):
            calls.append(("upload_folder", kwargs))
            return mock.Mock(commit_url="https://huggingface.co/someone/tiny-drafter/commit/1")

    monkeypatch.setattr(hub, "HfApi", FakeApi)
    monkeypatch.setenv("HF_TOKEN", "hf_env")
    plan = push_to_hub(export_dir, REPO_ID, token="hf_arg", commit_message="first")
    assert calls == [
        ("token", "hf_arg"),
        ("create_repo", REPO_ID, {"private": True, "exist_ok": True, "repo_type": "model"}),
        (
            "upload_folder",
            {
                "repo_id": REPO_ID,
                "folder_path": export_dir,
                "repo_type": "model",
                "commit_message": "first",
                "allow_patterns": FILES,
            },
        ),
    ]
    assert plan.token_source == "argument" and not plan.dry_run and plan.url.endswith("/commit/1")


def test_the_cards_snippet_repeats_every_key_the_targets_kind_reads():
    """Every key the target's kind reads is repeated, also one that equals another kind's default:
    Chameleon's own default caption_overflow is 'error', so a run with 'truncate' must say so. A drafter
    exported before targets owned their config recorded every kind's keys; the others stay out."""
    from vdtrain.hub import _usage_section

    recorded = {
        **dataclasses.asdict(TargetConfig()),
        "folder": None,  # what fit's former one-schema-for-all-kinds target config recorded
        "gpt_ckpt": None,
        "gpt_preset": "GPT-XL",
        "kind": "chameleon",
        "name": "lumina",
        "family": "lumina_mgpt",
        "model_dir": "/models/lumina",
        "caption_overflow": "truncate",
    }
    snippet = _usage_section({"config": {"target": recorded}}, "eagle2")
    assert '"caption_overflow": "truncate"' in snippet and '"family": "lumina_mgpt"' in snippet
    assert '"gpt_ckpt"' not in snippet and '"folder"' not in snippet  # other kinds' keys stay out
