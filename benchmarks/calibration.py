"""The grain world against the papers: every criterion of the visual-AR regime side by side.

python -m benchmarks.calibration                                   # 32 held-out captions, T = 1
python -m benchmarks.calibration --split validation --num-prompts 16 --methods lantern \
    --decode lantern.acceptance.delta=0.2                          # a knob tried on validation captions
python -m benchmarks.calibration --device cuda --num-prompts 512 --batch-size 64 --units /tmp/units
    # on a GPU; captions past the shipped 32 cached first (python -m data_prep.captions target=grain)

Decodes AR, EAGLE-1, EAGLE-2, LANTERN, LANTERN++ (λ 2 and 3), SJD, GSD and VVS on the same captions and
seeds (``vdtrain.eval.runner.evaluate``) with the target's own sampling defaults and the presets as the
target's config sets them, measures the target's next-token regime on the same captions, and prints the
criteria with the papers' figures. ``--out`` keeps results.{md,csv,json}, regime.json and calibration.md;
``--units`` keeps each finished batch, so a stopped run goes on where it stopped (same settings only).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch
from omegaconf import OmegaConf

from vdtrain.decode.methods import load_preset
from vdtrain.devices import pick_device
from vdtrain.eval.regime import confidence_on
from vdtrain.eval.runner import evaluate
from vdtrain.eval.table import EvalRow, to_markdown, write_tables
from vdtrain.prompts import shapes_heldout_captions, shapes_validation_captions
from vdtrain.sharding import Ranks, UnitStore
from vdtrain.target_settings import load_drafter, world_knobs
from vdtrain.targets.registry import load_target

METHODS = ["eagle1", "eagle2", "lantern", "lantern_pp", "lantern_pp_lam3", "sjd", "gsd", "vvs"]


def method_list(methods: list[str], decode_overrides: dict) -> list:
    """The presets with the target's own knobs (``decode`` in its config); ``lantern_pp_lam3`` is
    LANTERN++ at λ 3. Trees never shrink to fit a GPU batch (``tree.max_rows`` 0, as on a CPU): the
    papers' S is measured at batch 1, and a batch of 64 on a GPU would cut every tree to 2 nodes."""
    configs = []
    for name in methods:
        preset = "lantern_pp" if name == "lantern_pp_lam3" else name
        overrides = OmegaConf.merge({"tree": {"max_rows": 0}}, decode_overrides.get(preset, {}))
        if name == "lantern_pp_lam3":
            overrides = OmegaConf.merge(overrides, {"acceptance": {"lam": 3.0}})
        configs.append(replace(load_preset(preset, overrides), name=name))
    return configs


def criteria(rows: dict[str, EvalRow], regime: dict) -> list[tuple[str, str, str, str, bool]]:
    """(criterion, papers' figure, the issue's target, measured here, met)."""
    s = {name: row.S for name, row in rows.items()}
    cfg = regime["after_cfg"]
    vvs = rows["vvs"]
    fd = {name: row.score("frechet_ar") for name, row in rows.items()}
    skip_share = vvs.skipped_steps / max(vvs.skipped_steps + vvs.verified_steps, 1e-9)
    return [
        (
            "target's median top-1 (after CFG)",
            "rarely above 0.2 (LANTERN++ §3.2)",
            "≤ 0.3",
            f"{cfg['top1_median']:.3f}",
            cfg["top1_median"] <= 0.3,
        ),
        (
            "tokens with top-1 < 0.2",
            "most",
            "≥ 30 %",
            f"{cfg['share_top1_below_0.2']:.0%}",
            cfg["share_top1_below_0.2"] >= 0.3,
        ),
        (
            "EAGLE-1 S (static tree)",
            "2.38–2.94 (LANTERN++ Table 2)",
            "2.3–3.0",
            f"{s['eagle1']:.2f}",
            2.3 <= s["eagle1"] <= 3.0,
        ),
        (
            "EAGLE-2 S vs EAGLE-1",
            "2.11 vs 2.49, 15 % lower (LlamaGen-3B, LANTERN++ Table 1)",
            "below",
            f"{s['eagle2']:.2f} ({s['eagle2'] / s['eagle1'] - 1:+.0%})",
            s["eagle2"] < s["eagle1"],
        ),
        (
            "LANTERN++ λ 2 / EAGLE-1",
            "+8 / +10 % (Lumina-mGPT / Anole, k 10; LANTERN++ Table 2)",
            "≥ 1.1×",
            f"{s['lantern_pp'] / s['eagle1']:.2f}×",
            s["lantern_pp"] >= 1.1 * s["eagle1"],
        ),
        (
            "LANTERN++ λ 3 / EAGLE-1",
            "+23 / +27 / +19 / +20 % (Lumina-mGPT / Anole / LlamaGen-XL I / II)",
            "≥ 1.2×",
            f"{s['lantern_pp_lam3'] / s['eagle1']:.2f}×",
            s["lantern_pp_lam3"] >= 1.2 * s["eagle1"],
        ),
        (
            "LANTERN vs EAGLE-2",
            "TPF 2.10 vs 1.22 (δ 0.3; VVS Table 1)",
            "above",
            f"{s['lantern']:.2f} vs {s['eagle2']:.2f}",
            s["lantern"] > s["eagle2"],
        ),
        (
            "SJD S",
            "1.63 / 1.97 / 2.22 (LlamaGen / Anole / Lumina-mGPT; SJD paper)",
            "1.4–2.3",
            f"{s['sjd']:.2f}",
            1.4 <= s["sjd"] <= 2.3,
        ),
        (
            "GSD vs SJD",
            "3.7× on Lumina-mGPT (GSD)",
            "above, relaxed > 0",
            f"{s['gsd']:.2f} vs {s['sjd']:.2f}, {rows['gsd'].relaxed_acceptances:.1f} relaxed per image",
            s["gsd"] > s["sjd"] and rows["gsd"].relaxed_acceptances > 0,
        ),
        (
            "VVS skipped steps",
            "uniform interval 4 / 3 / 2: 25 / 33 / 50 % of steps, TPF 2.24–2.86 (VVS Table 1)",
            "reported",
            f"{skip_share:.0%} of steps ({vvs.skipped_steps:.1f} per image), TPF {vvs.TPF:.2f}",
            True,
        ),
        (
            "Fréchet to AR: floor / LANTERN++ λ 2 / λ 3",
            "FID 28.93 / 30.11 / 33.91 (Lumina-mGPT; AR / λ 2 / λ 3, LANTERN++ Table 2)",
            "rises with λ, above the floor",
            f"{fd['ar']:.3g} / {fd['lantern_pp']:.3g} ({fd['lantern_pp'] / fd['ar']:.2f}×) / "
            f"{fd['lantern_pp_lam3']:.3g} ({fd['lantern_pp_lam3'] / fd['ar']:.2f}×)",
            fd["ar"] < fd["lantern_pp"] < fd["lantern_pp_lam3"],
        ),
    ]


