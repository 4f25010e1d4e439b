"""benchmarks.data_scaling: the fit run it makes per drafter kind, and the curve it reads from its log."""

from __future__ import annotations

import argparse
from pathlib import Path

from hydra import compose, initialize_config_dir

from benchmarks.data_scaling import fit_command, read_curve, to_markdown
from vdtrain.config import register_configs

CONF = Path(__file__).resolve().parents[1] / "conf"


def test_each_kinds_run_is_a_valid_fit_config_that_validates_every_point(tmp_path):
    args = argparse.Namespace(
        device="cuda", target="grain", minutes=2.0, points=2048, batch=16, val_samples=64,
        ttt_steps=3, precision="bf16-mixed", threads=None,
    )  # fmt: skip
    command = fit_command(args, "eagle3", tmp_path / "eagle3")
    assert command[1:3] == ["-m", "vdtrain.fit"]
    overrides = [o for o in command[3:] if not o.startswith("hydra.")]
    register_configs()  # fit's schema, as `python -m vdtrain.fit` registers it
    with initialize_config_dir(str(CONF), version_base=None):
        cfg = compose("fit", overrides=overrides)
    assert cfg.drafter.kind == "eagle3" and cfg.drafter.ttt_steps == 3
    assert cfg.trainer.accelerator == "gpu" and cfg.trainer.max_minutes == 2.0
    assert cfg.data.samples_per_epoch == 2048 and cfg.data.batch_size == 16 and not cfg.eval.enabled
    assert cfg.target.folder == "checkpoints/grain/target"
    assert "drafter.ttt_steps=3" in fit_command(args, "eagle1", tmp_path / "eagle1")  # unrolled kinds read it


def test_the_curve_has_one_point_per_validation(tmp_path):
    """Lightning's CSV log: training rows leave the validation columns empty."""
    log = tmp_path / "metrics.csv"
    log.write_text(
        "epoch,step,train/top1,val/tau_sim,val/top1_depth1,val/top1_depth2,val/top1_depth10\n"
        "0,9,0.1,,,,\n"
        "0,127,,1.5,0.40,0.30,0.05\n"
        "1,255,,1.7,0.45,0.35,0.07\n"
        "1,256,,1.7,0.45,0.35,0.07\n"  # the final weights validated again at the end of fit
    )
    curve = read_curve(log, batch=16)
    assert curve == [
        {"samples": 2048, "top1_depth": [0.40, 0.30, 0.05], "tau_sim": 1.5},
        {"samples": 4096, "top1_depth": [0.45, 0.35, 0.07], "tau_sim": 1.7},
    ]  # depth 10 sorts after 2
    assert "| eagle1 | 4,096 | 0.450 / 0.350 / 0.070 | 1.7 |" in to_markdown({"eagle1": curve})
