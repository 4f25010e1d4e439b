"""Faults during training: non-finite weights, SIGTERM (preemption), a full disk while checkpointing.
Each leaves a ``last.ckpt`` that resumes the run."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import textwrap
import time

import lightning as L
import pytest
import torch
from test_fit import CONF, SMALL, fit_config, read_ckpt, sub_env

from vdtrain.fit import PREEMPTED_EXIT_CODE, fit
from vdtrain.train.checkpointing import Interrupted, NonFiniteWeightsError, Preempted
from vdtrain.train.module import NonFiniteLossError


# --- item 7: non-finite weights never reach a checkpoint ---------------------------------------------------
class PoisonGradients(L.Callback):
    """NaN gradients at one optimizer step: the weights after it are NaN while its loss was finite."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == self.step:
            for p in pl_module.drafter.parameters():
                p.grad.fill_(float("nan"))


@pytest.mark.parametrize(
    ("every", "error"), [(1, NonFiniteWeightsError), (2, NonFiniteLossError)], ids=["at-save", "at-loss"]
)
def test_non_finite_weights_are_never_saved_and_the_error_names_the_last_finite_checkpoint(
    tiny_folder, tmp_path, every, error
):
    # Step 2's update makes the weights NaN: with checkpoints every step, saving step 3 is refused;
    # every 2 steps, step 3's loss is NaN first. Either way last.ckpt keeps step 2, which is finite.
    run = tmp_path / "run"
    cfg = fit_config(
        tiny_folder,
        run,
        "trainer.max_steps=6",
        f"trainer.checkpoint_every_n_steps={every}",
        "optim.grad_clip=0",
    )
    with pytest.raises(error, match="last finite checkpoint") as caught:
        fit(cfg, callbacks=[PoisonGradients(2)])
    last = run / "checkpoints" / "last.ckpt"
    assert str(last) in str(caught.value)
    ckpt = read_ckpt(last)
    assert ckpt["global_step"] == 2
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values())


# --- item 8: SIGTERM saves a resumable checkpoint and exits non-zero ---------------------------------------
class SigtermAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            signal.raise_signal(signal.SIGTERM)


RUN = ("trainer.max_steps=7", "trainer.checkpoint_every_n_steps=100", "trainer.threads=1", "data.p_null=0.5")


