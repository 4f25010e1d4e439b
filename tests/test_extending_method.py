"""docs/extending.md, "Adding a decoding method": its toy tree runs from the page's own snippets."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import torch
from conftest import tiny_condition
from omegaconf import OmegaConf
from test_engine import make_drafter, make_target

from vdtrain.decode.ar import generate_ar
from vdtrain.decode.engine import SpeculativeEngine
from vdtrain.decode.methods import TREES, Part, build_method, decode_config
from vdtrain.decode.sampling import SamplingConfig

PAGE = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
GREEDY = SamplingConfig(cfg_scale=2.0, temperature=0.0)


def snippets(section: str) -> dict[str, str]:
    """The fenced code blocks of ``## <section>``, keyed by their first line (a comment naming where the
    code goes), that line left out."""
    text = PAGE.read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```\w+\n(.*?)```", body, flags=re.S)
    return {block.split("\n", 1)[0].lstrip("# ").strip(): block.split("\n", 1)[1] for block in blocks}


def test_a_toy_tree_method_from_the_docs(monkeypatch):
    code = snippets("Adding a decoding method")
    module = types.ModuleType("docs_fan")
    monkeypatch.setitem(sys.modules, module.__name__, module)  # dataclasses and OmegaConf look it up
    exec(compile(code["vdtrain/decode/builders/fan.py"], str(PAGE), "exec"), module.__dict__)
    entry = eval("{" + code["TREES entry in vdtrain/decode/methods.py"] + "}", {**vars(module), "Part": Part})
    for kind, part in entry.items():
        monkeypatch.setitem(TREES, kind, part)
    config = decode_config(OmegaConf.create(code["conf/decode/fan.yaml"]))
    assert config.needs_drafter and config.exact and config.tree.width == 4

    target = make_target()
    method = build_method(config, target, make_drafter(target), GREEDY)
    assert isinstance(method, SpeculativeEngine) and method.recorder is None  # no recorder asked for
    cond = tiny_condition()
    result = method.generate(cond, [None, None])
    assert torch.equal(result.tokens, generate_ar(target, cond, GREEDY, [None, None]))
    assert all(set(s.depth_per_step) <= {0, 1} and max(s.committed_per_step) <= 2 for s in result.stats)
