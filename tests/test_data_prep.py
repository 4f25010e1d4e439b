"""Data preparation into versioned shard sets: every step, resumption, the validator and the reader.

A tiny random target (64 px images, 8×8 tokens, MiniLM captions) stands in for a real one.
"""

from __future__ import annotations

import io
import json
import logging
import shutil
import tarfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
from conftest import TINY_FOLDER_TOKENS
from hydra import compose, initialize_config_dir
from PIL import Image

from data_prep import self_generate as self_generate_cli
from data_prep import validate as validate_cli
from vdtrain.config import DataConfig
from vdtrain.data.prepare import (
    center_crop_arr,
    null_decision,
    prepare_features,
    prepare_laion_coco,
    prepare_self_generate,
)
from vdtrain.data.shard_stream import ShardStream
from vdtrain.data.shards import (
    MANIFEST,
    SCHEMA_VERSION,
    SampleSpec,
    ShardError,
    ShardReader,
    ShardWriter,
    feature_taps,
    read_manifest,
    read_shards,
    sample_bytes,
    validate_shards,
)
from vdtrain.decode.ar import generate_ar
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.images import images_to_tensor
from vdtrain.prompts import load_captions, read_caption_table
from vdtrain.targets import load_target_folder
from vdtrain.targets.base import Condition

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
COCO = ROOT.parent / "shared" / "data" / "coco_mini"
N_IMAGES = 8
N_TOKENS = TINY_FOLDER_TOKENS

needs_coco = pytest.mark.skipif(not COCO.exists(), reason="shared coco_mini not beside the checkout")


# --- fixtures -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target(tiny_folder):
    """The 64 px / 8×8-token / MiniLM tiny target (``tiny_folder`` from conftest), loaded once."""
    return load_target_folder(tiny_folder)


def coco_samples(n: int = N_IMAGES) -> list[tuple[str, Path, str]]:
    """(img2dataset-style key, image path, first caption) for the first n coco_mini images."""
    data = json.loads((COCO / "captions_train2017.json").read_text())
    first_caption: dict[int, str] = {}
    for ann in data["annotations"]:
        first_caption.setdefault(ann["image_id"], ann["caption"].strip())
    images = sorted(data["images"], key=lambda im: im["file_name"])[:n]
    return [
        (f"{i:09d}", COCO / "train2017" / im["file_name"], first_caption[im["id"]])
        for i, im in enumerate(images)
    ]


@pytest.fixture(scope="module")
def img2dataset_files(tmp_path_factory) -> Path:
    """``--output_format files`` layout: ``00000/{key}.jpg`` + ``.txt`` + ``.json``."""
    root = tmp_path_factory.mktemp("i2d_files")
    part = root / "00000"
    part.mkdir()
    for key, image, caption in coco_samples():
        shutil.copy(image, part / f"{key}.jpg")
        (part / f"{key}.txt").write_text(caption)
        (part / f"{key}.json").write_text(json.dumps({"url": f"http://x/{key}.jpg", "key": key}))
    return root


@pytest.fixture(scope="module")
def img2dataset_tars(tmp_path_factory) -> Path:
    """``--output_format webdataset`` layout: ``00000.tar``, ``00001.tar`` of 4 samples each."""
    root = tmp_path_factory.mktemp("i2d_wds")
    samples = coco_samples()
    for t in range(2):
        with wds.TarWriter(str(root / f"{t:05d}.tar")) as sink:
            for key, image, caption in samples[4 * t : 4 * t + 4]:
                sink.write({"__key__": key, "jpg": image.read_bytes(), "txt": caption, "json": {"key": key}})
    return root


@pytest.fixture(scope="module")
def coco_shards(target, img2dataset_files, tmp_path_factory) -> Path:
    """A finished laion_coco shard set (3 shards: 3 + 3 + 2 samples) with the encoded condition."""
    out = tmp_path_factory.mktemp("shards") / "coco"
    prepare_laion_coco(
        target, img2dataset_files, out, samples_per_shard=3, batch_size=4, store_cond=True, progress=False
    )
    return out


@pytest.fixture
def shards(coco_shards, tmp_path) -> Path:
    """A private copy of the coco shard set, free to damage."""
    return Path(shutil.copytree(coco_shards, tmp_path / "copy"))


