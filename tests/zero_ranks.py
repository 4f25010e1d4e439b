"""Two ranks on the CPU train a tiny drafter under DeepSpeed ZeRO-2 and ZeRO-3 and write the checkpoint
folders as fit does under ``trainer=deepspeed_stage_{2,3}``; the same drafter trained without DeepSpeed
beside them.

``python tests/zero_ranks.py <folder> <port>`` writes ``<folder>/zero2/``, ``<folder>/zero3/``
(DeepSpeed's own ``save_checkpoint`` with Lightning's tag and client state: the drafter config, the step) and
``<folder>/plain.pt`` (the drafter's state dict after the same steps on the same samples, one process,
torch's AdamW). Lightning's DeepSpeed strategy refuses a CPU, so the ranks drive DeepSpeed's engine as the
strategy does: ``DrafterModule``'s loss, the optimizer and scheduler of its ``configure_optimizers``, fp32.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from conftest import TINY_GPT, random_gpt, random_vq

import vdtrain.eval.callback
from vdtrain.config import DrafterTrainConfig, EvalCallbackConfig, OptimConfig
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.drafters import Drafter, DrafterConfig
from vdtrain.drafters.base import CHECKPOINT_CONFIG_KEY
from vdtrain.targets.base import Condition
from vdtrain.targets.llamagen import LlamaGenTarget, VQTokenizer
from vdtrain.train.module import DrafterModule

STEPS, WORLD, PER_RANK = 2, 2, 2
OPTIM = OptimConfig(lr=3e-2, warmup_steps=0, grad_clip=0.0)  # large steps: the weights move visibly


def module() -> DrafterModule:
    tokenizer = VQTokenizer(random_vq(), image_size=8)
    target = LlamaGenTarget(random_gpt(), tokenizer, None, "tiny", SamplingConfig())
    torch.manual_seed(0)
    drafter = Drafter.make(DrafterConfig.for_target(target, kind="eagle1")).start_from(target)
    return DrafterModule(target, drafter, DrafterTrainConfig(), OPTIM, max_steps=STEPS)


def samples(module: DrafterModule, step: int, rank: int, count: int) -> tuple[torch.Tensor, ...]:
    """Rank ``rank``'s ``count`` samples of ``step`` (the plain run takes all ranks' at once): full captions,
    so every sample weighs the same in the loss and the ranks' mean gradient is the whole batch's."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    cond = Condition(
        torch.randn(count, TINY_GPT.cls_token_num, TINY_GPT.caption_dim, generator=g),
        torch.ones(count, TINY_GPT.cls_token_num, dtype=torch.bool),
    )
    tokens = torch.randint(0, module.target.vocab_size, (count, module.target.num_image_tokens), generator=g)
    with torch.no_grad():
        states = module.target.sequence_features(cond, tokens, ())
    return tokens, cond.mask, states


def loss(module: DrafterModule, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return module.loss_on(*batch, None, 0.0)[0]


def plain(out: Path) -> None:
    m = module()
    optimizers = m.configure_optimizers()
    optimizer, scheduler = optimizers["optimizer"], optimizers["lr_scheduler"]["scheduler"]
    for step in range(STEPS):
        parts = [samples(m, step, rank, PER_RANK) for rank in range(WORLD)]
        loss(m, tuple(torch.cat(p) for p in zip(*parts, strict=True))).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    torch.save(m.drafter.state_dict(), out / "plain.pt")


def evaluated_drafter(m: DrafterModule, out: Path, rank: int) -> None:
    """The drafter ``EvalAfterEpoch`` decodes with on this rank, saved: its evaluation is recorded, not run
    (a decode of the tiny target says nothing more about which weights it was handed)."""
    seen: list[dict[str, torch.Tensor]] = []

    def record(target, drafter, *args, **kwargs) -> str:
        seen.append({name: value.clone() for name, value in drafter.state_dict().items()})
        return "decoded"

    vdtrain.eval.callback.evaluate = record
    vdtrain.eval.callback.EvalAfterEpoch(EvalCallbackConfig(), out, ["a prompt"])._evaluate(m, report=False)
    torch.save(seen[0], out / f"zero3_eval_rank{rank}.pt")


def rank_main(rank: int, out: Path, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
    )  # fmt: skip
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    for stage in (2, 3):
        m = module()
        optimizers = m.configure_optimizers()
        # ZeRO-3 keeps parameters under 1e5 values whole on every rank by default: all of this drafter's,
        # where a 7B target's drafter has none; 0 partitions every one, as they are at that size.
        zero = {"stage": stage} | ({"stage3_param_persistence_threshold": 0} if stage == 3 else {})
        config = {"train_micro_batch_size_per_gpu": PER_RANK, "zero_optimization": zero}
        engine, *_ = deepspeed.initialize(
            model=m,
            optimizer=optimizers["optimizer"],
            lr_scheduler=optimizers["lr_scheduler"]["scheduler"],
            config=config,
        )
        for step in range(STEPS):
            engine.backward(loss(m, samples(m, step, rank, PER_RANK)))
            engine.step()
        if stage == 3:
            evaluated_drafter(m, out, rank)
        # Lightning's DeepSpeedStrategy.save_checkpoint: its tag, and the checkpoint dict as client state
        client = {CHECKPOINT_CONFIG_KEY: m.drafter.config.to_dict(), "global_step": STEPS, "epoch": 0}
        engine.save_checkpoint(str(out / f"zero{stage}"), client_state=client, tag="checkpoint")
        engine.destroy()


if __name__ == "__main__":
    folder, port = Path(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)  # no thread pool to fork
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed.comm.torch

    # DeepSpeed compiles a shared-memory all-reduce for CPU inference on first use (minutes): training's
    # collectives go through gloo without it.
    deepspeed.comm.torch.build_shm_op = lambda: None
    plain(folder)
    # forked: the ranks inherit the imports (torch, vdtrain, DeepSpeed) instead of repeating them
    torch.multiprocessing.start_processes(rank_main, args=(folder, port), nprocs=WORLD, start_method="fork")
