"""``EvalAfterEpoch`` inside ``vdtrain.fit``: real decoding after every epoch, printed, logged to CSV,
written under ``<run>/eval`` with the acceptance report, able to pick ``best.ckpt``, and carried into the
exported model card."""

from __future__ import annotations

import contextlib
import csv
import io
import json

import pytest
import torch
from test_fit import fit_config

from vdtrain.config import EvalCallbackConfig
from vdtrain.decode.profiling import DeviceGuard
from vdtrain.eval.callback import EvalAfterEpoch
from vdtrain.eval.table import read_results
from vdtrain.fit import fit

# 2 steps an epoch, 2 epochs; the callback decodes 2 held-out captions with eagle2 and AR at T = 0.
EVAL_ON = (
    "eval.enabled=true",
    "eval.num_prompts=2",
    "eval.batch_size=2",
    "data.samples_per_epoch=4",
    "trainer.max_steps=4",
    "eval.speed_repeats=1",  # one timing round a table: tests/test_timing.py tests the rounds
)


@pytest.fixture(scope="module")
def eval_run(tiny_folder, tmp_path_factory):
    """One training run with evaluation after each epoch, shared by the module: its folder, its summary
    and what it printed. It runs as on a GPU (``DeviceGuard``): what the data, the decodes and the
    acceptance report hand a model must be on the model's device."""
    run = tmp_path_factory.mktemp("eval") / "run"
    cfg = fit_config(tiny_folder, run, *EVAL_ON, "best_metric=eval/eagle2_T0/S")
    with contextlib.redirect_stdout(io.StringIO()) as printed, DeviceGuard():
        summary = fit(cfg)
    return run, summary, printed.getvalue()


def test_the_table_is_printed_after_every_epoch(eval_run):
    out = eval_run[2]
    assert "EvalAfterEpoch (epoch000, step 2, 2 prompts)" in out
    assert "EvalAfterEpoch (epoch001, step 4, 2 prompts)" in out
    assert "EvalAfterEpoch (final" not in out  # the last epoch already measured the final drafter
    assert out.count("| eagle2 | 0 |") == 2 and out.count("| ar | 0 |") == 2


def test_metrics_reach_the_csv_log_and_the_run_folder(eval_run):
    run, summary, _ = eval_run
    with open(run / "logs" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    for name in ("S", "tau", "mean_depth", "TPF", "speedup"):
        logged = [r[f"eval/eagle2_T0/{name}"] for r in rows if r.get(f"eval/eagle2_T0/{name}")]
        assert len(logged) == 2, name  # once per epoch
    assert [r["step"] for r in rows if r.get("eval/eagle2_T0/S")] == ["2", "4"]
    results, settings = read_results(run / "eval" / "latest")
    assert settings["step"] == 4 and [r.method for r in results] == ["ar", "eagle2"]
    assert results[1].identical_to_ar is True  # exact at T = 0, measured through the real engine
    assert (run / "eval" / "epoch000" / "results.md").is_file()
    assert (run / "eval" / "latest" / "samples.png").stat().st_size > 0
    assert summary["eval/eagle2_T0/S"] == pytest.approx(results[1].S)


def test_the_acceptance_gap_is_logged_and_its_table_and_plot_written(eval_run):
    """eagle2 at T = 0 reused from the table, at T = 1 decoded for the report (docs/evaluation.md), at the
    last evaluation only (``acceptance.every_round`` false: its T = 1 decodes cost as much as a round)."""
    run_dir, summary, _ = eval_run
    with open(run_dir / "logs" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("eval/acceptance/tau_gap_T0")]
    assert [r["step"] for r in rows] == ["4"]  # the final drafter's, not the first epoch's
    for r in rows:
        for t in ("T0", "T1"):
            sim, real = float(r[f"eval/acceptance/tau_sim_{t}"]), float(r[f"eval/acceptance/tau_real_{t}"])
            assert float(r[f"eval/acceptance/tau_gap_{t}"]) == pytest.approx(sim - real, abs=1e-5)
        assert float(r["eval/acceptance/tau_real_T0"]) == pytest.approx(float(r["eval/eagle2_T0/tau"]))
    for folder in ("epoch001", "latest"):
        assert (run_dir / "eval" / folder / "acceptance.png").stat().st_size > 1000
        assert "τ_sim" in (run_dir / "eval" / folder / "acceptance.md").read_text()
    assert not (run_dir / "eval" / "epoch000" / "acceptance.md").exists()
    data = json.loads((run_dir / "eval" / "latest" / "acceptance.json").read_text())["acceptance"]
    assert [d["temperature"] for d in data] == [0.0, 1.0]
    assert summary["eval/acceptance/tau_gap_T1"] == pytest.approx(data[1]["tau_gap"])


def test_the_measured_speed_picks_the_best_checkpoint(eval_run):
    run, *_ = eval_run
    best = torch.load(run / "checkpoints" / "best.ckpt", map_location="cpu", weights_only=False)
    state = next(v for k, v in best["callbacks"].items() if "eval/eagle2_T0/S" in k)
    results, _ = read_results(run / "eval" / "latest")
    assert state["best_model_path"].endswith("best.ckpt")
    assert float(state["best_model_score"]) >= results[1].S - 1e-6  # the best of the measured epochs


def test_the_export_model_card_carries_the_last_table(eval_run):
    run, *_ = eval_run
    card = (run / "drafter" / "README.md").read_text()
    assert "| eagle2 | 0 |" in card


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="every_n_epochs"):
        EvalAfterEpoch(EvalCallbackConfig(every_n_epochs=0), tmp_path, ["a caption"])
    with pytest.raises(ValueError, match="prompt set is empty"):
        EvalAfterEpoch(EvalCallbackConfig(), tmp_path, [])


