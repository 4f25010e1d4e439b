"""Block drafting against EAGLE-1, -2 and -3, side by side (issues #48, item 5, and #55, item 4).

    python -m benchmarks.block_drafting                  # grain, 64 held-out captions, T = 1 and 0
    python -m benchmarks.block_drafting --prompts 8 --out /tmp/block      # quicker
    python -m benchmarks.block_drafting --captions validation --methods ar block block_tree \
        --block-drafter <a fit run's drafter/>    # a candidate, on validation captions

Every method decodes the same captions (the held-out ones, or ``--captions validation`` for choosing) with
the same seeds (prompt ``i`` with seed ``i``, as ``vdtrain.evaluate``), batch by batch with every method in
turn (the shared machine's load falls on all alike), with the world's own knobs (conf/target/<world>.yaml,
as every app decodes): eagle1 and eagle2 with the world's shipped eagle1 drafter, eagle3 with its eagle3
drafter, block and block_tree with its shipped block drafter (``drafter_block``, or ``--block-drafter``).
Per method and temperature: S (image tokens per target forward), τ, the drafter forwards per verified step
and the decode's wall time per image on this CPU (eager, ``--threads``).

Beside them, the GPU-time proxy of issue #46: kernel-launching ATen ops per step at LlamaGen-XL depth with
random weights (``benchmarks.step_kernels --phases``' setting: the count depends on neither the weights
nor the width), eager, B = 1, counted by ``vdtrain.decode.phase_ops``; the block presets with a random
block drafter of the evaluated one's options (its layers count). The **draft phase** is everything the
tree's build runs, the drafter forwards in it included (not the commit's catch-up forward, which every
drafter method runs once a step), and **weighted** charges each vocabulary-wide selection its measured
GPU price in ordinary kernels (conf/benchmarks/kernel_weights.yaml). The **projected XL speed-up** is
issue #46's model: S × AR's weighted step ÷ the method's. Writes ``results.{json,csv,md}`` under ``--out``.
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
from vdtrain.drafters import Drafter, DrafterConfig
from vdtrain.eval.runner import decode_prompts
from vdtrain.prompts import shapes_heldout_captions, shapes_validation_captions
from vdtrain.target_settings import load_drafter, target_config, world_knobs
from vdtrain.targets import Target, load_target_folder

# Each method and the shipped drafter it decodes with (a folder under checkpoints/<world>/; AR: none).
METHODS = {
    "ar": None,
    "eagle1": "drafter",
    "eagle2": "drafter",
    "eagle3": "drafter_eagle3",
    "block": "drafter_block",
    "block_tree": "drafter_block",
    "block_tree_iid": "drafter_block",
}
PRESETS = {"eagle3": "eagle2"}  # a method that is a preset decoded with another kind of drafter: its preset


@dataclass
class Row:
    method: str
    temperature: float
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
    projected_xl_speedup: float  # S × AR's weighted step ÷ this one's (issue #46's model)


def method_preset(name: str, knobs: dict[str, dict], draft_cfg_scale: float | None = None):
    """The decode preset ``name`` runs (eagle3: eagle2's tree with the eagle3 drafter), with the world's
    knobs for it, and ``draft_cfg_scale`` (when given) for a method that drafts with a drafter."""
    preset = PRESETS.get(name, name)
    config = load_preset(preset, knobs.get(preset))
    if draft_cfg_scale is not None and config.needs_drafter:
        config.tree.draft_cfg_scale = draft_cfg_scale
    return config


def xl_depth_ops(
    methods: list[str],
    knobs: dict[str, dict],
    block_options: dict | None = None,
    temperature: float | None = None,
) -> dict[str, PhaseOps]:
    """Per method: ops per step by region and by engine phase at XL depth (random weights, B = 1), with
    the world's ``knobs``, at ``temperature`` (None: the target's default; T = 0 takes other code: top-k
    drafts, argmax verdicts); the block presets draft with a random block drafter of ``block_options`` (its
    layers count: one forward runs each), the others with an eagle1 one."""
    shape = {**XL_DEPTH, "block_size": 64}
    target, drafter = random_llamagen("llamagen-xl", torch.device("cpu"), 0, shape)
    sampling = target.sampling_defaults
    if temperature is not None:
        sampling = replace(sampling, temperature=temperature)
    cond = conditions(target, "llamagen-xl", 1, 1, 0)[0]
    out = {}
    for name in methods:
        config = method_preset(name, knobs)
        drafts = drafter_for(config, "llamagen-xl", target, drafter) if config.needs_drafter else None
        if METHODS[name] == "drafter_eagle3":  # its taps and fusion are part of its draft phase
            torch.manual_seed(0)
            drafts = Drafter.make(DrafterConfig.for_target(target, kind="eagle3")).attach(target).eval()
        if config.drafts_blocks and block_options:
            torch.manual_seed(0)
            made = DrafterConfig.for_target(target, kind="block", **block_options)
            drafts = Drafter.make(made).attach(target).eval()
        method = build_method(config, target, drafts, sampling)
        out[name] = count_phase_ops(method, cond, _generators(torch.device("cpu"), 0, 0, 1))
    return out


def decode_side_by_side(
    methods: dict, target: Target, prompts: list[str], batch: int
) -> tuple[dict[str, list], dict[str, float]]:
    """Each method's decode stats and seconds over ``prompts``, batch by batch with every method in turn
    (the shared machine's load falls on all of them alike)."""
    stats: dict[str, list] = {m: [] for m in methods}
    seconds = dict.fromkeys(methods, 0.0)
    for start in range(0, len(prompts), batch):
        for name, method in methods.items():
            with torch.no_grad():
                decoded = decode_prompts(method, target, prompts[start : start + batch], start, batch)
            stats[name] += decoded.stats
            seconds[name] += decoded.seconds
        print(f"{min(start + batch, len(prompts))}/{len(prompts)} prompts", flush=True)
    return stats, seconds


def measure(args: argparse.Namespace) -> list[Row]:
    knobs = world_knobs(target_config(args.world))
    weights = KernelWeights.load()
    folder = Path(EMBEDDED[args.world])
    target = load_target_folder(folder / "target")
    captions = shapes_validation_captions if args.captions == "validation" else shapes_heldout_captions
    prompts = captions(args.prompts)
    sources = {METHODS[m]: folder / METHODS[m] for m in args.methods if METHODS[m]}
    if args.block_drafter and "drafter_block" in sources:
        sources["drafter_block"] = Path(args.block_drafter)
    drafters = {None: None, **{source: load_drafter(path, target) for source, path in sources.items()}}
    block = drafters.get("drafter_block")
    rows = []
    for temperature in args.temperatures:  # each temperature's own step: T = 0 runs other code
        ops = xl_depth_ops(args.methods, knobs, dataclass_dict(block.options) if block else None, temperature)
        sampling = replace(target.sampling_defaults, temperature=temperature)
        if args.cfg_scale is not None:
            sampling = replace(sampling, cfg_scale=args.cfg_scale)
        methods = {
            m: build_method(
                method_preset(m, knobs, args.draft_cfg_scale), target, drafters[METHODS[m]], sampling
            )
            for m in args.methods
        }
        stats, seconds = decode_side_by_side(methods, target, prompts, args.batch)
        ar_step = ops["ar"].weighted(weights) if "ar" in ops else None
        for name in methods:
            summary, o = summarize(stats[name], target.num_image_tokens), ops[name]
            weighted = o.weighted(weights)
            rows.append(
                Row(
                    name,
                    temperature,
                    str(sources.get(METHODS[name], "")),
                    summary["S"],
                    summary["tau"],
                    summary["mean_depth"],
                    summary["drafter_forwards"] / max(1.0, summary["verified_steps"]),
                    seconds[name] / len(prompts),
                    o.phases["draft"],
                    o.weighted_phase("draft", weights),
                    weighted - o.regions["layers"],
                    weighted,
                    summary["S"] * ar_step / weighted if ar_step else float("nan"),
                )
            )
    return rows


def dataclass_dict(options: object) -> dict:
    """A kind's options dataclass as the keyword arguments that rebuild it."""
    return asdict(options)  # type: ignore[call-overload]


COLUMNS = (
    ("method", "method", "{}"),
    ("temperature", "T", "{:g}"),
    ("S", "S", "{:.2f}"),
    ("tau", "τ", "{:.2f}"),
    ("drafter_forwards_per_step", "drafter fwd / step", "{:.2f}"),
    ("seconds_per_image", "CPU s / image", "{:.2f}"),
    ("draft_phase_ops", "draft phase ops", "{:.0f}"),
    ("draft_phase_weighted", "draft phase weighted", "{:.0f}"),
    ("beyond_layers_weighted", "weighted beyond layers", "{:.0f}"),
    ("total_weighted", "weighted step", "{:.0f}"),
    ("projected_xl_speedup", "projected XL speed-up", "{:.2f}×"),
)


def table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(c[1] for c in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(fmt.format(getattr(row, key)) for key, _, fmt in COLUMNS) + " |")
    return "\n".join(lines)


def write(out: Path, rows: list[Row], args: argparse.Namespace) -> None:
    flags = " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items()
        if v is not None and k != "out"
    )
    settings = {
        "command": f"python -m benchmarks.block_drafting {flags}",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "kernel_weights": KernelWeights.load().source,
    }
    write_results(out, settings, rows, f"`{settings['command']}` ({settings['date']})\n\n{table(rows)}\n")


def write_results(out: Path, settings: dict, rows: list, markdown: str) -> None:
    """``results.json`` (``settings`` and the dataclass ``rows``), ``results.csv`` and ``results.md``
    (``markdown``) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps({"settings": settings, "rows": [asdict(r) for r in rows]}, indent=2) + "\n"
    )
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    (out / "results.md").write_text(markdown)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", default="grain", choices=list(EMBEDDED))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument(
        "--captions", default="heldout", choices=["heldout", "validation"], help="validation: for choosing"
    )
    parser.add_argument("--block-drafter", default=None, help="decode the block presets with this drafter")
    parser.add_argument(
        "--cfg-scale", type=float, default=None, help="the target's CFG scale (default: the world's, 3)"
    )
    parser.add_argument(
        "--draft-cfg-scale",
        type=float,
        default=None,
        help="tree.draft_cfg_scale for every drafter method (default: each preset's, as the world sets it)",
    )
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