def rewrite_member(shard: Path, key: str, suffix: str, data: bytes) -> None:
    """Replace one member of a shard and record the new size in the manifest (so only the member is bad)."""
    with tarfile.open(shard) as tar:
        members = [(info, tar.extractfile(info).read()) for info in tar.getmembers()]
    with tarfile.open(shard, "w") as tar:
        for info, content in members:
            if info.name == f"{key}.{suffix}":
                content = data
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    manifest_path = shard.parent / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    for entry in manifest["shards"]:
        if entry["name"] == shard.name:
            entry["bytes"] = shard.stat().st_size
    manifest_path.write_text(json.dumps(manifest))


def npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


# --- laion_coco ---------------------------------------------------------------------------------------


@needs_coco
def test_laion_coco_from_files_encodes_cropped_images_and_captions(target, coco_shards):
    manifest = read_manifest(coco_shards)
    assert manifest["schema_version"] == SCHEMA_VERSION and manifest["complete"]
    assert manifest["kind"] == "laion_coco"
    assert manifest["target"]["head_fingerprint"] == target.identity.head_fingerprint
    assert manifest["fields"] == ["tokens", "caption", "meta", "cond", "cond_mask"]
    assert manifest["shapes"] == {"tokens": [N_TOKENS], "cond": [48, 384], "cond_mask": [48]}
    assert [s["samples"] for s in manifest["shards"]] == [3, 3, 2]
    assert [s["name"] for s in manifest["shards"]] == [f"shard-00000-000{i}.tar" for i in range(3)]

    samples = list(read_shards(coco_shards))
    expected = coco_samples()
    assert [s["key"] for s in samples] == [k for k, _, _ in expected]
    assert [s["caption"] for s in samples] == [c for _, _, c in expected]
    key, image, caption = expected[5]
    with Image.open(image) as im:
        pixels = center_crop_arr(im.convert("RGB"), 64)
        assert samples[5]["meta"]["original_size"] == list(im.size)
    assert pixels.shape == (64, 64, 3)
    tokens = target.tokenizer.encode(images_to_tensor([pixels]))[0].numpy()
    assert samples[5]["tokens"].dtype == np.int64 and np.array_equal(samples[5]["tokens"], tokens)
    assert samples[5]["meta"]["url"] == f"http://x/{key}.jpg"
    cond = target.encode_captions([caption])
    assert np.array_equal(samples[5]["cond_mask"], cond.mask[0].numpy())
    np.testing.assert_allclose(samples[5]["cond"], cond.features[0].numpy(), atol=2e-3, rtol=1e-3)
    assert validate_shards(coco_shards, target.identity).ok


@needs_coco
def test_laion_coco_from_webdataset_tars_matches_files(target, coco_shards, img2dataset_tars, tmp_path):
    manifest = prepare_laion_coco(
        target, img2dataset_tars, tmp_path / "out", samples_per_shard=3, batch_size=8, progress=False
    )
    # shards never span two input tars: 4 + 4 samples → 3 + 1, 3 + 1
    assert [(s["name"], s["samples"]) for s in manifest["shards"]] == [
        ("shard-00000-0000.tar", 3),
        ("shard-00000-0001.tar", 1),
        ("shard-00001-0000.tar", 3),
        ("shard-00001-0001.tar", 1),
    ]
    assert manifest["source"]["input_format"] == "webdataset" and "cond" not in manifest["fields"]
    from_tars = {s["key"]: s["tokens"] for s in read_shards(tmp_path / "out")}
    from_files = {s["key"]: s["tokens"] for s in read_shards(coco_shards)}
    assert from_tars.keys() == from_files.keys()
    assert all(np.array_equal(from_tars[k], from_files[k]) for k in from_files)


@needs_coco
def test_laion_coco_skips_broken_images_and_missing_captions(target, img2dataset_files, tmp_path, caplog):
    source = Path(shutil.copytree(img2dataset_files, tmp_path / "in"))
    (source / "00000" / "000000002.jpg").write_bytes(b"not a jpeg")
    (source / "00000" / "000000006.txt").unlink()
    with caplog.at_level(logging.WARNING):
        manifest = prepare_laion_coco(target, source, tmp_path / "out", samples_per_shard=4, progress=False)
    assert [(s["samples"], s["skipped_inputs"]) for s in manifest["shards"]] == [(3, 1), (3, 1)]
    assert "000000002" in caplog.text and "000000006" in caplog.text
    assert validate_shards(tmp_path / "out").num_samples == 6


