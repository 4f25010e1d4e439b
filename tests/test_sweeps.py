"""Hydra sweeps (``-m``) of fit, evaluate and generate (issue 57, item 2): one folder per job, and a single
run's one-line checks for every job, before the first job starts (``vdtrain.cli.run_app``).

The sweeps that run run in this process, through each app's ``main`` as ``python -m <app> -m ...`` calls
it: a child process would pay for torch and Lightning's imports again (half a minute on a loaded CPU). The
mistakes, which end the process, are tried in a child."""

from __future__ import annotations

import json
import logging
import shutil
import sys

import pytest
import yaml
from test_fit import SMALL, run_cli

from vdtrain import evaluate, fit, generate

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def sweep_here(tmp_path, monkeypatch):
    """Run ``app.main()`` as ``python -m <app> -m <args>`` in ``tmp_path``; Hydra's logging set-up undone."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    monkeypatch.chdir(tmp_path)

    def sweep(app, args: list[str]) -> None:
        monkeypatch.setattr(sys, "argv", [app.__file__, "-m", *args])
        app.main()

    yield sweep
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
        handler.close()
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)


def test_a_fit_sweep_trains_each_job_in_its_own_run_folder_and_resumes_as_a_requeued_sweep(
    tiny_folder, tmp_path, sweep_here, monkeypatch, capsys
):
    """Named as a run is (``VDTRAIN_RUN_NAME``, a SLURM job): the same command again (``resume=auto``, a
    requeue) finds its jobs' folders; a finished job says so, one that lost its folder trains anew."""
    monkeypatch.setenv("VDTRAIN_RUN_NAME", "sweep")
    args = [f"target.folder={tiny_folder}", *SMALL, "trainer.max_steps=1", "resume=auto"]
    sweep_here(fit, [*args, "drafter.kind=eagle1,eagle3"])
    sweep = tmp_path / "checkpoints" / "multirun" / "sweep"
    for number, kind in enumerate(["eagle1", "eagle3"]):
        job = sweep / str(number)
        assert json.loads((job / "summary.json").read_text())["steps"] == 1
        assert (job / "checkpoints" / "last.ckpt").is_file()
        assert f"drafter.kind={kind}" in yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
        assert json.loads((job / "drafter" / "config.json").read_text())["kind"] == kind
    first = (sweep / "0" / "summary.json").read_text()
    shutil.rmtree(sweep / "1")
    capsys.readouterr()
    sweep_here(fit, [*args, "drafter.kind=eagle1,eagle3"])
    out = capsys.readouterr().out
    assert f"vdtrain.fit: the run {str(sweep / '0')!r} is finished (1 steps" in out
    assert (sweep / "0" / "summary.json").read_text() == first  # not trained again
    assert json.loads((sweep / "1" / "summary.json").read_text())["steps"] == 1
    with pytest.raises(SystemExit) as ended:  # every job finished: nothing starts
        sweep_here(fit, [*args, "drafter.kind=eagle1,eagle3"])
    assert ended.value.code == 0 and "sweep job #1: the run" in capsys.readouterr().out


def test_an_evaluate_sweep_writes_each_job_to_its_own_folder(tiny_folder, tmp_path, sweep_here):
    args = [f"target.folder={tiny_folder}", "drafter=null", "methods=[ar]", "seed=0,1"]  # one decode a job
    args += ["eval=fast", "num_prompts=1", "batch_size=1", "out_dir=out", "speed_repeats=0", "warmup=false"]
    sweep_here(evaluate, [*args, "plots=false", "save_images=false", "acceptance.enabled=false"])
    for seed in (0, 1):
        settings = json.loads((tmp_path / "out" / str(seed) / "results.json").read_text())["settings"]
        assert settings["config"]["seed"] == seed
        assert settings["config"]["out_dir"] == str(tmp_path / "out" / str(seed))
        # the command that redoes this job alone, not the sweep's
        assert f" seed={seed} " in settings["command"] and "seed=0,1" not in settings["command"]


