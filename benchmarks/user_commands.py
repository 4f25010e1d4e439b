"""What a user runs, run as the README writes it, on this machine's device: ``gpu_check.sh``'s ``user`` step.

    python -m benchmarks.user_commands --device cuda --work /tmp/user --out user.json

Each command is its own process, as a user starts it, and is recorded (exit code, seconds, the figures it
printed or wrote) in ``--out`` as soon as it ends, so a step cut short keeps what was done:

1. ``fit trainer=gpu``: a short run whose epochs end, so the after-epoch evaluation and its acceptance report
   run (the callback's S, the loss and top-1 are recorded);
2. ``fit trainer=deepspeed_stage_2`` and ``deepspeed_stage_3``: a few steps each (steps per second);
3. ``fit trainer=gpu`` killed with SIGKILL once its first step checkpoint is written, then
   ``resume=last`` (it must finish the run's steps);
4. ``export`` of run 1, then ``evaluate`` and ``generate`` with that drafter.

The runs are short and small (batch 4, 16 steps) so that every caption they read is cached beside the shapes
target: the first 64 of the training stream and the first 32 held-out ones (shipped), for a GPU machine
without the caption encoder or network (benchmarks/README.md, "GPU check", says how to cache them).
``--device cpu`` runs the same commands with ``trainer=cpu`` and 2 prompts per decode (the script's own
check), and leaves out the DeepSpeed runs, which need a GPU, with a line saying so.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Short runs that read only cached captions: 16 steps of 4 (64 training captions), two epochs of 8 steps.
RUN = (
    "trainer.max_steps=16",
    "data.batch_size=4",
    "data.samples_per_epoch=32",
    "data.val_samples=16",
    "trainer.checkpoint_every_n_steps=4",
)
CHEAP = ("eval.enabled=false",)  # the runs that check a strategy or a resume, not the evaluation
# The CPU check of the script: one thread a process, one prompt, eagle1 at T = 0 with its acceptance report
# from the same decode, where the GPU decodes the defaults (eagle2 with an untrained drafter drafts one token
# a step: 256 tree steps, over ten minutes a prompt on a busy 2-core CPU).
CPU_EVAL = {
    "vdtrain.fit": (
        "trainer.threads=1",
        "eval.num_prompts=1",
        "eval.methods=[eagle1]",
        "eval.acceptance.method=eagle1",
        "eval.acceptance.temperatures=[0]",
    ),
    "vdtrain.evaluate": (
        "threads=1",
        "eval=fast",
        "num_prompts=1",
        "methods=[eagle1]",
        "acceptance.method=eagle1",
        "acceptance.temperatures=[0]",
    ),
    "vdtrain.generate": ("threads=1", "num_prompts=1"),
}
# The after-epoch evaluation's figures a summary carries: each method's S and speed-up, the acceptance gap.
EVAL_FIGURES = re.compile(r"eval/(\w+_T[\d.]+/(S|speedup)|acceptance/tau_\w+)")
TRAINING_CAPTIONS = 64  # python -m data_prep.captions prompts=shapes_training num_prompts=64
EVAL_PROMPTS = 16  # held-out captions, within the 32 the shapes target ships encoded


@dataclass
class Outcome:
    """One command: what ran, how it ended and what it reported."""

    name: str
    command: list[str]
    rc: int | None = None
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None  # why it did not run
    error: str | None = None  # the end of its output, when it failed


def plan(device: str, work: Path) -> list[tuple[str, list[str], str | None]]:
    """(name, command, why it is left out or None) in the order they run."""

    def app(module: str, *overrides: str) -> list[str]:
        small = CPU_EVAL.get(module, ()) if device == "cpu" else ()
        return [sys.executable, "-m", module, *overrides, *small]

    trainer = "gpu" if device == "cuda" else "cpu"
    gpu_only = None if device == "cuda" else "DeepSpeed needs a GPU: left out on the CPU"
    drafter, on = f"drafter={work / 'export'}", f"device={device}"
    killed = f"hydra.run.dir={work / 'killed'}"
    deepspeed = [
        (
            f"fit_deepspeed_stage_{stage}",
            app(
                "vdtrain.fit",
                f"trainer=deepspeed_stage_{stage}",
                "trainer.devices=1",
                "trainer.max_steps=6",
                *RUN[1:],
                *CHEAP,
                f"hydra.run.dir={work / f'deepspeed_stage_{stage}'}",
            ),
            gpu_only,
        )
        for stage in (2, 3)
    ]
    return [
        ("fit", app("vdtrain.fit", f"trainer={trainer}", *RUN, f"hydra.run.dir={work / 'fit'}"), None),
        *deepspeed,
        ("fit_killed", app("vdtrain.fit", f"trainer={trainer}", *RUN, *CHEAP, killed), None),
        ("fit_resumed", app("vdtrain.fit", "resume=last", killed), None),
        ("export", app("vdtrain.export", f"source={work / 'fit'}", f"out_dir={work / 'export'}"), None),
        (
            "evaluate",
            app(
                "vdtrain.evaluate", drafter, f"num_prompts={EVAL_PROMPTS}", on, f"out_dir={work / 'evaluate'}"
            ),
            None,
        ),
        ("generate", app("vdtrain.generate", drafter, on, f"out_dir={work / 'generate'}"), None),
    ]


def figures(name: str, work: Path) -> dict[str, Any]:
    """What the command left behind that says it worked: the summary's loss, top-1, the callback's S and
    the acceptance gap; steps per second; the evaluation's S and speed-up per method; the image count."""
    if name.startswith("fit"):
        folder = {"fit": "fit", "fit_killed": "killed", "fit_resumed": "killed"}.get(
            name, name.removeprefix("fit_")
        )
        path = work / folder / "summary.json"
        if not path.is_file():
            return {}
        summary = json.loads(path.read_text())
        keys = ("steps", "minutes", "samples_per_s", "val/total", "val/top1", "val/tau_sim")
        out = {k: summary[k] for k in keys if k in summary}
        out |= {k: v for k, v in summary.items() if EVAL_FIGURES.fullmatch(k)}
        if summary.get("minutes"):
            out["steps_per_s"] = summary["steps"] / (summary["minutes"] * 60)
        return out
    if name == "export":
        return (
            {"files": sorted(p.name for p in (work / "export").iterdir())}
            if (work / "export").is_dir()
            else {}
        )
    if name == "evaluate":
        path = work / "evaluate" / "results.json"
        if not path.is_file():
            return {}
        rows = json.loads(path.read_text())["results"]
        return {f"{r['method']}_T{r['temperature']:g}": {"S": r["S"], "speedup": r["speedup"]} for r in rows}
    if name == "generate":
        path = work / "generate" / "stats.json"
        return {"images": len(json.loads(path.read_text())["samples"])} if path.is_file() else {}
    return {}


