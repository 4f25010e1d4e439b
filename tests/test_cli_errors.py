"""Every app ends a user's mistake with one line naming it and exit status 2 (``vdtrain.cli``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CASES = {
    "vdtrain.fit": (["target.folder=/nonexistent"], "there is no folder '/nonexistent'"),
    "vdtrain.generate": (["num_prompts=0"], "num_prompts must be at least 1, got 0"),
    "vdtrain.evaluate": (["methods=[nope]"], "unknown method preset 'nope'"),
    "vdtrain.export": (["source=/nonexistent"], "source='/nonexistent' does not exist"),
    "data_prep.features": (["in_dir=/nonexistent", "out_dir=out"], "is not a shard set"),
}


def _run(app: str, args: list[str], cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return subprocess.run(
        [sys.executable, "-m", app, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("app", sorted(CASES))
def test_a_user_error_is_one_line_and_status_2(app, tmp_path):
    args, message = CASES[app]
    done = _run(app, args, tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith(f"{app}: error: ")]
    assert len(errors) == 1 and message in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("spelling", ["debug=true", "debug=True"])
def test_debug_keeps_the_traceback(tmp_path, spelling):
    done = _run("vdtrain.generate", ["num_prompts=0", spelling], tmp_path)
    assert done.returncode == 1 and "ValueError: num_prompts must be at least 1" in done.stderr


@pytest.mark.parametrize(
    ("app", "kept"),
    [
        (
            "vdtrain.evaluate",
            "the finished methods are kept in out/units: the same command goes on from them",
        ),
        (
            "vdtrain.generate",
            "the finished batches are kept in out/units: the same command goes on from them",
        ),
    ],
)
def test_ctrl_c_is_one_line_saying_what_is_kept_and_status_130(app, kept, monkeypatch, capsys):
    """Not an 80-line traceback: evaluate and generate keep every finished batch, and the same command
    resumes from them."""
    import importlib

    from omegaconf import OmegaConf

    module = importlib.import_module(app)

    def stopped(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "run", stopped)
    try:
        module._main.__wrapped__(OmegaConf.create({"out_dir": "out", "debug": False}))
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C went through as a traceback")
    except SystemExit as exit_:
        assert exit_.code == 130
    else:
        pytest.fail("no exit")
    assert capsys.readouterr().err == f"{app}: interrupted (Ctrl-C); {kept}\n"
