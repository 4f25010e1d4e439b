"""The block drafter's architecture search at equal training compute on the grain world (issue #55, item 2).

    python -m benchmarks.block_search --out docs/grain_world/block_search          # every variant
    python -m benchmarks.block_search --variants base w128 --jobs 2 --out /tmp/bs  # some, two at a time

The variants, the shared fit overrides and the budget are conf/benchmarks/block_search.yaml. Each variant's
training compute is the budget's FLOPs: ``budget_steps`` steps of ``base``, where a step's FLOPs are what
torch's ``FlopCounterMode`` counts over one of fit's training steps (``DrafterModule.loss`` and its backward:
the target's feature pass, the drafter's passes, the frozen head on every scored row) at the search's batch;
a variant trains ``budget ÷ its step's FLOPs`` steps with ``python -m vdtrain.fit`` (``--jobs`` at a time,
``trainer.threads`` = cores ÷ jobs). Then, per variant: the held-out top-1 per block slot from its fit's
last validation (``val/top1_slot{j}``: fit's validation images, never the captions below), S of block and
block_tree on ``--prompts`` **validation** captions at T = 1 (``benchmarks.block_drafting``'s side-by-side
decode; the held-out captions are kept for the final report), and the draft phase's weighted ops at XL depth.
Writes ``results.{json,csv,md}`` under ``--out``; the fits' run folders and logs go under ``--runs``, and a
variant whose run folder already holds a finished fit (``summary.json``) is not trained again, nor scored
again where its scores are there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.block_drafting import decode_side_by_side, write_results, xl_depth_ops
from vdtrain.config import DrafterTrainConfig, OptimConfig
from vdtrain.decode.methods import build_method, load_preset
from vdtrain.decode.metrics import summarize
from vdtrain.decode.phase_ops import KernelWeights
from vdtrain.drafters import Drafter, DrafterConfig
from vdtrain.paths import CONF_DIR
from vdtrain.prompts import shapes_training_captions, shapes_validation_captions
from vdtrain.target_settings import load_drafter, target_config, world_knobs
from vdtrain.targets import Target, load_target_folder
from vdtrain.train.module import DrafterModule

SEARCH = CONF_DIR / "benchmarks" / "block_search.yaml"
METHODS = ("block", "block_tree")


@dataclass
class Row:
    variant: str
    why: str
    options: str
    step_gflops: float  # one training step at the search's batch
    steps: int  # the budget ÷ the step
    minutes: float  # the fit's wall time (its share of this CPU)
    val_top1_slots: list[float]  # fit's last validation: slot 1 (the root's row), then the query rows
    val_tau_block: float  # the chain estimate from those
    S_block: float  # validation captions, T = 1
    S_block_tree: float
    draft_phase_weighted: float  # block's draft phase at XL depth, weighted ops


def step_flops(target: Target, options: dict, train: DrafterTrainConfig, batch: int) -> float:
    """FLOPs of one of fit's training steps (loss and backward) for a block drafter of ``options``."""
    torch.manual_seed(0)
    drafter = Drafter.make(DrafterConfig.for_target(target, kind="block", **options)).start_from(target)
    module = DrafterModule(target, drafter.attach(target).train(), train, OptimConfig(), max_steps=1)
    module.on_fit_start()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(target.vocab_size, (batch, target.num_image_tokens), generator=generator)
    data = {"tokens": tokens, "caption": shapes_training_captions(batch)}
    with FlopCounterMode(display=False) as counter:
        loss, _ = module.loss(data, generator)
        loss.backward()
    return float(counter.get_total_flops())


