"""Issue #56: the drafter's decode side is one object (``vdtrain.decode.drafting``), with a null twin for
the drafter-free methods; capabilities are declared values; checks mutate nothing; kinds come from a
plain factory."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from conftest import random_drafter
from test_engine import make_target

from vdtrain.decode.builders.block import BlockTreeBuilder, BlockTreeConfig
from vdtrain.decode.builders.dynamic import DynamicTreeBuilder, DynamicTreeConfig
from vdtrain.decode.builders.jacobi import JacobiTreeConfig, JacobiWindowBuilder
from vdtrain.decode.drafting import Drafting, NoDrafting, drafting_for
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.drafters import DRAFTERS, Drafter, DrafterConfig
from vdtrain.drafters.base import block_kind
from vdtrain.targets.base import TargetOutput

ENGINE = Path(__file__).resolve().parent.parent / "vdtrain" / "decode" / "engine.py"


def test_the_engine_asks_nowhere_whether_a_drafter_is_there():
    """The drafter-free methods get the null twin, so the loop has no presence branch."""
    source = ENGINE.read_text(encoding="utf-8")
    names = {n.attr for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute)}
    assert "needs_drafter" not in names and "drafter is None" not in source


def test_a_drafter_free_builder_drafts_through_the_null_twin():
    target, sampling = make_target(), SamplingConfig()
    null = drafting_for(target, None, JacobiWindowBuilder(JacobiTreeConfig(window=2)), sampling)
    assert type(null) is NoDrafting and null.drafter is None and null.taps == ()
    hidden = torch.randn(2, 3, target.hidden_size)
    assert null.features(TargetOutput(hidden, torch.zeros(2, 3, 4))) is hidden
    with pytest.raises(TypeError, match="drafts without a drafter model"):
        null.drafter_forward(hidden, None)
    drafter = random_drafter(target)
    drafting = drafting_for(target, drafter, DynamicTreeBuilder(DynamicTreeConfig()), sampling)
    assert isinstance(drafting, Drafting) and drafting.drafter is drafter
    with pytest.raises(ValueError, match="drafts with a drafter model: pass one"):
        drafting_for(target, None, DynamicTreeBuilder(DynamicTreeConfig()), sampling)
    with pytest.raises(ValueError, match=r"skipping verification \(VVS\) needs one"):
        drafting_for(target, None, JacobiWindowBuilder(JacobiTreeConfig(window=2)), sampling, skips=True)


def test_fitting_a_builder_to_the_vocabulary_leaves_it_as_it_is():
    wide = DynamicTreeBuilder(DynamicTreeConfig(top_k=40))
    with pytest.warns(UserWarning, match="so top_k is 16"):
        fitted = wide.for_vocabulary(16)
    assert (wide.top_k, fitted.top_k) == (40, 16)
    assert wide.for_vocabulary(40) is wide  # nothing to fit: the builder itself
    tree = BlockTreeBuilder(BlockTreeConfig(depth=3, paths=[(r,) for r in range(6)]))
    paths = tree.configured_tree.paths
    cut = tree.for_vocabulary(4)
    assert tree.configured_tree.paths == paths and max(max(p) for p in cut.configured_tree.paths) < 4


def test_a_kind_is_made_by_a_plain_factory_and_declares_its_blocks():
    target = make_target()
    for kind, cls in DRAFTERS.items():
        drafter = Drafter.make(DrafterConfig.for_target(target, kind=kind))
        assert type(drafter) is cls and drafter.drafts_blocks == (drafter.block_slots > 0)
    with pytest.raises(ValueError, match=r"make one with Drafter.make\(config\)"):
        Drafter(DrafterConfig.for_target(target))
    assert DRAFTERS[block_kind()].drafts_blocks
