"""The registry of method parts (``vdtrain.decode.methods``: ``TREES``, ``ACCEPTANCE``, ``SCHEDULES``).

A method's capabilities (needs a drafter, lossless) are read from the registry's data; here they are
checked against the objects the parts build and against what each preset is known to be, and a part
added to the registry alone is shown to give a working method.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import pytest
import torch
from conftest import tiny_condition
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from test_engine import make_drafter, make_target

from vdtrain.cli import CONF_DIR
from vdtrain.decode.ar import generate_ar
from vdtrain.decode.builders.static import StaticTreeBuilder, StaticTreeConfig
from vdtrain.decode.engine import SpeculativeEngine
from vdtrain.decode.methods import (
    ACCEPTANCE,
    PRESETS,
    SCHEDULES,
    TREES,
    AcceptanceConfig,
    DecodeConfig,
    Part,
    ScheduleConfig,
    TreeConfig,
    acceptance_rule,
    build_method,
    decode_config,
    load_preset,
    preset_names,
    preset_node,
    register_part_schemas,
    tree_builder,
    verification_schedule,
)
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.decode.vvs import UniformSchedule, UniformScheduleConfig

GREEDY = SamplingConfig(cfg_scale=2.0, temperature=0.0)


@pytest.fixture(scope="module")
def tiny():
    target = make_target()
    return target, make_drafter(target)


def _preset(name: str, tmp_path) -> DecodeConfig:
    return load_preset(name, {"acceptance": {"cache_dir": str(tmp_path)}})


def test_the_presets_use_every_registered_part():
    """So the per-preset checks below cover every registry entry."""
    configs = [load_preset(n) for n in preset_names()]
    assert {c.tree.kind for c in configs} == set(TREES)
    assert {c.acceptance.kind for c in configs} == set(ACCEPTANCE)
    assert {c.schedule.kind for c in configs} == set(SCHEDULES)


def test_the_capabilities_of_the_presets():
    """A preset's capabilities are its parts' registry flags, and the method table of docs/decoding.md
    says the same: a preset it lists is lossy there iff its rule or schedule is."""
    names = preset_names()
    table = (PRESETS.parents[1] / "docs" / "decoding.md").read_text()
    for name in names:
        config = load_preset(name)
        parts = TREES[config.tree.kind], ACCEPTANCE[config.acceptance.kind], SCHEDULES[config.schedule.kind]
        assert config.exact == (parts[1].lossless and parts[2].lossless)
        assert config.needs_drafter == parts[0].needs_drafter
        assert config.drafts_blocks == parts[0].drafts_blocks
        rows = [line for line in table.splitlines() if line.startswith(f"| `{name}` |")]
        assert all(("lossy" in row) != config.exact for row in rows), rows


def _preset_file(name: str) -> dict:
    return OmegaConf.to_container(preset_node(PRESETS / f"{name}.yaml"))


def test_hydra_composes_each_preset_as_load_preset_reads_it():
    """The generate app composes ``decode=<preset>`` through the parts' ConfigStore schemas: the same
    method as ``load_preset``, and a key left at its dataclass default can be overridden and is typed."""
    register_part_schemas()
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        for name in preset_names():
            assert decode_config(compose("generate", [f"decode={name}"]).decode) == load_preset(name), name
        cfg = compose("generate", ["decode=sjd", "decode.tree.window=32", "decode.tree.init=vertical_repeat"])
        overrides = {"tree": {"window": 32, "init": "vertical_repeat"}}
        assert decode_config(cfg.decode) == load_preset("sjd", overrides)
        with pytest.raises(ConfigCompositionException, match=r"decode\.tree\.window"):
            compose("generate", ["decode=sjd", "decode.tree.window=many"])
        with pytest.raises(ConfigCompositionException, match=r"decode\.tree\.window"):
            compose("generate", ["decode=ar", "decode.tree.window=32"])  # AR has no window


@pytest.mark.parametrize("name", preset_names())
def test_each_default_lives_in_its_config_class_only(name):
    """Every field of a preset read with no override is the preset's own value or its config class's
    default, and a preset never repeats a default (so a default is written once, in its class)."""
    config, written = load_preset(name, {}), _preset_file(name)
    for section, parts in (("tree", TREES), ("acceptance", ACCEPTANCE), ("schedule", SCHEDULES)):
        typed = getattr(config, section)
        defaults = parts[typed.kind].config()
        own = written.get(section, {})
        for f in fields(typed):
            value = getattr(typed, f.name)
            if f.name in own:
                assert value == own[f.name]
                assert f.name == "kind" or own[f.name] != getattr(defaults, f.name), (
                    f"{name}: {section}.{f.name} repeats {type(defaults).__name__}'s default"
                )
            else:
                assert value == getattr(defaults, f.name), f"{name}: {section}.{f.name}"


@pytest.mark.parametrize("name", preset_names())
def test_each_preset_agrees_with_the_parts_it_builds(tiny, name, tmp_path):
    target, _ = tiny
    config = _preset(name, tmp_path)
    if TREES[config.tree.kind].make is None:  # AR: nothing drafted, so nothing to attach a drafter to
        assert not config.needs_drafter
        with pytest.raises(ValueError, match="no draft-tree builder"):
            tree_builder(config.tree)
    else:
        builder = tree_builder(config.tree)
        assert (builder.needs_drafter, builder.drafts_blocks) == (config.needs_drafter, config.drafts_blocks)
    rule = acceptance_rule(config.acceptance, target)
    schedule = verification_schedule(config.schedule, target)
    accept, verify = ACCEPTANCE[config.acceptance.kind], SCHEDULES[config.schedule.kind]
    assert rule.needs_soft_p == accept.needs_soft_p
    assert rule.relaxes != accept.lossless  # a lossless rule credits no group
    assert schedule.can_skip != verify.lossless  # a lossless schedule verifies every step
    assert config.exact == (accept.lossless and verify.lossless)


def test_unknown_kinds_are_refused_with_the_known_ones(tiny):
    target, _ = tiny
    with pytest.raises(ValueError, match=r"unknown tree kind 'magic'; known: \[.*'dynamic'.*'sjd_pac'"):
        _ = DecodeConfig(tree=TreeConfig(kind="magic")).needs_drafter
    with pytest.raises(ValueError, match=r"unknown tree kind 'magic'; known: \[.*'none'"):
        tree_builder(TreeConfig(kind="magic"))
    with pytest.raises(ValueError, match=r"unknown acceptance 'magic'; known: \[.*'lantern_pp'"):
        _ = DecodeConfig(acceptance=AcceptanceConfig(kind="magic")).exact
    with pytest.raises(ValueError, match=r"unknown schedule kind 'magic'; known: \['always', 'similarity'"):
        verification_schedule(ScheduleConfig(kind="magic"), target)


def test_each_kind_owns_its_config_and_refuses_other_kinds_keys():
    """A section holds only its kind's keys (its config's fields, beside its class): another kind's key
    fails when the method is read, naming the kind and the keys it has."""
    for parts in (TREES, ACCEPTANCE, SCHEDULES):
        for kind, part in parts.items():
            assert part.config().kind == kind
    assert load_preset("sjd", {"tree": {"window": 8}}).tree.window == 8
    with pytest.raises(ValueError, match=r"tree kind 'dynamic' has no key \['window'\]; its keys: \['depth'"):
        load_preset("eagle2", {"tree": {"window": 8}})
    with pytest.raises(
        ValueError, match=r"acceptance 'exact' has no key \['delta'\]; its keys: \['cache_dir'\]"
    ):
        load_preset("eagle2", {"acceptance": {"delta": 0.2}})
    with pytest.raises(ValueError, match=r"schedule kind 'uniform' has no key \['t_sim'\]"):
        load_preset("vvs_uniform", {"schedule": {"t_sim": 0.5}})
    with pytest.raises(ValueError, match=r"unknown decode keys \['trees'\]"):
        decode_config({"trees": {"kind": "dynamic"}})


@dataclass
class ChainConfig(TreeConfig):
    """A new tree kind for the test: the drafter's top-1 chain, ``depth`` drafts long."""

    kind: str = "chain"
    depth: int = 2


