"""A resume is the run's own (issue 37, item 1 and 2): ``resume=last hydra.run.dir=<run>`` continues
with the run's saved configuration, keeps its record and every row of its metrics, and refuses an
override that would change the run; ``resume=last`` without a run folder names the runs it could mean."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import pytest
from omegaconf import OmegaConf
from test_bad_input import HEAVY, run_listing_imports
from test_fit import SMALL, fit_config, read_ckpt, run_cli, sub_env

from vdtrain.fit import fit
from vdtrain.resume import finished
from vdtrain.train.checkpointing import checkpoint_interval

RUN = ("trainer.max_steps=24", "trainer.checkpoint_every_n_steps=4", "trainer.threads=1", "data.p_null=0.5")


def rows(run: Path) -> list[dict[str, str]]:
    with open(run / "logs" / "metrics.csv", newline="") as file:
        return list(csv.DictReader(file))


def losses(table: list[dict[str, str]]) -> dict[int, str]:
    """step -> train/total as written; a step logged twice keeps its later row."""
    return {int(r["step"]): r["train/total"] for r in table if r.get("train/total")}


def kill_after_first_checkpoint(args: list[str], cwd: Path, run: Path) -> None:
    proc = subprocess.Popen(args, cwd=cwd, env=sub_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    last, deadline = run / "checkpoints" / "last.ckpt", time.monotonic() + 120
    while not last.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"the run ended before it could be killed: {stderr[-3000:]}"


@pytest.mark.slow  # three fit processes: about 60 s on a loaded 2-core machine
def test_sigkill_then_resume_with_only_the_run_folder_is_the_uninterrupted_run(tiny_folder, tmp_path):
    run = tmp_path / "run"
    start = [sys.executable, "-m", "vdtrain.fit", f"target.folder={tiny_folder}", *SMALL, *RUN]
    kill_after_first_checkpoint([*start, f"hydra.run.dir={run}"], tmp_path, run)
    stopped = read_ckpt(run / "checkpoints" / "last.ckpt")["global_step"]
    before = rows(run)
    record = {f: (run / ".hydra" / f).read_text() for f in ("config.yaml", "overrides.yaml")}
    assert 4 <= stopped < 24 and before

    resume = [sys.executable, "-m", "vdtrain.fit", "resume=last", f"hydra.run.dir={run}"]
    # An override that would change the run is refused before anything loads, naming the saved value.
    refused = run_cli([*resume, "data.batch_size=4", "trainer.max_steps=20"], tmp_path)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert "data.batch_size=4 (the run has data.batch_size=2)" in refused.stderr
    assert "trainer.max_steps=20 (the run has trainer.max_steps=24)" in refused.stderr

    done = run_cli(resume, tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert read_ckpt(run / "checkpoints" / "last.ckpt")["global_step"] == 24  # not the default 400
    after = rows(run)
    assert after[: len(before)] == before  # every row written before the kill is kept
    assert {f: (run / ".hydra" / f).read_text() for f in record} == record
    (resumed,) = (run / "resumes").iterdir()
    assert OmegaConf.load(resumed / "config.yaml").trainer.max_steps == 24
    assert OmegaConf.load(resumed / "overrides.yaml") == ["resume=last"]

    whole = tmp_path / "whole"
    fit(fit_config(tiny_folder, whole, *RUN))
    expected, got = losses(rows(whole)), losses(after)
    later = [step for step in expected if step >= stopped]
    assert later and all(got[step] == expected[step] for step in later), (expected, got)


def test_resume_last_without_a_run_folder_names_the_runs_and_leaves_nothing(tmp_path):
    runs = tmp_path / "checkpoints" / "runs"
    (runs / "2020-01-01_00-00-00" / "checkpoints").mkdir(parents=True)
    (runs / "2020-01-01_00-00-00" / "checkpoints" / "last.ckpt").write_bytes(b"")
    done, (line,), imported = run_listing_imports(["-m", "vdtrain.fit", "resume=last"], tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "hydra.run.dir=<run folder>" in line and "checkpoints/runs/2020-01-01_00-00-00" in line
    assert [p.name for p in runs.iterdir()] == ["2020-01-01_00-00-00"]  # no new empty run folder
    assert not imported & set(HEAVY)  # found from the configuration alone


class RaiseAt(L.Callback):
    """A crash at one step (an exception, not SIGTERM: no checkpoint is written for it)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"crash at step {self.step}")


