"""``benchmarks/step_cost_guard.py``: a step_cost row slower than its recorded reference names the commit
and fails the run."""

from __future__ import annotations

import re
from types import SimpleNamespace

import yaml

from benchmarks.step_cost_guard import EXCEEDED, REFERENCE, check, load

SETTINGS = {"device": "cpu", "dtype": "fp32", "temperature": 0.0}


def _row(preset: str, r: float, batch: int = 1, ar_step_ms: float = 7.0) -> SimpleNamespace:
    return SimpleNamespace(
        target="shapes", preset=preset, batch=batch, mode="eager", r=r, ar_step_ms=ar_step_ms
    )


def _references(tmp_path):
    path = tmp_path / "ref.yaml"
    entry = {"target": "shapes", "batch": 1, "mode": "eager", "device": "cpu", "dtype": "fp32"}
    path.write_text(
        yaml.safe_dump(
            {
                "margin": {"cpu": 0.3, "cuda": 0.1},
                "load_factor": 1.5,
                "defaults": {"temperature": None},
                "references": [
                    {
                        **entry,
                        "preset": "eagle2",
                        "temperature": 0.0,
                        "r": 7.0,
                        "ar_step_ms": 7.5,
                        "commit": "29bf849",
                        "where": "x",
                    },
                    {
                        **entry,
                        "preset": "sjd",
                        "r": 2.0,
                        "ar_step_ms": 7.5,
                        "commit": "abc1234",
                        "where": "x",
                    },
                ],
            }
        )
    )
    return path


def test_a_row_past_its_reference_by_more_than_the_margin_fails_and_names_the_commit(tmp_path, capsys):
    path = _references(tmp_path)
    assert check([_row("eagle2", 9.0)], SETTINGS, path) == 0  # +29 %: inside the CPU's margin
    assert "r 9.00 vs 7.00 at 29bf849" in capsys.readouterr().out
    assert check([_row("eagle2", 9.8), _row("sjd", 1.0)], SETTINGS, path) == EXCEEDED  # +40 %
    out = capsys.readouterr().out
    assert "29bf849" in out and "+40%" in out and "over the 30% margin" in out


def test_a_row_measured_under_another_load_is_not_compared(tmp_path, capsys):
    """Issue 33's r 9.77 came with an AR step of 29.8 ms, four times the reference's."""
    path = _references(tmp_path)
    assert check([_row("eagle2", 20.0, ar_step_ms=29.8)], SETTINGS, path) == 0
    assert "not compared: AR step 29.80 ms vs 7.50 ms" in capsys.readouterr().out


def test_rows_without_a_reference_of_the_same_settings_pass_silently(tmp_path, capsys):
    path = _references(tmp_path)
    assert check([_row("eagle2", 99.0, batch=16), _row("peanut", 99.0)], SETTINGS, path) == 0
    assert check([_row("eagle2", 99.0)], {**SETTINGS, "temperature": None}, path) == 0  # T differs
    assert check([_row("sjd", 99.0)], {**SETTINGS, "device": "cuda:0"}, path) == 0  # device differs
    assert capsys.readouterr().out == ""


def test_the_shipped_references_are_unique_and_name_their_commits():
    margins, _, refs = load()
    raw = yaml.safe_load(REFERENCE.read_text())["references"]
    assert len(refs) == len(raw)  # no row recorded twice
    assert set(margins) == {"cpu", "cuda"}
    assert all(re.fullmatch(r"[0-9a-f]{7,40}", ref.commit) and ref.r > 0 for ref in refs.values())
    assert {ref.device for ref in refs.values()} == {"cpu", "cuda"}