@needs_coco
def test_laion_coco_retries_shards_whose_inputs_were_all_skipped(target, img2dataset_files, tmp_path):
    source = Path(shutil.copytree(img2dataset_files, tmp_path / "in"))
    captions = {p: p.read_text() for p in (source / "00000").glob("*.txt")}
    for path in captions:
        path.unlink()
    with pytest.raises(ShardError, match="no usable samples"):  # a first run with no captions at all
        prepare_laion_coco(target, source, tmp_path / "out", samples_per_shard=4, progress=False)
    for path, text in captions.items():
        path.write_text(text)
    manifest = prepare_laion_coco(target, source, tmp_path / "out", samples_per_shard=4, progress=False)
    assert manifest["num_samples"] == N_IMAGES and manifest["skipped_parts"] == {}
    assert [(s["samples"], s["skipped_inputs"]) for s in manifest["shards"]] == [(4, 0), (4, 0)]


@needs_coco
def test_laion_coco_skips_a_truncated_input_tar_and_reports_it(
    tiny_folder, img2dataset_tars, tmp_path, caplog
):
    from data_prep import laion_coco as laion_coco_cli

    source = Path(shutil.copytree(img2dataset_tars, tmp_path / "in"))
    broken = source / "00001.tar"
    broken.write_bytes(broken.read_bytes()[: broken.stat().st_size // 2])  # an interrupted download
    args = (f"target.folder={tiny_folder}", f"input={source}", "samples_per_shard=4", "device=cpu")
    with caplog.at_level(logging.WARNING):
        summary = laion_coco_cli.run(_compose("laion_coco", *args, f"out_dir={tmp_path / 'out'}"))
    assert summary["num_samples"] == 4 and list(summary["skipped_parts"]) == ["00001"]
    assert str(broken) in summary["skipped_parts"]["00001"] and "unreadable" in caplog.text
    assert validate_shards(tmp_path / "out").num_samples == 4
    with pytest.raises(ShardError, match=r"00001\.tar.* is unreadable"):
        laion_coco_cli.run(_compose("laion_coco", *args, f"out_dir={tmp_path / 'b'}", "on_bad_tar=error"))


@needs_coco
def test_shards_are_plain_webdataset(coco_shards):
    """The shards read with webdataset too, and decode to the same samples."""
    manifest = read_manifest(coco_shards)
    spec = SampleSpec.from_manifest(manifest)
    urls = [str(coco_shards / s["name"]) for s in manifest["shards"]]
    raw = list(wds.WebDataset(urls, shardshuffle=False, empty_check=False))
    decoded = [spec.decode(r["__key__"], {k: v for k, v in r.items() if not k.startswith("__")}) for r in raw]
    ours = list(read_shards(coco_shards))
    assert [d["key"] for d in decoded] == [s["key"] for s in ours]
    assert all(np.array_equal(d["tokens"], s["tokens"]) for d, s in zip(decoded, ours, strict=True))


# --- self_generate ------------------------------------------------------------------------------------


def test_self_generate_records_seed_and_sampling_per_sample(target, tmp_path):
    captions = tmp_path / "captions.txt"
    captions.write_text("a red circle\na blue square on the left\ntwo green triangles\n")
    sampling = SamplingConfig(cfg_scale=2.0, temperature=0.9, top_k=8)
    manifest = prepare_self_generate(
        target,
        captions,
        tmp_path / "out",
        sampling=sampling,
        seed=7,
        samples_per_shard=2,
        batch_size=2,
        progress=False,
    )
    assert manifest["kind"] == "self_generate" and [s["samples"] for s in manifest["shards"]] == [2, 1]
    assert manifest["source"]["sampling"] == {"cfg_scale": 2.0, "temperature": 0.9, "top_k": 8, "top_p": 1.0}
    samples = list(read_shards(tmp_path / "out", target_identity=target.identity))
    assert [s["caption"] for s in samples] == load_captions(captions)
    for i, s in enumerate(samples):
        assert s["meta"]["seed"] == 7 + i and s["meta"]["caption_index"] == i
        assert s["meta"]["sampling"]["top_k"] == 8 and s["meta"]["sampling"]["cfg_scale"] == 2.0
    # sample 2 alone, with its own seed, gives the same tokens as in its batch
    alone = generate_ar(
        target, target.encode_captions([samples[2]["caption"]]), sampling, [torch.Generator().manual_seed(9)]
    )
    assert np.array_equal(samples[2]["tokens"], alone[0].numpy())


def _compose(name: str, *overrides: str):
    with initialize_config_dir(str(CONF), version_base=None):
        return compose(f"data_prep/{name}", overrides=list(overrides))


def test_self_generate_cli_with_the_target_group(tiny_folder, tmp_path):
    captions = tmp_path / "c.json"
    captions.write_text(
        json.dumps({"annotations": [{"caption": "a red circle"}, {"caption": "blue square"}]})
    )
    cfg = _compose(
        "self_generate",
        f"target.folder={tiny_folder}",
        f"captions={captions}",
        "num_samples=1",
        f"out_dir={tmp_path / 'out'}",
        "sampling.top_k=4",
        "device=cpu",
    )
    assert cfg.target.kind == "folder"
    summary = self_generate_cli.run(cfg)
    assert summary["num_samples"] == 1
    (sample,) = read_shards(tmp_path / "out")
    assert sample["caption"] == "a red circle" and sample["meta"]["sampling"]["cfg_scale"] == 3.0
    assert sample["meta"]["sampling"]["top_k"] == 4
    # the validator CLI, with and without the target check
    assert validate_cli.run(_compose("validate", f"shards={tmp_path / 'out'}")).ok
    report = validate_cli.run(
        _compose("validate", f"shards={tmp_path / 'out'}", "target=shapes", f"target.folder={tiny_folder}")
    )
    assert report.ok


# --- features -----------------------------------------------------------------------------------------


@needs_coco
def test_features_match_the_target_under_cond_or_null(target, coco_shards, tmp_path):
    seed, p_null = 3, 0.5
    manifest = prepare_features(
        target, coco_shards, tmp_path / "feats", p_null=p_null, seed=seed, batch_size=3
    )
    assert manifest["kind"] == "features" and manifest["source"]["p_null"] == p_null
    assert manifest["fields"] == ["tokens", "caption", "meta", "cond", "cond_mask", "feats", "feats_mask"]
    assert manifest["shapes"]["feats"] == [48 + N_TOKENS, 32]
    assert [s["name"] for s in manifest["shards"]] == [
        s["name"] for s in read_manifest(coco_shards)["shards"]
    ]
    samples = list(read_shards(tmp_path / "feats"))
    flags = [s["meta"]["null_conditioned"] for s in samples]
    assert flags == [null_decision(seed, s["key"], p_null) for s in samples]
    assert any(flags) and not all(flags)
    for s in samples:
        assert s["feats"].dtype == np.float16
        tokens = torch.from_numpy(s["tokens"])[None]
        caption = Condition(torch.from_numpy(s["cond"]).float()[None], torch.from_numpy(s["cond_mask"])[None])
        null = target.null_condition(caption)
        used, unused = (null, caption) if s["meta"]["null_conditioned"] else (caption, null)
        feats = s["feats"].astype(np.float32)
        np.testing.assert_allclose(
            feats, target.forward_sequence(used, tokens).hidden[0], atol=1e-2, rtol=1e-2
        )
        assert not np.allclose(feats, target.forward_sequence(unused, tokens).hidden[0], atol=1e-2)
    assert validate_shards(tmp_path / "feats", target.identity).ok


@needs_coco
def test_features_warn_before_writing_more_than_warn_bytes(target, coco_shards, tmp_path, caplog):
    manifest = prepare_features(target, coco_shards, tmp_path / "feats", warn_bytes=1e4, progress=False)
    assert "more than warn_bytes=1e+04" in caplog.text and "feature_layers" in caplog.text
    estimate = manifest["num_samples"] * sample_bytes(manifest["shapes"])
    stored = sum(s["bytes"] for s in manifest["shards"])
    # + per sample its members' headers and padding (≤ 1 KiB each) and meta JSON; per shard its end blocks
    assert estimate <= stored <= estimate + 8 * 7 * 1024 + 3 * 10240
    caplog.clear()
    prepare_features(target, coco_shards, tmp_path / "more", warn_bytes=stored, progress=False)
    assert "warn_bytes" not in caplog.text


def test_features_without_stored_cond_encode_the_caption(target, tmp_path):
    prepare_self_generate(target, ["a red circle", "a blue square"], tmp_path / "gen", progress=False)
    prepare_features(target, tmp_path / "gen", tmp_path / "feats", p_null=0.0, progress=False)
    for s in read_shards(tmp_path / "feats"):
        assert not s["meta"]["null_conditioned"] and "cond" not in s
        hidden = target.forward_sequence(
            target.encode_captions([s["caption"]]), torch.from_numpy(s["tokens"])[None]
        ).hidden[0]
        np.testing.assert_allclose(s["feats"].astype(np.float32), hidden.numpy(), atol=1e-2, rtol=1e-2)
    with pytest.raises(ShardError, match="already has features"):
        prepare_features(target, tmp_path / "feats", tmp_path / "again", progress=False)


def test_offline_eagle3_features_equal_the_online_ones(target, tmp_path):
    """With ``taps`` the stored features are what online training computes for an eagle3 drafter: the
    final-norm state followed by the tapped layers (fp16), recorded in the manifest; a training stream for
    a drafter that reads other layers is refused."""
    taps = (0, 1)
    prepare_self_generate(target, ["a red circle", "a blue square"], tmp_path / "gen", progress=False)
    manifest = prepare_features(
        target, tmp_path / "gen", tmp_path / "feats", p_null=0.0, progress=False, taps=taps
    )
    assert manifest["source"]["taps"] == [0, 1] and feature_taps(manifest) == [0, 1]
    assert manifest["shapes"]["feats"] == [target.prefix_length + N_TOKENS, 3 * target.hidden_size]
    for s in read_shards(tmp_path / "feats"):
        cond = target.encode_captions([s["caption"]])
        online = target.sequence_features(cond, torch.from_numpy(s["tokens"])[None], taps)[0]
        np.testing.assert_allclose(s["feats"].astype(np.float32), online.numpy(), atol=1e-2, rtol=1e-2)
    assert validate_shards(tmp_path / "feats", target.identity).ok
    config = DataConfig(source="shards", shards=str(tmp_path / "feats"), features="offline", batch_size=2)
    ShardStream(config, 0, 1, target.identity, taps)
    with pytest.raises(ValueError, match=r"stores target layers \[0, 1\] but the drafter reads \[1\]"):
        ShardStream(config, 0, 1, target.identity, (1,))


def test_null_decision_is_seeded_per_key():
    keys = [f"{i:09d}" for i in range(4000)]
    picks = [null_decision(0, k, 0.1) for k in keys]
    assert picks == [null_decision(0, k, 0.1) for k in keys]
    assert 0.08 < sum(picks) / len(picks) < 0.12
    assert picks != [null_decision(1, k, 0.1) for k in keys]
    assert not any(null_decision(0, k, 0.0) for k in keys) and all(null_decision(0, k, 1.0) for k in keys)


# --- resumption ---------------------------------------------------------------------------------------


@needs_coco
def test_rerun_skips_finished_shards_and_redoes_only_a_deleted_one(
    target, img2dataset_files, tmp_path, monkeypatch
):
    out = tmp_path / "out"
    encoded: list[int] = []
    real_encode = target.tokenizer.encode

    def counting_encode(images):
        encoded.append(len(images))
        return real_encode(images)

    monkeypatch.setattr(target.tokenizer, "encode", counting_encode)
    run = lambda: prepare_laion_coco(target, img2dataset_files, out, samples_per_shard=3, progress=False)  # noqa: E731
    first = run()
    assert sum(encoded) == N_IMAGES
    stamps = {p.name: p.stat().st_mtime_ns for p in out.glob("*.tar")}

    encoded.clear()
    assert run()["shards"] == first["shards"]
    assert encoded == [] and {p.name: p.stat().st_mtime_ns for p in out.glob("*.tar")} == stamps

    (out / "shard-00000-0001.tar").unlink()
    encoded.clear()
    again = run()
    assert sum(encoded) == 3 and again["shards"] == first["shards"] and again["complete"]
    for name, stamp in stamps.items():
        assert (out / name).stat().st_mtime_ns == stamp or name == "shard-00000-0001.tar"
    assert validate_shards(out).ok


@needs_coco
def test_a_crash_leaves_no_finished_looking_shard(target, img2dataset_files, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real_encode, calls = target.tokenizer.encode, []

    def failing_encode(images):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("killed")
        return real_encode(images)

    monkeypatch.setattr(target.tokenizer, "encode", failing_encode)
    with pytest.raises(RuntimeError, match="killed"):
        prepare_laion_coco(target, img2dataset_files, out, samples_per_shard=3, batch_size=3, progress=False)
    manifest = json.loads((out / MANIFEST).read_text())
    assert [s["name"] for s in manifest["shards"]] == ["shard-00000-0000.tar"] and not manifest["complete"]
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "shard-00000-0000.tar"]
    with pytest.raises(ShardError, match="incomplete"):
        ShardReader(out)
    assert not validate_shards(out, raise_on_error=False).ok

    monkeypatch.setattr(target.tokenizer, "encode", real_encode)
    assert prepare_laion_coco(target, img2dataset_files, out, samples_per_shard=3, progress=False)["complete"]
    assert validate_shards(out).num_samples == N_IMAGES


def test_growing_num_samples_reuses_full_shards(target, tmp_path):
    captions = ["a red circle", "a blue square", "a green triangle", "two circles", "one square"]
    kwargs = {"samples_per_shard": 2, "batch_size": 2, "progress": False}
    prepare_self_generate(target, captions, tmp_path / "out", num_samples=3, **kwargs)
    stamp = (tmp_path / "out" / "shard-000000.tar").stat().st_mtime_ns
    manifest = prepare_self_generate(target, captions, tmp_path / "out", num_samples=5, **kwargs)
    assert [s["samples"] for s in manifest["shards"]] == [2, 2, 1]
    assert (tmp_path / "out" / "shard-000000.tar").stat().st_mtime_ns == stamp
    assert [s["caption"] for s in read_shards(tmp_path / "out")] == captions


@needs_coco
def test_changed_settings_are_refused_unless_overwrite(target, img2dataset_files, shards):
    with pytest.raises(ShardError, match="other settings"):
        prepare_laion_coco(target, img2dataset_files, shards, samples_per_shard=4, progress=False)
    manifest = prepare_laion_coco(
        target, img2dataset_files, shards, samples_per_shard=4, overwrite=True, progress=False
    )
    assert [s["samples"] for s in manifest["shards"]] == [4, 4]
    assert sorted(p.name for p in shards.glob("*.tar")) == ["shard-00000-0000.tar", "shard-00000-0001.tar"]


# --- validator and reader -----------------------------------------------------------------------------


@needs_coco
def test_validator_catches_a_missing_shard(shards):
    (shards / "shard-00000-0001.tar").unlink()
    with pytest.raises(ShardError, match=r"shard-00000-0001\.tar.*missing"):
        validate_shards(shards)
    with pytest.raises(ShardError, match=r"shard-00000-0001\.tar.*missing"):
        list(read_shards(shards))


@needs_coco
def test_validator_catches_a_truncated_tar(shards):
    path = shards / "shard-00000-0002.tar"
    with tarfile.open(path) as tar:  # cut inside a member's data: a cut header reads as a clean end
        member = max(tar.getmembers(), key=lambda m: m.size)
    path.write_bytes(path.read_bytes()[: member.offset_data + member.size // 2])
    report = validate_shards(shards, raise_on_error=False)
    assert not report.ok
    assert any("shard-00000-0002.tar" in p and "truncated" in p for p in report.problems)
    assert any("shard-00000-0002.tar" in p and "unreadable tar" in p for p in report.problems)


@needs_coco
def test_validator_catches_a_corrupt_tar(shards):
    path = shards / "shard-00000-0000.tar"
    data = bytearray(path.read_bytes())
    data[:512] = bytes(range(256)) * 2  # a header with a wrong checksum, same size
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=r"shard-00000-0000\.tar.*unreadable tar"):
        validate_shards(shards)


@needs_coco
def test_validator_catches_a_wrong_token_length(shards):
    rewrite_member(shards / "shard-00000-0001.tar", "000000004", "tokens.npy", npy(np.zeros(255, np.int64)))
    with pytest.raises(ShardError, match=r"shard-00000-0001\.tar.*'000000004'.*tokens has shape \[255\]"):
        validate_shards(shards)


@needs_coco
def test_validator_catches_token_ids_outside_the_vocabulary(shards):
    tokens = np.full(N_TOKENS, 32, np.int64)
    rewrite_member(shards / "shard-00000-0000.tar", "000000001", "tokens.npy", npy(tokens))
    with pytest.raises(ShardError, match=r"'000000001'.*out of range \[0, 32\)"):
        validate_shards(shards)


@needs_coco
def test_validator_catches_a_wrong_schema_version(shards):
    manifest = json.loads((shards / MANIFEST).read_text())
    manifest["schema_version"] = SCHEMA_VERSION + 1
    (shards / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match="schema version"):
        validate_shards(shards)
    with pytest.raises(ShardError, match="schema version"):
        ShardReader(shards)


@needs_coco
def test_validator_catches_a_mismatched_target(target, shards):
    other = replace(target.identity, head_fingerprint="0123456789abcdef")
    with pytest.raises(ShardError, match=r"another target.*head_fingerprint"):
        validate_shards(shards, other)
    with pytest.raises(ShardError, match="another target"):
        ShardReader(shards, target_identity=other)
    assert validate_shards(shards, target.identity).ok


@needs_coco
def test_validator_catches_a_wrong_sample_count(shards):
    manifest = json.loads((shards / MANIFEST).read_text())
    manifest["shards"][0]["samples"] = 4
    (shards / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match=r"shard-00000-0000\.tar.*3 samples, the manifest records 4"):
        validate_shards(shards)


@needs_coco
def test_on_corrupt_skip_leaves_out_a_bad_sample_with_a_warning(shards, caplog):
    rewrite_member(shards / "shard-00000-0001.tar", "000000003", "tokens.npy", b"not an npy file")
    with pytest.raises(ShardError, match=r"shard-00000-0001\.tar.*'000000003'.*tokens\.npy"):
        list(read_shards(shards, on_corrupt="error"))
    reader = ShardReader(shards, on_corrupt="skip")
    with caplog.at_level(logging.WARNING, logger="vdtrain.data.shards"):
        keys = [s["key"] for s in reader]
    assert keys == [f"{i:09d}" for i in range(N_IMAGES) if i != 3] and reader.skipped == 1
    assert "shard-00000-0001.tar" in caplog.text and "000000003" in caplog.text and "skipped" in caplog.text


def test_writer_refuses_bad_samples(target, tmp_path):
    writer = ShardWriter(tmp_path, kind="test", target_identity=target.identity, source={})
    good = {"key": "a", "tokens": np.zeros(N_TOKENS, np.int64), "caption": "c", "meta": {}}
    with writer.shard("shard-0.tar", plan=0) as sink:
        sink.write(good)
        with pytest.raises(ShardError, match=r"shard-0\.tar.*'b'.*dtype int32"):
            sink.write({**good, "key": "b", "tokens": np.zeros(N_TOKENS, np.int32)})
        with pytest.raises(ValueError, match="duplicate"):
            sink.write(good)
        with pytest.raises(ValueError, match="clean_key"):
            sink.write({**good, "key": "x.y"})
    assert writer.finished("shard-0.tar", 0) and not writer.finished("shard-0.tar", 1)
    writer.close(["shard-0.tar"])
    assert [s["key"] for s in read_shards(tmp_path)] == ["a"]


# --- caption tables through datasets ------------------------------------------------------------------


def test_caption_tables_through_datasets(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"URL": ["http://a", "http://b", "http://c"], "top_caption": ["a cat", " ", "a dog "]}),
        tmp_path / "meta.parquet",
    )
    (tmp_path / "prompts.csv").write_text('id,text\n1,"red, round"\n2,blue\n')
    cache = tmp_path / "hf_cache"
    assert read_caption_table(tmp_path / "meta.parquet", cache_dir=cache) == ["a cat", "a dog"]
    assert read_caption_table(tmp_path / "prompts.csv", cache_dir=cache) == ["red, round", "blue"]
    assert load_captions(tmp_path / "meta.parquet", cache_dir=cache) == ["a cat", "a dog"]
    assert load_captions(tmp_path / "prompts.csv") == ["red, round", "blue"]  # read_captions: "text" column
    with pytest.raises(ValueError, match="no captions"):
        load_captions(tmp_path / "prompts.csv", column="id", cache_dir=cache)  # numbers are not captions
    with pytest.raises(ValueError, match="no caption column"):
        read_caption_table(tmp_path / "meta.parquet", cache_dir=cache, columns=["URL"])
