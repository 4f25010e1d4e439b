"""DeepSpeed ZeRO checkpoint folders (``trainer=deepspeed_stage_{2,3}``'s ``last.ckpt/``): export, evaluation
(``Drafter.from_pretrained``), fit's own export and resume recognise them and gather the full fp32 drafter,
equal to the same drafter trained without DeepSpeed; a folder missing a rank's files is refused in one line.

The folders come from two CPU ranks under DeepSpeed (gloo) in ``tests/zero_ranks.py``; the refusals are
checked on folders laid out by hand, before DeepSpeed is imported."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from zero_ranks import module

from vdtrain.checkpoint_io import CheckpointError
from vdtrain.drafters import Drafter
from vdtrain.export import resolve_source
from vdtrain.export_format import holds_drafter
from vdtrain.resume import auto, checkpoint
from vdtrain.train.whole_drafter import whole_drafter
from vdtrain.zero_checkpoint import check_zero_checkpoint

ROOT = Path(__file__).resolve().parents[1]
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="no deepspeed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory) -> Path:
    """``zero2/``, ``zero3/`` and ``plain.pt`` of ``tests/zero_ranks.py`` (two ranks, two steps)."""
    folder = tmp_path_factory.mktemp("zero")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "zero_ranks.py"), str(folder), str(_free_port())],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return folder


def _assert_the_plain_drafter(state: dict[str, torch.Tensor], folder: Path) -> None:
    """``state`` is the plain run's drafter: fp32, every tensor whole, equal to float rounding. AdamW's
    first steps are ``lr · g/(|g| + eps)``: for a gradient near eps the ranks' reduction order moves an
    entry by a fraction of lr (3e-2), so the bound is on the whole difference against the whole move."""
    plain = torch.load(folder / "plain.pt")
    assert state.keys() == plain.keys()
    moved = diff = 0.0
    start = _initial()
    for name, value in plain.items():
        assert state[name].dtype == torch.float32 and state[name].shape == value.shape, name
        diff += (state[name] - value).pow(2).sum().item()
        moved += (value - start[name]).pow(2).sum().item()
        torch.testing.assert_close(state[name], value, rtol=0, atol=1e-3)
    assert moved > 1.0 and diff < 1e-4 * moved, (diff, moved)


def _initial() -> dict[str, torch.Tensor]:
    return module().drafter.state_dict()


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_a_zero_folder_gives_the_full_fp32_drafter_trained_without_deepspeed(zero_runs, stage):
    drafter = Drafter.from_pretrained(zero_runs / f"zero{stage}")
    _assert_the_plain_drafter(drafter.state_dict(), zero_runs)
    assert drafter.metadata["checkpoint"]["global_step"] == 2


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_the_after_epoch_evaluation_under_zero3_decodes_with_the_whole_drafter(zero_runs, rank):
    """``EvalAfterEpoch`` on each ZeRO-3 rank hands the decoding the gathered, trained drafter
    (``whole_drafter``), not the rank's empty partition; a drafter DeepSpeed does not partition is handed
    over as it is."""
    _assert_the_plain_drafter(torch.load(zero_runs / f"zero3_eval_rank{rank}.pt"), zero_runs)
    plain = module()
    with whole_drafter(plain.drafter, plain.target) as drafter:
        assert drafter is plain.drafter


@needs_deepspeed
@pytest.mark.slow
def test_export_and_fit_write_the_gathered_drafter(zero_runs, tmp_path):
    """``vdtrain.export source=<run>/checkpoints/last.ckpt`` (a ZeRO-3 folder) and fit's own export under
    DeepSpeed (``trained_drafter``) write the gathered drafter, not rank 0's partition."""
    from vdtrain.fit import trained_drafter
    from vdtrain.hub import export_drafter

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    last = run / "checkpoints" / "last.ckpt"
    shutil.copytree(zero_runs / "zero3", last)
    assert holds_drafter(last)
    source, found = resolve_source(str(last))
    assert (source, found) == (last, run)
    trained = module()
    export = export_drafter(source, tmp_path / "export", target=trained.target)
    _assert_the_plain_drafter(Drafter.from_pretrained(export).state_dict(), zero_runs)
    # the partitioned in-memory drafter of a ZeRO-3 rank is replaced by the gathered one
    gathered = trained_drafter(trained.drafter, "deepspeed_stage_3", str(last))
    assert gathered is not trained.drafter
    _assert_the_plain_drafter(gathered.state_dict(), zero_runs)
    assert trained_drafter(trained.drafter, "ddp", str(last)) is trained.drafter
    written = load_file(export / "model.safetensors")
    assert all(v.numel() > 0 for v in written.values())


@needs_deepspeed
@pytest.mark.slow
def test_a_truncated_shard_is_refused_in_one_line(zero_runs, tmp_path):
    folder = shutil.copytree(zero_runs / "zero2", tmp_path / "last.ckpt")
    shard = folder / "checkpoint" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="cannot gather DeepSpeed ZeRO checkpoint") as err:
        Drafter.from_pretrained(folder)
    assert "\n" not in str(err.value)


def _laid_out(folder: Path, stage: int, ranks: list[int], world: int = 2) -> Path:
    """A ZeRO folder as DeepSpeed lays it out, with the files of ``ranks`` only (the contents are not read
    before the check)."""
    tag = folder / "checkpoint"
    tag.mkdir(parents=True)
    (folder / "latest").write_text("checkpoint")
    states = {"dp_world_size": world, "drafter_config": {}}
    if stage == 2:
        torch.save(states, tag / "mp_rank_00_model_states.pt")
    for rank in ranks:
        if stage == 3:
            torch.save(states, tag / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        (tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")
    return folder


@pytest.mark.parametrize("stage", [2, 3])
def test_a_zero_folder_missing_a_rank_is_refused_in_one_line(tmp_path, stage):
    folder = _laid_out(tmp_path / "last.ckpt", stage, [0])
    for read in (Drafter.from_pretrained, check_zero_checkpoint):
        with pytest.raises(CheckpointError, match=r"rank\(s\) \[1\] of the 2 that trained are missing") as e:
            read(folder)
        assert "\n" not in str(e.value)
    check_zero_checkpoint(_laid_out(tmp_path / "whole.ckpt", stage, [0, 1]))  # no error


def test_a_zero_folder_without_its_tag_folder_or_model_states_is_refused(tmp_path):
    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    (folder / "latest").write_text("checkpoint")
    with pytest.raises(CheckpointError, match="latest names 'checkpoint', which is not there"):
        Drafter.from_pretrained(folder)
    (folder / "checkpoint").mkdir()
    (folder / "checkpoint" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"has no mp_rank_00_model_states\.pt"):
        Drafter.from_pretrained(folder)


def test_resume_takes_a_zero_folder_and_refuses_an_incomplete_one(tmp_path):
    """``resume=auto`` and ``resume=last`` of a DeepSpeed run find its ``last.ckpt`` folder; one missing a
    rank's files is refused before Lightning and DeepSpeed start."""
    run = tmp_path / "run"
    assert auto("auto", run) is None
    last = _laid_out(run / "checkpoints" / "last.ckpt", 2, [0, 1])
    assert auto("auto", run) == "last"
    assert checkpoint("last", run) == last
    (last / "checkpoint" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[1\]"):
        checkpoint("last", run)
