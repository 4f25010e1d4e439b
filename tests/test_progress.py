"""The training progress a person reads: the terminal bar counts optimizer steps out of ``max_steps``
(Lightning's own shows "Epoch 3/-2" on a stream without epochs), and durations print compactly."""

from __future__ import annotations

import lightning as L
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel
from omegaconf import OmegaConf

from vdtrain.preflight import FIT_MINIMUMS, at_least
from vdtrain.train.progress import StepProgressBar, duration, progress_interval


def test_the_terminal_bar_counts_steps_out_of_max_steps(tmp_path):
    bar = StepProgressBar()
    trainer = L.Trainer(
        max_steps=5,
        callbacks=[bar],
        logger=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        accelerator="cpu",
    )
    trainer.fit(BoringModel())
    shown = bar.train_progress_bar
    assert (shown.total, shown.n) == (5, 5) and shown.desc.startswith("step")


@pytest.mark.parametrize(("seconds", "text"), [(0, "0s"), (40.4, "40s"), (312, "5m12s"), (3720, "1h02m")])
def test_durations_print_compactly(seconds, text):
    assert duration(seconds) == text


def test_a_bad_interval_is_refused():
    cfg = OmegaConf.create({"trainer": {"progress_every_n_steps": 0}})
    with pytest.raises(ValueError, match="progress_every_n_steps must be at least 1"):
        at_least(cfg, FIT_MINIMUMS)


@pytest.mark.parametrize(("max_steps", "every"), [(20, 2), (5, 1), (400, 25), (60, 6)])
def test_the_default_interval_gives_at_least_ten_lines(max_steps, every):
    assert progress_interval(None, max_steps) == every and max_steps // every >= 5
    assert max_steps // every >= min(max_steps, 10)


def test_a_slow_run_gets_a_line_at_least_every_minute_training_and_validating(tmp_path, monkeypatch, caplog):
    """Progress every 25 steps left a loaded CPU silent for minutes (16 gaps over a minute, one of 199 s),
    and the final validation was silent for 215 s. With the silence limit at 0 s every step and every
    validation batch gets its line, whatever ``every`` says."""
    from vdtrain.train import progress

    monkeypatch.setattr(progress, "MAX_SILENCE_S", 0.0)
    trainer = L.Trainer(
        max_steps=3,
        limit_train_batches=3,  # one epoch: validation runs after step 3
        callbacks=[progress.ProgressLog(every=1000, samples_per_step=1)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
        accelerator="cpu",
    )
    with caplog.at_level("INFO", logger="vdtrain.fit"):
        trainer.fit(BoringModel())
    lines = [r.getMessage() for r in caplog.records if r.name == "vdtrain.fit"]
    assert [line.split(" |")[0] for line in lines if " | " in line] == ["step 1/3", "step 2/3", "step 3/3"]
    assert "validation at step 3/3: batch 1/2, 0s so far" in lines