def test_on_by_default(tiny_folder, tmp_path):
    from hydra import compose, initialize_config_dir
    from test_fit import CONF

    with initialize_config_dir(str(CONF), version_base=None):
        cfg = compose("fit", overrides=[f"target.folder={tiny_folder}", f"run_dir={tmp_path}"])
    assert cfg.eval.enabled and list(cfg.eval.methods) == ["eagle2"] and cfg.eval.num_prompts == 4
    assert not cfg.eval.acceptance.every_round  # the report comes with the last evaluation


def test_sample_grids_go_to_image_loggers():
    """TensorBoard's writer takes ``add_image``, wandb's logger ``log_image``; CSV keeps the PNG only."""
    import numpy as np

    from vdtrain.eval.callback import _log_image

    calls = []

    class Writer:
        def add_image(self, key, image, step, dataformats):
            calls.append(("tb", key, image.shape, step, dataformats))

    class TensorBoardLike:
        experiment = Writer()

    class WandbLike:
        experiment = object()

        def log_image(self, key, images, step):
            calls.append(("wandb", key, images[0].shape, step))

    image = np.zeros((4, 6, 3), np.uint8)
    for logger in (TensorBoardLike(), WandbLike(), object()):
        _log_image(logger, "eval/samples", image, 7)
    assert calls == [("tb", "eval/samples", (4, 6, 3), 7, "HWC"), ("wandb", "eval/samples", (4, 6, 3), 7)]


def test_each_evaluation_measures_its_speedup_against_its_own_ar(monkeypatch):
    """The machine's load changes between epochs (a run read S 3.3 as 0.61x, 3.31x and 0.31x against the
    first epoch's AR): every evaluation decodes and times AR again. A fake clock makes AR take 10 s in
    the first round and 100 s in the second. The acceptance report's extra temperature (T = 1) reads only
    AR's tokens: the first round's are reused."""
    import time
    from types import SimpleNamespace

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
    module = SimpleNamespace(target=target, drafter=random_drafter(target), training=True)
    module.eval, module.train = (lambda: None), (lambda mode: None)
    clock = {"now": 0.0, "ar": 0.0}

    def perf_counter() -> float:  # one second between reads, AR's decode adds its own
        clock["now"] += 1.0
        return clock["now"]

    generate = ar.ARDecoder.generate

    def timed_ar(*args, **kwargs):
        clock["now"] += clock["ar"]
        return generate(*args, **kwargs)

    monkeypatch.setattr(runner, "time", SimpleNamespace(perf_counter=perf_counter, monotonic=time.monotonic))
    monkeypatch.setattr(ar.ARDecoder, "generate", timed_ar)
    callback = EvalAfterEpoch(
        EvalCallbackConfig(num_prompts=2, batch_size=2), "unused", shapes_heldout_captions(2)
    )
    ar_seconds, sampled = [], []
    for clock["ar"] in (10.0, 100.0):
        result, reports = callback._evaluate(module, report=True)
        ar_row, eagle2 = result.rows
        assert (ar_row.method, eagle2.method) == ("ar", "eagle2") and eagle2.identical_to_ar
        assert eagle2.ar_seconds == ar_row.method_seconds
        ar_seconds.append(ar_row.method_seconds)
        sampled.append(callback.ar_runs[1.0, 0])
        assert [r.temperature for r in reports] == [0.0, 1.0]
    assert ar_seconds == [11.0, 101.0]
    assert sampled[0] is sampled[1]


