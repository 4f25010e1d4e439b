"""Export after DeepSpeed ZeRO-2 and ZeRO-3 writes the full drafter, equal to the one trained without
DeepSpeed: ``gpu_check.sh``'s ``zero_export`` step (issue #54).

    python -m benchmarks.zero_export --work /tmp/zero --out zero_export.json [--devices 2]

Three short fits of the shapes world on the same GPUs, fp32 (``trainer.precision=32-true``, the target in
fp32) so that only the strategy differs: DDP (``trainer=ddp``; ``gpu`` on one GPU), ``deepspeed_stage_2`` and
``deepspeed_stage_3``. For each DeepSpeed run it records whether the exported ``drafter/model.safetensors``
is fp32 with every tensor whole, equal to the drafter gathered from its ``last.ckpt`` folder, and how far
it is from the DDP run's export (relative norm of the difference; the bound 1e-3 leaves the reduction
order's rounding through AdamW, as tests/test_zero_checkpoint.py measures it on two CPU ranks). The runs
read the shapes target's cached captions only, as ``benchmarks.user_commands`` does. Exit status 1 when a
check fails.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.user_commands import CHEAP, RUN

BOUND = 1e-3  # relative norm of (ZeRO export - DDP export)
FP32 = ("trainer.precision=32-true", "trainer.target_dtype=null", "trainer.compile=false")


def fit(name: str, trainer: str, devices: int, work: Path) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "vdtrain.fit", f"trainer={trainer}", f"trainer.devices={devices}",
        "trainer.max_steps=6", *RUN[1:], *CHEAP, *FP32, f"hydra.run.dir={work / name}",
    ]  # fmt: skip
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True)
    outcome = {"command": " ".join(command[1:]), "rc": done.returncode, "seconds": time.monotonic() - start}
    if done.returncode:
        outcome["error"] = (done.stdout + done.stderr)[-2000:]
    return outcome


def compare(exported: dict[str, torch.Tensor], plain: dict[str, torch.Tensor]) -> dict[str, Any]:
    diff = sum((exported[k].double() - v.double()).pow(2).sum().item() for k, v in plain.items())
    norm = sum(v.double().pow(2).sum().item() for v in plain.values())
    return {
        "max_abs_diff": max((exported[k] - v).abs().max().item() for k, v in plain.items()),
        "relative_norm_diff": (diff / norm) ** 0.5,
    }


def check(stage: int, work: Path, plain: dict[str, torch.Tensor]) -> dict[str, Any]:
    from safetensors.torch import load_file

    from vdtrain.drafters import Drafter

    run = work / f"deepspeed_stage_{stage}"
    exported = load_file(run / "drafter" / "model.safetensors")
    gathered = Drafter.from_pretrained(run / "checkpoints" / "last.ckpt").state_dict()
    result = {
        "dtypes": sorted({str(v.dtype) for v in exported.values()}),
        "empty_tensors": sorted(k for k, v in exported.items() if v.numel() == 0),
        "same_keys_and_shapes_as_ddp": {k: v.shape for k, v in exported.items()}
        == {k: v.shape for k, v in plain.items()},
        "equals_the_gathered_last_ckpt": gathered.keys() == exported.keys()
        and all(torch.equal(gathered[k], v) for k, v in exported.items()),
    }
    if result["same_keys_and_shapes_as_ddp"]:
        result.update(compare(exported, plain))
    result["ok"] = (
        result["dtypes"] == ["torch.float32"]
        and not result["empty_tensors"]
        and result["equals_the_gathered_last_ckpt"]
        and result.get("relative_norm_diff", 1.0) < BOUND
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=2, help="GPUs per run (fewer if fewer are there)")
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    report: dict[str, Any] = {"gpus": min(args.devices, gpus), "bound": BOUND, "runs": {}, "checks": {}}
    if gpus == 0:
        report["skipped"] = "DeepSpeed needs a GPU (Lightning's strategy refuses a CPU)"
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(report["skipped"])
        return
    devices = report["gpus"]
    plain_trainer = "ddp" if devices > 1 else "gpu"
    for name, trainer in (("plain", plain_trainer), ("deepspeed_stage_2", None), ("deepspeed_stage_3", None)):
        report["runs"][name] = fit(name, trainer or name, devices, args.work)
        print(name, json.dumps({k: v for k, v in report["runs"][name].items() if k != "error"}), flush=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    if report["runs"]["plain"]["rc"] == 0:
        from safetensors.torch import load_file

        plain = load_file(args.work / "plain" / "drafter" / "model.safetensors")
        for stage in (2, 3):
            if report["runs"][f"deepspeed_stage_{stage}"]["rc"] == 0:
                report["checks"][f"zero{stage}"] = check(stage, args.work, plain)
                print(f"zero{stage}", json.dumps(report["checks"][f"zero{stage}"]), flush=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    ok = len(report["checks"]) == 2 and all(c["ok"] for c in report["checks"].values())
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
