"""A requeued SLURM job never starts over (issue 57, item 1): one command, ``resume=auto``, starts a fresh
run in an empty folder and continues a run that has a checkpoint; SIGUSR1 (``--signal=USR1@90``) stops it at
a step boundary with ``last.ckpt`` written."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from test_fit import SMALL, read_ckpt, run_cli, sub_env
from test_resume import RUN, losses, rows

from vdtrain.fit import PREEMPTED_EXIT_CODE
from vdtrain.resume import auto


@pytest.mark.slow  # two fit processes: about 40 s on a loaded 2-core machine
def test_sigusr1_then_the_same_command_continues_from_the_step_reached(tiny_folder, tmp_path):
    run = tmp_path / "run"
    command = [sys.executable, "-m", "vdtrain.fit", f"target.folder={tiny_folder}", *SMALL, *RUN,
               "resume=auto", f"hydra.run.dir={run}"]  # fmt: skip
    out = subprocess.PIPE
    proc = subprocess.Popen(command, cwd=tmp_path, env=sub_env(), stdout=out, stderr=out, text=True)
    last, deadline = run / "checkpoints" / "last.ckpt", time.monotonic() + 120
    while not last.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGUSR1)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == PREEMPTED_EXIT_CODE, stderr[-3000:]
    assert "stopped by SIGUSR1" in stdout + stderr, (stdout + stderr)[-3000:]
    stopped = read_ckpt(last)["global_step"]
    before = rows(run)
    assert 4 <= stopped < 24 and before and max(losses(before)) == stopped - 1

    again = run_cli(command, tmp_path, timeout=300)  # the requeued job: the same command
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"Restoring states from the checkpoint path at {last}" in again.stdout + again.stderr
    assert read_ckpt(last)["global_step"] == 24
    after = rows(run)
    assert after[: len(before)] == before  # the rows written before the signal are kept
    assert sorted(losses(after)) == list(range(24))  # every step once, none from 0 again after the stop
    (resumed,) = (run / "resumes").iterdir()  # the run's own record stays; the second launch records itself
    assert (run / ".hydra" / "config.yaml").is_file() and (resumed / "config.yaml").is_file()


def test_auto_resumes_only_a_folder_with_a_checkpoint(tmp_path):
    assert auto("auto", tmp_path) is None
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert auto("auto", tmp_path) == "last"
    assert auto(None, tmp_path) is None and auto("x.ckpt", tmp_path) == "x.ckpt"
