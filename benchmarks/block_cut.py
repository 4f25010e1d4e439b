"""The block presets' confidence cut (``tree.cut``, issue #55 item 3), measured on validation captions.

    python -m benchmarks.block_cut --world grain --prompts 16 --batch 8 --threads 1 --out /tmp/cut

Each preset (block, block_tree) decodes the same validation captions with the same seeds (prompt ``i``
with seed ``i``) with no cut (the shipped presets) and with each ``--cuts`` value, with the world's knobs
and its shipped block drafter (``drafter_block``), batch by batch with every trial in turn (the shared
machine's load falls on all alike). Per trial: S (image tokens per target forward), τ, the drafts
verified per verified step (valid nodes past the root) and the CPU seconds per image (eager,
``--threads``). Never run it on held-out captions: the cut it picks is measured there. Writes
``results.{json,md}`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from omegaconf import OmegaConf

from benchmarks.block_drafting import decode_side_by_side
from benchmarks.step_cost import EMBEDDED
from vdtrain.decode.engine import SpeculativeEngine
from vdtrain.decode.methods import build_method, load_preset
from vdtrain.decode.metrics import summarize
from vdtrain.prompts import shapes_validation_captions
from vdtrain.target_settings import load_drafter, target_config, world_knobs
from vdtrain.targets import load_target_folder


@dataclass
class Row:
    preset: str
    cut: float | None
    S: float
    tau: float
    drafts_per_step: float  # valid nodes past the root, per verified step
    seconds_per_image: float


def count_drafts(engine: SpeculativeEngine) -> list[int]:
    """A one-element counter of the valid nodes past the root in every tree ``engine`` builds (a done
    prompt's tree has none: its depth limit is 0)."""
    counter, build = [0], engine.builder.build

    def counted(ctx, state):
        tree = build(ctx, state)
        counter[0] += int(tree.valid[:, 1:].sum())
        return tree

    engine.builder.build = counted
    return counter


def measure(args: argparse.Namespace) -> list[Row]:
    knobs = world_knobs(target_config(args.world))
    folder = Path(EMBEDDED[args.world])
    target = load_target_folder(folder / "target")
    drafter = load_drafter(folder / "drafter_block", target)
    sampling = replace(target.sampling_defaults, temperature=args.temperature)
    prompts = shapes_validation_captions(args.prompts)
    trials = [(p, c) for p in args.presets for c in [None, *args.cuts]]
    engines, counters = {}, {}
    for preset, cut in trials:
        config = load_preset(preset, OmegaConf.merge(knobs.get(preset, {}), {"tree": {"cut": cut}}))
        engines[preset, cut] = build_method(config, target, drafter, sampling)
        counters[preset, cut] = count_drafts(engines[preset, cut])
    stats, seconds = decode_side_by_side(engines, target, prompts, args.batch)
    return summary_rows(target, stats, seconds, counters)


def summary_rows(target, stats: dict, seconds: dict, counters: dict) -> list[Row]:
    """One row per trial over the prompts decoded so far."""
    rows = []
    for trial, decoded in stats.items():
        summary = summarize(decoded, target.num_image_tokens)
        steps = sum(s.steps for s in decoded)
        rows.append(
            Row(
                *trial,
                summary["S"],
                summary["tau"],
                counters[trial][0] / steps,
                seconds[trial] / len(decoded),
            )
        )
    return rows


def table(rows: list[Row]) -> str:
    lines = [
        "| preset | tree.cut | S | τ | drafts verified / step | CPU s / image |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        cut = "none" if r.cut is None else f"{r.cut:g}"
        lines.append(
            f"| {r.preset} | {cut} | {r.S:.2f} | {r.tau:.2f} | {r.drafts_per_step:.2f} | "
            f"{r.seconds_per_image:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", default="grain", choices=list(EMBEDDED))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--presets", nargs="+", default=["block", "block_tree"])
    parser.add_argument("--cuts", nargs="+", type=float, default=[0.02, 0.05, 0.1, 0.2])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="a folder for results.{json,md}")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = measure(args)
    print(table(rows), flush=True)
    if args.out:
        command = (
            f"python -m benchmarks.block_cut --world {args.world} --prompts {args.prompts} --batch "
            f"{args.batch} --temperature {args.temperature:g} --presets {' '.join(args.presets)} "
            f"--cuts {' '.join(f'{c:g}' for c in args.cuts)} --threads {args.threads}"
        )
        settings = {"command": command, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
        args.out.mkdir(parents=True, exist_ok=True)
        payload = {"settings": settings, "rows": [asdict(r) for r in rows]}
        (args.out / "results.json").write_text(json.dumps(payload, indent=2) + "\n")
        (args.out / "results.md").write_text(f"`{command}` ({settings['date']})\n\n{table(rows)}\n")


if __name__ == "__main__":
    main()
