"""``benchmarks/step_profile.py`` on a CPU: the trace of a step is split into phases that add up."""

from __future__ import annotations

import json
from contextlib import nullcontext

import pytest
import torch

from benchmarks.step_cost import conditions, load, run_steps
from benchmarks.step_profile import PhaseSegments, main
from vdtrain.decode.methods import build_method, load_preset

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


class FakeGraph:
    """Stands in for a CUDA graph: the step runs eagerly while 'captured'; a replay is only logged."""

    def __init__(self, log: list) -> None:
        self.log = log

    def capture_begin(self) -> None:
        self.log.append("begin")

    def capture_end(self) -> None:
        self.log.append("end")

    def replay(self) -> None:
        self.log.append("replay")


@pytest.mark.parametrize(
    ("name", "labels"),
    [
        ("ar", ["other", "forward", "other"]),
        # the step's state, the window, the plan; then the refined window observed before the commit
        ("sjd", ["other", "draft", "other", "verify", "accept", "draft", "commit", "other"]),
    ],
)
def test_a_recorded_step_is_cut_into_its_phases(name, labels, tmp_path):
    """The graph-mode phase split (``PhaseSegments``): one graph per phase in step order, no empty one,
    every capture ended, each replayed inside its phase's range."""
    target, drafter = load("shapes", torch.device("cpu"), None, 0)
    config = load_preset(name, {"acceptance": {"cache_dir": str(tmp_path)}})
    method = build_method(config, target, drafter, target.sampling_defaults)
    cond = conditions(target, "shapes", 1, 1, 0)[0]
    with torch.no_grad():
        run_steps(method, cond, [torch.Generator().manual_seed(0)], None, 2)
        log, ranges = [], []
        segments = PhaseSegments(lambda: FakeGraph(log), lambda label: nullcontext(ranges.append(label)))
        step = method.decoder._step if name == "ar" else method._step
        _, replay, ran = segments.bind(method)(step, None)
    assert segments.labels == labels and not ran
    assert log == ["begin", "end"] * len(labels)
    replay()
    assert ranges == labels and log[-len(labels) :] == ["replay"] * len(labels)
