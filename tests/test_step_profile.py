"""``benchmarks/step_profile.py`` on a CPU: the trace of a step is split into phases that add up."""

from __future__ import annotations

import json

import pytest

from benchmarks.step_profile import main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_one_traced_step_per_method_splits_into_phases(tmp_path):
    out = tmp_path / "profile.json"
    summary = main(["--presets", "sjd", "--skip", "1", "--steps", "1", "--top", "3", "--out", str(out)])
    assert json.loads(out.read_text())["methods"] == summary["methods"]
    assert summary["settings"]["unit"] == "leaf ATen ops"
    ar, sjd = summary["methods"]["ar"]["eager"], summary["methods"]["sjd"]["eager"]
    assert list(summary["methods"]["ar"]) == ["eager"]  # replays need a GPU
    # AR: the forward and the sampling after it; nothing else.
    assert set(ar["phases"]) == {"other", "forward"}
    assert ar["phases"]["other"]["units"] == ar["units"] > ar["phases"]["forward"]["units"] > 0
    # A speculative step: every phase, which (with what runs outside them) add up to the step.
    assert {"draft", "verify", "accept", "commit", "forward"} <= set(sjd["phases"])
    exclusive = sum(v["units"] for k, v in sjd["phases"].items() if k != "forward")
    assert exclusive == sjd["units"] and sjd["phases"]["verify"]["units"] > 0
    assert len(sjd["names"]) == 3 and sjd["names"][0]["us"] >= sjd["names"][-1]["us"]
    assert 0 < sjd["us"] <= sjd["wall_us"]
