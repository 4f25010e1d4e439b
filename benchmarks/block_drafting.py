"""Block drafting against EAGLE-1 and EAGLE-2, side by side (issue #48, item 5).

    python -m benchmarks.block_drafting                                # grain, 32 held-out captions, T = 1
    python -m benchmarks.block_drafting --prompts 8 --out /tmp/block   # quicker

Every method decodes the same held-out captions with the same seeds (prompt ``i`` with seed ``i``, as
``vdtrain.evaluate``), batch by batch with every method in turn (the shared machine's load falls on all
alike), with the world's own knobs (conf/target/<world>.yaml, as every app decodes): eagle1 and eagle2
with the world's shipped eagle1 drafter, block and block_tree with its shipped block drafter
(``drafter_block``). Per method: S (image tokens per target forward), τ, the drafter forwards per
verified step and the decode's wall time per image on this CPU (eager, ``--threads``).

Beside them, the GPU-time proxy of issue #46: kernel-launching ATen ops per step at LlamaGen-XL depth with
random weights (``benchmarks.step_kernels --phases``' setting: the count depends on neither the weights
nor the width), eager, B = 1, counted by ``vdtrain.decode.phase_ops``. The **draft phase** is everything
the tree's build runs, the drafter forwards in it included (not the commit's catch-up forward, which every
drafter method runs once a step), and **weighted** charges each vocabulary-wide selection its measured
GPU price in ordinary kernels (conf/benchmarks/kernel_weights.yaml). Writes ``results.{json,csv,md}``
under ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from benchmarks.step_cost import EMBEDDED, _generators, conditions, drafter_for, random_llamagen
from benchmarks.step_kernels import XL_DEPTH
from vdtrain.decode.methods import build_method, load_preset
from vdtrain.decode.metrics import summarize
from vdtrain.decode.phase_ops import KernelWeights, PhaseOps, count_phase_ops
from vdtrain.eval.runner import decode_prompts
from vdtrain.prompts import shapes_heldout_captions
from vdtrain.target_settings import load_drafter, target_config, world_knobs
from vdtrain.targets import load_target_folder

# Each method and the shipped drafter it decodes with (a folder under checkpoints/<world>/; AR: none).
METHODS = {
    "ar": None,
    "eagle1": "drafter",
    "eagle2": "drafter",
    "block": "drafter_block",
    "block_tree": "drafter_block",
}


@dataclass
class Row:
    method: str
    drafter: str
    S: float
    tau: float
    mean_depth: float
    drafter_forwards_per_step: float
    seconds_per_image: float
    draft_phase_ops: float  # the draft phase's ops per step at XL depth (its drafter forwards included)
    draft_phase_weighted: float  # the same, a vocabulary-wide selection at its GPU price
    beyond_layers_weighted: float  # the step beyond the target's decoder layers, weighted
    total_weighted: float  # the whole step, weighted


def xl_depth_ops(methods: list[str], knobs: dict[str, dict]) -> dict[str, PhaseOps]:
    """Per method: ops per step by region and by engine phase at XL depth (random weights, B = 1), with
    the world's ``knobs``; the block presets draft with a random block drafter (``drafter_for``)."""
    shape = {**XL_DEPTH, "block_size": 64}
    target, drafter = random_llamagen("llamagen-xl", torch.device("cpu"), 0, shape)
    cond = conditions(target, "llamagen-xl", 1, 1, 0)[0]
    out = {}
    for name in methods:
        config = load_preset(name, knobs.get(name))
        drafts = drafter_for(config, "llamagen-xl", target, drafter) if config.needs_drafter else None
        method = build_method(config, target, drafts, target.sampling_defaults)
        out[name] = count_phase_ops(method, cond, _generators(torch.device("cpu"), 0, 0, 1))
    return out


def measure(args: argparse.Namespace) -> list[Row]:
    knobs = world_knobs(target_config(args.world))
    weights = KernelWeights.load()
    ops = xl_depth_ops(args.methods, knobs)
    folder = Path(EMBEDDED[args.world])
    target = load_target_folder(folder / "target")
    sampling = replace(target.sampling_defaults, temperature=args.temperature)
    prompts = shapes_heldout_captions(args.prompts)
    sources = {METHODS[m] for m in args.methods} - {None}
    drafters = {None: None, **{source: load_drafter(folder / source, target) for source in sources}}
    methods = {
        m: build_method(load_preset(m, knobs.get(m)), target, drafters[METHODS[m]], sampling)
        for m in args.methods
    }
    stats: dict[str, list] = {m: [] for m in methods}
    seconds = dict.fromkeys(methods, 0.0)
    # Batch by batch, every method in turn: the shared machine's load falls on all of them alike.
    for start in range(0, len(prompts), args.batch):
        for name, method in methods.items():
            with torch.no_grad():
                decoded = decode_prompts(
                    method, target, prompts[start : start + args.batch], start, args.batch
                )
            stats[name] += decoded.stats
            seconds[name] += decoded.seconds
        print(f"{min(start + args.batch, len(prompts))}/{len(prompts)} prompts", flush=True)
    rows = []
    for name in methods:
        summary, o = summarize(stats[name], target.num_image_tokens), ops[name]
        weighted = o.weighted(weights)
        rows.append(
            Row(
                name,
                str(folder / METHODS[name]) if METHODS[name] else "",
                summary["S"],
                summary["tau"],
                summary["mean_depth"],
                summary["drafter_forwards"] / max(1.0, summary["verified_steps"]),
                seconds[name] / len(prompts),
                o.phases["draft"],
                o.weighted_phase("draft", weights),
                weighted - o.regions["layers"],
                weighted,
            )
        )
    return rows


COLUMNS = (
    ("method", "method", "{}"),
    ("S", "S", "{:.2f}"),
    ("tau", "τ", "{:.2f}"),
    ("drafter_forwards_per_step", "drafter fwd / step", "{:.2f}"),
    ("seconds_per_image", "CPU s / image", "{:.2f}"),
    ("draft_phase_ops", "draft phase ops", "{:.0f}"),
    ("draft_phase_weighted", "draft phase weighted", "{:.0f}"),
    ("beyond_layers_weighted", "weighted beyond layers", "{:.0f}"),
    ("total_weighted", "weighted step", "{:.0f}"),
)


def table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(c[1] for c in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(fmt.format(getattr(row, key)) for key, _, fmt in COLUMNS) + " |")
    return "\n".join(lines)


def write(out: Path, rows: list[Row], args: argparse.Namespace) -> None:
    out.mkdir(parents=True, exist_ok=True)
    flags = " ".join(
        f"--{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}"
        for k, v in vars(args).items()
        if v is not None and k != "out"
    )
    settings = {
        "command": f"python -m benchmarks.block_drafting {flags}",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "kernel_weights": KernelWeights.load().source,
    }
    (out / "results.json").write_text(
        json.dumps({"settings": settings, "rows": [asdict(r) for r in rows]}, indent=2) + "\n"
    )
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    (out / "results.md").write_text(f"`{settings['command']}` ({settings['date']})\n\n{table(rows)}\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", default="grain", choices=list(EMBEDDED))
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="a folder for results.{json,csv,md}")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = measure(args)
    print(table(rows), flush=True)
    if args.out:
        write(Path(args.out), rows, args)


if __name__ == "__main__":
    main()
