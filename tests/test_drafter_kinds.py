"""Every registered drafter kind (``DRAFTERS``), end to end, with no test of its own: ``fit`` trains it a few
steps, its export and its checkpoint reload as the same drafter, the drafter-tree presets (and the block
presets, for a kind that drafts blocks) decode AR's tokens at T = 0 with it, and where it trains
unrolled, step 0 of the unroll is its teacher-forced pass. A kind added later (docs/extending.md,
"Adding a drafter kind") is tested here as it is registered."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import random_drafter
from test_engine import make_target
from test_fit import fit_config

from vdtrain.decode.ar import generate_ar
from vdtrain.decode.methods import build_method, load_preset
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.drafters import DRAFTERS, Drafter, DrafterConfig
from vdtrain.fit import fit
from vdtrain.targets import load_target
from vdtrain.targets.base import split_taps

pytestmark = pytest.mark.usefixtures("one_thread")

KINDS = list(DRAFTERS)
GREEDY = SamplingConfig(cfg_scale=2.0, temperature=0.0)
TREE_PRESETS = ("eagle1", "eagle2")  # a static and a dynamic tree: every drafter-tree builder's calls
BLOCK_PRESETS = ("block", "block_tree")  # a kind that drafts blocks: its chain and its tree


@pytest.fixture(scope="module")
def trained(tiny_folder, tmp_path_factory) -> dict:
    """Each kind trained 4 steps by ``fit``: (its run folder, the target) by kind."""
    target = load_target({"kind": "folder", "folder": str(tiny_folder)})
    runs = {}
    for kind in KINDS:
        run = tmp_path_factory.mktemp(kind) / "run"
        fit(
            fit_config(tiny_folder, run, f"drafter.kind={kind}", "trainer.max_steps=4", "drafter.ttt_steps=2")
        )
        runs[kind] = run
    return {"target": target, "runs": runs}


@pytest.mark.parametrize("kind", KINDS)
def test_fit_trains_the_kind_and_its_export_and_checkpoint_reload_it(kind, trained):
    target, run = trained["target"], trained["runs"][kind]
    exported = Drafter.from_pretrained(run / "drafter", target)
    assert type(exported) is DRAFTERS[kind] and exported.config.kind == kind
    config = json.loads((run / "drafter" / "config.json").read_text())
    assert DrafterConfig.from_dict({k: v for k, v in config.items() if k != "metadata"}) == exported.config
    card = (run / "drafter" / "README.md").read_text()
    assert exported.title in card and f"method={exported.method} " in card  # its own preset
    load_preset(exported.method)  # a preset that exists
    checkpoint = Drafter.from_pretrained(run / "checkpoints" / "last.ckpt", target)
    assert checkpoint.config == exported.config
    saved = exported.state_dict()
    assert all(torch.equal(v, checkpoint.state_dict()[k]) for k, v in saved.items())
    fresh = Drafter.make(DrafterConfig.for_target(target, kind)).start_from(target).state_dict()
    assert set(fresh) == set(saved)
    assert any(not torch.equal(fresh[k], v) for k, v in saved.items()), "training moved no weight"


@pytest.mark.parametrize("kind", KINDS)
def test_the_tree_presets_decode_ar_tokens_with_the_trained_kind(kind, trained):
    target = trained["target"]
    drafter = Drafter.from_pretrained(trained["runs"][kind] / "drafter", target)
    cond = target.encode_captions(["a red circle", "two blue squares"])
    ar = generate_ar(target, cond, GREEDY, [None, None])
    for preset in TREE_PRESETS + (BLOCK_PRESETS if drafter.block_slots else ()):
        result = build_method(load_preset(preset), target, drafter, GREEDY).generate(cond, [None, None])
        assert torch.equal(result.tokens, ar), f"{kind} with {preset}"


@pytest.mark.parametrize("kind", KINDS)
def test_an_unrolled_kind_starts_its_unroll_with_the_teacher_forced_pass(kind, trained):
    """Training-time test, where the kind trains so: unrolled step 0 sees what ``forward_teacher`` does."""
    target = trained["target"]
    drafter = Drafter.from_pretrained(trained["runs"][kind] / "drafter", target)
    steps = drafter.unroll_steps(3)
    if steps is None:
        pytest.skip(f"{kind} trains teacher-forced")
    cond = target.encode_captions(["a red circle"])
    tokens = generate_ar(target, cond, GREEDY, [None])
    with torch.no_grad():
        states = target.sequence_features(cond, tokens, drafter.taps)
        hidden, tapped = split_taps(states, target.hidden_size, len(drafter.taps))
        features = drafter.input_features(hidden, tapped)
        unrolled = drafter.unroll(features, tokens, cond.mask, steps)
        teacher = drafter.forward_teacher(features, tokens, cond.mask)
    assert len(unrolled) == steps
    torch.testing.assert_close(unrolled[0], teacher)


@pytest.mark.parametrize("kind", KINDS)
def test_options_are_the_kinds_own_and_round_trip(kind, trained):
    target = trained["target"]
    config = DrafterConfig.for_target(target, kind)
    assert isinstance(config.options, DRAFTERS[kind].Options)
    assert DrafterConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(ValueError, match=f"are not {kind} options"):
        DrafterConfig.for_target(target, kind, no_such_option=1)
    own = {f.name for f in dataclasses.fields(DRAFTERS[kind].Options)}
    for cls in DRAFTERS.values():
        foreign = {f.name for f in dataclasses.fields(cls.Options)} - own
        for name in foreign:  # another kind's option is refused naming this kind's
            with pytest.raises(ValueError, match=f"are not {kind} options"):
                DrafterConfig.for_target(target, kind, **{name: getattr(cls.Options(), name)})


@pytest.mark.parametrize("kind", KINDS)
def test_every_kinds_features_are_the_targets_width(kind):
    """No per-row state in feature channels (issue #56): ``f`` and ``f̂`` are [.., H] for every kind at any
    offset; what a kind reads per row besides is its rows' ``offset``."""
    target = make_target(image_size=8)
    drafter = random_drafter(target, kind=kind)
    size = target.hidden_size
    hidden, tapped = torch.randn(1, 3, size), torch.randn(1, 3, size * len(drafter.taps))
    with torch.no_grad():
        features = drafter.input_features(hidden, tapped if drafter.taps else None)
        positions = torch.arange(3)
        for offset in (0, 2, torch.arange(1, 4) if drafter.block_slots else 1):
            out = drafter(features, torch.randn(1, 3, size), positions, None, offset=offset)
            assert features.shape == out.shape == hidden.shape, (kind, offset)
            assert drafter.logits(out, offset).shape == (1, 3, target.vocab_size)
