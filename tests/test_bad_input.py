"""The bad-input table (issue 37; docs/bad_input.md): each case runs as a user would, in a subprocess, and
ends with one ``<app>: error:`` line, exit status 2, no traceback, before torch or Lightning is imported
(``python -X importtime`` lists every module the process imported) and before Hydra makes an output
folder. What that costs in seconds is the table's, measured, not a limit here."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_fit import run_cli

from vdtrain.cli import LAZY_USER_ERRORS, is_user_error, one_line
from vdtrain.devices import torch_built_with_cuda
from vdtrain.export_format import CONFIG_FILE
from vdtrain.paths import repo_path

HEAVY = ("torch", "lightning")  # what a mistake must be reported before
NO_CUDA = pytest.mark.skipif(torch_built_with_cuda(), reason="this torch has CUDA: the case is no error")
# (app, arguments, a part of the message); {tmp} is the test's folder, the working directory.
CASES = [
    # issue 58: a plain misspelt key gets a "did you mean", never advice to add it with '+'
    (
        "vdtrain.fit",
        ["trainer.max_stepz=3"],
        "unknown config key 'trainer.max_stepz' (did you mean trainer.max_steps?)",
    ),
    ("vdtrain.fit", ["device=cuda"], "unknown config key 'device' (did you mean trainer.devices?)"),
    ("vdtrain.evaluate", ["num_promptz=3"], "unknown config key 'num_promptz' (did you mean num_prompts?)"),
    ("vdtrain.fit", ["drafter.kind=blok"], "drafter.kind must be one of ['block', 'eagle1', 'eagle3'"),
    ("vdtrain.fit", ["+trainer.max_stepz=3"], "did you mean trainer.max_steps"),
    ("vdtrain.fit", ["trainer.max_steps=-5"], "trainer.max_steps must be at least 1, got -5"),
    ("vdtrain.fit", ["data.batch_size=0"], "data.batch_size must be at least 1, got 0"),
    ("vdtrain.fit", ["target=nope"], "Available options in 'target': anole"),
    ("vdtrain.fit", ["resume=last"], "name the run to continue with hydra.run.dir=<run folder>"),
    pytest.param("vdtrain.fit", ["trainer=gpu"], "built without CUDA", marks=NO_CUDA),
    ("vdtrain.generate", ["batch_size=0"], "batch_size must be at least 1, got 0"),
    ("vdtrain.generate", ["num_prompts=0"], "num_prompts must be at least 1, got 0"),
    pytest.param("vdtrain.generate", ["device=cuda"], "device='cuda', but this torch", marks=NO_CUDA),
    ("vdtrain.generate", ["out_dir={tmp}/a_file/x"], "a_file' is a file"),
    ("vdtrain.generate", ["method=nope"], "unknown method 'nope' (method=); known: ar, block, block_tree"),
    ("vdtrain.generate", ["target=nope"], "Could not find 'target/nope'"),
    ("vdtrain.generate", ["prompts={tmp}/links.csv"], "among the columns ['id', 'url']; name the one"),
    ("vdtrain.evaluate", ["methods=[nope]"], "unknown method preset 'nope'"),
    ("vdtrain.evaluate", ["batch_size=0"], "batch_size must be at least 1, got 0"),
    ("vdtrain.export", ["source=/nonexistent"], "source='/nonexistent' does not exist"),
    # issue 50: tracebacks, late checks and misleading messages a new user met
    ("vdtrain.evaluate", ["num_prompts=abc"], "num_prompts must be a whole number, got 'abc'"),
    ("vdtrain.generate", ["num_prompts=abc"], "num_prompts must be a whole number, got 'abc'"),
    (
        "vdtrain.generate",
        ["out_dir=/proc/x"],
        "out_dir='/proc/x' cannot be made: no folder can be made in '/proc'",
    ),
    (
        "vdtrain.evaluate",
        ["out_dir=/proc/x"],
        "out_dir='/proc/x' cannot be made: no folder can be made in '/proc'",
    ),
    ("vdtrain.fit", ["eval.methods=[nope]"], "unknown method preset 'nope' in eval.methods="),
    ("vdtrain.fit", ["resume=last", "optim.lr=-1"], "optim.lr must be at least 0, got -1.0"),
    ("vdtrain.fit", ["target.folder=/typo"], "target.folder='/typo': there is no folder '/typo'"),
    ("vdtrain.evaluate", ["methods=eagle2x"], "unknown method preset 'eagle2x' in methods="),
    ("vdtrain.export", ["source=docs"], "source='docs': no drafter here"),
    # issue 58: a drafter that cannot serve a requested preset, seen in its config before torch loads
    (
        "vdtrain.evaluate",
        ["num_prompts=2", "methods=[eagle2,block_tree]", "drafter={tmp}/eagle1"],
        "cannot decode block_tree: a block tree needs a drafter that drafts blocks; this eagle1 drafter "
        "drafts none (train one with drafter.kind=block); this target's drafter that would is "
        "drafter=checkpoints/shapes/drafter_block",
    ),
    (
        "vdtrain.fit",
        ["eval.methods=[eagle2,block_tree]"],
        "eval.methods ['block_tree'] cannot decode with the eagle1 drafter being trained",
    ),
]


def run_listing_imports(
    args: list[str], cwd: Path, **kwargs
) -> tuple[subprocess.CompletedProcess, list[str], set[str]]:
    """``python -X importtime <args>``: the process, its stderr without the import lines, and the top-level
    packages it imported."""
    done = run_cli([sys.executable, "-X", "importtime", *args], cwd, **kwargs)
    lines, packages = [], set()
    for line in done.stderr.splitlines():
        if line.startswith("import time:"):
            packages.add(line.rsplit("|", 1)[1].strip().split(".")[0])
        else:
            lines.append(line)
    return done, lines, packages


def _inputs(tmp: Path) -> None:
    (tmp / "a_file").write_text("")
    (tmp / "links.csv").write_text("id,url\n1,http://example.com/1.jpg\n")
    (tmp / "eagle1").mkdir()  # a user's eagle1 drafter folder: its config is all the check reads
    shutil.copy(repo_path("checkpoints/shapes/drafter") / CONFIG_FILE, tmp / "eagle1")


@pytest.mark.parametrize(("app", "args", "message"), CASES)
def test_bad_input_is_one_line_status_2_before_torch_or_lightning(app, args, message, tmp_path):
    _inputs(tmp_path)
    args = [a.format(tmp=tmp_path) for a in args]
    before = sorted(tmp_path.iterdir())
    done, lines, imported = run_listing_imports(["-m", app, *args], tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = lines  # one line, nothing else
    assert line.startswith(f"{app}: error: ") and message in line, line
    assert "use +" not in line  # Hydra's advice to append a key the typed config then refuses
    assert sorted(tmp_path.iterdir()) == before  # no output or run folder left behind
    assert not imported & set(HEAVY), f"{sorted(imported & set(HEAVY))} imported before the error"


def test_the_import_listing_sees_torch_where_it_is_imported(tmp_path):
    """The check above can fail: a process that imports torch is seen to."""
    _, _, imported = run_listing_imports(["-c", "import torch"], tmp_path)
    assert "torch" in imported


def test_a_failure_after_loading_leaves_no_empty_output_folder(tmp_path):
    out = tmp_path / "out"
    done = run_cli([sys.executable, "-m", "vdtrain.generate", "method=eagle2", "drafter=/nonexistent",
                    "num_prompts=1", f"out_dir={out}"], tmp_path, timeout=300)  # fmt: skip
    assert done.returncode == 2 and "no drafter at '/nonexistent'" in done.stderr, done.stderr[-2000:]
    assert not out.exists()


def test_a_dataloader_workers_error_keeps_only_the_original_message():
    worker = RuntimeError(
        "Caught ShardError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
        '  File "x.py", line 1, in f\n    raise ShardError(...)\n'
        "vdtrain.data.shards.ShardError: shard 'a.tar', sample 'k': tokens.npy is not a numpy array"
    )
    expected = "in a DataLoader worker: shard 'a.tar', sample 'k': tokens.npy is not a numpy array"
    assert one_line(worker) == expected


def test_lightnings_configuration_errors_are_user_errors():
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    assert "lightning.fabric.utilities.exceptions" in LAZY_USER_ERRORS
    assert is_user_error(MisconfigurationException("`max_steps` must be a non-negative integer"))
    assert not is_user_error(RuntimeError("a bug"))


def test_one_method_name_is_a_one_item_list(tmp_path):
    """``evaluate methods=eagle2`` was read letter by letter ('e', 'a', 'g', ...)."""
    from hydra import compose, initialize_config_dir

    from vdtrain.cli import CONF_DIR
    from vdtrain.config import register_configs
    from vdtrain.preflight import check_decoding

    register_configs()
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = compose("evaluate", ["methods=eagle2", "temperatures=1", f"out_dir={tmp_path}"])
    check_decoding(cfg)
    from vdtrain.config import as_list  # what evaluate reads the two settings with

    assert as_list(cfg.methods) == ["eagle2"] and as_list(cfg.temperatures) == [1]


def test_a_prompt_file_shorter_than_num_prompts_is_used_with_a_note(tmp_path, caplog):
    from vdtrain.prompts import prompts_for_run

    (tmp_path / "two.txt").write_text("a red circle\na blue square\n")
    assert prompts_for_run(tmp_path / "two.txt", 8) == ["a red circle", "a blue square"]
    assert "holds 2 captions, num_prompts=8 asked for more: using those 2" in caplog.text


def test_the_config_only_drafter_checks_agree_with_the_classes():
    """What the preflight reads from source and config files (before torch) is what the classes say: each
    registered drafter kind and whether it drafts blocks, the tree kinds that need one, the config's name."""
    from vdtrain.decode.methods import TREES
    from vdtrain.drafters import DRAFTERS, Drafter
    from vdtrain.preflight import BLOCK_TREE_KINDS, DRAFTER_CONFIG, drafter_kinds

    assert drafter_kinds() == {k: c.block_slots is not Drafter.block_slots for k, c in DRAFTERS.items()}
    assert set(BLOCK_TREE_KINDS) == {k for k, part in TREES.items() if part.drafts_blocks}
    assert DRAFTER_CONFIG == CONFIG_FILE


def test_a_drafter_given_by_checkpoint_or_hub_id_is_left_to_its_load(tmp_path):
    """Only a folder's config is read before torch: a .ckpt, a repo id or a config without a kind is
    checked once the drafter loads (``vdtrain.eval.serving``), not refused here."""
    from vdtrain.preflight import folder_drafter_kind

    (tmp_path / "old").mkdir()
    (tmp_path / "old" / CONFIG_FILE).write_text("{}")
    assert folder_drafter_kind(str(tmp_path / "old")) is None
    assert folder_drafter_kind(str(tmp_path / "last.ckpt")) is None
    assert folder_drafter_kind("owner/name") is None
    assert folder_drafter_kind("checkpoints/shapes/drafter_block") == "block"
