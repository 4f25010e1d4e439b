"""benchmarks/block_search.py (issue #55, item 2): a variant's compute is counted over fit's own step, so a
wider drafter or more trained roots cost more FLOPs and get fewer steps of the same budget; its fit command
carries its options (lists as Hydra reads them) and its own overrides after the shared ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.block_search import fit_command, step_flops
from vdtrain.config import DrafterTrainConfig
from vdtrain.targets import load_target

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_step_of_a_wider_drafter_or_more_roots_counts_more_flops(tiny_folder):
    target = load_target({"kind": "folder", "folder": str(tiny_folder)})
    train = DrafterTrainConfig(kind="block")
    narrow = step_flops(target, {"width": 16, "heads": 1, "slots": 4}, train, 2)
    wide = step_flops(target, {"width": 32, "heads": 1, "slots": 4}, train, 2)
    roots = step_flops(target, {"width": 16, "heads": 1, "slots": 4, "train_roots": 64}, train, 2)
    assert 0 < narrow < wide and narrow < roots
    assert step_flops(target, {"width": 16, "heads": 1, "slots": 4}, train, 2) == narrow  # a count


def test_a_variants_fit_command_carries_its_options_and_overrides():
    variant = {"options": {"width": 128, "feature_layers": [2, 4, 8]}, "train": ["drafter.ttt_decay=1.0"]}
    command = fit_command(["target=grain", "drafter.kind=block"], variant, 134, Path("runs/taps"), 1)
    assert command[1:3] == ["-m", "vdtrain.fit"]
    assert command[3:] == [
        "target=grain",
        "drafter.kind=block",
        "+drafter.options.width=128",
        "+drafter.options.feature_layers=[2, 4, 8]",
        "drafter.ttt_decay=1.0",
        "trainer.max_steps=134",
        "trainer.threads=1",
        "hydra.run.dir=runs/taps",
    ]
