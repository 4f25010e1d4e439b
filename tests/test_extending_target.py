"""docs/extending.md, "Adding a target", followed literally in a copy of the repository: its five pieces
written where the page says, then the page's "try" block and a decode with the new target there."""

from __future__ import annotations

import pytest
from walkthrough import copy_repo, follow, run_python

SECTION = "Adding a target"
FILES = {
    "vdtrain/models/toy.py",
    "vdtrain/models/toy_io.py",
    "vdtrain/targets/toy.py",
    "vdtrain/targets/registry.py",
    "conf/target/toy.yaml",
}
CHECK = """
import pytest, torch, yaml
from vdtrain.config import UnknownConfigKeyError
from vdtrain.decode.ar import generate_ar
from vdtrain.decode.methods import build_method, load_preset
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.targets import draft_layer_class, load_target

tried = {}
exec(open("try.py").read(), tried)
target, drafter = tried["target"], tried["drafter"]
ident = target.identity
assert (ident.family, ident.grid, ident.prefix_length, ident.num_layers) == ("toy", (4, 4), 16, 2)
assert draft_layer_class("toy").__name__ == "ChameleonDraftLayer"
config = {**yaml.safe_load(open("conf/target/toy.yaml")), "folder": "toy_model"}
assert load_target(config).identity == ident
with pytest.raises(UnknownConfigKeyError, match=r"kind 'toy': target\\.foldr \\(did you mean folder"):
    load_target({**config, "foldr": "toy_model"})
captions = ["a red square", "two blue dots on a long white stripe, far too long for sixteen bytes"]
greedy = SamplingConfig(cfg_scale=2.0, temperature=0.0)
with torch.no_grad():
    cond = target.encode_captions(captions)
    ar = generate_ar(target, cond, greedy, [None, None])
    result = build_method(load_preset("eagle2"), target, drafter, greedy).generate(cond, [None, None])
assert ar.shape == (2, 16) and torch.equal(result.tokens, ar)
images = target.tokenizer.decode(ar)
assert images.shape == (2, 3, 16, 16) and torch.equal(target.tokenizer.encode(images), ar)
"""

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_target_walkthrough_gives_a_target_every_method_decodes_with(tmp_path):
    root = copy_repo(tmp_path)
    found = follow(SECTION, root, ("vdtrain/targets/registry.py",))
    assert set(found) == {*FILES, "try"}
    (root / "try.py").write_text(found["try"])
    checked = run_python(root, CHECK)
    assert checked.returncode == 0, checked.stderr[-3000:]
