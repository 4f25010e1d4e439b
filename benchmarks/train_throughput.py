"""What one drafter-training step costs: samples/s, image tokens/s, the frozen target's share, and model
FLOP utilisation, for ``fit``'s own step (``DrafterModule``: online features with 10% null rows, feature
noise, the drafter's pass, its loss, backward and AdamW) on random-weight targets, for ``eagle1`` drafters
(one teacher-forced pass) and ``eagle3`` drafters (``--ttt-steps`` unrolled passes over fused layers).

    python -m benchmarks.train_throughput                              # CPU: a small LlamaGen-shaped target
    python -m benchmarks.train_throughput --device cuda --targets llamagen-b llamagen-xl \\
        --drafters eagle1 eagle3 --modes eager compiled zero2 --batch 8 --out train_throughput.json

Modes: ``eager``; ``compiled`` (the drafter's decoder layer under ``torch.compile``); ``zero2`` (DeepSpeed
ZeRO stage 2 in one process, as ``trainer=deepspeed_stage_2`` runs each rank; GPU only). ``--dtype bf16``
runs the target in bf16 and the drafter under bf16 autocast (``precision: bf16-mixed``). Captions are
random condition rows (a real run adds the text encoder's pass, not counted here). The first
``--warmup`` steps (compilation included) are left out.

Columns: step time; ``target``: the feature pass; ``drafter``: the rest (drafter forward, loss, backward,
optimizer); samples/s and image tokens/s; model TFLOP/s (``step_flops``: 2 per weight per row for the
target's pass, 6 for the drafter's trained weights per pass, 4 for its frozen head per scored row of each
pass, whose input gradient is needed, 2 for the head on the target's features, 4 for an eagle3 fusion,
plus attention at 4·d per visible query-key pair, three times for the drafter's backward; an eagle3 step
makes ``ttt_steps`` passes, each as costly as a teacher-forced one) and MFU against the device's dense
bf16 peak (known GPUs only: H100 / H200 989 TFLOP/s, A100 312). Goal on an H100 / H200 at XL shape: the
drafter ≤ 35% of the step, MFU ≥ 35%.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch

from benchmarks.step_cost import random_llamagen
from vdtrain.config import DrafterTrainConfig, OptimConfig
from vdtrain.drafters.base import Drafter, DrafterConfig
from vdtrain.drafters.rows import chain_rows
from vdtrain.eval.runner import device_description
from vdtrain.targets import cast_for_inference
from vdtrain.targets.base import Target
from vdtrain.train.losses import image_target_mask
from vdtrain.train.module import DrafterModule

# A LlamaGen-shaped target small enough for a CPU: GPT-B's vocabulary and caption rows, 4 layers of 256.
SMALL = {"n_layer": 4, "n_head": 4, "dim": 256}
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
MODES = ("eager", "compiled", "zero2")


@dataclass
class Row:
    target: str
    drafter: str
    mode: str
    dtype: str
    batch: int
    steps: int
    step_ms: float
    target_ms: float
    drafter_ms: float
    drafter_share: float
    samples_per_s: float
    tokens_per_s: float
    tflops: float
    mfu: float | None


class RandomCaptions:
    """A caption encoder of the target's shape that returns random rows: the benchmark times training, not
    the text encoder."""

    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        self.rows, self.width, self.device = rows, width, device

    def __call__(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        features = torch.randn(len(captions), self.rows, self.width, device=self.device)
        return features, torch.ones(len(captions), self.rows, dtype=torch.bool, device=self.device)


def build(
    name: str, device: torch.device, dtype: str, seed: int, kind: str = "eagle1"
) -> tuple[Target, Drafter]:
    """The random-weight target (its captions random rows, cast to ``dtype``) and a fresh ``kind`` drafter."""
    target, drafter = random_llamagen(name, device, seed, SMALL if name == "small" else None)
    gpt = target.gpt.config
    target.caption_encoder = RandomCaptions(target.prefix_length, gpt.caption_dim, device)
    if kind != drafter.config.kind:
        drafter = Drafter(DrafterConfig.for_target(target, kind=kind)).to(device).start_from(target)
    return cast_for_inference(target, dtype), drafter.attach(target).train()  # fp32 drafter (autocast)


def matmul_weights(module: torch.nn.Module) -> int:
    """The weights a row is multiplied by: 2-D parameters (norm scales and biases are not matmuls)."""
    return sum(p.numel() for p in module.parameters() if p.dim() == 2)


def causal_pairs(rows: int) -> int:
    """Query-key pairs of causal attention over ``rows``: row ``s`` sees ``s + 1`` keys. Every unrolled
    step sees as many (``UnrollCache``: ``s - j + 1`` teacher keys and ``j`` ancestors)."""
    return rows * (rows + 1) // 2


def scored_rows(target: Target, unrolled: int) -> list[int]:
    """Rows per sample whose logits each drafter pass scores: eagle1 (``unrolled`` 0) the ``N`` image rows;
    eagle3 step ``j`` those whose chain starts at or after the prefix (``unrolled_loss``)."""
    prefix, image = target.prefix_length, target.num_image_tokens
    rows = image_target_mask(prefix, image)
    if not unrolled:
        return [int(rows.sum())]
    return [int((rows & chain_rows(prefix, rows.shape[0], j)).sum()) for j in range(unrolled)]


def step_flops(target: Target, drafter: Drafter, batch: int, unrolled: int = 1) -> float:
    """Model FLOPs of one training step (see the module docstring): what the model computes, 2 per
    multiply-add. ``unrolled``: an eagle3 drafter's ``ttt_steps`` (ignored for eagle1, one pass)."""
    gpt = target.gpt
    prefix, seq = target.prefix_length, target.prefix_length + target.num_image_tokens
    rows = seq - 1  # drafter rows: slot s pairs f_s with the token at s + 1
    width = gpt.config.dim
    # Attention: QKᵀ and AV, 2·d each per visible query-key pair.
    target_flops = 2 * matmul_weights(gpt.layers) * seq + 2 * matmul_weights(gpt.cls_embedding) * prefix
    target_flops += len(gpt.layers) * 4 * width * causal_pairs(seq)
    head = target.vocab_size * width
    fused = drafter.fuse.weight.numel() if drafter.taps else 0
    trained = matmul_weights(drafter) - fused
    passes = scored_rows(target, unrolled if drafter.taps else 0)
    # Per pass: the trained layer forward and backward; the head forward and its input gradient.
    per_pass = 6 * trained * rows + 3 * 4 * width * causal_pairs(rows)
    drafter_flops = sum(per_pass + 4 * head * n for n in passes)
    drafter_flops += 4 * fused * seq  # fusion: forward and weight gradient (the tapped layers need none)
    drafter_flops += 2 * head * target.num_image_tokens  # the target's logits, once
    return float(batch * (target_flops + drafter_flops))