def calibration_markdown(rows: list[tuple[str, str, str, str, bool]]) -> str:
    lines = ["| criterion | papers (real models) | target | measured | met |", "|---|---|---|---|---|"]
    lines += [f"| {c} | {p} | {t} | {m} | {'yes' if ok else 'NO'} |" for c, p, t, m, ok in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="conf/target/grain.yaml", help="a conf/target/*.yaml")
    parser.add_argument("--drafter", default="checkpoints/grain/drafter")
    parser.add_argument("--split", choices=["heldout", "validation"], default="heldout")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu | cuda | auto (a GPU records steps)")
    parser.add_argument(
        "--cuda-graphs", choices=["auto", "false"], default="auto", help="false: eager on a GPU"
    )
    parser.add_argument("--units", type=Path, default=None, help="keep finished batches here and reuse them")
    parser.add_argument("--methods", nargs="+", default=METHODS, help="a subset (no criteria table)")
    parser.add_argument("--decode", nargs="*", default=[], help="KEY=VALUE over the target's knobs")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = OmegaConf.to_container(OmegaConf.load(args.target))
    decode_overrides = OmegaConf.to_container(
        OmegaConf.merge(world_knobs(config), OmegaConf.from_dotlist(args.decode))
    )
    config["decode"] = decode_overrides
    target = load_target(config, pick_device(args.device))
    methods = method_list(args.methods, decode_overrides)
    needs_drafter = any(m.needs_drafter for m in methods)  # SJD and GSD calibrate without one
    drafter = load_drafter(args.drafter, target) if needs_drafter else None
    captions = (shapes_heldout_captions if args.split == "heldout" else shapes_validation_captions)(
        args.num_prompts
    )
    store = None
    if args.units is not None:  # its batches are reused only by a run that would decode them alike
        store = UnitStore(args.units)
        decides = [
            "target",
            "drafter",
            "split",
            "num_prompts",
            "batch_size",
            "temperature",
            "seed",
            "methods",
        ]
        settings = {k: str(getattr(args, k)) for k in decides} | {"decode": decode_overrides}
        store.check_settings(settings, Ranks())
    result = evaluate(
        target,
        drafter,
        captions,
        methods,
        [args.temperature],
        seed=args.seed,
        batch_size=args.batch_size,
        warmup=False,
        cuda_graphs="auto" if args.cuda_graphs == "auto" else False,
        store=store,
    )
    rows = {row.method: row for row in result.rows}
    ar_tokens = result.decoded[("ar", float(args.temperature))].tokens  # the regime AR decoding visits
    regime = confidence_on(target, captions, ar_tokens, args.temperature, args.batch_size)
    table = calibration_markdown(criteria(rows, regime)) if set(METHODS) <= set(rows) else ""
    print(to_markdown(result.rows))
    print(table)
    if args.out is not None:
        write_tables(
            result.rows,
            args.out,
            {
                "command": "python -m benchmarks.calibration "
                + " ".join(
                    f"--{k.replace('_', '-')} {v}"
                    for k, v in vars(args).items()
                    if v is not None and k not in ("out", "units", "cuda_graphs")
                ),
                "target": args.target,
                "drafter": args.drafter if needs_drafter else None,
                "split": args.split,
                "decode": decode_overrides,
            },
        )
        (args.out / "regime.json").write_text(json.dumps(regime, indent=2) + "\n")
        (args.out / "calibration.md").write_text(table)


if __name__ == "__main__":
    main()