class ChainBuilder(StaticTreeBuilder):
    """The chain as a static tree of rank-0 paths (its flags are the static tree's: needs a drafter)."""

    def __init__(self, config: ChainConfig) -> None:
        super().__init__(StaticTreeConfig(paths=[(0,) * d for d in range(1, config.depth + 1)]))


def test_a_registry_entry_is_enough_to_add_a_part(tiny, monkeypatch):
    target, drafter = tiny
    monkeypatch.setitem(TREES, "chain", Part(ChainConfig, ChainBuilder))
    monkeypatch.setitem(
        SCHEDULES,
        "every_other",
        Part(ScheduleConfig, lambda c: UniformSchedule(UniformScheduleConfig(every=2))),
    )
    cond = tiny_condition()
    ar = generate_ar(target, cond, GREEDY, [None, None])

    # A new tree with exact acceptance: exact by the registry, and it does reproduce AR at T = 0.
    chain = decode_config({"name": "chain", "tree": {"kind": "chain", "depth": 3}})
    assert chain.needs_drafter and chain.exact
    engine = build_method(chain, target, drafter, GREEDY)
    assert isinstance(engine, SpeculativeEngine) and engine.drafting.drafter is drafter
    result = engine.generate(cond, [None, None])
    assert torch.equal(result.tokens, ar)
    assert all(max(s.depth_per_step) == 3 for s in result.stats)

    # A new schedule: lossy by the registry, it skips steps, and the rules for skipping schedules hold.
    skipping = decode_config({"name": "skip", "tree": {"kind": "chain"}, "schedule": {"kind": "every_other"}})
    assert skipping.needs_drafter and not skipping.exact
    result = build_method(skipping, target, drafter, GREEDY).generate(cond, [None, None])
    assert all(s.skipped_steps > 0 for s in result.stats)
    sjd = decode_config({"name": "sjd_skip", "tree": {"kind": "jacobi"}, "schedule": {"kind": "every_other"}})
    with pytest.raises(ValueError, match="needs a drafter tree"):
        build_method(sjd, target, None, GREEDY)
    with pytest.raises(ValueError, match="no draft tree to skip verifying"):
        build_method(decode_config({"schedule": {"kind": "every_other"}}), target, None, GREEDY)
