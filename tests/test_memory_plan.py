"""The memory plan (vdtrain/train/memory_plan.py): its trace of fit's step, made on fake tensors, agrees with
torch's profiler on the same step of the same models run for real; fit's preflight refuses a run whose
plan exceeds the device's memory, and ``plan=true`` prints the plan without training; the strategies'
arithmetic shards what ZeRO shards."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import TINY_GPT, TINY_VQ, random_drafter, random_gpt, random_vq
from hydra import compose, initialize_config_dir

from benchmarks.memory_plan import measured_step_peak, planned_step_peak
from benchmarks.train_throughput import RandomCaptions
from vdtrain.cli import CONF_DIR, NothingToDo
from vdtrain.config import DrafterTrainConfig, register_configs
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.drafters import Drafter, DrafterConfig
from vdtrain.preflight import check_fit
from vdtrain.targets.llamagen import LlamaGenTarget, VQTokenizer
from vdtrain.train.memory_plan import PlanUnavailable, StepTrace, strategy_plan, trace_step

# The plan's step peak (beyond the weights and AdamW's moments, which a measured step finds allocated)
# is within this share of the peak torch's profiler measures on the CPU: docs/training.md, "Memory plan".
BOUND = 0.05
SMALL_GPT = replace(
    TINY_GPT, dim=64, n_layer=4, caption_dim=48, cls_token_num=16, block_size=64, vocab_size=512
)


def small_target() -> LlamaGenTarget:
    gpt = random_gpt(SMALL_GPT)
    target = LlamaGenTarget(
        gpt,
        VQTokenizer(random_vq(replace(TINY_VQ, codebook_size=512)), image_size=16),
        None,
        "small",
        SamplingConfig(),
    )
    target.caption_encoder = RandomCaptions(
        SMALL_GPT.cls_token_num, SMALL_GPT.caption_dim, torch.device("cpu")
    )
    return target


@pytest.mark.parametrize(("kind", "precision"), [("eagle1", "32-true"), ("eagle3", "bf16-mixed")])
def test_the_plan_agrees_with_the_measured_peak_of_a_step(kind, precision):
    torch.manual_seed(0)
    half = precision == "bf16-mixed"
    target = small_target()
    if half:
        target = target.use_dtype(torch.bfloat16)
    drafter = random_drafter(target, kind=kind)
    train, batch = DrafterTrainConfig(kind=kind, ttt_steps=3), 2
    planned = planned_step_peak(target, drafter, train, batch, precision)
    measured = measured_step_peak(target, drafter, train, batch, half)
    assert abs(planned - measured) <= BOUND * measured, (planned, measured)


def test_the_block_kind_is_planned_and_a_loss_with_data_dependent_shapes_is_refused_by_name(monkeypatch):
    """The block kind's loss keeps its shapes fixed (issue #55), so the plan traces it; a loss that takes a
    shape from its data (a boolean index) is refused in one line that names the kind."""
    meta = small_target().to("meta")
    with torch.device("meta"):
        drafter = Drafter.make(DrafterConfig.for_target(meta, kind="block"), meta)
    step = trace_step(meta, drafter, DrafterTrainConfig(kind="block"), 2)
    assert step.drafter_pass > 0
    own = type(drafter).training_loss

    def data_dependent(self, batch, train):
        total, parts = own(self, batch, train)
        return total + batch.hidden[batch.hidden > 0].sum() * 0, parts

    monkeypatch.setattr(type(drafter), "training_loss", data_dependent)
    with pytest.raises(PlanUnavailable, match=r"drafter\.kind=block: its loss takes shapes from its data"):
        trace_step(meta, drafter, DrafterTrainConfig(kind="block"), 2)


def test_zero_shards_what_it_shards():
    """P = 1M parameters over 8 GPUs: ZeRO-2 keeps 1/8 of the moments; ZeRO-3 also 1/8 of the bf16 weights
    (but gathers the one layer whole for its passes); the target is whole on every GPU."""
    P = 1_000_000
    step = StepTrace(P, 10**9, 4 * P, 10**7, 10**6, 10**7, 4 * P, 8 * P, 9 * P)
    ddp, zero2, zero3 = (
        strategy_plan(step, None, s, 8, "bf16-mixed")
        for s in ("ddp", "deepspeed_stage_2", "deepspeed_stage_3")
    )
    assert ddp.parts["optimizer"] == 8 * P and zero2.parts["optimizer"] == zero3.parts["optimizer"] == P
    assert ddp.parts["gradients"] == 8 * P  # fp32 gradients and DDP's bucket copy of them
    assert zero2.parts["drafter weights"] == 2 * P + P // 2  # bf16 weights, the fp32 master's shard
    assert zero3.parts["drafter weights"] == 2 * P // 8 + P // 2 + 2 * P  # shards and the gathered layer
    assert {p.parts["target weights"] for p in (ddp, zero2, zero3)} == {10**9}
    assert zero2.peak_step < ddp.peak_step


def fit_config(tmp_path, folder, *overrides: str):
    register_configs()
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return compose(
            "fit",
            [f"target.folder={folder}", f"hydra.run.dir={tmp_path / 'run'}", "data.batch_size=4", *overrides],
            return_hydra_config=True,
        )


def test_preflight_refuses_a_run_that_will_not_fit(tiny_folder, tmp_path):
    cfg = fit_config(tmp_path, tiny_folder, "trainer.device_memory_gib=0.001")
    with pytest.raises(
        ValueError, match=r"memory plan's peak .* over the 0\.0 GiB of trainer.device_memory_gib: lower"
    ):
        check_fit(cfg)
    check_fit(fit_config(tmp_path, tiny_folder, "trainer.device_memory_gib=80"))  # fits: no refusal
    assert not (tmp_path / "run").exists()


def test_plan_true_prints_the_plan_and_trains_nothing(tiny_folder, tmp_path):
    with pytest.raises(NothingToDo, match=r"memory plan per GPU[\s\S]*\| auto \| 1 \|"):
        check_fit(fit_config(tmp_path, tiny_folder, "plan=true"))
