"""The papers' S (conf/papers.yaml) and the speedup projected from it, in step_cost and evaluate tables."""

from __future__ import annotations

import pytest

from vdtrain.decode.methods import preset_names
from vdtrain.eval.papers import paper_s, projected_speedup
from vdtrain.eval.table import EvalRow, to_markdown


def test_the_papers_s_per_family_are_the_published_figures():
    assert paper_s("eagle1").s == paper_s("eagle2").s == 2.50  # EAGLE-1 on LlamaGen-XL, LANTERN++ Table 2
    assert paper_s("lantern_pp").s == 2.98
    assert paper_s("sjd").s == 1.63
    assert paper_s("vvs") is None and paper_s("ar") is None  # no paper figure: no projection
    assert all(paper_s(name).source for name in ("eagle1", "lantern_pp", "sjd"))


def test_every_listed_preset_exists():
    from vdtrain.eval.papers import _by_preset

    assert set(_by_preset()) <= set(preset_names())


def test_projection_is_the_papers_s_over_the_step_cost():
    assert projected_speedup("sjd", 1.35) == pytest.approx(1.63 / 1.35)
    assert projected_speedup("gsd", 1.35) is None


def test_evaluate_table_prints_the_paper_projection_next_to_the_measured_speedup():
    row = EvalRow("eagle2", 0.0, 4.0, 3.0, 3.0, 4.0, 2.0, 2.0, 1.0, 2.0, paper_speedup=2.5 / 2.0)
    table = to_markdown([row])
    assert "at paper S" in table and "1.25×" in table and "2.00×" in table
