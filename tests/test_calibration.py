"""``benchmarks/calibration.py`` and ``benchmarks/step_cost.py`` decode with the world's own knobs, and the
calibration measures S with whole trees on any device."""

from __future__ import annotations

from omegaconf import OmegaConf

from benchmarks.calibration import METHODS, method_list
from benchmarks.step_cost import embedded_knobs
from vdtrain.cli import CONF_DIR


def test_the_calibration_keeps_whole_trees_and_the_worlds_knobs():
    """A GPU shrinks trees to fit a batch (``tree.max_rows``); the papers' S is at batch 1, so the
    calibration turns that off. It happened once: 512 captions at batch 64 on an H100 measured EAGLE-1 at
    1.49 with 2-node trees, against 2.25 with whole ones."""
    knobs = {"lantern": {"acceptance": {"delta": 0.3}}, "lantern_pp": {"acceptance": {"k": 7}}}
    configs = {c.name: c for c in method_list(METHODS, knobs)}
    assert list(configs) == METHODS
    assert all(c.tree.max_rows == 0 for c in configs.values())
    assert configs["lantern"].acceptance.delta == 0.3
    assert configs["lantern_pp"].acceptance.lam == 2.0 and configs["lantern_pp_lam3"].acceptance.lam == 3.0
    assert configs["lantern_pp_lam3"].acceptance.k == 7  # λ 3 is LANTERN++ with its knobs


def test_step_cost_reads_an_embedded_worlds_knobs():
    grain = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "target" / "grain.yaml"))["decode"]
    assert embedded_knobs("grain") == grain and grain
    assert embedded_knobs("llamagen-xl") == {}
