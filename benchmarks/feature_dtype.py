"""Does a drafter trained on half-precision offline features match one trained on fp32 features? Measured on
the grain world (issue #54; docs/training.md, "Feature shards at scale"):

    python -m benchmarks.feature_dtype --work /tmp/feature_dtype --out feature_dtype.json \\
        [--train 512 --val 128 --steps 300 --batch 8 --dtypes fp32 bf16 fp16 --threads 2]

1. Renders ``--train`` training scenes and ``--val`` held-out ones of the grain world (its training and
   held-out seeds), tokenizes them with the grain target's VQ and writes two shard sets (tokens, captions).
2. ``data_prep.features``' ``prepare_features`` on the training samples in fp32 (p_null 0.1), and on the
   held-out ones in fp32 with no null conditioning: every drafter is validated on the same fp32 states, as
   it drafts from the target's own at decode time. The other ``--dtypes`` are the fp32 set rounded
   (``recast``): the target's pass is deterministic, so that is what ``prepare_features feats_dtype=...``
   writes, bit for bit (tests/test_fit_shards.py checks it), without the target's pass once per dtype.
3. ``python -m vdtrain.fit`` per dtype, offline, the same seed, steps and batches (the CPU, fp32 training):
   only the stored dtype of the training features differs.

Reports per dtype the bytes a sample's features take and the final validation's held-out top-1 (depth 1,
teacher-forced ``val/top1``), top-1 per unrolled depth and ``val/tau_sim`` (the acceptance length those
agreements imply for one chain; not a decoded S), and each difference to fp32.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

GRAIN = "checkpoints/grain/target"
CHUNK = 32  # images tokenized at once


def write_pairs(target, out: Path, seed: int, count: int, name: str) -> Path:
    """A shard set of ``count`` grain scenes of split ``seed``: tokens and caption per sample."""
    from vdtrain.data.shards import ShardWriter
    from vdtrain.images import images_to_tensor
    from vdtrain.shapes.scene import generate

    if (out / "manifest.json").is_file() and json.loads((out / "manifest.json").read_text()).get("complete"):
        return out
    samples = generate(count, seed, world="grain")
    writer = ShardWriter(
        out, kind="rendered", target_identity=target.identity, overwrite=True,
        source={"world": "grain", "seed": seed, "count": count}, samples_per_shard=count,
    )  # fmt: skip
    with writer.shard(f"{name}.tar", {"count": count}) as sink, torch.inference_mode():
        for start in range(0, count, CHUNK):
            chunk = samples[start : start + CHUNK]
            tokens = target.tokenizer.encode(images_to_tensor([s.image for s in chunk])).flatten(1)
            for i, (s, row) in enumerate(zip(chunk, tokens, strict=True)):
                ids = row.numpy().astype(np.int64)
                sink.write({"key": f"{name}{start + i:06d}", "tokens": ids, "caption": s.caption, "meta": {}})
    writer.close([f"{name}.tar"])
    return out


def features(target, pairs: Path, out: Path, dtype: str, p_null: float) -> dict[str, Any]:
    from vdtrain.data.prepare import prepare_features
    from vdtrain.data.shards import sample_bytes

    start = time.monotonic()
    manifest = prepare_features(target, pairs, out, p_null=p_null, feats_dtype=dtype, progress=False)
    return {
        "feats_bytes_per_sample": sample_bytes({"feats": manifest["shapes"]["feats"]}, manifest["dtypes"]),
        "seconds": time.monotonic() - start,
    }


def recast(source: Path, out: Path, dtype: str) -> dict[str, Any]:
    """The features set ``source`` (fp32) with its states rounded to ``dtype``, as ``prepare_features``
    writes them in that dtype: the same samples, shards and manifest settings but the stored dtype."""
    from vdtrain.data.prepare import stored_features
    from vdtrain.data.shards import ShardReader, ShardWriter, feature_dtype, read_manifest, sample_bytes

    manifest = read_manifest(source)
    stored = feature_dtype(dtype)
    if not (out / "manifest.json").is_file() or not read_manifest(out).get("complete"):
        start = time.monotonic()
        writer = ShardWriter(
            out, kind=manifest["kind"], target_identity=manifest["target"], overwrite=True,
            source={**manifest["source"], "features": f"{manifest['source']['features']} -> {dtype}"},
            optional_fields=[f for f in manifest["fields"] if f in ("cond", "feats")],
            cond_dim=manifest["shapes"].get("cond", [None, None])[1],
            samples_per_shard=manifest["samples_per_shard"], feats_dtype=stored,
            feature_parts=1 + len(manifest["source"]["taps"]),
        )  # fmt: skip
        reader = ShardReader(source)
        for entry in manifest["shards"]:
            with writer.shard(entry["name"], {"from": entry["name"]}) as sink:
                for sample in reader.iter_shard(entry["name"]):
                    states = torch.from_numpy(sample.pop("feats"))
                    sink.write({**sample, "feats": stored_features(states, stored)})
        writer.close([entry["name"] for entry in manifest["shards"]])
        seconds = time.monotonic() - start
    else:
        seconds = 0.0
    written = read_manifest(out)
    return {
        "feats_bytes_per_sample": sample_bytes({"feats": written["shapes"]["feats"]}, written["dtypes"]),
        "seconds": seconds,
    }


def train(args: argparse.Namespace, shards: Path, val: Path, run: Path) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "vdtrain.fit", "target=grain", "data=offline_features", "trainer=cpu",
        f"data.shards={shards}", f"data.val_shards={val}", f"data.val_samples={args.val}",
        f"data.batch_size={args.batch}", "data.num_workers=0", f"trainer.max_steps={args.steps}",
        f"trainer.threads={args.threads}", f"trainer.checkpoint_every_n_steps={args.steps}",
        "trainer.val_every_n_epochs=1000", "eval.enabled=false", f"hydra.run.dir={run}",
    ]  # fmt: skip
    if not (run / "summary.json").is_file():  # a rerun reads the runs already done
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(command[1:])} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    summary = json.loads((run / "summary.json").read_text())
    keys = sorted(k for k in summary if k.startswith("val/top1") or k in ("val/tau_sim", "val/total"))
    values = {k: summary[k] for k in keys}
    return {"command": " ".join(command[1:]), "fit_minutes": summary["minutes"], **values}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--train", type=int, default=512)
    parser.add_argument("--val", type=int, default=128)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16", "fp16"])
    args = parser.parse_args()
    if "fp32" not in args.dtypes:
        parser.error("--dtypes must include fp32, the reference")
    torch.set_num_threads(args.threads)
    from vdtrain.paths import repo_path
    from vdtrain.shapes.scene import HELDOUT_SEED, TRAIN_SEED
    from vdtrain.targets.shapes import load_target_folder

    target = load_target_folder(repo_path(GRAIN))
    work = args.work
    report: dict[str, Any] = {"settings": {k: str(v) for k, v in vars(args).items()}, "dtypes": {}}
    pairs = write_pairs(target, work / "pairs_train", TRAIN_SEED, args.train, "train")
    held_out = write_pairs(target, work / "pairs_val", HELDOUT_SEED, args.val, "val")
    val = work / "feats_val_fp32"
    report["val_features"] = features(target, held_out, val, "fp32", 0.0)
    reference = work / "feats_train_fp32"
    made = {"fp32": features(target, pairs, reference, "fp32", 0.1)}
    for dtype in args.dtypes:
        shards = work / f"feats_train_{dtype}"
        made[dtype] = made.get(dtype) or recast(reference, shards, dtype)
        report["dtypes"][dtype] = {**made[dtype], **train(args, shards, val, work / f"run_{dtype}")}
        print(dtype, json.dumps(report["dtypes"][dtype]), flush=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    reference = report["dtypes"]["fp32"]
    print("| stored feats | bytes / sample | held-out top-1 | Δ top-1 | τ_sim | Δ τ_sim | fit minutes |")
    print("|---|---|---|---|---|---|---|")
    for dtype, row in report["dtypes"].items():
        row["top1_minus_fp32"] = row["val/top1"] - reference["val/top1"]
        row["tau_sim_minus_fp32"] = row["val/tau_sim"] - reference["val/tau_sim"]
        print(
            f"| {dtype} | {row['feats_bytes_per_sample']:,} | {row['val/top1']:.4f} | "
            f"{row['top1_minus_fp32']:+.4f} | {row['val/tau_sim']:.3f} | {row['tau_sim_minus_fp32']:+.3f} | "
            f"{row['fit_minutes']:.1f} |"
        )
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