def test_a_generate_sweep_writes_each_job_to_its_own_folder(tiny_folder, tmp_path, sweep_here):
    # a sweep through the method= alias: test_a_mistake_in_any_job_... (method=ar,eagle9)
    sweep_here(generate, [f"target.folder={tiny_folder}", "seed=0,1", "num_prompts=1", "out_dir=out"])
    for seed in (0, 1):
        job = tmp_path / "out" / str(seed)
        stats = json.loads((job / "stats.json").read_text())
        assert [s["seed"] for s in stats["samples"]] == [seed] and stats["summary"]["method"] == "ar"
        assert (job / "0000.png").is_file() and (job / "grid.png").is_file()


def test_a_job_that_fails_once_running_ends_the_sweep_leaving_no_folder(tiny_folder, tmp_path, sweep_here):
    """A mistake only the job finds (here the drafter, after the target loads): one line, exit 2, and
    neither the job's folder nor the sweep's ``multirun.yaml`` is left."""
    with pytest.raises(SystemExit) as ended:
        args = ["method=eagle2", "seed=0,1", "drafter=/nonexistent", "num_prompts=1", "out_dir=out"]
        sweep_here(generate, [f"target.folder={tiny_folder}", *args])
    assert ended.value.code == 2 and not (tmp_path / "out").exists()


MISTAKES = [  # (app, overrides, the error line's start)
    ("vdtrain.fit", ["trainer.max_stepz=3", "optim.lr=1e-3,3e-4"],
     "sweep job #0 (optim.lr=0.001): unknown config key 'trainer.max_stepz' (did you mean trainer.max_steps"),
    # a bad value in the second job: refused before the first trains
    ("vdtrain.fit", ["optim.lr=1e-3,-1"], "sweep job #1 (optim.lr=-1): optim.lr must be at least 0, got -1"),
    ("vdtrain.evaluate", ["num_promptz=1", "seed=0,1"],
     "sweep job #0 (seed=0): unknown config key 'num_promptz' (did you mean num_prompts?)"),
    ("vdtrain.generate", ["method=ar,eagle9"], "sweep job #1 (decode=eagle9): unknown method 'eagle9'"),
]  # fmt: skip


@pytest.mark.parametrize(("app", "args", "message"), MISTAKES)
def test_a_mistake_in_any_job_is_one_line_and_status_2_with_no_folder_left(
    app, args, message, tiny_folder, tmp_path
):
    command = [sys.executable, "-m", app, "-m", f"target.folder={tiny_folder}", *args]
    done = run_cli(command, tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith(f"{app}: error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"{app}: error: {message}"), done.stderr[-3000:]
    assert errors[0].endswith("(debug=true shows the traceback)") and "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []  # no multirun.yaml, no job folder


def test_a_sweep_is_expanded_into_the_jobs_hydra_numbers():
    """The basic sweeper's order (the last key varies fastest): job N's folder is N."""
    from vdtrain.cli import SweepJobError, sweep_jobs, sweep_overrides

    assert sweep_overrides(["-m", "a=1"]) == ["a=1"] and sweep_overrides(["a=1", "--cfg", "job"]) is None
    assert sweep_overrides(["hydra.mode=MULTIRUN", "a=1,2"]) == ["a=1,2"] and sweep_overrides(["a=1"]) is None
    jobs = sweep_jobs(["drafter.kind=eagle1,eagle3", "optim.lr=1e-3,3e-4", "seed=1"])
    assert jobs == [
        ["drafter.kind=eagle1", "optim.lr=0.001", "seed=1"],
        ["drafter.kind=eagle1", "optim.lr=0.0003", "seed=1"],
        ["drafter.kind=eagle3", "optim.lr=0.001", "seed=1"],
        ["drafter.kind=eagle3", "optim.lr=0.0003", "seed=1"],
    ]
    with pytest.raises(ValueError, match=r"hydra\.job\.chdir=true,false: a sweep cannot vary Hydra.s own"):
        sweep_jobs(["hydra.job.chdir=true,false"])
    error = SweepJobError(jobs, 2, ValueError("bad"))
    assert str(error) == "sweep job #2 (drafter.kind=eagle3 optim.lr=0.001): bad"
