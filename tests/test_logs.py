"""Logs that never go quiet (issue 37, item 6): a redirected ``fit`` log gets at least ten progress lines,
an ETA of training alone, and evaluation start, per-method and end lines; a long decode says where it is
at least every minute."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import time

import pytest
from test_fit import SMALL, sub_env

from vdtrain.eval.heartbeat import Heartbeat
from vdtrain.train.progress import ProgressLog


@pytest.mark.slow  # one fit process with an evaluation: about 60 s on a loaded 2-core machine
def test_a_redirected_fit_log_shows_progress_and_evaluation(tiny_folder, tmp_path):
    log = tmp_path / "fit.out"
    args = [sys.executable, "-m", "vdtrain.fit", f"target.folder={tiny_folder}", *SMALL]
    args += ["trainer.max_steps=20", "data.samples_per_epoch=40", "eval.enabled=true", "eval.speed_repeats=1"]
    args += ["eval.num_prompts=2", "eval.batch_size=2", "eval.acceptance.enabled=false"]
    args += [f"hydra.run.dir={tmp_path / 'run'}"]
    with open(log, "w") as out:  # a file, as under SLURM: no progress bar
        done = subprocess.run(args, cwd=tmp_path, env=sub_env(), stdout=out, stderr=subprocess.STDOUT)
    text = log.read_text()
    assert done.returncode == 0, text[-3000:]
    steps = re.findall(r"step (\d+)/20 \| loss .* \| ETA \d+s of training", text)
    assert len(steps) >= 10, text[-3000:]  # progress_every_n_steps: null gives ten lines a run
    assert re.search(r"evaluation: ar, eagle2 at T = 0 on 2 prompts", text)
    assert re.search(r"eagle2 T=0: decoding 2 prompts", text) and re.search(r"eagle2 T=0: done in \d", text)
    assert re.search(r"evaluation done in \d", text)
    assert re.search(r"EvalAfterEpoch \(\w+, step 20, 2 prompts\) \d{4}-\d\d-\d\d \d\d:\d\d:\d\d", text)


def test_a_long_decode_logs_its_progress_while_it_runs(caplog):
    caplog.set_level(logging.INFO, logger="vdtrain.eval")
    with Heartbeat("eagle2 T=0", total=4, every=0.05) as beat:
        beat.update(2)
        time.sleep(0.3)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "eagle2 T=0: decoding 4 prompts"
    assert "eagle2 T=0: 2/4 prompts, 0s so far" in lines[1:-1]
    assert lines[-1].startswith("eagle2 T=0: done in ")


def test_the_eta_leaves_evaluation_time_out(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    progress = ProgressLog(every=1, samples_per_step=2)
    progress._started_at = clock[0]
    clock[0] += 10  # ten seconds of training
    progress.on_train_epoch_end(None, None)
    clock[0] += 600  # a ten-minute evaluation
    progress.on_train_epoch_start(None, None)
    clock[0] += 10
    assert progress.training_seconds(clock[0]) == pytest.approx(20)