def run_one(name: str, command: list[str], work: Path, timeout: float) -> Outcome:
    outcome = Outcome(name, command)
    start = time.monotonic()
    if name == "fit_killed":
        outcome.rc, outcome.figures = kill_after_first_checkpoint(command, work / "killed", timeout)
    else:
        try:
            done = subprocess.run(
                command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired as late:
            outcome.error = f"still running after {timeout:.0f} s: {str(late.stderr or '')[-1500:]}"
        else:
            outcome.rc = done.returncode
            if done.returncode:
                outcome.error = (done.stdout + done.stderr)[-2000:]
        outcome.figures = figures(name, work)
    outcome.seconds = round(time.monotonic() - start, 1)
    return outcome


def kill_after_first_checkpoint(command: list[str], run: Path, timeout: float) -> tuple[int | None, dict]:
    """Start the run, SIGKILL it as soon as its first step checkpoint is on disk (a preemption without
    warning: no handler runs), and report what it left."""
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    last = run / "checkpoints" / "last.ckpt"  # published by a rename (DeepSpeed's: a folder)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None and not last.exists():
        time.sleep(0.2)
    killed = process.poll() is None
    process.send_signal(signal.SIGKILL) if killed else None
    rc = process.wait()
    return rc, {
        "killed": killed and last.exists(),
        "checkpoints": sorted(p.name for p in last.parent.glob("*")),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--work", type=Path, required=True, help="a new folder for the runs")
    parser.add_argument("--out", type=Path, required=True, help="the JSON written after every command")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one command may take")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    outcomes: list[Outcome] = []
    for name, command, why_not in plan(args.device, args.work):
        if why_not is not None:
            outcome = Outcome(name, command, skipped=why_not)
            print(f"{name}: {why_not}", flush=True)
        else:
            outcome = run_one(name, command, args.work, args.timeout)
            status = "ok" if outcome.rc == 0 or outcome.figures.get("killed") else f"exit {outcome.rc}"
            print(f"{name}: {status} in {outcome.seconds:.0f}s {json.dumps(outcome.figures)}", flush=True)
            if outcome.error:
                print(outcome.error, flush=True)
        outcomes.append(outcome)
        report = {"device": args.device, "commands": [asdict(o) for o in outcomes]}
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    failed = [o.name for o in outcomes if o.skipped is None and not (o.rc == 0 or o.figures.get("killed"))]
    print(f"user commands: {len(outcomes) - len(failed)} of {len(outcomes)} fine; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
