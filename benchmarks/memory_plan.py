"""The memory plan per GPU for each target family's released shape × drafter kind × strategy (the table in
docs/training.md, "Memory plan"), printed as markdown:

    python -m benchmarks.memory_plan                              # five families, eagle1 eagle3 medusa, B 1 8
    python -m benchmarks.memory_plan --targets emu3-8b --kinds eagle3 --batch 4 --gpus 16
    python -m benchmarks.memory_plan --agreement shapes grain --kinds eagle1 eagle3 --batch 4 16  # CPU check
    python -m benchmarks.memory_plan --agreement llamagen-xl anole-7b --layers 2 --device cuda --out plan.json

``--agreement`` checks the plan against a real step's peak (torch's profiler on a CPU, the caching
allocator's ``max_memory_allocated`` on a GPU, where the whole peak, weights included, is compared too);
``--layers`` cuts a random-weight target to that many decoder layers.

The targets are step_cost's random-weight shapes (``RANDOM_CHAMELEON``, ``RANDOM_JANUS``, ``RANDOM_TARGETS``),
built on the meta device: nothing is allocated, a CPU plans a 7B target in under a minute a row. The plan is
``vdtrain.train.memory_plan``'s: fit's step traced at ``--precision`` with the target in bf16 (the GPU trainer
configs' ``trainer.target_dtype``) and the fused AdamW a GPU gets, then DDP, ZeRO-2 and ZeRO-3 over
``--gpus`` GPUs; the after-epoch evaluation at eval.batch_size prompts (CFG: twice as many streams) and an
eagle2 tree of 59 nodes. The block kind is not planned: its loss indexes by the roots it draws, a shape the
fake tensors cannot follow (``PlanUnavailable``).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from benchmarks.step_cost import EMBEDDED, load
from benchmarks.train_throughput import loss_peak_bytes
from vdtrain.config import DrafterTrainConfig, EvalCallbackConfig, OptimConfig
from vdtrain.decode.builders.dynamic import DynamicTreeConfig
from vdtrain.drafters import Drafter, DrafterConfig
from vdtrain.targets.base import Target
from vdtrain.train.memory_plan import (
    GIB,
    STRATEGIES,
    Plan,
    planning_condition,
    strategy_plan,
    trace_eval,
    trace_step,
)
from vdtrain.train.module import DrafterModule

# (table name, step_cost's random target): the five families at their released image shapes.
FAMILIES = {
    "LlamaGen-XL (256 px)": "llamagen-xl",
    "Janus-Pro-7B (384 px)": "janus-pro-7b",
    "Anole-7B (512 px)": "anole-7b",
    "Lumina-mGPT-7B (768 px)": "lumina-mgpt-7b-768",
    "Emu3-Gen 8B (720 px)": "emu3-8b",
}
SHORT = {"ddp": "DDP", "deepspeed_stage_2": "ZeRO-2", "deepspeed_stage_3": "ZeRO-3"}


def build(name: str, kind: str, dtype: str = "bf16") -> tuple[Target, Drafter]:
    """The target (in ``dtype``) and a new ``kind`` drafter (fp32, as fit's optimiser holds it), on meta."""
    target, _ = load(name, torch.device("meta"), None, 0, dtype)
    with torch.device("meta"):
        drafter = Drafter.make(DrafterConfig.for_target(target, kind=kind))
    return target, drafter.attach(target)


def measured_step_peak(
    target: Target, drafter: Drafter, train: DrafterTrainConfig, batch: int, half: bool
) -> int:
    """fit's step on real models on the target's device, its peak beyond the weights by torch's profiler
    on a CPU or the caching allocator's peak on a GPU (``loss_peak_bytes``): the second step, so AdamW's
    moments exist as in a running job (fused on a GPU, as fit's plan assumes there), and the plan's
    condition in place of the captions (the plan does not run the text encoder)."""
    device = target.device
    module = DrafterModule(target, drafter.to(device).train(), train, OptimConfig())
    module.input_dtype = lambda: torch.bfloat16 if half else torch.float32  # what precision implies
    target.encode_captions = lambda captions: planning_condition(target, len(captions))
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda" or None)
    tokens = torch.randint(target.vocab_size, (batch, target.num_image_tokens), device=device)
    data = {"tokens": tokens, "caption": [""] * batch}

    def step() -> None:
        with torch.autocast(device.type, torch.bfloat16, enabled=half):
            loss, _ = module.loss(data, torch.Generator().manual_seed(0))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    return loss_peak_bytes(step, device)


def step_plan(
    target: Target, drafter: Drafter, train: DrafterTrainConfig, batch: int, precision: str, fused: bool
) -> Plan:
    """The plan of one process's step, from meta copies of ``target`` and ``drafter``."""
    meta_target = copy.deepcopy(target).to("meta")
    with torch.device("meta"):
        meta_drafter = Drafter.make(drafter.config, meta_target)
    step = trace_step(meta_target, meta_drafter, train, batch, precision, fused)
    return strategy_plan(step, None, "auto", 1, precision)


def planned_step_peak(
    target: Target,
    drafter: Drafter,
    train: DrafterTrainConfig,
    batch: int,
    precision: str,
    fused: bool = False,
) -> int:
    """The plan's step peak for one process beyond what a measured step finds allocated (the weights and
    AdamW's moments)."""
    return beyond_weights(step_plan(target, drafter, train, batch, precision, fused))


def beyond_weights(plan: Plan) -> int:
    """The plan's step peak less what a measured step finds allocated when it starts."""
    return (
        plan.peak_step
        - plan.parts["target weights"]
        - plan.parts["drafter weights"]
        - plan.parts["optimizer"]
    )


def agreement(
    world: str,
    kinds: list[str],
    batches: list[int],
    precisions: list[str],
    device: torch.device,
    layers: int | None = None,
) -> list[dict]:
    """The plan against the measured peak on ``world``'s target (an embedded world's or a random-weight
    family's), printed as table rows and returned. On a GPU the whole peak too: what was allocated when the
    step began (the weights, AdamW's moments) plus its peak beyond that, against the plan's."""
    cuda = device.type == "cuda"
    print(
        "| target | kind | B | precision | planned MiB | measured MiB | plan / measured | whole, plan / m. |"
    )
    print("|---|---|---|---|---|---|---|---|")
    out = []
    for kind in kinds:
        for precision in precisions:
            for batch in batches:
                half = precision.startswith("bf16")
                target, _ = load(world, device, None, 0, "bf16" if half else "fp32", layers)
                torch.manual_seed(0)
                drafter = Drafter.make(DrafterConfig.for_target(target, kind=kind)).attach(target)
                train = DrafterTrainConfig(kind=kind)
                plan = step_plan(target, drafter, train, batch, precision, cuda)
                planned = beyond_weights(plan)
                if cuda:
                    torch.cuda.empty_cache()
                measured = measured_step_peak(target, drafter, train, batch, half)
                row = {
                    "target": world, "layers": layers, "kind": kind, "batch": batch, "precision": precision,
                    "device": str(device), "planned": planned, "measured": measured,
                    "ratio": planned / measured,
                }  # fmt: skip
                if cuda:  # what the second step began with, beside its peak beyond that
                    whole = torch.cuda.memory_allocated(device) + measured
                    row |= {"planned_whole": plan.peak_step, "measured_whole": whole}
                    row["whole_ratio"] = plan.peak_step / whole
                out.append(row)
                whole_cell = f"{row['whole_ratio']:.3f}" if cuda else "-"
                print(
                    f"| {world} | {kind} | {batch} | {precision} | {planned / 2**20:.1f} | "
                    f"{measured / 2**20:.1f} | {planned / measured:.3f} | {whole_cell} |",
                    flush=True,
                )
                del target, drafter
    return out


def rows(args: argparse.Namespace) -> list[str]:
    out = []
    for family, name in FAMILIES.items():
        if args.targets and name not in args.targets:
            continue
        for kind in args.kinds:
            ev = trace_eval(*build(name, kind), args.eval_batch, args.tree_nodes)
            for batch in args.batch:
                start = time.perf_counter()
                step = trace_step(
                    *build(name, kind), DrafterTrainConfig(kind=kind), batch, args.precision, True
                )
                plans = [strategy_plan(step, ev, s, args.gpus, args.precision) for s in STRATEGIES]
                p = plans[0].parts
                state = [
                    q.parts["drafter weights"] + q.parts["gradients"] + q.parts["optimizer"] for q in plans
                ]
                cells = [p["target weights"], p["target pass"], p["drafter pass"], p["eval"]]
                cells += [v for q, s in zip(plans, state, strict=True) for v in (s, q.peak)]
                out.append(
                    f"| {family} | {kind} | {batch} | " + " | ".join(f"{v / GIB:.1f}" for v in cells) + " |"
                )
                print(out[-1], f"<!-- {time.perf_counter() - start:.0f} s -->", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--targets", nargs="+", default=None, choices=list(FAMILIES.values()))
    parser.add_argument("--kinds", nargs="+", default=["eagle1", "eagle3", "medusa"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8], help="data.batch_size per GPU")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--eval-batch", type=int, default=EvalCallbackConfig.batch_size)
    parser.add_argument("--tree-nodes", type=int, default=DynamicTreeConfig.total_tokens)
    parser.add_argument(
        "--agreement",
        nargs="+",
        default=None,
        choices=[*EMBEDDED, *FAMILIES.values()],
        help="instead: the plan against a measured step on these targets (embedded worlds, random families)",
    )
    parser.add_argument("--device", default="cpu", help="--agreement: where the measured step runs")
    parser.add_argument("--layers", type=int, default=None, help="--agreement: cut a random target's layers")
    parser.add_argument(
        "--precisions", nargs="+", default=None, help="--agreement: default bf16-mixed 32-true"
    )
    parser.add_argument("--out", type=Path, default=None, help="--agreement: the rows as JSON")
    args = parser.parse_args(argv)
    if args.agreement:
        rows_out = []
        for world in args.agreement:
            precisions = args.precisions or [args.precision, "32-true"]
            cut = args.layers if world in FAMILIES.values() else None
            rows_out += agreement(world, args.kinds, args.batch, precisions, torch.device(args.device), cut)
            if args.out:  # rewritten after each target: a time limit keeps what was measured
                args.out.write_text(json.dumps({"rows": rows_out}, indent=1) + "\n")
        return
    strategies = " | ".join(f"{SHORT[s]} state | {SHORT[s]} peak" for s in STRATEGIES)
    print(
        f"GiB per GPU, {args.gpus} GPUs, {args.precision}, target bf16; eval: {args.eval_batch} prompts, "
        f"{args.tree_nodes}-node tree; state: the drafter's weights, gradients and optimizer\n"
    )
    print(f"| target | kind | B | target weights | target pass | drafter pass | eval | {strategies} |")
    print("|---|---|---|---|---|---|---|" + "---|" * 2 * len(STRATEGIES), flush=True)
    rows(args)


if __name__ == "__main__":
    main()
