"""``benchmarks/gpu_check.sh``: the GPU checks in priority order, listed without running them, and what its
steps import on a machine without matplotlib or scipy."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
ORDER = [
    "tests",
    "user",
    "xl_graphs",
    "big",
    "profile",
    "xl_compiled",
    "shapes",
    "grain",
    "shapes_compiled",
    "train",
    "evaluate",
    "xl_eager",
]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def _steps(stdout: str) -> list[tuple[str, int]]:
    """(name, budget s) of each listed step."""
    return [(m[1], int(m[2])) for m in re.finditer(r"^\d+\. (\w+) \(≤ (\d+)s\)", stdout, re.M)]


def test_dry_run_lists_the_steps_in_priority_order(tmp_path):
    out = tmp_path / "out"
    done = _run("--dry-run", str(out))
    assert done.returncode == 0, done.stderr
    assert "deadline 540s" in done.stdout.splitlines()[0]
    steps = _steps(done.stdout)
    assert [name for name, _ in steps] == ORDER
    # The first four fit 400 s on an H100 (budgets sized from the H200 run, benchmarks/README.md).
    assert sum(budget for _, budget in steps[:4]) <= 400
    assert "-m 'gpu and not slow'" in done.stdout and "--modes graphs" in done.stdout
    assert "--dtype bf16" in done.stdout and "device=cuda" in done.stdout
    assert "--presets all" in done.stdout  # the SCD presets among them
    assert "benchmarks.step_profile --device cuda --target llamagen-xl" in done.stdout
    assert "--targets shapes --modes compiled" in done.stdout and "zero2" in done.stdout
    # issue #46: the 7B-class shapes at full depth with graphs, B 1 and 16, a cut number of steps
    assert (
        "--targets chameleon-7b janus-pro-7b --dtype bf16 --steps 24 --modes graphs --batch 1 16"
        in done.stdout
    )
    # issue #47: the training step's split, breaks and MFU at batch 8 and at 32, the GPU batch it proposes
    assert "--modes eager zero2 compiled --batch 8 32" in done.stdout
    assert not out.exists()  # a dry run writes nothing


def test_a_rerun_takes_chosen_steps_in_priority_order(tmp_path):
    done = _run("--dry-run", "--steps", "evaluate,profile", "300", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "deadline 300s" in done.stdout
    assert [name for name, _ in _steps(done.stdout)] == ["profile", "evaluate"]
    assert _run("--dry-run", "--steps", "nothing", str(tmp_path)).returncode == 2


def test_the_optional_steps_run_only_when_named(tmp_path):
    """Issue #35's data-scaling curve (minutes of training per drafter kind) and issue #32's grain
    calibration at 512 captions are left out of a full run."""
    full = [name for name, _ in _steps(_run("--dry-run", str(tmp_path)).stdout)]
    optional = {
        "scaling",
        "big_compiled",
        "grain_calibration",
        "zero_export",
        "plan_check",
        "big_train",
        "big_fit",
        "block_xl",
        "block_big",
        "block_xl_compiled",
    }
    assert not optional & set(full)
    # issue #55, item 5: the block presets beside eagle1, eagle2 and sjd at XL and the 7B-class shapes, B 1,
    # graphs and compiled, in one prepared call
    block = _run("--dry-run", "--steps", "block_xl,block_big,block_xl_compiled", str(tmp_path)).stdout
    steps = _steps(block)
    assert [name for name, _ in steps] == ["block_xl", "block_big", "block_xl_compiled"]
    assert sum(budget for _, budget in steps) <= 540
    presets = "--presets block block_tree block_tree_iid eagle1 eagle2 sjd"
    assert f"--targets llamagen-xl --dtype bf16 --modes graphs --batch 1 {presets}" in block
    big = "--targets chameleon-7b janus-pro-7b --dtype bf16 --steps 24"
    assert f"{big} --modes graphs --batch 1 {presets}" in block
    assert f"--modes compiled --batch 1 {presets}" in block
    zero = _run("--dry-run", "--steps", "zero_export", str(tmp_path)).stdout
    assert "benchmarks.zero_export --devices 2" in zero  # issue #54: export after ZeRO-2 / ZeRO-3
    # issue #54's second prepared call: the memory plan against max_memory_allocated, a 7B-class step under
    # ZeRO-2 at 2 layers, fit at that width with its evaluation; in one deadline, each step saved as it ends
    second = _run("--dry-run", "--steps", "plan_check,big_train,big_fit", str(tmp_path)).stdout
    steps = _steps(second)
    assert [name for name, _ in steps] == ["plan_check", "big_train", "big_fit"]
    assert sum(budget for _, budget in steps) <= 540
    assert "memory_plan --agreement llamagen-xl janus-pro-7b" in second and "--device cuda" in second
    assert "--layers 2 --drafters eagle1 --modes eager zero2" in second
    assert "benchmarks.big_fit --device cuda" in second
    compiled = _run("--dry-run", "--steps", "big_compiled", str(tmp_path)).stdout
    assert "--targets chameleon-7b janus-pro-7b --dtype bf16 --steps 24 --modes compiled" in compiled
    done = _run("--dry-run", "--steps", "grain_calibration,scaling,train", str(tmp_path))
    assert [name for name, _ in _steps(done.stdout)] == ["train", "scaling", "grain_calibration"]
    assert "benchmarks.data_scaling --device cuda --target grain" in done.stdout
    assert "benchmarks.calibration --device cuda --num-prompts 512" in done.stdout


def test_the_cpu_mode_lists_small_steps(tmp_path):
    done = _run("--dry-run", "--device", "cpu", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert [name for name, _ in _steps(done.stdout)] == ORDER
    assert "llamagen-xl" not in done.stdout and "device=cpu" in done.stdout
    assert "--targets chameleon-7b janus-pro-7b --layers 1" in done.stdout  # the 7B shapes at one layer
    second = _run("--dry-run", "--device", "cpu", "--steps", "plan_check,big_train", str(tmp_path)).stdout
    assert "--agreement grain" in second and "--device cpu" in second and "--modes eager --batch 1" in second


def test_the_big_fit_step_is_fit_under_zero2_with_its_evaluation_on_cached_captions(tmp_path):
    """``big_fit`` runs the user's fit (the ``user`` step's short run, so its captions are cached) on a
    7B-class-width folder under ZeRO-2 with a bf16 target and the after-epoch evaluation left on; the
    folder copies the shapes target's caption caches (a GPU machine has no encoder) and matches their
    caption rows."""
    from benchmarks import big_fit

    command = big_fit.fit_command("cuda", tmp_path / "target", tmp_path / "run")
    assert "trainer=deepspeed_stage_2" in command and "target.dtype=bf16" in command
    assert not any(a.startswith("eval.enabled") for a in command)  # fit.yaml's default: on
    assert big_fit.SEVEN_B["dim"] == 4096 and big_fit.SEVEN_B["vocab_size"] == 16384
    folder = tmp_path / "small"
    big_fit.write_big_target(folder, 1, big_fit.CPU)
    config = json.loads((folder / "config.json").read_text())
    shipped = json.loads((big_fit.SHAPES / "config.json").read_text())
    assert config["gpt"]["cls_token_num"] == shipped["gpt"]["cls_token_num"]
    assert (config["gpt"]["dim"], config["gpt"]["n_layer"], config["vq"]["codebook_size"]) == (64, 1, 512)
    assert (folder / "captions.safetensors").read_bytes() == (
        big_fit.SHAPES / "captions.safetensors"
    ).read_bytes()


def test_the_user_step_runs_the_readme_commands_on_cached_captions_only(tmp_path):
    """The ``user`` step: every command a user runs, on the step's device; on the CPU DeepSpeed is left out
    with a line. Its short runs read no caption beyond those cached beside the shapes target (a GPU machine
    has no caption encoder): the training stream's first ``TRAINING_CAPTIONS`` and the 32 shipped held-out."""
    from omegaconf import OmegaConf

    from benchmarks import user_commands as uc
    from vdtrain.config import EvalCallbackConfig

    dry = _run("--dry-run", str(tmp_path)).stdout
    assert "benchmarks.user_commands --device cuda" in dry
    gpu = uc.plan("cuda", tmp_path)
    assert [name for name, _, _ in gpu] == [
        "fit",
        "fit_deepspeed_stage_2",
        "fit_deepspeed_stage_3",
        "fit_killed",
        "fit_resumed",
        "export",
        "evaluate",
        "generate",
    ]
    assert all(why is None for _, _, why in gpu) and "trainer=gpu" in gpu[0][1]
    cpu = {name: why for name, _, why in uc.plan("cpu", tmp_path)}
    assert "trainer=cpu" in uc.plan("cpu", tmp_path)[0][1]
    assert [n for n, why in cpu.items() if why] == ["fit_deepspeed_stage_2", "fit_deepspeed_stage_3"]
    assert "needs a GPU" in cpu["fit_deepspeed_stage_2"]
    shipped_heldout = 32
    for _, command, _ in gpu:
        keys = dict(a.split("=", 1) for a in command[3:] if "=" in a and not a.startswith("hydra."))
        if command[2] == "vdtrain.fit" and "resume" not in keys:
            assert int(keys["trainer.max_steps"]) * int(keys["data.batch_size"]) <= uc.TRAINING_CAPTIONS
            assert int(keys["data.val_samples"]) <= shipped_heldout
        if command[2] == "vdtrain.fit" and keys.get("eval.enabled") != "false":
            fit_eval = EvalCallbackConfig()  # fit.yaml keeps the defaults (tests/test_training_defaults.py)
            assert fit_eval.num_prompts <= shipped_heldout and fit_eval.prompts is None
        if command[2] == "vdtrain.evaluate":
            assert int(keys["num_prompts"]) <= shipped_heldout
        if command[2] == "vdtrain.generate":
            assert OmegaConf.load(ROOT / "conf" / "generate.yaml").num_prompts <= shipped_heldout


