"""One training step of ``fit`` as a GPU trainer config runs it (issue #54): the target, loaded from its
official files, cast to bf16 as fit casts it (``trainer.target_dtype: bf16``), online features, a new
drafter of the kind, ``DrafterModule``'s step under Lightning's ``bf16-mixed`` on the CPU. Each target
family's test module calls it on the target of its own tiny checkpoint (at most 4 decoder layers), so no
family's files are written twice."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader

from vdtrain.config import DrafterTrainConfig, OptimConfig
from vdtrain.drafters import Drafter, DrafterConfig
from vdtrain.targets.base import Target
from vdtrain.targets.registry import cast_for_inference
from vdtrain.train.module import DrafterModule


class SeesTheStates(L.Callback):
    """The dtype of the drafter's inputs in the step (``prepare``'s, which the step computes again)."""

    def __init__(self) -> None:
        self.states: torch.dtype | None = None

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.states = module.prepare(batch, torch.zeros(len(batch["caption"]), dtype=torch.bool))[2].dtype


def bf16_fit_step(loaded: Target, captions: list[str], kind: str = "eagle1") -> None:
    """Cast the ``loaded`` target to bf16 as fit does, train a new ``kind`` drafter one step on ``captions``
    with random image tokens, and check what a GPU run relies on: bf16 target weights, bf16 drafter inputs,
    a finite loss (else ``NonFiniteLossError``), a drafter that moved and stays finite."""
    target = cast_for_inference(loaded, "bf16")
    assert target.num_layers <= 4, "a tiny checkpoint: at most 4 decoder layers"
    assert {p.dtype for p in target.transformer.parameters()} == {torch.bfloat16}
    torch.manual_seed(0)
    drafter = Drafter.make(DrafterConfig.for_target(target, kind)).start_from(target)
    module = DrafterModule(target, drafter, DrafterTrainConfig(kind=kind), OptimConfig(warmup_steps=0))
    before = {name: value.clone() for name, value in drafter.state_dict().items()}
    tokens = torch.randint(target.vocab_size, (len(captions), target.num_image_tokens))
    seen = SeesTheStates()
    trainer = L.Trainer(
        accelerator="cpu", precision="bf16-mixed", max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[seen],
    )  # fmt: skip
    trainer.fit(module, DataLoader([{"tokens": tokens, "caption": captions}], batch_size=None))
    assert torch.isfinite(trainer.callback_metrics["train/total"])
    assert seen.states == torch.bfloat16
    assert {p.dtype for p in target.transformer.parameters()} == {torch.bfloat16}  # the step kept it
    after = drafter.state_dict()
    assert all(torch.isfinite(value).all() for value in after.values())
    assert any(not torch.equal(before[name], value) for name, value in after.items()), "no step was taken"