@contextlib.contextmanager
def timed(clock: list[float], device: torch.device) -> Iterator[None]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    clock.append(time.perf_counter() - start)


def measure(
    name: str,
    mode: str,
    dtype: str,
    batch: int,
    steps: int,
    warmup: int,
    device,
    seed: int,
    kind: str = "eagle1",
    ttt_steps: int = DrafterTrainConfig.ttt_steps,
) -> Row:
    target, drafter = build(name, device, dtype, seed, kind)
    train = DrafterTrainConfig(kind=kind, ttt_steps=ttt_steps)
    module = DrafterModule(target, drafter, train, OptimConfig(), max_steps=steps + warmup)
    module.to(device)
    module.on_fit_start()  # places the target, as fit does
    if mode == "compiled":
        module.drafter.layer.compile()
    params = [p for p in module.drafter.parameters() if p.requires_grad]
    if mode == "zero2":
        import deepspeed  # GPU only: ZeRO shards the optimizer state across ranks (here one)

        for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "RANK": "0"}.items():
            os.environ.setdefault(key, value)
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")

        config = {
            "train_micro_batch_size_per_gpu": batch,
            "zero_optimization": {"stage": 2},
            "bf16": {"enabled": dtype == "bf16"},
        }
        # torch's AdamW handed over, as Lightning's strategy hands fit's: DeepSpeed's own AdamW is a CUDA
        # op that a wheel built without ops would compile at first use.
        optimizer = torch.optim.AdamW(params, lr=OptimConfig().lr)
        engine, *_ = deepspeed.initialize(model=module.drafter, optimizer=optimizer, config=config)
        backward, step = engine.backward, engine.step
    else:
        optimizer = torch.optim.AdamW(params, lr=OptimConfig().lr)

        def backward(loss: torch.Tensor) -> None:
            loss.backward()

        def step() -> None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    prepare, feature_clock = module.prepare, []

    def timed_prepare(*args, **kwargs):
        with timed(feature_clock, device):
            return prepare(*args, **kwargs)

    module.prepare = timed_prepare
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(target.vocab_size, (batch, target.num_image_tokens), generator=generator)
    batch_data = {"tokens": tokens.to(device), "caption": [""] * batch}
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=dtype == "bf16")
    step_clock: list[float] = []
    for i in range(warmup + steps):
        with timed(step_clock, device):
            with autocast:
                loss, _ = module.loss(batch_data, torch.Generator().manual_seed(i))
            backward(loss)
            step()
    step_s = sum(step_clock[warmup:]) / steps
    target_s = sum(feature_clock[warmup:]) / steps
    unroll = module.drafter.kind.unroll  # None: teacher-forced, one pass
    unrolled = 1 if unroll is None else unroll(module.drafter.config, ttt_steps)
    flops = step_flops(target, module.drafter, batch, unrolled) / step_s
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device_description(device)), None)
    return Row(
        name,
        kind if unroll is None else f"{kind} k={unrolled}",
        mode,
        dtype,
        batch,
        steps,
        step_s * 1e3,
        target_s * 1e3,
        (step_s - target_s) * 1e3,
        (step_s - target_s) / step_s,
        batch / step_s,
        batch * target.num_image_tokens / step_s,
        flops / 1e12,
        flops / 1e12 / peak if peak and device.type == "cuda" else None,
    )


