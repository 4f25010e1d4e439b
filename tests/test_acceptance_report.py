"""The acceptance report (``vdtrain.eval.acceptance``): simulated against real acceptance per draft depth,
its arithmetic on hand-made stats, the reuse of rows the evaluation already decoded, and what the
``python -m vdtrain.evaluate`` writes (the after-epoch callback's: tests/test_eval_callback.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import random_drafter, random_gpt, random_vq
from test_evaluate import PROMPTS, _config, hashed_caption_features

from vdtrain.config import AcceptanceReportConfig
from vdtrain.decode.profiling import DeviceGuard
from vdtrain.decode.run import DecodeStats
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.drafters import Drafter, DrafterConfig
from vdtrain.eval import acceptance
from vdtrain.eval.acceptance import (
    acceptance_markdown,
    acceptance_metrics,
    build_report,
    measure,
    real_acceptance,
)
from vdtrain.eval.runner import evaluate
from vdtrain.eval.table import EvalRow
from vdtrain.evaluate import run
from vdtrain.targets import load_target_folder
from vdtrain.targets.llamagen import LlamaGenTarget, VQTokenizer
from vdtrain.train.agreement import depth_agreement

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def agreement_calls(monkeypatch) -> list[tuple[torch.Tensor, int, int, list[float]]]:
    """The real ``depth_agreement``, recording (tokens, condition rows, depth, result) of every call."""
    calls: list[tuple[torch.Tensor, int, int, list[float]]] = []

    def recorded(drafter, target, cond, tokens, depth):
        out = depth_agreement(drafter, target, cond, tokens, depth)
        calls.append((tokens, len(cond), depth, out))
        return out

    monkeypatch.setattr(acceptance, "depth_agreement", recorded)
    return calls


def stats(*committed: list[int]) -> list[DecodeStats]:
    return [DecodeStats(steps=len(c), committed_per_step=c, depth_per_step=[3] * len(c)) for c in committed]


def row(tau: float, S: float) -> EvalRow:
    return EvalRow("eagle2", 0.0, S, tau, 3.0, S, 1.0, 1.0, 1.0, 1.0)


def test_real_acceptance_is_the_share_of_steps_accepting_at_least_d_averaged_over_prompts():
    # accepted = committed - 1: prompt 0 accepts 0, 1, 2, 3; prompt 1 accepts 2, 2
    decoded = stats([1, 2, 3, 4], [3, 3])
    assert real_acceptance(decoded, 4) == pytest.approx([(3 / 4 + 1) / 2, (2 / 4 + 1) / 2, (1 / 4) / 2, 0.0])
    # summed over every depth it is the eval table's τ (mean over prompts of committed per step)
    tau = sum(s.tau for s in decoded) / 2
    assert 1 + sum(real_acceptance(decoded, 4)) == pytest.approx(tau) == pytest.approx(2.75)


def test_the_report_chains_agreements_and_states_the_gap():
    report = build_report("eagle2", 0.0, [0.9, 0.5, 0.2], row(tau=2.75, S=2.5), stats([1, 2, 3, 4], [3, 3]))
    assert [d.p_sim for d in report.depths] == pytest.approx([0.9, 0.45, 0.09])
    assert [d.p_real for d in report.depths] == pytest.approx([0.875, 0.75, 0.125])
    assert report.tau_sim == pytest.approx(1 + 0.9 + 0.45 + 0.09)
    assert report.gap == pytest.approx(2.44 - 2.75)
    metrics = acceptance_metrics([report])
    assert metrics["eval/acceptance/tau_gap_T0"] == pytest.approx(-0.31)
    assert metrics["eval/acceptance/tau_sim_T0"] == pytest.approx(2.44)
    assert metrics["eval/acceptance/tau_real_T0"] == 2.75 and metrics["eval/acceptance/S_T0"] == 2.5
    assert metrics["eval/acceptance/p_sim_d2_T0"] == pytest.approx(0.45)
    assert metrics["eval/acceptance/p_real_d3_T0"] == pytest.approx(0.125)
    table = acceptance_markdown([report])
    assert "| 0 | eagle2 | 2.44 | 2.75 | -0.31 | 2.50 |" in table
    assert "| 0 | 2 | 0.500 | 0.450 | 0.750 | -0.300 |" in table


@pytest.fixture(scope="module")
def target() -> LlamaGenTarget:
    tokenizer = VQTokenizer(random_vq(), image_size=8)
    return LlamaGenTarget(
        random_gpt(), tokenizer, hashed_caption_features, "tiny", SamplingConfig(cfg_scale=2.0)
    )


def test_measure_reuses_decoded_rows_and_decodes_only_missing_temperatures(
    target, agreement_calls, monkeypatch
):
    drafter = random_drafter(target)
    result = evaluate(target, drafter, PROMPTS, ["eagle2"], [0], batch_size=2, progress=False)
    decodes: list[list[float]] = []

    def counted(*args, **kwargs):
        decodes.append(list(args[4]))
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(acceptance, "evaluate", counted)
    reports = measure(target, drafter, result, AcceptanceReportConfig(depth=3), seed=0, batch_size=2)
    assert decodes == [[1.0]]  # T = 0 reused, T = 1 decoded
    assert [r.temperature for r in reports] == [0.0, 1.0]
    row0 = next(r for r in result.rows if r.method == "eagle2")
    assert reports[0].tau_real == row0.tau and reports[0].S == row0.S
    assert [d.p_real for d in reports[0].depths] == real_acceptance(result.decoded["eagle2", 0.0].stats, 3)
    # teacher-forced on AR's own samples, in batches of 2 (3 prompts: 2 + 1), no CFG rows: the captions,
    # then the null condition, per temperature
    assert [(n, depth) for _, n, depth, _ in agreement_calls] == [(2, 3), (1, 3)] * 4
    assert torch.equal(torch.cat([c[0] for c in agreement_calls[:2]]), result.decoded["ar", 0.0].tokens)
    assert torch.equal(torch.cat([c[0] for c in agreement_calls[2:4]]), result.decoded["ar", 0.0].tokens)
    again = evaluate(target, drafter, PROMPTS, ["eagle2"], [1], batch_size=2, progress=False)
    ar_tokens = again.decoded["ar", 1.0].tokens
    assert torch.equal(torch.cat([c[0] for c in agreement_calls[4:6]]), ar_tokens)
    assert pytest.approx(reports[1].S) == again.rows[1].S  # the same seeds decode the same draws
    # batches weigh by their size: the same agreement as all three prompts in one batch
    whole = depth_agreement(drafter, target, target.encode_captions(PROMPTS), ar_tokens, 3)
    assert [d.agreement for d in reports[1].depths] == pytest.approx(whole)
    assert [d.p_sim for d in reports[1].depths] == pytest.approx(np.cumprod(whole))
    assert reports[1].tau_sim == pytest.approx(1 + sum(np.cumprod(whole)))


def test_the_report_measures_the_null_stream_beside_the_conditional_one(target):
    """a_d and τ_sim of the null stream: the same AR samples teacher-forced under the null condition, in
    the report, its metrics and its table. The evaluation and the report run as on a GPU (``DeviceGuard``:
    the models count as on the device, and the decoded samples the runner keeps on the host must be moved
    back before a model reads them)."""
    drafter = random_drafter(target)
    with DeviceGuard():
        result = evaluate(target, drafter, PROMPTS, ["eagle2"], [0], batch_size=3, progress=False)
        (report,) = measure(
            target, drafter, result, AcceptanceReportConfig(temperatures=[0.0], depth=2), seed=0, batch_size=3
        )
    tokens = result.decoded["ar", 0.0].tokens
    null = target.null_condition(target.encode_captions(PROMPTS))
    expected = depth_agreement(drafter, target, null, tokens, 2)
    assert [d.null_agreement for d in report.depths] == pytest.approx(expected)
    assert report.tau_sim_null == pytest.approx(1 + sum(np.cumprod(expected)))
    assert expected != [d.agreement for d in report.depths]  # a different stream, not a copy
    metrics = acceptance_metrics([report])
    assert metrics["eval/acceptance/tau_sim_null_T0"] == pytest.approx(report.tau_sim_null)
    assert metrics["eval/acceptance/a_null_d2_T0"] == pytest.approx(expected[1])
    table = acceptance_markdown([report])
    assert f"| {report.tau_sim_null:.2f} |" in table and "a_d, null stream" in table


def test_depth_defaults_to_the_deepest_drafted_tree(target):
    drafter = random_drafter(target)
    result = evaluate(target, drafter, PROMPTS, ["eagle2"], [0], batch_size=3, progress=False)
    cfg = AcceptanceReportConfig(temperatures=[0.0])
    (report,) = measure(target, drafter, result, cfg, seed=0, batch_size=3)
    deepest = max(d for s in result.decoded["eagle2", 0.0].stats for d in s.depth_per_step)
    assert len(report.depths) == deepest > 1


def test_evaluate_writes_the_report_and_its_plot(tiny_folder, tmp_path):
    drafter = Drafter.make(DrafterConfig.for_target(load_target_folder(tiny_folder)))
    drafter.save_pretrained(tmp_path / "drafter")
    out = tmp_path / "out"
    cfg = _config(
        "eval=fast",
        f"target.folder={tiny_folder}",
        f"drafter={tmp_path / 'drafter'}",
        "num_prompts=2",
        "batch_size=2",
        "save_images=false",
        "acceptance.depth=4",
        f"out_dir={out}",
    )
    result = run(cfg)
    data = json.loads((out / "acceptance.json").read_text())["acceptance"]
    assert [(d["method"], d["temperature"]) for d in data] == [("eagle2", 0.0), ("eagle2", 1.0)]
    for d in data:
        agreement = [row["agreement"] for row in d["depths"]]
        assert len(agreement) == 4 and all(0.0 <= a <= 1.0 for a in agreement)
        assert [row["p_sim"] for row in d["depths"]] == pytest.approx(np.cumprod(agreement))
        assert d["tau_gap"] == pytest.approx(1 + sum(np.cumprod(agreement)) - d["tau_real"])
    assert data[0]["tau_real"] == next(r.tau for r in result.rows if r.method == "eagle2")
    assert (out / "plots" / "acceptance.png").stat().st_size > 1000
    assert "| 1 | eagle2 |" in (out / "acceptance.md").read_text()
