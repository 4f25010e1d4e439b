"""Drafter training (``vdtrain.fit``): the CLI, null conditioning, offline features, gradient accumulation,
DDP on CPU processes and on two loopback "nodes", DeepSpeed configs, exact resume, bad input and the
typed configs. Everything runs on the tiny random target folder (``tiny_folder``) in seconds."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import socket
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import lightning as L
import numpy as np
import pytest
import torch
from conftest import TINY_GPT, random_gpt, random_vq
from hydra import compose, initialize_config_dir
from lightning.pytorch.callbacks import Timer
from omegaconf import OmegaConf
from reference_losses import drafter_loss, unrolled_loss
from safetensors.torch import load_file

from vdtrain.config import DrafterTrainConfig, FitConfig, OptimConfig, UnknownConfigKeyError, check_known_keys
from vdtrain.data.streams import ShapesStream, collate
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.drafters import Drafter, DrafterConfig
from vdtrain.drafters.losses import image_target_mask
from vdtrain.drafters.rows import chain_rows
from vdtrain.fit import build_strategy, fit
from vdtrain.images import images_to_tensor
from vdtrain.shapes.scene import HELDOUT_SEED, TRAIN_SEED, generate
from vdtrain.targets import load_target
from vdtrain.targets.base import split_taps
from vdtrain.targets.llamagen import LlamaGenTarget, VQTokenizer
from vdtrain.train.module import DrafterModule, NonFiniteLossError

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
# Tiny runs: 2 samples a batch, 4 batches an epoch, no validation or after-epoch decoding unless a test
# asks for it.
SMALL = (
    "data.batch_size=2",
    "data.samples_per_epoch=8",
    "data.val_samples=0",
    "trainer.log_every_n_steps=1",
    "eval.enabled=false",
)


def fit_config(folder: Path, run_dir: Path, *overrides: str):
    """``conf/fit.yaml`` composed for the tiny target; ``run_dir`` must be given (no Hydra runtime here)."""
    with initialize_config_dir(str(CONF), version_base=None):
        return compose("fit", overrides=[f"target.folder={folder}", f"run_dir={run_dir}", *SMALL, *overrides])


def read_ckpt(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def sub_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def run_cli(args: list[str], cwd: Path, timeout: float = 90, env: dict | None = None):
    return subprocess.run(
        args, cwd=cwd, env=env or sub_env(), capture_output=True, text=True, timeout=timeout, check=False
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def image_key(image) -> str:
    return hashlib.sha1(np.ascontiguousarray(np.asarray(image)).tobytes()).hexdigest()


@pytest.fixture(scope="module")
def target(tiny_folder):
    return load_target({"kind": "folder", "folder": str(tiny_folder)})


def make_module(
    target, p_null: float = 0.1, features: str = "online", noise: float = 0.1, seed: int = 0, kind="eagle1"
):
    torch.manual_seed(0)
    drafter = Drafter.make(DrafterConfig.for_target(target, kind=kind))
    train = DrafterTrainConfig(kind=kind, feature_noise=noise, ttt_steps=3)
    return DrafterModule(
        target, drafter, train, OptimConfig(), features=features, p_null=p_null, seed=seed, max_steps=100
    )


def shapes_batch(n: int = 3, start: int = 0) -> dict:
    stream = ShapesStream(64, TRAIN_SEED)
    return collate([stream.sample(0, start + i) for i in range(n)])


# --- 1. the CLI ----------------------------------------------------------------------------------------
def test_fit_cli_writes_checkpoints_logs_summary_and_drafter(tiny_folder, tmp_path, target):
    run = tmp_path / "run"
    result = run_cli(
        [
            sys.executable,
            "-m",
            "vdtrain.fit",
            f"target.folder={tiny_folder}",
            *SMALL,
            "data.samples_per_epoch=4",  # 2 steps an epoch: validation runs twice during fit
            "data.val_samples=2",
            "trainer.max_steps=4",
            "trainer.progress_every_n_steps=2",
            f"hydra.run.dir={run}",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # No terminal here: plain progress lines instead of a bar (issue 26, item 4).
    out = result.stdout + result.stderr
    progress = re.findall(r"step (\d)/4 \| loss [0-9.e+-]+ \| top-1 [0-9.]+ \| [0-9.]+ samples/s", out)
    assert progress == ["2", "4"], out[-3000:]
    assert re.search(r"step 2/4 .*\| ETA \d+s", out) and "validation at step 2/4: val/" in out
    assert "Epoch" not in out and re.search(r"^wall time \d", result.stdout, re.M)
    assert "Loading weights" not in out  # start-up noise that is not the user's to act on
    assert "has `__len__` defined" not in out  # false for the project's stream (fit.STREAM_HANDLES)
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert (run / "checkpoints" / "best.ckpt").is_file()
    header = (run / "logs" / "metrics.csv").read_text().splitlines()[0].split(",")
    for column in ("train/total", "train/feature", "train/cls", "train/top1", "val/total", "val/tau_sim"):
        assert column in header
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["run_dir"] == str(run)
    assert 0.0 <= summary["val/top1"] <= 1.0 and 1.0 <= summary["val/tau_sim"] <= 6.0
    # the null stream, which every CFG step also drafts, measured beside the conditional one
    assert 0.0 <= summary["val/null_top1_depth1"] <= 1.0 and 1.0 <= summary["val/null_tau_sim"] <= 6.0
    assert "train/total" in summary  # the final validation does not drop the training metrics
    assert summary["drafter"] == str(run / "drafter")
    line = re.search(r"^trained 4 steps .*top-1 ([0-9.]+), tau_sim ([0-9.]+) -> (.+)$", result.stdout, re.M)
    assert line, result.stdout[-2000:]
    assert float(line[1]) == pytest.approx(summary["val/top1"], abs=1e-3)
    assert float(line[2]) == pytest.approx(summary["val/tau_sim"], abs=1e-2)
    assert line[3] == str(run / "drafter")
    # The export is the final drafter: it loads against the target and holds last.ckpt's weights.
    drafter = Drafter.from_pretrained(run / "drafter", target)
    ckpt = read_ckpt(run / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == 4
    for name, value in drafter.state_dict().items():
        torch.testing.assert_close(value, ckpt["state_dict"][f"drafter.{name}"], rtol=0, atol=0)
    assert Drafter.read_metadata(run / "drafter")["fit"]["steps"] == 4
    # Resuming the finished run says so and changes nothing: no training, no record, the summary kept.
    record = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    again = run_cli([sys.executable, "-m", "vdtrain.fit", "resume=last", f"hydra.run.dir={run}"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"the run '{run}' is finished (4 steps, trainer.max_steps=4" in again.stdout
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == record
    assert not (run / "resumes").exists()


def test_run_dir_must_be_given_outside_hydra_and_resolves_when_given(tiny_folder, tmp_path):
    cfg = fit_config(tiny_folder, tmp_path / "r")
    assert cfg.run_dir == str(tmp_path / "r")
    with initialize_config_dir(str(CONF), version_base=None):
        bare = compose("fit")
    with pytest.raises(Exception, match="run_dir"):  # ${hydra:runtime.output_dir} needs a Hydra run
        _ = bare.run_dir


# --- 2. null conditioning ------------------------------------------------------------------------------
def test_null_rows_rate_matches_p_null_and_is_reproducible(tiny_target):
    module = make_module(tiny_target, p_null=0.1)
    steps, batch = 1000, 20
    with mock.patch.object(DrafterModule, "global_step", new_callable=mock.PropertyMock) as step:
        draws = []
        for s in range(steps):
            step.return_value = s
            draws.append(module._null_rows(batch, module._generator(0)))
        step.return_value = 123
        again = module._null_rows(batch, module._generator(0))
        fresh = make_module(tiny_target, p_null=0.1)  # e.g. after a resume
        assert torch.equal(fresh._null_rows(batch, fresh._generator(0)), draws[123])
        other_micro = module._null_rows(batch, module._generator(1))
    rows = torch.stack(draws)
    n, p = rows.numel(), 0.1
    assert abs(rows.float().mean().item() - p) < 5 * math.sqrt(p * (1 - p) / n)  # binomial, 5 sigma
    assert torch.equal(again, draws[123])  # same (seed, step, micro-batch): same rows
    assert not torch.equal(other_micro, draws[123])
    per_position = rows.float().mean(0)  # a pattern repeated every step would give rates of 0 or 1
    assert (per_position - p).abs().max() < 5 * math.sqrt(p * (1 - p) / steps)
    other_seed = make_module(tiny_target, p_null=0.1, seed=1)
    assert not torch.equal(other_seed._null_rows(batch, other_seed._generator(0)), draws[0])
    assert not make_module(tiny_target, p_null=0.0)._null_rows(1000, torch.Generator()).any()
    assert make_module(tiny_target, p_null=1.0)._null_rows(1000, torch.Generator()).all()


def test_null_rows_get_null_conditioned_features(target):
    module = make_module(target)
    batch = shapes_batch(3)
    rows = torch.tensor([True, False, True])
    tokens, cond_mask, hidden = module.prepare(batch, rows)
    cond = target.encode_captions(batch["caption"])
    expected = target.forward_sequence(target.with_null(cond, rows), tokens).hidden
    torch.testing.assert_close(hidden, expected.float(), rtol=0, atol=0)
    torch.testing.assert_close(cond_mask, target.with_null(cond, rows).mask, rtol=0, atol=0)
    _, _, cond_only = module.prepare(batch, torch.zeros(3, dtype=torch.bool))
    assert torch.equal(hidden[~rows], cond_only[~rows])
    for i in torch.nonzero(rows).flatten().tolist():
        differs = (hidden[i] - cond_only[i]).abs().amax(-1) > 1e-4
        assert differs.float().mean() > 0.9, "a null row kept (most of) its caption's features"
        alone = target.forward_sequence(
            target.null_condition(cond).select(torch.tensor([i])), tokens[i : i + 1]
        )
        torch.testing.assert_close(hidden[i : i + 1], alone.hidden.float(), rtol=1e-5, atol=1e-5)


def test_null_conditioned_loss_regresses_null_features(target):
    """With p_null = 1, inputs AND regression targets are the null-conditioned features."""
    module = make_module(target, p_null=1.0, noise=0.0)
    batch = shapes_batch(2)
    loss, _ = module.loss(batch, torch.Generator().manual_seed(0))
    tokens, cond_mask, cond_hidden = module.prepare(batch, torch.zeros(2, dtype=torch.bool))
    null = target.null_condition(target.encode_captions(batch["caption"]))
    hidden = target.forward_sequence(null, tokens).hidden.float()
    mask = image_target_mask(null.mask, tokens.shape[1])
    with torch.no_grad():
        pred = module.drafter.forward_teacher(hidden, tokens, null.mask)
        expected, _ = drafter_loss(pred, hidden[:, 1:], module.drafter.logits, mask, 0.1)
        pred_c = module.drafter.forward_teacher(cond_hidden, tokens, cond_mask)
        cond_loss, _ = drafter_loss(pred_c, cond_hidden[:, 1:], module.drafter.logits, mask, 0.1)
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-6, atol=1e-7)
    assert not torch.isclose(loss.detach(), cond_loss, rtol=1e-3)


def test_eagle3_loss_unrolls_on_null_conditioned_taps(target):
    """An eagle3 drafter keeps null conditioning: with p_null = 1 its fused inputs and its targets come from
    the null-conditioned target, and its loss is the unrolled one."""
    module = make_module(target, p_null=1.0, noise=0.0, kind="eagle3")
    batch = shapes_batch(2)
    loss, parts = module.loss(batch, torch.Generator().manual_seed(0))
    drafter = module.drafter
    tokens = target.tokenizer.encode(images_to_tensor(batch["image"].numpy()))
    null = target.null_condition(target.encode_captions(batch["caption"]))
    with torch.no_grad():
        states = target.sequence_features(null, tokens, drafter.taps).float()
        hidden, tapped = split_taps(states, target.hidden_size, len(drafter.taps))
        steps = drafter.unroll(drafter.input_features(hidden, tapped), tokens, null.mask, 3)
        mask = image_target_mask(null.mask, tokens.shape[1])
        chains = [chain_rows(null.mask, mask.shape[1], j) for j in range(3)]
        expected, _ = unrolled_loss(steps, hidden[:, 1:], drafter.normed, drafter.head_logits, mask, chains)
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)
    assert {"top1_step0", "top1_step2", "cls"} <= set(parts)


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_the_acceptance_loss_option_trains_both_kinds(target, kind):
    """drafter.cls_loss=acceptance replaces the soft CE by 1 − Σ min(p, q), with a gradient; an unknown
    name is refused before training."""
    module = make_module(target, kind=kind)
    module.train_cfg = replace(module.train_cfg, cls_loss="acceptance")
    loss, parts = module.loss(shapes_batch(2), torch.Generator().manual_seed(0))
    loss.backward()
    bound = 1.0 if kind == "eagle1" else 1 + 0.8 + 0.8**2  # Σ_j 0.8^j (1 − α_j) over 3 steps
    assert 0 < parts["cls"] < bound and module.drafter.fc.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="cls_loss"):
        DrafterModule(target, module.drafter, DrafterTrainConfig(cls_loss="tv"), OptimConfig())


def test_the_learning_rate_schedule_ends_with_the_time_budget(target):
    """A run stopped by trainer.max_minutes decays to the floor as a run stopped by max_steps does: the
    cosine reads whichever share of the two budgets is larger, from the Timer checkpoints keep."""
    module = make_module(target)
    module.max_steps = 300
    factor = module.configure_optimizers()["lr_scheduler"]["scheduler"].lr_lambdas[0]
    timer = Timer(duration={"minutes": 1})
    module._trainer = SimpleNamespace(callbacks=[timer])
    warmup, floor = OptimConfig().warmup_steps, OptimConfig().min_lr_ratio  # 100, 0.1

    def cosine(progress: float) -> float:
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    assert factor(warmup + 100) == pytest.approx(cosine(0.5))  # no time budget: steps only
    module.max_minutes = 1.0
    timer._offset = 45.0  # seconds; a resumed run starts from the checkpoint's elapsed time
    assert module.budget_spent() == pytest.approx(0.75)
    assert factor(warmup + 100) == pytest.approx(cosine(0.75))
    assert factor(9) == pytest.approx(10 / warmup)  # warm-up follows steps only
    timer._offset = 90.0
    assert factor(warmup + 1) == pytest.approx(floor)
    timer._offset = 6.0
    assert factor(warmup + 160) == pytest.approx(cosine(0.8))  # steps ahead of the clock


def test_fit_trains_evaluates_and_exports_an_eagle3_drafter(tiny_folder, tmp_path):
    run = tmp_path / "run"
    result = run_cli(
        [
            sys.executable,
            "-m",
            "vdtrain.fit",
            f"target.folder={tiny_folder}",
            *(s for s in SMALL if not s.startswith("eval.")),
            "drafter.kind=eagle3",
            "drafter.ttt_steps=2",
            "trainer.max_steps=2",
            "eval.num_prompts=2",
            "eval.batch_size=2",
            f"hydra.run.dir={run}",
        ],
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((run / "drafter" / "config.json").read_text())
    # the final state on top
    assert (config["kind"], config["options"]["feature_layers"]) == ("eagle3", [1, 1, 2])
    summary = json.loads((run / "summary.json").read_text())
    assert {"eval/eagle2_T0/S", "eval/acceptance/tau_gap_T0", "eval/acceptance/tau_gap_T1"} <= set(summary)


# --- 3. offline features = online features -------------------------------------------------------------
def online_and_offline(target, kind: str = "eagle1", size: int = 2):
    """Two modules of ``kind`` with one drafter, online and offline; a batch, its null rows, what
    data_prep.features stores of it (the online features under those rows) beside its caption and tokens,
    and the online loss on it."""
    online = make_module(target, p_null=0.5, kind=kind)
    offline = make_module(target, p_null=0.5, features="offline", kind=kind)
    offline.drafter.load_state_dict(online.drafter.state_dict())
    batch = shapes_batch(size)
    tokens = target.tokenizer.encode(images_to_tensor(batch["image"].numpy()))
    rows = online._null_rows(size, torch.Generator().manual_seed(7))
    _, cond_mask, states = online.prepare(batch, rows)
    base = {"caption": batch["caption"], "tokens": tokens.to(torch.int32), "feats_mask": cond_mask}
    ref = online.loss(batch, torch.Generator().manual_seed(7))
    return online, offline, batch, rows, base, states, ref


def test_offline_eagle3_loss_equals_online_loss(target):
    """Stored eagle3 features (the last state and the tapped layers, data_prep.features feature_layers=…)
    give the online loss exactly; features without the taps are refused naming the fix."""
    online, offline, _, _, base, states, (ref, _) = online_and_offline(target, "eagle3")
    assert states.shape[-1] == (1 + len(online.drafter.taps)) * target.hidden_size
    exact, _ = offline.loss({**base, "feats": states.clone()}, torch.Generator().manual_seed(7))
    assert torch.equal(exact, ref)
    last_only = states[..., : target.hidden_size]
    with pytest.raises(ValueError, match="feature_layers="):
        offline.loss({**base, "feats": last_only}, torch.Generator().manual_seed(7))


def test_offline_block_loss_equals_online_loss(target, monkeypatch):
    """A block drafter trains from stored features as every kind does (issue #55): the target does not run,
    and the loss (its roots drawn from the same generator) is the online one."""
    _, offline, _, _, base, states, (ref, ref_parts) = online_and_offline(target, "block")
    monkeypatch.setattr(target, "sequence_features", None)  # the target must not run
    exact, parts = offline.loss({**base, "feats": states.clone()}, torch.Generator().manual_seed(7))
    assert torch.equal(exact, ref) and torch.equal(parts["top1_slot3"], ref_parts["top1_slot3"])


def test_offline_loss_equals_online_loss(target):
    online, offline, batch, rows, base, hidden, (ref, ref_parts) = online_and_offline(target, size=4)
    assert 0 < rows.sum() < 4
    exact, _ = offline.loss({**base, "feats": hidden.clone()}, torch.Generator().manual_seed(7))
    assert torch.equal(exact, ref)
    # fp16 storage rounds each feature by at most 2^-11 of its size; the loss is a smooth function of
    # the features averaged over ~10^4 positions x channels, so it moves by much less than 2^-11 relative
    # (the rounding errors have random signs). 2^-11 itself is the worst case of every error aligned.
    fp16 = 2.0**-11
    half, half_parts = offline.loss({**base, "feats": hidden.half()}, torch.Generator().manual_seed(7))
    for key in ("total", "feature", "cls"):
        torch.testing.assert_close(half_parts[key], ref_parts[key], rtol=fp16, atol=0)
    torch.testing.assert_close(half, ref, rtol=fp16, atol=0)
    # That tolerance still sees features from the wrong null rows, or shifted by one position.
    _, _, other_rows = online.prepare(batch, ~rows)
    for wrong_feats in (other_rows, torch.roll(hidden, 1, dims=1)):
        wrong, _ = offline.loss({**base, "feats": wrong_feats.half()}, torch.Generator().manual_seed(7))
        assert not torch.isclose(wrong, ref, rtol=2 * fp16, atol=0)


def test_offline_features_without_feats_is_a_clear_error(target):
    module = make_module(target, features="offline")
    with pytest.raises(KeyError, match="feats"):
        module.loss(shapes_batch(2), torch.Generator())


# --- 4. gradient accumulation --------------------------------------------------------------------------
class GradRecorder(L.Callback):
    """The accumulated gradients the optimizer is about to use (before clipping)."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads.append({n: p.grad.clone() for n, p in pl_module.drafter.named_parameters()})


def test_gradient_accumulation_matches_one_big_batch(tiny_folder, tmp_path):
    common = ("trainer.max_steps=1", "drafter.feature_noise=0", "data.p_null=0", "optim.warmup_steps=0")
    recorders = {"acc": GradRecorder(), "big": GradRecorder()}
    cfg = fit_config(tiny_folder, tmp_path / "acc", *common, "trainer.accumulate_grad_batches=2")
    fit(cfg, callbacks=[recorders["acc"]])
    fit(fit_config(tiny_folder, tmp_path / "big", *common, "data.batch_size=4"), callbacks=[recorders["big"]])
    (acc_grads,), (big_grads,) = recorders["acc"].grads, recorders["big"].grads
    for name, grad in big_grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(acc_grads[name], grad, rtol=1e-4, atol=1e-7, msg=name)
    acc = load_file(tmp_path / "acc" / "drafter" / "model.safetensors")
    big = load_file(tmp_path / "big" / "drafter" / "model.safetensors")
    # AdamW's first step moves a weight by lr · g / (|g| + eps): a gradient near eps (1e-8) turns a 1e-10
    # rounding difference (batches of 2 and of 4 cut the loss's rows into chunks apart) into 1e-6 of weight
    for name, value in big.items():
        torch.testing.assert_close(acc[name], value, rtol=1e-5, atol=1e-5, msg=name)
    for run in ("acc", "big"):
        assert read_ckpt(tmp_path / run / "checkpoints" / "last.ckpt")["global_step"] == 1


# --- 5. data parallel on CPU processes -----------------------------------------------------------------
def stream_keys(stream, start: int = 0) -> list[str]:
    """The samples of one ``iter()`` from position ``start``, batch after batch."""
    stream.start_at(start)
    return [image_key(image) for batch in stream for image in batch["image"]]


def test_shapes_stream_splits_ranks_and_resumes():
    world, per_epoch = 2, 12
    r0, r1 = (ShapesStream(per_epoch, TRAIN_SEED, rank, world, 2) for rank in range(2))
    assert len(r0) == len(r1) == 3  # batches an epoch
    e0 = [stream_keys(r) for r in (r0, r1)]  # one epoch each
    assert not set(e0[0]) & set(e0[1])
    single = [image_key(ShapesStream(per_epoch, TRAIN_SEED).sample(0, i)["image"]) for i in range(per_epoch)]
    assert e0[0] == single[0::2] and e0[1] == single[1::2]  # every sample of the epoch, once
    e1 = stream_keys(r0, 6)  # from position 6: epoch 1, fresh samples
    assert len(e1) == 6 and not set(e1) & set(e0[0] + e0[1])
    assert stream_keys(r0, 4) == e0[0][4:]  # resuming after 4 samples continues mid-epoch
    uneven = ShapesStream(13, TRAIN_SEED, 1, 3, 2)  # 13 samples, 3 ranks, batches of 2: 2 batches each
    assert len(uneven) == 2
    with pytest.raises(ValueError, match="less than one batch"):
        ShapesStream(3, TRAIN_SEED, 0, 2, 2)
    with pytest.raises(ValueError, match="whole batch"):
        r0.start_at(3)


def test_fit_cli_ddp_two_cpu_processes(tiny_folder, tmp_path):
    run = tmp_path / "run"
    result = run_cli(
        [
            sys.executable,
            "-m",
            "vdtrain.fit",
            "trainer=ddp_cpu",
            f"target.folder={tiny_folder}",
            *SMALL,
            "trainer.max_steps=3",
            "data.val_samples=2",
            f"hydra.run.dir={run}",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ckpt = read_ckpt(run / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == 3
    assert ckpt["DrafterDataModule"]["consumed"] == 3 * 2  # per rank: 3 batches of 2
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["samples_per_s"] > 0
    assert "GLOBAL_RANK: 1" in result.stdout + result.stderr + (run / "train_ddp_process_1.log").read_text()


DDP_RECORDER = """
import hashlib, json, sys
from pathlib import Path
import lightning as L
import numpy as np
from hydra import compose, initialize_config_dir
from vdtrain.fit import fit

class Recorder(L.Callback):
    def __init__(self, out):
        self.out = Path(out)

    def _write(self, trainer, kind, batch):
        keys = [hashlib.sha1(np.ascontiguousarray(i).tobytes()).hexdigest() for i in batch["image"].numpy()]
        with open(self.out / f"rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps({"kind": kind, "samples": keys}) + "\\n")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._write(trainer, "train", batch)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._write(trainer, "sanity" if trainer.sanity_checking else trainer.state.fn.value, batch)

conf, out, *overrides = sys.argv[1:]
with initialize_config_dir(conf, version_base=None):
    cfg = compose("fit", overrides=overrides)
fit(cfg, callbacks=[Recorder(out)])
"""


def test_ddp_ranks_train_on_their_own_samples_and_validate_each_sample_once(tiny_folder, tmp_path):
    script = tmp_path / "ddp_fit.py"
    script.write_text(textwrap.dedent(DDP_RECORDER))
    out = tmp_path / "seen"
    out.mkdir()
    overrides = [
        "trainer=ddp_cpu",
        f"target.folder={tiny_folder}",
        f"run_dir={tmp_path / 'run'}",
        *SMALL,
        "trainer.max_steps=3",
        "data.val_samples=4",
    ]
    result = run_cli([sys.executable, str(script), str(CONF), str(out), *overrides], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = {}
    for rank in range(2):
        lines = [json.loads(x) for x in (out / f"rank{rank}.jsonl").read_text().splitlines()]
        seen[rank] = {
            k: [s for x in lines if x["kind"] == k for s in x["samples"]] for k in ("train", "validate")
        }
    for rank in range(2):  # rank r trains on exactly its stream: samples r, r+2, ... of each epoch
        stream = ShapesStream(8, TRAIN_SEED, rank, 2, 2)
        expected = [image_key(stream.sample(e, k * 2 + rank)["image"]) for e in (0, 1) for k in range(4)][:6]
        assert seen[rank]["train"] == expected
    assert not set(seen[0]["train"]) & set(seen[1]["train"])
    # The final validation covers the held-out set exactly once over the two ranks.
    held_out = sorted(image_key(s.image) for s in generate(4, HELDOUT_SEED))
    assert sorted(seen[0]["validate"] + seen[1]["validate"]) == held_out


# --- 6. two nodes on loopback --------------------------------------------------------------------------
def test_launch_sh_two_nodes_on_loopback_share_one_run_folder(tiny_folder, tmp_path):
    run, port = tmp_path / "checkpoints" / "runs" / "shared", free_port()
    args = [
        str(REPO / "launch.sh"),
        "trainer=ddp_cpu",
        f"target.folder={tiny_folder}",
        *SMALL,
        "trainer.max_steps=3",
    ]
    env = {"NNODES": "2", "NPROC": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env["VDTRAIN_RUN_NAME"] = "shared"  # the same on every node; no hydra.run.dir given
    env["PYTHON"] = sys.executable
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # torchrun
    nodes = [
        subprocess.Popen(
            args,
            cwd=tmp_path,
            env={**sub_env(), **env, "NODE_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [node.communicate(timeout=90)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for rank, (node, output) in enumerate(zip(nodes, outputs, strict=True)):
        assert node.returncode == 0, f"node {rank}:\n{output[-3000:]}"
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in outputs[1]
    assert [p.name for p in run.parent.iterdir()] == ["shared"]  # no folder of a node's own
    ckpt = read_ckpt(run / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == 3
    assert json.loads((run / "summary.json").read_text())["steps"] == 3


LAUNCH_ENV = (
    "VDTRAIN_RUN_NAME",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
)


def hydra_run_dir(monkeypatch, **env: str) -> str:
    """``hydra.run.dir`` as a process started with ``env`` resolves it."""
    for name in (*LAUNCH_ENV, "TORCHELASTIC_RUN_ID", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with initialize_config_dir(str(CONF), version_base=None):
        return compose("fit", return_hydra_config=True).hydra.run.dir


def test_every_rank_of_a_launch_resolves_the_same_run_folder(monkeypatch):
    runs = "checkpoints/runs"
    slurm = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "WORLD_SIZE": "16"}
    assert hydra_run_dir(monkeypatch, **slurm, SLURM_PROCID="9") == f"{runs}/slurm-77.0"
    array = {"SLURM_ARRAY_JOB_ID": "70", "SLURM_ARRAY_TASK_ID": "3"}
    assert hydra_run_dir(monkeypatch, **slurm, **array) == f"{runs}/slurm-70_3.0"
    assert hydra_run_dir(monkeypatch, VDTRAIN_RUN_NAME="exp1", WORLD_SIZE="4") == f"{runs}/exp1"
    assert hydra_run_dir(monkeypatch, TORCHELASTIC_RUN_ID="j1", WORLD_SIZE="2") == f"{runs}/torchrun-j1"
    with pytest.raises(Exception, match="VDTRAIN_RUN_NAME"):  # torchrun without --rdzv-id or a name
        hydra_run_dir(monkeypatch, TORCHELASTIC_RUN_ID="none", WORLD_SIZE="2")
    with pytest.raises(Exception, match="plain folder name"):
        hydra_run_dir(monkeypatch, VDTRAIN_RUN_NAME="../elsewhere")
    assert re.fullmatch(rf"{runs}/\d{{4}}-\d\d-\d\d_\d\d-\d\d-\d\d", hydra_run_dir(monkeypatch))


def test_a_launch_named_by_the_time_is_one_folder(monkeypatch):
    """``generate`` and ``evaluate`` resolve ``${run_name:}`` twice (Hydra's folder, then ``out_dir``):
    a second apart, that made two folders per launch. The time is read once per process."""
    from datetime import datetime

    from vdtrain import config

    for name in (*LAUNCH_ENV, "TORCHELASTIC_RUN_ID", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    clock = iter([datetime(2026, 1, 1, 12, 0, 0), datetime(2026, 1, 1, 12, 0, 1)])

    class Clock(datetime):
        @classmethod
        def now(cls, tz=None):
            return next(clock)

    monkeypatch.setattr(config, "datetime", Clock)
    config.launch_time.cache_clear()
    try:
        assert config.run_name() == config.run_name() == "2026-01-01_12-00-00"
    finally:
        config.launch_time.cache_clear()


# --- 7. strategies -------------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_configs_build_their_zero_stage(tiny_folder, tmp_path, stage):
    from lightning.pytorch.strategies import DeepSpeedStrategy

    cfg = fit_config(
        tiny_folder, tmp_path, f"trainer=deepspeed_stage_{stage}", "trainer.accumulate_grad_batches=3"
    )
    strategy = build_strategy(cfg)
    assert isinstance(strategy, DeepSpeedStrategy)
    assert strategy.config["zero_optimization"]["stage"] == stage
    # The micro-batch is data.batch_size: Lightning would read it from the train loader's batch sampler,
    # which the positioned stream has not (an AttributeError at setup on a GPU). Accumulation is Lightning's.
    assert strategy.config["train_micro_batch_size_per_gpu"] == cfg.data.batch_size == 2
    trainer = SimpleNamespace(accumulate_grad_batches=3, gradient_clip_val=0.5, fit_loop=None)
    with mock.patch.object(DeepSpeedStrategy, "lightning_module", SimpleNamespace(trainer=trainer)):
        strategy._format_batch_size_and_grad_accum_config()  # what setup runs; fit_loop is never read
    assert strategy.config["gradient_accumulation_steps"] == 3
    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        build_strategy(
            fit_config(
                tiny_folder,
                tmp_path,
                f"trainer=deepspeed_stage_{stage}",
                "+trainer.deepspeed.gradient_accumulation_steps=2",
            )
        )
    # Extra entries (a struct config: new keys take Hydra's + or ++) are merged into the stage's config.
    for extra in (
        ("++trainer.deepspeed={zero_optimization: {overlap_comm: true}, wall_clock_breakdown: true}",),
        (
            "+trainer.deepspeed.zero_optimization.overlap_comm=true",
            "+trainer.deepspeed.wall_clock_breakdown=true",
        ),
    ):
        cfg = fit_config(tiny_folder, tmp_path, f"trainer=deepspeed_stage_{stage}", *extra)
        strategy = build_strategy(cfg)
        zero = strategy.config["zero_optimization"]
        assert zero["stage"] == stage and zero["overlap_comm"] is True  # merged, not replaced
        assert strategy.config["wall_clock_breakdown"] is True
        assert strategy.config["train_micro_batch_size_per_gpu"] == 2


@pytest.mark.parametrize(
    ("name", "expected"), [("cpu", "auto"), ("gpu", "auto"), ("ddp", "ddp"), ("multinode", "ddp")]
)
def test_trainer_configs_compose_and_build(tiny_folder, tmp_path, name, expected):
    cfg = fit_config(tiny_folder, tmp_path, f"trainer={name}")
    typed = OmegaConf.to_object(cfg)
    assert isinstance(typed, FitConfig)
    assert build_strategy(cfg) == expected
    if name == "multinode":
        assert typed.trainer.num_nodes == 2


def test_ddp_cpu_strategy_uses_gloo(tiny_folder, tmp_path):
    strategy = build_strategy(fit_config(tiny_folder, tmp_path, "trainer=ddp_cpu"))
    assert strategy.process_group_backend == "gloo"


# --- 8. resume -----------------------------------------------------------------------------------------
class StopAfter(L.Callback):
    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.steps:
            trainer.should_stop = True


@pytest.mark.parametrize(
    "kind", ["eagle1", "block"]
)  # block: its loss draws blocks from the step's generator
def test_resume_reproduces_the_uninterrupted_run(kind, tiny_folder, tmp_path):
    # 4 steps an epoch: the interruption (step 3) is mid-epoch, the resumed run crosses into epoch 1.
    run = (
        "trainer.max_steps=6",
        "trainer.checkpoint_every_n_steps=1",
        "data.p_null=0.5",
        f"drafter.kind={kind}",
    )
    fit(fit_config(tiny_folder, tmp_path / "whole", *run))
    fit(fit_config(tiny_folder, tmp_path / "split", *run), callbacks=[StopAfter(3)])
    stopped = read_ckpt(tmp_path / "split" / "checkpoints" / "last.ckpt")
    assert stopped["global_step"] == 3 and stopped["DrafterDataModule"]["consumed"] == 6
    fit(fit_config(tiny_folder, tmp_path / "split", *run, "resume=last"))
    whole = read_ckpt(tmp_path / "whole" / "checkpoints" / "last.ckpt")
    split = read_ckpt(tmp_path / "split" / "checkpoints" / "last.ckpt")
    assert whole["global_step"] == split["global_step"] == 6
    assert whole["epoch"] == split["epoch"] == 1
    assert whole["DrafterDataModule"] == split["DrafterDataModule"] == {"consumed": 12}
    best = {"eagle1": "'val/tau_sim'", "block": "'val/tau_block'"}[kind]  # the kind's estimate of S
    assert any(f"'monitor': {best}" in key for key in whole["callbacks"]), whole["callbacks"].keys()
    assert whole["state_dict"].keys() == split["state_dict"].keys()
    for name, value in whole["state_dict"].items():
        assert torch.equal(value, split["state_dict"][name]), name
    assert not torch.equal(
        whole["state_dict"]["drafter.fc.weight"], stopped["state_dict"]["drafter.fc.weight"]
    )
    (opt_w,), (opt_s,) = whole["optimizer_states"], split["optimizer_states"]
    assert opt_w["state"].keys() == opt_s["state"].keys() and opt_w["state"]
    for index, state in opt_w["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], opt_s["state"][index][key]), (index, key)
    assert opt_w["param_groups"][0]["lr"] == opt_s["param_groups"][0]["lr"]
    assert whole["lr_schedulers"] == split["lr_schedulers"]


# --- 9. bad input --------------------------------------------------------------------------------------
def test_misspelled_key_fails_at_compose_naming_it(tiny_folder, tmp_path):
    with pytest.raises(Exception, match="max_stepz"):
        fit_config(tiny_folder, tmp_path, "trainer.max_stepz=3")
    with pytest.raises(Exception, match="warmup"):
        fit_config(tiny_folder, tmp_path, "optim.warmup=3")


def test_misspelled_key_fails_at_cli_start(tiny_folder, tmp_path):
    result = run_cli(
        [sys.executable, "-m", "vdtrain.fit", f"target.folder={tiny_folder}", "trainer.max_stepz=3"],
        cwd=tmp_path,
        timeout=60,
    )
    assert result.returncode != 0 and "max_stepz" in result.stderr
    assert not (tmp_path / "checkpoints").exists()


def test_plus_added_typo_is_refused_naming_the_key_and_close_matches(tiny_folder, tmp_path):
    cfg = fit_config(tiny_folder, tmp_path / "run", "+trainer.max_stepz=3", "+optim.lrr=1")
    with pytest.raises(
        UnknownConfigKeyError, match=r"trainer\.max_stepz \(did you mean trainer\.max_steps"
    ) as error:
        fit(cfg)
    assert "optim.lrr (did you mean optim.lr?)" in str(error.value)
    assert not (tmp_path / "run").exists()
    # The free-form maps the docs add keys to with + keep taking them.
    ok = ("+drafter.layer.n_head=2", "+trainer.deepspeed.zero_optimization.overlap_comm=true")
    check_known_keys(fit_config(tiny_folder, tmp_path / "run", *ok))


def test_a_target_key_its_kind_does_not_declare_is_refused_naming_the_kind(tiny_folder, tmp_path):
    cfg = fit_config(tiny_folder, tmp_path / "run", "+target.foldr=elsewhere")
    with pytest.raises(UnknownConfigKeyError, match=r"kind 'folder': target\.foldr \(did you mean folder"):
        fit(cfg)
    assert not (tmp_path / "run").exists()


def test_drafter_of_another_target_is_refused(tiny_folder, tmp_path):
    wide = LlamaGenTarget(
        random_gpt(replace(TINY_GPT, dim=64)),
        VQTokenizer(random_vq(), image_size=8),
        None,
        "wide",
        SamplingConfig(),
    )
    Drafter.make(DrafterConfig.for_target(wide)).save_pretrained(tmp_path / "wide_drafter")
    cfg = fit_config(tiny_folder, tmp_path / "run", f"drafter.init_from={tmp_path / 'wide_drafter'}")
    with pytest.raises(ValueError, match="hidden_size"):
        fit(cfg)


def test_resume_last_without_checkpoint_names_the_path(tiny_folder, tmp_path):
    cfg = fit_config(tiny_folder, tmp_path / "run", "resume=last")
    with pytest.raises(
        FileNotFoundError, match=re.escape(str(tmp_path / "run" / "checkpoints" / "last.ckpt"))
    ):
        fit(cfg)


class PoisonAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.drafter.fc.weight.fill_(float("nan"))


def test_nan_loss_stops_training_and_keeps_the_last_checkpoint(tiny_folder, tmp_path, target):
    cfg = fit_config(
        tiny_folder, tmp_path / "run", "trainer.max_steps=6", "trainer.checkpoint_every_n_steps=1"
    )
    with pytest.raises(NonFiniteLossError, match="step 2"):
        fit(cfg, callbacks=[PoisonAt(2)])
    ckpt = read_ckpt(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == 2
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values())
    module = make_module(target)
    module.load_state_dict(ckpt["state_dict"])
    loss, _ = module.loss(shapes_batch(2), torch.Generator())
    assert torch.isfinite(loss)


def test_unknown_strategy_lists_the_choices(tiny_folder, tmp_path):
    cfg = fit_config(tiny_folder, tmp_path, "trainer.strategy=fsdp")
    with pytest.raises(ValueError, match=r"'fsdp'") as error:
        build_strategy(cfg)
    for choice in ("auto", "ddp", "ddp_cpu", "deepspeed_stage_2", "deepspeed_stage_3"):
        assert choice in str(error.value)


def test_offline_features_need_shards(tiny_folder, tmp_path):
    cfg = fit_config(tiny_folder, tmp_path / "run", "data.features=offline")
    with pytest.raises(ValueError, match="offline"):
        fit(cfg)


# --- 10. every config file composes with the typed schema ----------------------------------------------
@pytest.mark.parametrize(
    "group_option",
    [
        f"{group}={path.stem}"
        for group in ("data", "trainer", "logger")
        for path in sorted((CONF / group).glob("*.yaml"))
    ],
)
def test_config_files_compose_with_fit_yaml(tiny_folder, tmp_path, group_option):
    cfg = fit_config(tiny_folder, tmp_path, group_option)
    group, option = group_option.split("=")
    typed = OmegaConf.to_object(cfg)  # every value type-checked against FitConfig
    assert isinstance(typed, FitConfig)
    raw = OmegaConf.load(CONF / group / f"{option}.yaml")
    for key, value in raw.items():
        if f"{group}.{key}" not in {o.split("=")[0] for o in SMALL}:
            assert OmegaConf.to_container(cfg[group])[key] == value


def test_the_closing_line_says_what_was_learned_with_or_without_validation():
    from vdtrain.fit import _learned

    validated = {"val/total": 0.5, "val/top1": 0.75, "val/tau_sim": 3.0, "train/total": 9.0}
    assert _learned(validated) == "val loss 0.5000, top-1 0.750, tau_sim 3.00"
    unvalidated = {"train/total": 0.8, "train/top1": 0.7, "train/tau_sim_chain1": 2.9}
    assert "nan" not in _learned(unvalidated) and "no validation" in _learned(unvalidated)
