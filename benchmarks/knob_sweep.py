"""A world's relaxed knobs and tree sizes, re-chosen on its validation captions.

python -m benchmarks.knob_sweep                       # conf/benchmarks/knob_sweep.yaml: the grain world
python -m benchmarks.knob_sweep --out docs/grain_world/knobs
python -m benchmarks.knob_sweep --presets gsd num_prompts=2      # one preset's grid, on 2 captions

Every value of ``grid`` decodes the same validation captions and seeds as AR, in one evaluation (AR runs
once), from the target's own knobs (its config's ``decode``) with that one key changed. The rule that
picks a winner is in the config; the table prints S, Fréchet to AR, consistency and which value wins.
Never run it on held-out captions: the knobs it picks are then measured there (benchmarks.calibration).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from omegaconf import OmegaConf

from vdtrain.decode.budget import GPU_MAX_ROWS
from vdtrain.decode.methods import load_preset
from vdtrain.eval.runner import evaluate
from vdtrain.eval.table import EvalRow, write_tables
from vdtrain.prompts import shapes_validation_captions
from vdtrain.target_settings import load_drafter, world_knobs
from vdtrain.targets.registry import load_target


@dataclass(frozen=True)
class Trial:
    preset: str
    key: str  # dotted, under the preset's config
    value: float

    @property
    def name(self) -> str:
        return f"{self.preset}[{self.key}={self.value:g}]"


def eligible(trial: Trial, row: EvalRow, ar: EvalRow, rule: dict, exact: bool) -> bool:
    """Whether ``trial`` may win: an exact method's tree within the GPU's ridge at B 1 with CFG, a relaxed
    method's images near AR's (``max_frechet_ratio``, ``max_consistency_drop``)."""
    if exact:
        return trial.key != "tree.total_tokens" or 2 * (trial.value + 1) <= GPU_MAX_ROWS
    near = row.score("frechet_ar") <= rule["max_frechet_ratio"] * ar.score("frechet_ar")
    drop = ar.score("shapes_consistency") - row.score("shapes_consistency")
    return near and drop <= rule["max_consistency_drop"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="conf/benchmarks/knob_sweep.yaml")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--presets", default=None, help="sweep only these presets of the grid: a,b,...")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE over the sweep's config")
    args = parser.parse_args()
    cfg = OmegaConf.to_container(
        OmegaConf.merge(OmegaConf.load(args.config), OmegaConf.from_dotlist(args.overrides))
    )
    if args.presets is not None:
        cfg["grid"] = {p: keys for p, keys in cfg["grid"].items() if p in args.presets.split(",")}
    torch.set_num_threads(cfg["threads"])
    target_cfg = OmegaConf.to_container(OmegaConf.load(cfg["target"]))
    knobs = world_knobs(target_cfg)
    target = load_target(target_cfg)
    trials = [
        Trial(preset, key, value)
        for preset, keys in cfg["grid"].items()
        for key, values in keys.items()
        for value in values
    ]
    configs = []
    for trial in trials:
        overrides = OmegaConf.merge(
            knobs.get(trial.preset, {}), OmegaConf.from_dotlist([f"{trial.key}={trial.value}"])
        )
        configs.append(replace(load_preset(trial.preset, overrides), name=trial.name))
    drafter = load_drafter(cfg["drafter"], target) if any(c.needs_drafter for c in configs) else None
    result = evaluate(
        target,
        drafter,
        shapes_validation_captions(cfg["num_prompts"]),
        configs,
        [cfg["temperature"]],
        seed=cfg["seed"],
        batch_size=cfg["batch_size"],
        warmup=False,
        cuda_graphs=False,
    )
    rows = {row.method: row for row in result.rows}
    ar = rows["ar"]
    floor, consistency = ar.score("frechet_ar"), ar.score("shapes_consistency")
    lines = [
        f"AR: Fréchet floor {floor:.5f}, consistency {consistency:.3f}",
        "",
        "| method | S | Fréchet to AR | consistency | eligible | chosen |",
        "|---|---|---|---|---|---|",
    ]
    chosen: dict[str, dict[str, float]] = {}
    for preset in cfg["grid"]:
        for key in cfg["grid"][preset]:
            group = [(t, rows[t.name]) for t in trials if t.preset == preset and t.key == key]
            exact = configs[trials.index(group[0][0])].exact
            ok = {t.name: eligible(t, r, ar, cfg, exact) for t, r in group}
            best = max((p for p in group if ok[p[0].name]), key=lambda p: p[1].S, default=None)
            if best is not None:
                chosen.setdefault(preset, {})[key] = best[0].value
            for t, r in group:
                lines.append(
                    f"| {t.name} | {r.S:.2f} | {r.score('frechet_ar'):.5f} | "
                    f"{r.score('shapes_consistency'):.3f} | {'yes' if ok[t.name] else 'no'} | "
                    f"{'**yes**' if best is not None and best[0] is t else ''} |"
                )
    report = "\n".join(lines) + "\n\nchosen: " + json.dumps(chosen) + "\n"
    print(report)
    if args.out is not None:
        write_tables(
            result.rows,
            args.out,
            {"command": " ".join(["python -m benchmarks.knob_sweep", *sys.argv[1:]]), "sweep": cfg},
        )
        (args.out / "knobs.md").write_text(report)
        (args.out / "chosen.json").write_text(json.dumps(chosen, indent=2) + "\n")


if __name__ == "__main__":
    main()