def test_sigterm_saves_the_step_reached_and_raises(tiny_folder, tmp_path):
    run = tmp_path / "run"
    with pytest.raises(Preempted, match="SIGTERM at step 3") as caught:
        fit(fit_config(tiny_folder, run, *RUN), callbacks=[SigtermAt(2)])  # stops after step 3's batch
    assert str(run / "checkpoints" / "last.ckpt") in str(caught.value)
    ckpt = read_ckpt(run / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == 3 and ckpt["DrafterDataModule"] == {"consumed": 6}


class SigintAt(L.Callback):
    """Ctrl-C at one step, ``presses`` times."""

    def __init__(self, step: int, presses: int = 1) -> None:
        self.step, self.presses = step, presses

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            for _ in range(self.presses):
                signal.raise_signal(signal.SIGINT)


def test_ctrl_c_saves_the_step_reached_as_sigterm_does(tiny_folder, tmp_path):
    run = tmp_path / "run"
    with pytest.raises(Interrupted, match="stopped by Ctrl-C at step 3") as caught:
        fit(fit_config(tiny_folder, run, *RUN), callbacks=[SigintAt(2)])  # stops after step 3's batch
    assert str(run / "checkpoints" / "last.ckpt") in str(caught.value)
    assert f"resume=last hydra.run.dir='{run}'" in str(caught.value)
    ckpt = read_ckpt(run / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == 3 and ckpt["DrafterDataModule"] == {"consumed": 6}
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is given back


def test_a_second_ctrl_c_stops_at_once(tiny_folder, tmp_path):
    run = tmp_path / "run"
    with pytest.raises(Interrupted, match="stopped at once by Ctrl-C at step 2; no checkpoint"):
        fit(fit_config(tiny_folder, run, *RUN), callbacks=[SigintAt(2, presses=2)])
    assert not (run / "checkpoints" / "last.ckpt").exists()


@pytest.mark.slow
def test_cli_sigterm_exits_non_zero_and_resume_is_exact(tiny_folder, tmp_path):
    """The preemption a SLURM job sees: SIGTERM from outside at whatever step, with DataLoader workers."""
    run = tmp_path / "split"
    args = [sys.executable, "-m", "vdtrain.fit", f"target.folder={tiny_folder}", *SMALL, *RUN]
    args += ["trainer.max_steps=400", "trainer.checkpoint_every_n_steps=2", "data.num_workers=2"]
    proc = subprocess.Popen(
        [*args, f"hydra.run.dir={run}"],
        cwd=tmp_path,
        env=sub_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    last = run / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 120
    while not last.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == PREEMPTED_EXIT_CODE, output[-3000:]
    assert "SIGTERM" in output and "last.ckpt" in output
    stopped = read_ckpt(last)["global_step"]
    assert 2 <= stopped < 400
    # The schedule's length as in the stopped run; last.ckpt written at every step.
    overrides = (*RUN, "trainer.max_steps=400", "trainer.checkpoint_every_n_steps=1", "data.num_workers=2")

    class StopAt(L.Callback):
        def on_train_batch_end(self, trainer, *_):
            trainer.should_stop = trainer.global_step >= stopped + 2

    fit(fit_config(tiny_folder, tmp_path / "whole", *overrides), callbacks=[StopAt()])
    fit(fit_config(tiny_folder, run, *overrides, "resume=last"), callbacks=[StopAt()])
    whole, split = (read_ckpt(r / "checkpoints" / "last.ckpt") for r in (tmp_path / "whole", run))
    assert whole["global_step"] == split["global_step"] == stopped + 2
    for name, value in whole["state_dict"].items():
        assert torch.equal(value, split["state_dict"][name]), name


# --- item 10: a full disk while checkpointing keeps the previous last.ckpt --------------------------------
FULL_DISK = """
import shutil
import sys
import lightning as L
from hydra import compose, initialize_config_dir
from vdtrain.fit import fit

class Grow(L.Callback):
    '''Checkpoints that grow: from step 2 on, far larger than the disk.'''
    pad = b""

    def on_train_batch_end(self, trainer, *_):
        Grow.pad = b"\\0" * (int(sys.argv[3]) if trainer.global_step >= 2 else 0)

    def state_dict(self):
        return {"pad": Grow.pad}

conf, run, _, *overrides = sys.argv[1:]
with initialize_config_dir(conf, version_base=None):
    cfg = compose("fit", overrides=[f"run_dir={run}", *overrides])
try:
    fit(cfg, callbacks=[Grow()])
finally:  # the small filesystem goes with this process: keep what it held
    shutil.copytree(f"{run}/checkpoints", f"{run}/after")
"""


def test_full_disk_while_checkpointing_keeps_the_previous_last_ckpt(tiny_folder, tmp_path):
    """A real full filesystem: the checkpoint folder is a small tmpfs (mounted in a user namespace), the
    system temp folder is not. Step 1's checkpoint fits; step 2's does not."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) to mount a small filesystem")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"user namespaces unavailable: {probe.stderr.decode()[-200:]}")
    script = tmp_path / "full_disk.py"
    script.write_text(textwrap.dedent(FULL_DISK))
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    size = 4 * 1024 * 1024  # about 4x a tiny drafter's checkpoint with AdamW state
    overrides = [
        f"target.folder={tiny_folder}",
        *SMALL,
        "trainer.max_steps=3",
        "trainer.checkpoint_every_n_steps=1",
    ]
    inner = [sys.executable, str(script), str(CONF), str(run), str(2 * size), *overrides]
    mount = f'mount -t tmpfs -o size={size} tmpfs {run / "checkpoints"} && exec "$@"'
    result = subprocess.run(
        ["unshare", "-rm", "sh", "-c", mount, "sh", *inner],
        cwd=tmp_path,
        env=sub_env(),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode != 0, result.stdout[-2000:]
    assert "No space left on device" in result.stderr, result.stderr[-3000:]
    assert "the previous last.ckpt is kept" in result.stderr
    after = run / "after"
    assert sorted(p.name for p in after.iterdir()) == ["last.ckpt"]  # no partial file left behind
    assert read_ckpt(after / "last.ckpt")["global_step"] == 1
