"""Agreement per draft depth against samples seen, for each drafter kind: the data-scaling curve the EAGLE-3
paper is about (its drafter keeps gaining with data where EAGLE-1's flattens), measured with fit itself.

    python -m benchmarks.data_scaling --device cuda --target grain --minutes 2 --points 2048 --batch 16 \\
        --out scaling.json                                   # gpu_check.sh's optional step `scaling`
    python -m benchmarks.data_scaling --dry-run              # the fit commands only

Each kind trains once, ``python -m vdtrain.fit`` for ``--minutes`` (the learning-rate cosine ends with that
budget), with an epoch of ``--points`` samples, so validation (held-out captions, the drafter unrolled on
its own features for ``drafter.val_depth`` steps) runs after every ``--points`` samples. The curve is read
from the run's CSV log: ``val/top1_depth{d}`` and ``val/tau_sim`` at each validation, against the samples
seen by then (step × batch).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

DEPTH = re.compile(r"val/top1_depth(\d+)$")


def fit_command(args: argparse.Namespace, kind: str, run_dir: Path) -> list[str]:
    """The fit run for one kind: time-limited, validating every ``--points`` samples, nothing else."""
    accelerator = "gpu" if args.device.startswith("cuda") else "cpu"
    overrides = [
        f"target={args.target}",
        f"drafter.kind={kind}",
        f"trainer.accelerator={accelerator}",
        "trainer.devices=1",
        f"trainer.precision={args.precision}",
        f"trainer.max_minutes={args.minutes}",
        "trainer.max_steps=1000000",
        "trainer.checkpoint_every_n_steps=1000000",
        f"data.batch_size={args.batch}",
        f"data.samples_per_epoch={args.points}",
        f"data.val_samples={args.val_samples}",
        "eval.enabled=false",
        f"hydra.run.dir={run_dir}",
        f"export_dir={run_dir / 'drafter'}",
    ]
    if args.ttt_steps is not None:  # read by the kinds trained unrolled on their own outputs
        overrides.append(f"drafter.ttt_steps={args.ttt_steps}")
    if args.threads is not None:
        overrides.append(f"trainer.threads={args.threads}")
    return [sys.executable, "-m", "vdtrain.fit", *overrides]


def read_curve(metrics_csv: Path, batch: int) -> list[dict]:
    """One point per validation row of a fit run's CSV log: samples seen, top-1 per depth, τ_sim."""
    points = []
    with metrics_csv.open() as f:
        for row in csv.DictReader(f):
            depths = sorted((int(m.group(1)), k) for k in row if (m := DEPTH.match(k)) and row[k] != "")
            if not depths:
                continue
            point = {
                "samples": (int(row["step"]) + 1) * batch,
                "top1_depth": [round(float(row[k]), 4) for _, k in depths],
                "tau_sim": round(float(row["val/tau_sim"]), 4) if row.get("val/tau_sim") else None,
            }
            same = points and {**points[-1], "samples": point["samples"]} == point
            if not same:  # fit validates the final weights once more when the clock stops it
                points.append(point)
    return points


def to_markdown(curves: dict[str, list[dict]]) -> str:
    lines = ["| kind | samples seen | top-1 at depth 1 … n | τ_sim |", "|---|---|---|---|"]
    for kind, points in curves.items():
        for p in points:
            depths = " / ".join(f"{a:.3f}" for a in p["top1_depth"])
            lines.append(f"| {kind} | {p['samples']:,} | {depths} | {p['tau_sim']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--target", default="grain", help="a conf/target name: grain is the visual-AR regime")
    parser.add_argument("--kinds", nargs="+", default=["eagle1", "eagle3"])
    parser.add_argument("--minutes", type=float, default=2.0, help="training budget per kind")
    parser.add_argument("--points", type=int, default=2048, help="samples between two validations")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--val-samples", type=int, default=64)
    parser.add_argument("--ttt-steps", type=int, default=None, help="eagle3's unrolled steps (fit's default)")
    parser.add_argument("--precision", default="32-true", help="fit's trainer.precision, e.g. bf16-mixed")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--work-dir", type=Path, default=Path("outputs/data_scaling"))
    parser.add_argument("--out", type=Path, default=None, help="write the curves as JSON (and .md beside it)")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    curves: dict[str, list[dict]] = {}
    for kind in args.kinds:
        run_dir = args.work_dir / kind
        command = fit_command(args, kind, run_dir)
        print(shlex.join(["python", *command[1:]]), flush=True)
        if args.dry_run:
            continue
        subprocess.run(command, check=True)
        curves[kind] = read_curve(run_dir / "logs" / "metrics.csv", args.batch)
    if args.dry_run:
        return
    table = to_markdown(curves)
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        args.out.write_text(json.dumps({"settings": settings, "curves": curves}, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(table)


if __name__ == "__main__":
    main()
