"""The built wheel runs every app outside the repository: conf/ travels inside it (setup.py) and each
console script starts from any folder. Built and installed from local files only (no network): the heavy
dependencies come from the system's site-packages."""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from vdtrain.paths import REPO_ROOT

SOURCES = ["vdtrain", "data_prep", "conf", "pyproject.toml", "setup.py", "README.md"]


# Every app: the installed scripts must be these (pyproject.toml's [project.scripts])
APPS = ["fit", "evaluate", "export", "generate"]
PREP = ["shapes", "grain", "captions", "laion-coco", "self-generate", "features", "validate"]
SCRIPTS = sorted([f"vdtrain-{app}" for app in APPS] + [f"vdtrain-prep-{step}" for step in PREP])


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment holding only the wheel built from this tree; its bin/ folder."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    for name in SOURCES:
        (shutil.copytree if (REPO_ROOT / name).is_dir() else shutil.copy)(REPO_ROOT / name, source / name)
    wheels = root / "wheels"
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
    done = _run([*build, "-w", str(wheels), str(source)], root)
    assert done.returncode == 0, done.stdout + done.stderr
    env = root / "venv"
    venv.create(env, system_site_packages=True, with_pip=False)
    install = [sys.executable, "-m", "pip", "--python", str(env / "bin" / "python"), "install"]
    done = _run([*install, "--no-deps", "--no-index", str(next(wheels.glob("*.whl")))], root)
    assert done.returncode == 0, done.stdout + done.stderr
    return env / "bin"


@pytest.mark.slow
def test_every_console_script_starts_outside_the_repository(installed: Path, tmp_path: Path) -> None:
    python = installed / "python"
    where = _run([str(python), "-c", "import vdtrain.paths as p; print(p.__file__, p.CONF_DIR)"], tmp_path)
    module, conf = where.stdout.split()
    assert str(installed.parent) in module, "the venv imports the repository's vdtrain, not the wheel's"
    assert Path(conf).is_relative_to(installed.parent), conf
    listed = _run(
        [
            str(python),
            "-c",
            "from importlib.metadata import distribution as d; "
            "print(*sorted(e.name for e in d('vdtrain').entry_points))",
        ],
        tmp_path,
    )
    assert listed.stdout.split() == SCRIPTS, listed.stdout + listed.stderr
    # all at once: each imports torch, the bulk of its time
    helps = {
        script: subprocess.Popen(
            [str(installed / script), "--help"],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for script in SCRIPTS
    }
    for script, process in helps.items():
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0 and "Powered by Hydra" in out, (script, err[-2000:])


@pytest.mark.slow
def test_the_installed_fit_composes_and_checks_its_config(installed: Path, tmp_path: Path) -> None:
    fit = str(installed / "vdtrain-fit")
    shown = _run([fit, "--cfg", "job", "optim.lr=0.002"], tmp_path)
    assert shown.returncode == 0 and "lr: 0.002" in shown.stdout, shown.stderr[-2000:]
    no_target = _run([fit], tmp_path)  # the shipped checkpoints stay in the repository (docs/install.md)
    assert no_target.returncode == 2 and "target.folder=" in no_target.stderr, no_target.stderr[-2000:]
    assert str(tmp_path / "checkpoints" / "shapes" / "target") in no_target.stderr
    target = f"target.folder={REPO_ROOT / 'checkpoints' / 'shapes' / 'target'}"
    refused = _run([fit, target, "drafter.kind=blok"], tmp_path)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "blok" in refused.stderr and "Traceback" not in refused.stderr
