"""Shard sets index each sample's bytes, so a rank's DataLoader worker reads only its own samples."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import webdataset as wds

import vdtrain.data.shards as shards_module
from vdtrain.config import DataConfig
from vdtrain.data import streams
from vdtrain.data.shard_stream import ShardStream
from vdtrain.data.shards import (
    ShardError,
    ShardReader,
    ShardWriter,
    index_shard_set,
    read_manifest,
    sample_index,
    validate_shards,
)
from vdtrain.targets.base import TargetIdentity

IDENTITY = TargetIdentity("llamagen", "index-test", 64, 512, (8, 8), 8, "0" * 16, 2)


@pytest.fixture(scope="module")
def feats(tmp_path_factory) -> Path:
    """A features shard set of 12 samples, 4 a shard, each ~9 KB of fp16 states (written, not computed)."""
    out = tmp_path_factory.mktemp("index") / "feats"
    writer = ShardWriter(
        out,
        kind="features",
        target_identity=IDENTITY,
        source={},
        optional_fields=["feats"],
        samples_per_shard=4,
    )
    rng = np.random.default_rng(0)
    for s in range(3):
        with writer.shard(f"shard-{s}.tar", plan=s) as sink:
            for i in range(4):
                sink.write(
                    {
                        "key": f"s{s}_{i}",
                        "tokens": rng.integers(0, 512, 64),
                        "caption": f"caption {s} {i}",
                        "meta": {},
                        "feats": rng.standard_normal((72, 64)).astype(np.float16),
                        "feats_mask": np.ones(8, bool),
                    }
                )
    writer.close([f"shard-{s}.tar" for s in range(3)])
    return out


class CountingFile:
    """A binary file that adds the bytes each read returns to ``counter``."""

    def __init__(self, handle, counter: list[int]) -> None:
        self.handle, self.counter = handle, counter

    def read(self, *args):
        data = self.handle.read(*args)
        self.counter[0] += len(data)
        return data

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.handle.close()


def bytes_read_per_process(folder: Path, monkeypatch, ranks: int = 2, workers: int = 2) -> list[int]:
    """Tar bytes one epoch reads in each of ``ranks`` × ``workers`` processes (run one after another)."""
    config = DataConfig(source="shards", shards=str(folder), batch_size=1, shuffle_buffer=4)
    counts = []
    for rank in range(ranks):
        for worker in range(workers):
            counter = [0]
            opener = lambda *a, counter=counter, **k: CountingFile(open(*a, **k), counter)  # noqa: E731, SIM115
            monkeypatch.setattr(shards_module, "open", opener, raising=False)
            info = SimpleNamespace(id=worker, num_workers=workers)
            monkeypatch.setattr(streams, "get_worker_info", lambda info=info: info)
            list(ShardStream(config, rank, ranks))
            counts.append(counter[0])
    return counts


def unindexed_copy(folder: Path, out: Path) -> Path:
    shutil.copytree(folder, out)
    manifest = json.loads((out / "manifest.json").read_text())
    for entry in manifest["shards"]:
        del entry["index"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_each_rank_and_worker_reads_only_its_own_samples(feats, tmp_path, monkeypatch):
    pairs = feats
    total = sum(s["bytes"] for s in read_manifest(pairs)["shards"])
    after = bytes_read_per_process(pairs, monkeypatch)
    before = bytes_read_per_process(unindexed_copy(pairs, tmp_path / "old"), monkeypatch)
    print(f"tar bytes {total}; read per process, scanned: {before}; indexed: {after}")
    assert all(a < b / 2 for a, b in zip(after, before, strict=True))
    assert sum(after) < total  # together, less than one copy: each sample once, no tar end blocks


def test_the_index_matches_a_header_scan_and_webdataset_reads_the_set(feats):
    pairs = feats
    manifest = read_manifest(pairs)
    for entry in manifest["shards"]:
        assert entry["index"] == sample_index(pairs / entry["name"])
    assert validate_shards(pairs).ok
    urls = [str(pairs / s["name"]) for s in manifest["shards"]]
    raw = list(wds.WebDataset(urls, shardshuffle=False, empty_check=False))
    assert [r["__key__"] for r in raw] == [s["key"] for s in ShardReader(pairs)]


def test_an_old_set_reads_by_scanning_and_index_adds_the_index(feats, tmp_path):
    pairs = feats
    old = unindexed_copy(pairs, tmp_path / "old")
    wanted = {0, 2}
    reader = ShardReader(old)
    name = reader.shards[0]
    scanned = [(i, s["key"]) for i, s in reader.iter_slots(name, wanted)]
    assert len(scanned) == 2
    shards_module.main(["index", str(old)])
    assert read_manifest(old)["shards"] == read_manifest(pairs)["shards"]
    assert [(i, s["key"]) for i, s in ShardReader(old).iter_slots(name, wanted)] == scanned
    assert index_shard_set(old) == 0  # already indexed


def test_a_wrong_index_is_a_one_line_error_naming_the_fix(feats, tmp_path):
    pairs = feats
    bad = Path(shutil.copytree(pairs, tmp_path / "bad"))
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["shards"][0]["index"][1][0] += 512  # points into the middle of a sample
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match=r"re-index with `python -m vdtrain.data.shards index") as err:
        list(ShardReader(bad).iter_slots(manifest["shards"][0]["name"], {1}))
    assert "\n" not in str(err.value)
    report = validate_shards(bad, raise_on_error=False)
    assert not report.ok and "sample index does not match" in report.problems[0]
