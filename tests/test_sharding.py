"""``vdtrain.sharding`` on its own: the split of units over ranks, the launcher's variables, finished
units on disk (a half-written one is redone), and a shard set written by several processes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from test_fit import CONF

from vdtrain.data.shards import ShardWriter
from vdtrain.sharding import Ranks, UnitStore, ranks_from_env, units_of
from vdtrain.targets.base import TargetIdentity


@pytest.mark.parametrize("n", [0, 1, 5, 8, 13])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_the_split_is_balanced_contiguous_and_covers_every_unit_once(n, world):
    units = list(range(n))
    parts = [Ranks(rank, world).take(units) for rank in range(world)]
    assert [u for part in parts for u in part] == units  # rank order is unit order, nothing twice
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert parts == [Ranks(rank, world).take(units) for rank in range(world)]  # deterministic


def test_units_do_not_depend_on_the_world_size():
    assert units_of(5, 2) == [(0, 2), (2, 4), (4, 5)]
    with pytest.raises(ValueError, match="unit size"):
        units_of(5, 0)


def test_ranks_come_from_torchrun_then_srun():
    assert ranks_from_env({}) == Ranks(0, 1, 0)
    assert ranks_from_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}) == Ranks(3, 8, 1)
    slurm = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1"}
    assert ranks_from_env(slurm) == Ranks(9, 16, 1)


def test_a_half_written_or_damaged_unit_is_redone_never_read(tmp_path):
    store = UnitStore(tmp_path)
    store.save("ar_T1/000000", {"tokens": [1, 2]})
    assert store.load("ar_T1/000000") == {"tokens": [1, 2]}
    assert not list(tmp_path.rglob("*.tmp"))  # renamed into place
    (tmp_path / "ar_T1" / "000002.pt.tmp").write_bytes(b"half")  # a process killed while writing
    assert store.load("ar_T1/000002") is None
    store.path("ar_T1/000004").write_bytes(b"garbage")  # damaged after it was written
    assert store.load("ar_T1/000004") is None


def test_units_of_other_settings_are_refused(tmp_path):
    store = UnitStore(tmp_path)
    store.check_settings({"seed": 0, "methods": ["eagle2"]}, Ranks())
    store.check_settings({"seed": 0, "methods": ["eagle2"]}, Ranks())
    with pytest.raises(ValueError, match="other settings \\(changed: seed\\)"):
        store.check_settings({"seed": 1, "methods": ["eagle2"]}, Ranks())


def test_a_shard_set_written_by_two_processes_records_each_shard_beside_it(tmp_path):
    identity = TargetIdentity("llamagen", "tiny", 8, 32, (2, 2), 4, "f")
    settings = {"kind": "self_generate", "target_identity": identity, "source": {"seed": 0}}
    first = ShardWriter(tmp_path, shared=True, samples_per_shard=1, **settings)
    second = ShardWriter(tmp_path, shared=True, samples_per_shard=1, **settings)  # opened after the first
    sample = {"key": "000000000", "tokens": np.zeros(4, np.int64), "caption": "c", "meta": {}}
    for writer, name in ((first, "shard-000000.tar"), (second, "shard-000001.tar")):
        with writer.shard(name, {"n": name}) as sink:
            sink.write(sample)
    assert json.loads((tmp_path / "manifest.json").read_text())["shards"] == []  # untouched until close
    again = ShardWriter(tmp_path, shared=True, samples_per_shard=1, **settings)  # a restart
    assert again.finished("shard-000001.tar", {"n": "shard-000001.tar"})
    manifest = first.close(["shard-000000.tar", "shard-000001.tar"])
    assert manifest["complete"] and [s["name"] for s in manifest["shards"]] == [
        "shard-000000.tar",
        "shard-000001.tar",
    ]
    assert not list(tmp_path.glob("*.tar.json"))  # folded into the manifest


def test_self_generate_refuses_a_relaxed_method_before_loading_anything(tmp_path):
    from data_prep.self_generate import run_on

    with initialize_config_dir(str(CONF), version_base=None):
        cfg = compose(
            "data_prep/self_generate", overrides=["captions=x.txt", f"out_dir={tmp_path}", "method=lantern"]
        )
    with pytest.raises(ValueError, match="relaxed \\(not exact\\)"):
        run_on(cfg, Ranks())
