"""Speed-ups that survive a shared machine (vdtrain/eval/timing.py): interleaved rounds, paired ratios,
their median and spread, and the table's mark on a ratio the spread cannot tell from 1."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from vdtrain.eval.table import EvalRow, to_markdown
from vdtrain.eval.timing import interleaved, paired_speedup


def test_one_sample_30x_slow_leaves_the_median_ratio_true():
    ar = [10.0, 10.0, 300.0, 10.0, 10.0]  # round 3: something else took the machine during AR's decode
    spread = paired_speedup(ar, [4.0] * 5)
    assert spread.median == pytest.approx(2.5) and spread.rounds == 5
    assert (spread.low, spread.high) == (pytest.approx(2.5), pytest.approx(2.5)) and spread.clear


def test_a_spread_wider_than_the_distance_from_1_is_not_clear():
    spread = paired_speedup([10.0, 10.0, 10.0, 10.0], [8.0, 12.0, 9.0, 11.0])
    assert not spread.clear and 0.8 < spread.median < 1.2
    with pytest.raises(ValueError, match="as many rounds"):
        paired_speedup([1.0], [1.0, 2.0])


def test_rounds_interleave_after_one_untimed_decode_each():
    order: list[str] = []

    def decode(name: str, seconds: float):
        return lambda: order.append(name) or seconds

    seconds = interleaved({"ar": decode("ar", 2.0), "eagle2": decode("eagle2", 1.0)}, repeats=3)
    assert order == ["ar", "eagle2"] * 4  # the first pair is the untimed warm-up
    assert seconds == {"ar": [2.0] * 3, "eagle2": [1.0] * 3}


def test_a_round_already_run_warm_is_round_1_and_replaces_the_warm_up():
    order: list[str] = []

    def decode(name: str, seconds: float):
        return lambda: order.append(name) or seconds

    decodes = {"ar": decode("ar", 2.0), "eagle2": decode("eagle2", 1.0)}
    seconds = interleaved(decodes, repeats=3, first_round={"ar": 7.0, "eagle2": 3.0})
    assert order == ["ar", "eagle2"] * 2
    assert seconds == {"ar": [7.0, 2.0, 2.0], "eagle2": [3.0, 1.0, 1.0]}
    one = interleaved(decodes, repeats=1, first_round={"ar": 7.0, "eagle2": 3.0})
    assert one == {"ar": [7.0], "eagle2": [3.0]}
    assert len(order) == 4  # one round asked for and one given: nothing more decoded


def _row(speedup: float, low: float | None, high: float | None) -> EvalRow:
    return EvalRow(
        "eagle2",
        0.0,
        2.0,
        1.0,
        1.0,
        2.0,
        speedup,
        speedup,
        1.0,
        1.0,
        device="cpu (x, 2 threads)",
        speedup_low=low,
        speedup_high=high,
        speedup_rounds=5,
    )


def test_the_table_shows_the_spread_and_marks_an_unclear_ratio():
    table = to_markdown([_row(0.43, 0.40, 0.47), _row(1.01, 0.15, 1.50)])
    assert "0.43× (0.40–0.47) |" in table and "1.01× (0.15–1.50) ? |" in table
    assert "wider than its distance from 1" in table
    assert "?" not in to_markdown([_row(0.43, 0.40, 0.47)])


@pytest.mark.parametrize(
    ("batch_size", "slow", "calls"),
    [
        # one unit: 1 warm-up, 2 the run's timed decode (the one the table used to divide by), which is
        # round 1 of the timing, 3-6 rounds 2-5; the evaluation's warm decode replaces the timing's warm-up
        (2, (2,), 6),
        # two units: AR's decodes of the first batch and eagle2's are not neighbours, so the timing warms up
        # and runs its 5 rounds itself: 1 warm-up, 2-3 the units, 4 the timing's warm-up, 5-9 rounds
        (1, (2, 6), 9),
    ],
)
def test_evaluate_reports_the_true_ratio_when_one_ar_decode_is_30x_slow(monkeypatch, batch_size, slow, calls):
    """A fake clock: AR's decode of a batch takes 10 s, eagle2's 0 s, each clock read 1 s more; AR's ``slow``
    decodes take 300 s. The row still reads 11/1 = 11x over 5 rounds."""
    from conftest import random_drafter, random_gpt, random_vq
    from test_compiled import hashed_captions

    from vdtrain.decode import ar
    from vdtrain.decode.sampling import SamplingConfig
    from vdtrain.eval import runner
    from vdtrain.prompts import shapes_heldout_captions
    from vdtrain.targets.llamagen import LlamaGenTarget, VQTokenizer

    target = LlamaGenTarget(
        random_gpt(), VQTokenizer(random_vq(), 8), hashed_captions, "tiny", SamplingConfig(cfg_scale=2.0)
    )
    clock = {"now": 0.0, "calls": 0}

    def perf_counter() -> float:
        clock["now"] += 1.0
        return clock["now"]

    generate = ar.ARDecoder.generate

    def timed_ar(*args, **kwargs):
        clock["calls"] += 1
        clock["now"] += 300.0 if clock["calls"] in slow else 10.0
        return generate(*args, **kwargs)

    monkeypatch.setattr(runner, "time", SimpleNamespace(perf_counter=perf_counter, monotonic=time.monotonic))
    monkeypatch.setattr(ar.ARDecoder, "generate", timed_ar)
    result = runner.evaluate(
        target,
        random_drafter(target),
        shapes_heldout_captions(2),
        ["eagle2"],
        [0],
        batch_size=batch_size,
        progress=False,
        quality=runner.QualityConfig(metrics=[]),
        speed_repeats=5,
    )
    _, eagle2 = result.rows
    assert clock["calls"] == calls
    assert eagle2.speedup == pytest.approx(11.0) and eagle2.speedup_rounds == 5 and eagle2.speedup_clear()


def test_coinciding_points_of_the_tradeoff_plot_share_one_stacked_label():
    """AR and the exact methods at T = 0 share a quality and rows can share an S: their labels printed
    over each other in tradeoff.png."""
    from vdtrain.eval.plots import label_groups

    points = [(1.0, 0.9, "ar T=0"), (2.5, 0.9, "eagle2 T=0"), (2.5, 0.9, "peanut T=0"), (1.0, 0.5, "ar T=1")]
    assert label_groups(points) == [
        (1.0, 0.9, "ar T=0"),
        (2.5, 0.9, "eagle2 T=0\npeanut T=0"),
        (1.0, 0.5, "ar T=1"),
    ]
