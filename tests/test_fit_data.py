"""Training data positions: corrupt samples under ``on_corrupt=skip``, DataLoader workers (each sample once,
same order as without workers, exact resume), and why the library reads shards without webdataset."""

from __future__ import annotations

import io
import json
import re
import shutil
import tarfile
from pathlib import Path

import lightning as L
import pytest
import tomllib
import torch
from test_fit import REPO, StopAfter, fit_config, image_key, read_ckpt
from test_fit_shards import captions
from test_fit_shards import shard_sets as shard_sets  # the module-scoped fixture

from vdtrain.config import DataConfig
from vdtrain.data.shard_stream import ShardStream, epoch_order
from vdtrain.fit import fit


def corrupt_copy(folder: Path, out: Path, shard: int = 0, sample: int = 1) -> str:
    """A copy of a shard set whose ``sample``-th sample of shard ``shard`` has unreadable tokens (same
    byte size, so only decoding notices); returns that sample's caption."""
    shutil.copytree(folder, out)
    name = json.loads((out / "manifest.json").read_text())["shards"][shard]["name"]
    with tarfile.open(out / name) as tar:
        members = [(info, tar.extractfile(info).read()) for info in tar.getmembers()]
    keys = list(dict.fromkeys(info.name.split(".")[0] for info, _ in members))
    bad = keys[sample]
    caption = next(data.decode() for info, data in members if info.name == f"{bad}.caption.txt")
    with tarfile.open(out / name, "w", format=tarfile.USTAR_FORMAT) as tar:
        for info, data in members:
            if info.name == f"{bad}.tokens.npy":
                data = b"x" * len(data)
            tar.addfile(info, io.BytesIO(data))
    return caption


class Recorder(L.Callback):
    """What each training step was fed: (epoch, sample keys)."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, list[str]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        keys = batch["caption"] if "image" not in batch else [image_key(i) for i in batch["image"]]
        self.steps.append((trainer.current_epoch, list(keys)))


# --- item 5: a skipped sample consumes its position -------------------------------------------------------
def test_epoch_order_depends_on_the_manifest_only():
    order = epoch_order([3, 3, 2], 0, 4)[1]
    assert sorted(order) == list(range(8)) and order == epoch_order([3, 3, 2], 0, 4)[1]
    assert order != epoch_order([3, 3, 2], 1, 4)[1]


def test_skipped_sample_consumes_its_position_and_every_epoch_stays_full(shard_sets, tmp_path, caplog):
    pairs, _ = shard_sets
    bad = corrupt_copy(pairs, tmp_path / "bad")
    config = DataConfig(source="shards", shards=str(tmp_path / "bad"), batch_size=2, on_corrupt="skip")
    stream = ShardStream(config, 0, 1)
    for epoch in range(3):
        stream.start_at(epoch * 8)
        batches = list(stream)
        assert len(batches) == len(stream) == 4  # the same step count every epoch
        seen = [c for b in batches for c in b["caption"]]
        assert len(seen) == 7 and bad not in seen  # the bad sample's position passed, nothing else lost
    assert "skipped" in caplog.text and re.search(r"sample '[^']+'", caplog.text)


def test_fit_with_a_skipped_sample_reaches_max_steps(shard_sets, tiny_folder, tmp_path):
    pairs, _ = shard_sets
    corrupt_copy(pairs, tmp_path / "bad")
    cfg = fit_config(
        tiny_folder,
        tmp_path / "run",
        "data=laion_coco",  # on_corrupt=skip is its default
        f"data.shards={tmp_path / 'bad'}",
        "data.batch_size=2",
        "data.val_samples=0",
        "data.num_workers=0",
        "trainer.max_steps=10",  # 4 steps an epoch: into the third epoch
        "trainer.max_epochs=4",  # before the fix, epochs after the first were empty: stop there
        "trainer.checkpoint_every_n_steps=10",
    )
    recorder = Recorder()
    assert fit(cfg, callbacks=[recorder])["steps"] == 10
    assert [e for e, _ in recorder.steps] == [0] * 4 + [1] * 4 + [2] * 2
    assert read_ckpt(tmp_path / "run" / "checkpoints" / "last.ckpt")["DrafterDataModule"] == {"consumed": 20}


def test_all_unreadable_batch_is_replaced_by_a_neighbour(shard_sets, tmp_path):
    pairs, _ = shard_sets
    corrupt_copy(pairs, tmp_path / "bad")
    config = DataConfig(source="shards", shards=str(tmp_path / "bad"), batch_size=1, on_corrupt="skip")
    batches = [b["caption"] for b in ShardStream(config, 0, 1)]
    assert len(batches) == 8 and all(len(b) == 1 for b in batches)
    assert len({c for b in batches for c in b}) == 7  # one batch repeats a neighbour


# --- item 6: workers split the batches; same order, exact resume ------------------------------------------
def test_shard_stream_workers_make_each_batch_once(shard_sets):
    pairs, _ = shard_sets
    config = DataConfig(source="shards", shards=str(pairs), batch_size=1, shuffle_buffer=4)
    expected = captions(ShardStream(config, 0, 1), 3)
    loader = torch.utils.data.DataLoader(ShardStream(config, 0, 1), batch_size=None, num_workers=2)
    loader.dataset.start_at(3)
    assert [c for b in loader for c in b["caption"]] == expected


@pytest.mark.slow
def test_workers_see_each_sample_once_in_order_and_resume_exactly(tiny_folder, tmp_path):
    run = (
        "trainer.max_steps=6",
        "trainer.checkpoint_every_n_steps=1",
        "data.p_null=0.5",
        "trainer.threads=1",
    )
    seen = {}
    for workers in (0, 2):
        seen[workers] = Recorder()
        fit(
            fit_config(tiny_folder, tmp_path / f"w{workers}", *run, f"data.num_workers={workers}"),
            [seen[workers]],
        )
    assert seen[2].steps == seen[0].steps  # the same batches in the same order
    epoch0 = [k for e, keys in seen[2].steps if e == 0 for k in keys]
    assert len(epoch0) == len(set(epoch0)) == 8  # every sample of the epoch once
    split = (*run, "data.num_workers=2")
    fit(fit_config(tiny_folder, tmp_path / "split", *split), callbacks=[StopAfter(3)])
    assert read_ckpt(tmp_path / "split" / "checkpoints" / "last.ckpt")["global_step"] == 3
    fit(fit_config(tiny_folder, tmp_path / "split", *split, "resume=last"))
    whole, resumed = (read_ckpt(tmp_path / r / "checkpoints" / "last.ckpt") for r in ("w2", "split"))
    assert resumed["global_step"] == 6 and resumed["DrafterDataModule"] == whole["DrafterDataModule"]
    for name, value in whole["state_dict"].items():
        assert torch.equal(value, resumed["state_dict"][name]), name


# --- item 13: shards are read by our own reader ----------------------------------------------------------
def test_webdataset_is_not_a_runtime_dependency():
    """Training needs exact, manifest-validated positions for resume (see docs/training.md); webdataset's
    pipeline splits shards, not positions, so the library reads tars itself. Only tests use webdataset,
    to show the shards stay readable by it."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("webdataset") for d in project["dependencies"])
    assert any(d.startswith("webdataset") for d in project["optional-dependencies"]["test"])
    sources = [*(REPO / "vdtrain").rglob("*.py"), *(REPO / "data_prep").rglob("*.py")]
    users = [p for p in sources if re.search(r"^\s*(import|from)\s+webdataset", p.read_text(), re.M)]
    assert not users, users
