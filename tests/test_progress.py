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
