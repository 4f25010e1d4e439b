"""``fit`` at a 7B-class width under ZeRO-2, with its after-epoch evaluation: ``gpu_check.sh``'s ``big_fit``.

    python -m benchmarks.big_fit --device cuda --work /tmp/big_fit --out big_fit.json

``train_throughput`` times a 7B-class training step and ``memory_plan`` plans it; neither runs ``fit``
itself: the strategy, the bf16 target, the data, the checkpoint and the evaluation that decodes held-out
captions with the drafter being trained. This does, as a user's command, on a target folder written here
in LlamaGen's official format with random weights: the shapes target's layout (64 px, 16×16 image tokens,
its 48 MiniLM caption rows, whose caches are copied so that no encoder is needed) at the width of
Janus-Pro-7B / Anole-7B (4096, 32 heads, SwiGLU 11 008, a 16 384-token codebook) and ``--layers`` of its
30–32 layers. Recorded as ``user_commands`` records a command (exit code, seconds, loss, the callback's S
and speed-up, the acceptance gap), with the folder's weight bytes and the peak GPU memory the run's
summary reports. ``--device cpu`` runs the same at ``--width 64`` on ``trainer=cpu`` (the script's own
check; DeepSpeed needs a GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks.user_commands import CPU_EVAL, RUN, run_one
from vdtrain.models.llamagen_gpt import GPTConfig, LlamaGenGPT
from vdtrain.models.vq import VQConfig, VQModel
from vdtrain.shapes.build import write_target_folder

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ROOT / "checkpoints" / "shapes" / "target"
# Janus-Pro-7B / Anole-7B: the width, heads and FFN of LLaMA-7B; a 16k image codebook (Janus's, LlamaGen's)
SEVEN_B = {"dim": 4096, "n_head": 32, "multiple_of": 256, "vocab_size": 16384}
CPU = {"dim": 64, "n_head": 4, "multiple_of": 16, "vocab_size": 512}


def write_big_target(folder: Path, layers: int, shape: dict[str, int]) -> int:
    """The shapes target's folder at ``shape``'s width and ``layers`` layers, random weights: its bytes."""
    shipped = json.loads((SHAPES / "config.json").read_text())
    gpt = LlamaGenGPT(replace(GPTConfig(**shipped["gpt"]), n_layer=layers, **shape)).eval()
    vq_config = {k: tuple(v) if isinstance(v, list) else v for k, v in shipped["vq"].items()}
    vq = VQModel(replace(VQConfig(**vq_config), codebook_size=shape["vocab_size"])).eval()
    write_target_folder(folder, gpt, vq, shipped["sampling"], {}, captions_from=SHAPES)
    return sum(p.stat().st_size for p in folder.iterdir())


def fit_command(device: str, folder: Path, run: Path) -> list[str]:
    """One short run whose two epochs end, so the after-epoch evaluation runs twice: bf16 target, ZeRO-2."""
    trainer = ("trainer=deepspeed_stage_2", "trainer.devices=1") if device == "cuda" else ("trainer=cpu",)
    small = CPU_EVAL["vdtrain.fit"] if device == "cpu" else ("eval.num_prompts=4", "eval.batch_size=4")
    return [
        sys.executable,
        "-m",
        "vdtrain.fit",
        f"target.folder={folder}",
        "target.dtype=bf16" if device == "cuda" else "target.dtype=fp32",
        *trainer,
        *RUN,
        *small,
        f"hydra.run.dir={run}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--layers", type=int, default=2, help="of the target (a 7B has 30-32)")
    parser.add_argument("--work", type=Path, required=True, help="a new folder for the target and the run")
    parser.add_argument("--out", type=Path, required=True, help="the JSON written when the run ends")
    parser.add_argument("--timeout", type=float, default=300, help="seconds the fit may take")
    args = parser.parse_args(argv)
    shape = SEVEN_B if args.device == "cuda" else CPU
    folder = args.work / "target"
    weight_bytes = write_big_target(folder, args.layers, shape)
    print(
        f"big_fit: a {args.layers}-layer target {shape} written, {weight_bytes / 2**30:.2f} GiB", flush=True
    )
    outcome = run_one("fit_big", fit_command(args.device, folder, args.work / "big"), args.work, args.timeout)
    report = {"device": args.device, "layers": args.layers, **shape, "folder_bytes": weight_bytes}
    args.out.write_text(json.dumps(report | asdict(outcome), indent=1) + "\n")
    print(f"big_fit: exit {outcome.rc} in {outcome.seconds:.0f}s {json.dumps(outcome.figures)}", flush=True)
    if outcome.error:
        print(outcome.error, flush=True)
    return 0 if outcome.rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