@pytest.mark.parametrize(
    ("overrides", "kept"),
    [
        (("data.samples_per_epoch=64",), 12),  # 32 steps an epoch: every 20 // 10 = 2 steps
        (("data.samples_per_epoch=8", "trainer.checkpoint_every_n_steps=100"), 12),  # 4 an epoch: epoch ends
    ],
    ids=["cadence-from-max-steps", "end-of-epoch"],
)
def test_a_short_run_stopped_midway_has_a_checkpoint(tiny_folder, tmp_path, overrides, kept):
    """Checkpoints every 100 steps gave a 60-step run killed at step 42 none to resume from."""
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="crash at step 13"):
        fit(fit_config(tiny_folder, run, "trainer.max_steps=20", *overrides), callbacks=[RaiseAt(13)])
    assert read_ckpt(run / "checkpoints" / "last.ckpt")["global_step"] == kept


def test_checkpoint_cadence_follows_max_steps_unless_given():
    assert [checkpoint_interval(None, n) for n in (5, 60, 400, 5000)] == [1, 6, 40, 100]
    assert checkpoint_interval(7, 5000) == 7


def write_run(run: Path, steps: int, max_steps: int, max_minutes: float | None = None) -> None:
    """A run folder as fit leaves it: its record and (when it ended) its summary."""
    (run / ".hydra").mkdir(parents=True)
    trainer = {"max_steps": max_steps, "max_minutes": max_minutes}
    OmegaConf.save(OmegaConf.create({"trainer": trainer}), run / ".hydra" / "config.yaml")
    (run / "summary.json").write_text(json.dumps({"steps": steps, **trainer}))


@pytest.mark.parametrize(
    ("ended", "resumed", "is_finished"),
    [
        ((24, 24), (24, None), True),  # at its max_steps
        ((24, 24), (48, None), False),  # more steps asked
        ((10, 24, 1.0), (24, 1.0), True),  # at its time limit
        ((10, 24, 1.0), (48, 1.0), True),  # more steps, but the same time limit
        ((10, 24, 1.0), (24, 5.0), False),  # more time
    ],
)
def test_a_resume_of_a_finished_run_has_nothing_to_do_unless_it_extends_it(
    tmp_path, ended, resumed, is_finished
):
    write_run(tmp_path, *ended)
    effective = OmegaConf.create({"trainer": {"max_steps": resumed[0], "max_minutes": resumed[1]}})
    assert (finished(tmp_path, effective) is not None) == is_finished
    assert finished(tmp_path / "elsewhere", effective) is None  # no summary: not finished


def test_resume_last_of_a_named_run_without_a_checkpoint_says_so(tmp_path):
    """The folder was given: the error does not ask for it."""
    (tmp_path / "run").mkdir()
    done = run_cli(
        [sys.executable, "-m", "vdtrain.fit", "resume=last", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path
    )
    assert done.returncode == 2
    assert "has no checkpoint" in done.stderr and "start it again without resume=last" in done.stderr
    assert "hydra.run.dir=<run folder>" not in done.stderr


def test_a_resumed_runs_samples_per_second_count_only_its_own_steps(tiny_folder, tmp_path):
    """A run resumed at step 2 of 4 reported all 4 steps over the resumed launch's minutes (13.7 samples/s
    where its own progress lines read 7.2-9.4), and Lightning warned that its checkpoint folder was not
    empty."""
    run = tmp_path / "run"
    first = fit(fit_config(tiny_folder, run, "trainer.max_steps=2", "trainer.checkpoint_every_n_steps=1"))
    assert first["steps"] == 2
    ckpt = run / "checkpoints" / "last.ckpt"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = fit(fit_config(tiny_folder, run, "trainer.max_steps=4", f"resume={ckpt}"))
    assert not [w for w in caught if "exists and is not empty" in str(w.message)]  # the run's own folder
    counted = summary["samples_per_s"] * summary["minutes"] * 60 / 2  # data.batch_size=2
    assert summary["steps"] == 4 and counted == pytest.approx(2)
