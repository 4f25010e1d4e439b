"""Drafter training from shard sets: self-generated pairs (online features) and offline features."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from vdtrain.config import DataConfig, register_configs
from vdtrain.data.prepare import prepare_features, prepare_self_generate
from vdtrain.data.shard_stream import ShardStream
from vdtrain.data.shards import ShardError
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.fit import fit
from vdtrain.prompts import shapes_heldout_captions
from vdtrain.targets import load_target_folder
from vdtrain.targets.llamagen import LlamaGenTarget

CONF = Path(__file__).resolve().parents[1] / "conf"
register_configs()


@pytest.fixture(scope="module")
def shard_sets(tiny_folder, tmp_path_factory) -> tuple[Path, Path]:
    target = load_target_folder(tiny_folder)
    root = tmp_path_factory.mktemp("shards")
    sampling = SamplingConfig(cfg_scale=3.0, temperature=1.0, top_k=8)
    prepare_self_generate(
        target,
        shapes_heldout_captions(8),
        root / "pairs",
        sampling=sampling,
        samples_per_shard=3,
        store_cond=False,  # features encode the captions; training must not need them again
        progress=False,
    )
    prepare_features(target, root / "pairs", root / "feats", p_null=0.5, progress=False)
    return root / "pairs", root / "feats"


def _cfg(tiny_folder: Path, run_dir: Path, *overrides: str):
    with initialize_config_dir(str(CONF), version_base=None):
        return compose(
            "fit",
            overrides=[
                f"target.folder={tiny_folder}",
                f"run_dir={run_dir}",
                "data.batch_size=2",
                "trainer.max_steps=3",
                "trainer.checkpoint_every_n_steps=3",
                "eval.enabled=false",
                *overrides,
            ],
        )


@pytest.mark.parametrize("data", ["coco_self_generated", "offline_features"])
def test_fit_trains_from_shards(data, shard_sets, tiny_folder, tmp_path, monkeypatch):
    pairs, feats = shard_sets
    folder = pairs if data == "coco_self_generated" else feats
    if data == "offline_features":  # neither the target nor its caption encoder runs (none on a GPU box)
        for name in ("encode_captions", "sequence_features"):
            monkeypatch.setattr(LlamaGenTarget, name, _never_called(name))
    cfg = _cfg(
        tiny_folder,
        tmp_path,
        f"data={data}",
        f"data.shards={folder}",
        f"data.val_shards={folder}",
        "data.val_samples=2",
        "data.num_workers=0",
    )
    summary = fit(cfg)
    assert summary["steps"] == 3
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    assert "val/tau_sim" in summary


def _never_called(name: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"offline training called the target's {name}")

    return refuse


def test_feature_sets_without_their_condition_mask_are_refused(shard_sets, tmp_path):
    """Sets written before ``feats_mask`` was stored: training would need the caption encoder to make
    the mask, so they are refused naming the fix."""
    _, feats = shard_sets
    old = tmp_path / "old_feats"
    shutil.copytree(feats, old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["fields"].remove("feats_mask")
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"feats_mask.*data_prep.features"):
        ShardStream(DataConfig(source="shards", shards=str(old), features="offline"), 0, 1)


def captions(stream: ShardStream, start: int = 0) -> list[str]:
    stream.start_at(start)
    return [c for batch in stream for c in batch["caption"]]


def test_shard_stream_splits_ranks_and_resumes(shard_sets):
    pairs, _ = shard_sets
    config = DataConfig(source="shards", shards=str(pairs), batch_size=1, shuffle_buffer=4)
    rank0 = captions(ShardStream(config, 0, 2))
    rank1 = captions(ShardStream(config, 1, 2))
    assert len(rank0) == len(rank1) == 4 and not set(rank0) & set(rank1)
    stream = ShardStream(config, 0, 2)
    epoch1 = captions(stream, 4)
    assert captions(stream) == rank0 and len(epoch1) == 4 and epoch1 != rank0  # reshuffled each epoch
    assert captions(ShardStream(config, 0, 2), 4 + 1) == epoch1[1:]  # one epoch and one sample in


def test_missing_shard_set_names_the_folder(tmp_path):
    config = DataConfig(source="shards", shards=str(tmp_path / "nowhere"))
    with pytest.raises(ShardError, match="nowhere"):
        ShardStream(config, 0, 1)


def test_offline_training_needs_features(shard_sets):
    pairs, _ = shard_sets
    with pytest.raises(ValueError, match="feats"):
        ShardStream(DataConfig(source="shards", shards=str(pairs), features="offline"), 0, 1)


def test_shards_of_another_target_are_refused(shard_sets, tiny_target):
    pairs, _ = shard_sets
    with pytest.raises(ShardError, match=r"hidden_size|vocab|fingerprint|target"):
        ShardStream(DataConfig(source="shards", shards=str(pairs)), 0, 1, tiny_target.identity)


def test_features_are_stored_in_the_dtype_asked_and_read_back_as_computed(shard_sets, tiny_folder, tmp_path):
    """``feats_dtype=bf16`` (and fp32) beside the default fp16: the manifest says which, bf16 states are
    their bits in a uint16 ``.npy`` (half fp32's bytes, as fp16's), training reads them as bfloat16 tensors
    equal to the fp32 states rounded; validation reads every sample; an unknown dtype is refused."""
    from vdtrain.data.shards import sample_bytes, validate_shards

    target = load_target_folder(tiny_folder)
    pairs, fp16 = shard_sets
    sets = {"fp16": fp16}
    for dtype in ("fp32", "bf16"):
        sets[dtype] = tmp_path / dtype
        prepare_features(target, pairs, sets[dtype], p_null=0.5, progress=False, feats_dtype=dtype)
    manifests = {k: json.loads((v / "manifest.json").read_text()) for k, v in sets.items()}
    assert {k: m["dtypes"]["feats"] for k, m in manifests.items()} == {
        "fp16": "float16", "fp32": "float32", "bf16": "bfloat16"
    }  # fmt: skip
    size = {k: sample_bytes({"feats": m["shapes"]["feats"]}, m["dtypes"]) for k, m in manifests.items()}
    assert size["bf16"] == size["fp16"] == size["fp32"] // 2
    feats = {}
    for dtype, folder in sets.items():
        validate_shards(folder)
        config = DataConfig(source="shards", shards=str(folder), batch_size=8, features="offline")
        feats[dtype] = next(iter(ShardStream(config, 0, 1)))["feats"]
    assert feats["bf16"].dtype == torch.bfloat16 and feats["fp32"].dtype == torch.float32
    assert torch.equal(feats["bf16"], feats["fp32"].to(torch.bfloat16))
    assert torch.equal(feats["fp16"], feats["fp32"].to(torch.float16))
    with pytest.raises(ValueError, match=r"feats_dtype must be one of \[.*\], got 'int8'"):
        prepare_features(target, pairs, tmp_path / "int8", progress=False, feats_dtype="int8")