def table(rows: list[Row], device: torch.device) -> str:
    lines = [
        f"device: {device_description(device)}, torch {torch.__version__}",
        "| target | drafter | mode | dtype | batch | step ms | target ms | drafter ms | drafter share "
        "| samples/s | tokens/s | TFLOP/s | MFU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mfu = "–" if r.mfu is None else f"{r.mfu:.0%}"
        lines.append(
            f"| {r.target} | {r.drafter} | {r.mode} | {r.dtype} | {r.batch} | {r.step_ms:.1f} | "
            f"{r.target_ms:.1f} | {r.drafter_ms:.1f} | {r.drafter_share:.0%} | {r.samples_per_s:.1f} | "
            f"{r.tokens_per_s:.0f} | {r.tflops:.2f} | {mfu} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--targets", nargs="+", default=["small"], choices=["small", "llamagen-b", "llamagen-xl"]
    )
    parser.add_argument("--drafters", nargs="+", default=["eagle1"], choices=["eagle1", "eagle3"])
    parser.add_argument("--ttt-steps", type=int, default=DrafterTrainConfig.ttt_steps, help="eagle3's unroll")
    parser.add_argument("--modes", nargs="+", default=["eager"], choices=MODES)
    parser.add_argument("--dtype", nargs="+", default=None, choices=["fp32", "bf16"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the rows as JSON")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtypes = args.dtype or (["bf16"] if device.type == "cuda" else ["fp32"])  # CPUs run bf16 slowly
    rows = []
    for name in args.targets:
        for mode in args.modes:
            if mode == "zero2" and (device.type != "cuda" or importlib.util.find_spec("deepspeed") is None):
                print(f"{name} zero2: skipped (DeepSpeed ZeRO needs a GPU and the deepspeed package)")
                continue
            for dtype in dtypes:
                for kind in args.drafters:
                    row = measure(
                        name,
                        mode,
                        dtype,
                        args.batch,
                        args.steps,
                        args.warmup,
                        device,
                        args.seed,
                        kind,
                        args.ttt_steps,
                    )
                    rows.append(row)
                    print(
                        f"{name} {row.drafter} {mode} {dtype}: {row.step_ms:.1f} ms/step, "
                        f"drafter {row.drafter_share:.0%}",
                        flush=True,
                    )
    print(table(rows, device))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "device": device_description(device),
                    "torch": torch.__version__,
                    "rows": [asdict(r) for r in rows],
                },
                f,
                indent=1,
            )
    return rows


if __name__ == "__main__":
    main()