def test_it_refuses_missing_arguments_and_unknown_options(tmp_path):
    assert _run("--dry-run").returncode == 2
    assert _run("--dry-run", "soon", str(tmp_path)).returncode == 2
    refused = _run("--fast", "10", str(tmp_path))
    assert refused.returncode == 2 and "unknown option --fast" in refused.stderr


BLOCK = """
import importlib.metadata as md
import sys

HIDDEN = {"matplotlib", "scipy"}


class Missing:  # the modules cannot be imported ...
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"no {name} here", name=name)


sys.meta_path.insert(0, Missing())


def hide(real):  # ... and their distributions are not installed
    def lookup(name):
        if name.lower() in HIDDEN:
            raise md.PackageNotFoundError(name)
        return real(name)

    return lookup


for attr in ("version", "distribution", "metadata", "requires"):
    setattr(md, attr, hide(getattr(md, attr)))
"""


def test_the_steps_import_without_matplotlib_or_scipy():
    """A GPU machine may lack both: the step scripts import neither at module level, and the GPU test
    selection collects."""
    code = BLOCK + (
        "import benchmarks.step_cost, benchmarks.step_profile, benchmarks.train_throughput\n"
        "import benchmarks.calibration, benchmarks.data_scaling, benchmarks.user_commands\n"
        "import vdtrain.evaluate\n"
        "import pytest\n"
        "rc = pytest.main(['-q', '-o', 'addopts=-ra', '-p', 'no:cacheprovider', '--collect-only',\n"
        "                  '-m', 'gpu and not slow',\n"
        "                  'tests/test_graphs.py', 'tests/test_rng.py'])\n"
        "sys.exit(int(rc))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "test_uniforms_are_the_same_on_a_gpu" in done.stdout