def test_an_evaluation_just_before_the_final_one_is_skipped():
    from types import SimpleNamespace

    callback = EvalAfterEpoch(EvalCallbackConfig(), "unused", ["a caption"])
    trainer = SimpleNamespace(max_steps=400, num_training_batches=128, accumulate_grad_batches=1)
    near = [
        s
        for s in (128, 256, 384, 400)
        if callback._final_is_near(SimpleNamespace(**vars(trainer), global_step=s))
    ]
    assert near == [384]  # 16 steps before the final evaluation: skipped


def test_an_epoch_cut_short_by_max_steps_is_the_final_round_not_the_next_epoch(monkeypatch):
    """The default run (400 steps, 128-step epochs): Lightning ends the 16 steps after epoch 2 as epoch 3;
    its round measures the final drafter and is named so (it was epoch003, the third round of a run of three
    epochs), while whole epochs keep Lightning's 0-based number, the one metrics.csv logs."""
    from types import SimpleNamespace

    callback = EvalAfterEpoch(EvalCallbackConfig(), "unused", ["a caption"])
    tags = []
    monkeypatch.setattr(callback, "run", lambda trainer, module, tag, last: tags.append(tag))
    for step, epoch, whole in ((128, 0, True), (256, 1, True), (384, 2, True), (400, 3, False)):
        progress = SimpleNamespace(batch_progress=SimpleNamespace(is_last_batch=whole))
        trainer = SimpleNamespace(
            global_step=step,
            current_epoch=epoch,
            max_steps=400,
            max_epochs=-1,
            should_stop=False,
            num_training_batches=128,
            accumulate_grad_batches=1,
            fit_loop=SimpleNamespace(epoch_loop=progress),
        )
        callback.on_train_epoch_end(trainer, None)
    assert tags == ["epoch000", "epoch001", "final"]  # epoch 2 is skipped: the final round is 16 steps on


def test_the_acceptance_report_comes_with_the_last_evaluation_unless_asked_every_round(monkeypatch):
    from types import SimpleNamespace

    from vdtrain.config import AcceptanceReportConfig
    from vdtrain.eval.callback import _training_ends

    def trainer(step: int, epoch: int, max_steps: int = 4, max_epochs: int = -1):
        return SimpleNamespace(
            global_step=step,
            current_epoch=epoch,
            max_steps=max_steps,
            max_epochs=max_epochs,
            should_stop=False,
        )

    assert not _training_ends(trainer(2, 0)) and _training_ends(trainer(4, 1))
    assert _training_ends(trainer(2, 1, max_steps=-1, max_epochs=2))
    asked = []
    for every_round in (False, True):
        cfg = EvalCallbackConfig(acceptance=AcceptanceReportConfig(every_round=every_round))
        callback = EvalAfterEpoch(cfg, "unused", ["a caption"])
        monkeypatch.setattr(callback, "_evaluate", lambda module, report: asked.append(report) or (None, []))
        monkeypatch.setattr(callback, "_report", lambda *args: None)
        strategy = SimpleNamespace(broadcast=lambda metrics, src: metrics)
        run = SimpleNamespace(is_global_zero=False, strategy=strategy, global_step=2, callback_metrics={})
        callback.run(run, None, "epoch000", last=False)
        callback.run(run, None, "final", last=True)
    assert asked == [False, True, True, True]


def test_a_method_the_trained_drafter_cannot_serve_is_refused_before_training(tiny_folder):
    """eval.methods with a block tree while an eagle1 drafter trains: refused at fit start, naming the
    method, not after the first epoch's AR and eagle2 decodes."""
    from types import SimpleNamespace

    from conftest import random_drafter

    from vdtrain.targets import load_target_folder

    target = load_target_folder(tiny_folder)
    callback = EvalAfterEpoch(EvalCallbackConfig(methods=["eagle2", "block_tree"]), "unused", ["a caption"])
    module = SimpleNamespace(target=target, drafter=random_drafter(target))
    with pytest.raises(ValueError, match=r"\['block_tree'\] cannot decode with the eagle1 drafter"):
        callback.on_fit_start(SimpleNamespace(), module)
    callback.cfg.methods = ["eagle2"]
    callback.on_fit_start(SimpleNamespace(), module)  # eagle2 is served
