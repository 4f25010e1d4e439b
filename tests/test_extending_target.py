"""docs/extending.md, "Adding a target": its toy target is built from the page's own code blocks,
registered and decoded."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml

from vdtrain.config import UnknownConfigKeyError
from vdtrain.decode.ar import generate_ar
from vdtrain.decode.builders.dynamic import DynamicTreeBuilder, DynamicTreeConfig
from vdtrain.decode.engine import SpeculativeEngine
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.targets import draft_layer_class, load_target, registry

DOC = Path(__file__).parents[1] / "docs" / "extending.md"
BLOCK = re.compile(r'^```(\w+) title="([^"]+)"\n(.*?)^```$', re.MULTILINE | re.DOTALL)
ROW = re.compile(r'^\s+("\w+": TargetKind\(.*\)),$', re.MULTILINE)

pytestmark = pytest.mark.usefixtures("one_thread")


def doc_blocks(section: str) -> dict[str, str]:
    """The titled code blocks of one ``## `` section of the page, by title."""
    text = DOC.read_text()
    start = text.index(f"## {section}\n")
    end = text.find("\n## ", start + 1)
    return {title: code for _, title, code in BLOCK.findall(text[start : end if end > 0 else None])}


def install_module(monkeypatch: pytest.MonkeyPatch, path: str, source: str) -> types.ModuleType:
    """Run a block as the module its path names (``vdtrain/models/toy.py`` → ``vdtrain.models.toy``)."""
    name = path.removesuffix(".py").replace("/", ".")
    module = types.ModuleType(name)
    module.__file__ = str(DOC)
    monkeypatch.setitem(sys.modules, name, module)
    parent, _, leaf = name.rpartition(".")
    monkeypatch.setattr(sys.modules[parent], leaf, module, raising=False)
    exec(compile(source, f"{DOC}: {path}", "exec"), module.__dict__)
    return module


def test_a_toy_target_from_the_docs(monkeypatch, tmp_path):
    blocks = doc_blocks("Adding a target")
    files = ["vdtrain/models/toy.py", "vdtrain/models/toy_io.py", "vdtrain/targets/toy.py"]
    assert set(blocks) == {*files, "vdtrain/targets/registry.py", "conf/target/toy.yaml", "try"}
    for path in files:  # in dependency order, as the page gives them
        install_module(monkeypatch, path, blocks[path])
    # The registry block: its import and its one row of TARGET_KINDS, run in the registry's namespace.
    registry_block = blocks["vdtrain/targets/registry.py"]
    namespace = dict(vars(registry))
    exec("\n".join(line for line in registry_block.splitlines() if line.startswith("from ")), namespace)
    rows = ROW.findall(registry_block)
    assert len(rows) == 1
    for kind, entry in eval("{" + rows[0] + "}", namespace).items():
        monkeypatch.setitem(registry.TARGET_KINDS, kind, entry)
    assert draft_layer_class("toy").__name__ == "ChameleonDraftLayer"

    monkeypatch.chdir(tmp_path)
    tried: dict[str, object] = {}
    exec(compile(blocks["try"], f"{DOC}: try", "exec"), tried)
    target, drafter = tried["target"], tried["drafter"]
    assert target.identity.family == "toy" and target.grid == (4, 4) and target.prefix_length == 16

    # The shipped-config block builds the same target, and refuses a key the spec does not declare.
    config = {**yaml.safe_load(blocks["conf/target/toy.yaml"]), "folder": "toy_model"}
    assert load_target(config).identity == target.identity
    with pytest.raises(UnknownConfigKeyError, match=r"kind 'toy': target\.foldr \(did you mean folder"):
        load_target({**config, "foldr": "toy_model"})

    # Something real through it: EAGLE-2 with the random drafter gives AR's tokens at T = 0.
    captions = ["a red square", "two blue dots on a long white stripe, far too long for sixteen bytes"]
    sampling = SamplingConfig(cfg_scale=2.0, temperature=0.0)
    builder = DynamicTreeBuilder(DynamicTreeConfig(top_k=4, depth=3, total_tokens=12))
    with torch.no_grad():
        cond = target.encode_captions(captions)
        ar = generate_ar(target, cond, sampling, [None, None])
        result = SpeculativeEngine(target, drafter, builder, sampling).generate(cond, [None, None])
    assert ar.shape == (2, 16) and torch.equal(result.tokens, ar)
    images = target.tokenizer.decode(ar)
    assert images.shape == (2, 3, 16, 16) and torch.equal(target.tokenizer.encode(images), ar)
