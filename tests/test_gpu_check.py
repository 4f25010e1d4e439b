"""``benchmarks/gpu_check.sh``: the GPU checks in priority order, listed without running them."""

from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_dry_run_lists_the_steps_in_priority_order(tmp_path):
    done = _run("--dry-run", "480", str(tmp_path))
    assert done.returncode == 0, done.stderr
    steps = [line.split(" ")[1] for line in done.stdout.splitlines()[1:]]
    assert steps == ["tests", "xl_graphs", "shapes", "xl_compiled", "evaluate", "train", "xl_eager"]
    assert "-m 'gpu and not slow'" in done.stdout and "--modes graphs" in done.stdout
    assert "--dtype bf16" in done.stdout and "device=cuda" in done.stdout
    assert not any(tmp_path.iterdir())  # a dry run writes nothing


def test_it_refuses_missing_arguments_and_unknown_options(tmp_path):
    assert _run("--dry-run").returncode == 2
    refused = _run("--fast", "10", str(tmp_path))
    assert refused.returncode == 2 and "unknown option --fast" in refused.stderr
