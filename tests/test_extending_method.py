"""docs/extending.md, "Adding a decoding method", followed literally in a copy of the repository: the
registry-driven tests pass there with the new preset among the others, and it decodes AR's tokens."""

from __future__ import annotations

import pytest
from walkthrough import copy_repo, follow, run_pytest, run_python

SECTION = "Adding a decoding method"
FILES = {"vdtrain/decode/builders/fan.py", "vdtrain/decode/methods.py", "conf/decode/fan.yaml"}
DECODE = """
import torch
from conftest import tiny_condition
from test_engine import make_drafter, make_target
from vdtrain.decode.ar import generate_ar
from vdtrain.decode.methods import build_method, load_preset
from vdtrain.decode.sampling import SamplingConfig

greedy = SamplingConfig(cfg_scale=2.0, temperature=0.0)
target, cond = make_target(), tiny_condition()
config = load_preset("fan")
assert config.needs_drafter and config.exact and config.tree.width == 4
result = build_method(config, target, make_drafter(target), greedy).generate(cond, [None, None])
assert torch.equal(result.tokens, generate_ar(target, cond, greedy, [None, None]))
assert all(set(s.depth_per_step) <= {0, 1} and max(s.committed_per_step) <= 2 for s in result.stats)
"""

pytestmark = pytest.mark.slow  # a copy of the repository and two fresh interpreters: 30-60 s


def test_the_method_walkthrough_leaves_the_registry_tests_green(tmp_path):
    root = copy_repo(tmp_path)
    assert set(follow(SECTION, root, ("vdtrain/decode/methods.py",))) == FILES
    registry = run_pytest(
        root,
        "tests/test_method_registry.py",
        "tests/test_evaluate.py::test_default_setting_is_every_preset_at_both_temperatures",
        "tests/test_graphs.py::test_every_speculative_preset_records_its_steps",
    )
    assert registry.returncode == 0, registry.stdout[-3000:] + registry.stderr[-2000:]
    decoded = run_python(root, DECODE)
    assert decoded.returncode == 0, decoded.stderr[-3000:]