def fit_command(overrides: list[str], variant: dict, steps: int, run_dir: Path, threads: int) -> list[str]:
    """``python -m vdtrain.fit`` for one variant: the shared overrides, then its options and its own."""
    options = [f"+drafter.options.{k}={json.dumps(v)}" for k, v in variant["options"].items()]
    return [
        sys.executable, "-m", "vdtrain.fit", *overrides, *options, *variant.get("train", []),
        f"trainer.max_steps={steps}", f"trainer.threads={threads}", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip


def run_fits(commands: dict[str, list[str]], logs: Path, jobs: int) -> None:
    """The fits, ``jobs`` at a time; a failed one stops the search with its log named."""
    pending, running = list(commands.items()), {}
    logs.mkdir(parents=True, exist_ok=True)
    while pending or running:
        while pending and len(running) < jobs:
            name, command = pending.pop(0)
            print(f"training {name}: {' '.join(command[2:])}", flush=True)
            log = open(logs / f"{name}.log", "w")  # noqa: SIM115 - closed when the process ends
            running[name] = (subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), log)
        time.sleep(5)
        for name, (process, log) in list(running.items()):
            if process.poll() is not None:
                log.close()
                del running[name]
                if process.returncode:
                    raise RuntimeError(f"fit of {name} failed (exit {process.returncode}): {logs / name}.log")
                print(f"{name} trained", flush=True)


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variants", nargs="+", default=None, help="default: every variant in the config")
    parser.add_argument("--budget-steps", type=int, default=None, help="override the config's budget_steps")
    parser.add_argument("--prompts", type=int, default=16, help="validation captions decoded per variant")
    parser.add_argument("--jobs", type=int, default=2, help="fits at a time")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for the FLOP count and decodes")
    parser.add_argument("--out", required=True, help="a folder for results.{json,csv,md}")
    parser.add_argument("--runs", default="checkpoints/block_search", help="the fits' run folders and logs")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    search = OmegaConf.to_container(OmegaConf.load(SEARCH))
    variants = {n: search["variants"][n] for n in (args.variants or search["variants"])}
    out, runs = Path(args.out), Path(args.runs)
    budget_steps = args.budget_steps or search["budget_steps"]
    target = load_target_folder(Path("checkpoints/grain/target"))
    train = DrafterTrainConfig(kind="block")  # the loss's choice and weights change no FLOP count
    flops = {n: step_flops(target, v["options"], train, search["batch"]) for n, v in variants.items()}
    base = flops.get("base") or step_flops(
        target, search["variants"]["base"]["options"], train, search["batch"]
    )
    steps = {n: max(1, round(budget_steps * base / f)) for n, f in flops.items()}
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    todo = {
        n: fit_command(search["train"], v, steps[n], runs / n, threads)
        for n, v in variants.items()
        if not (runs / n / "summary.json").exists()
    }
    run_fits(todo, runs / "logs", args.jobs)

    knobs, weights = world_knobs(target_config("grain")), KernelWeights.load()
    prompts = shapes_validation_captions(args.prompts)
    sampling = replace(target.sampling_defaults, temperature=1.0)
    rows = []
    for name, variant in variants.items():
        summary = json.loads((runs / name / "summary.json").read_text())
        drafter = load_drafter(runs / name / "drafter", target)
        scored = runs / name / f"search_scores_{args.prompts}.json"  # kept: a re-run scores only new fits
        if not scored.exists():
            methods = {
                m: build_method(load_preset(m, knobs.get(m)), target, drafter, sampling) for m in METHODS
            }
            stats, _ = decode_side_by_side(methods, target, prompts, 8)
            s = {m: summarize(stats[m], target.num_image_tokens)["S"] for m in METHODS}
            ops = xl_depth_ops(["block"], knobs, asdict(drafter.options))["block"]
            scored.write_text(json.dumps({**s, "draft": ops.weighted_phase("draft", weights)}))
        s = json.loads(scored.read_text())
        slots = [summary["val/top1"]] + [summary[f"val/top1_slot{j}"] for j in range(1, drafter.block_slots)]
        rows.append(
            Row(
                name,
                variant["why"],
                json.dumps({**variant["options"], **dict(o.split("=", 1) for o in variant.get("train", []))}),
                flops[name] / 1e9,
                steps[name],
                summary["minutes"],
                slots,
                summary["val/tau_block"],
                s["block"],
                s["block_tree"],
                s["draft"],
            )
        )
    write(out, rows, args, budget_steps, base)
    print(table(rows), flush=True)
    return rows


def table(rows: list[Row]) -> str:
    lines = [
        "| variant | options | GFLOP / step | steps | fit min | val top-1 per slot | τ_block | S block | "
        "S block_tree | draft weighted |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        slots = " ".join(f"{t:.2f}" for t in r.val_top1_slots)
        lines.append(
            f"| {r.variant} | `{r.options}` | {r.step_gflops:.1f} | {r.steps} | {r.minutes:.1f} | {slots} | "
            f"{r.val_tau_block:.2f} | {r.S_block:.2f} | {r.S_block_tree:.2f} | {r.draft_phase_weighted:.0f} |"
        )
    return "\n".join(lines)


def write(out: Path, rows: list[Row], args: argparse.Namespace, budget_steps: int, base: float) -> None:
    settings = {
        "command": "python -m benchmarks.block_search " + " ".join(sys.argv[1:]),
        "budget": f"{budget_steps} steps of base = {budget_steps * base / 1e12:.2f} TFLOP",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "config": OmegaConf.to_container(OmegaConf.load(SEARCH)),
    }
    markdown = f"`{settings['command']}` ({settings['date']}; {settings['budget']})\n\n{table(rows)}\n"
    write_results(out, settings, rows, markdown)


if __name__ == "__main__":
    main()
