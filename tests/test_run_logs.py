"""The logs a run leaves are complete (issue 57, item 3): the resolved configuration as hyperparameters,
the learning rate at every logged step, and one wandb run across a resume of the same folder."""

from __future__ import annotations

import csv
from pathlib import Path

import wandb as wandb_lib
import yaml
from test_fit import fit_config

from vdtrain.fit import fit, wandb_id

STEPS = ("trainer.max_steps=4", "trainer.checkpoint_every_n_steps=2", "trainer.threads=1")


def test_wandb_offline_sees_the_config_the_learning_rate_and_one_run_across_a_resume(tiny_folder, tmp_path):
    run = tmp_path / "run"
    wandb = ("logger=wandb", "optim.lr=0.002")
    fit(fit_config(tiny_folder, run, *STEPS, *wandb))
    first = wandb_lib.run
    config, first_id = dict(first.config), first.id
    wandb_lib.finish()  # a process of its own would end its run here
    fit(fit_config(tiny_folder, run, *STEPS, *wandb, "resume=last", "trainer.max_steps=6"))
    resumed_id, summary = wandb_lib.run.id, dict(wandb_lib.run.summary)
    wandb_lib.finish()
    assert first_id == resumed_id == wandb_id(run)
    runs = sorted((run / "logs" / "wandb").glob("offline-run-*"))  # what `wandb sync` uploads as one run
    assert len(runs) == 2 and all(r.name.endswith(f"-{wandb_id(run)}") for r in runs), runs
    assert config["optim"]["lr"] == 0.002 and config["run_dir"] == str(run)
    assert config["trainer"]["max_steps"] == 4
    assert summary["lr-AdamW"] > 0 and summary["trainer/global_step"] >= 5, summary


def test_csv_logs_hold_the_learning_rate_and_the_config(tiny_folder, tmp_path):
    run = tmp_path / "run"
    fit(fit_config(tiny_folder, run, *STEPS, "optim.warmup_steps=2"))
    with open(run / "logs" / "metrics.csv", newline="") as file:
        rates = [float(r["lr-AdamW"]) for r in csv.DictReader(file) if r.get("lr-AdamW")]
    assert len(rates) == 4 and rates[0] < rates[1], rates  # the warm-up shows
    hparams = yaml.safe_load((run / "logs" / "hparams.yaml").read_text())
    assert hparams["trainer"]["max_steps"] == 4 and hparams["run_dir"] == str(run)


def test_the_wandb_id_is_the_folders_and_only_its():
    assert wandb_id(Path("/a/run 1")) == wandb_id(Path("/a/run 1"))
    assert wandb_id(Path("/a/run 1")) != wandb_id(Path("/b/run 1"))
    assert wandb_id(Path("/a/run 1")).startswith("run-1-")
