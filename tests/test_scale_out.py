"""Decoding on 2 CPU processes (``torchrun``, gloo) gives what one process gives (``vdtrain.sharding``).

One launch per entry point, shared by its assertions: ``vdtrain.evaluate`` (killed on rank 1 mid-run,
then started again), ``vdtrain.generate``, ``data_prep.self_generate`` with an exact method, and the
after-epoch callback under 2-process DDP. The one-process side runs in this process. The shipped shapes
target and drafter keep every decode small.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from test_fit import CONF, REPO, fit_config, free_port, sub_env

from vdtrain.data.shards import read_shards
from vdtrain.prompts import shapes_heldout_captions

pytestmark = pytest.mark.slow

# Wall-clock fields: everything else must match whatever the world size.
WALL_CLOCK = {
    "speedup",
    "speedup_low",
    "speedup_high",
    "speedup_rounds",
    "speedup_with_vq_decode",
    "method_seconds",
    "ar_seconds",
    "startup_seconds",
    "paper_speedup",
    "images_per_second",
    "world_size",
    "batch_latency_s",
    "batch_latency_with_vq_decode_s",
    "mean_latency_per_image_s",
}

# Runs a module as torchrun's script; on rank 1 the second unit it saves is left half written and the
# process killed, as a crash or a preempted node would.
KILL_RANK_1 = """
import os, runpy, signal, sys
from vdtrain import sharding

if os.environ["RANK"] == "1":
    save, saved = sharding.UnitStore.save, []

    def dying_save(self, key, record):
        if saved:
            path = self.path(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.with_name(path.name + ".tmp").write_bytes(b"half a unit")
            os.kill(os.getpid(), signal.SIGKILL)
        saved.append(key)
        save(self, key, record)

    sharding.UnitStore.save = dying_save
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def child_env() -> dict[str, str]:
    """The children import this checkout, as this process does."""
    paths = [str(REPO), *(p for p in sys.path if p)]
    return {**sub_env(), "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


def torchrun(cwd: Path, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args]
    return subprocess.run(command, cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=timeout)


def compose_app(name: str, *overrides: str):
    with initialize_config_dir(str(CONF), version_base=None):
        return compose(name, overrides=list(overrides))


def same_values(a: list[dict], b: list[dict]) -> None:
    strip = [[{k: v for k, v in x.items() if k not in WALL_CLOCK} for x in rows] for rows in (a, b)]
    assert strip[0] == strip[1]


def same_images(a: Path, b: Path) -> None:
    names = sorted(p.relative_to(a) for p in a.rglob("*.png"))
    assert names and names == sorted(p.relative_to(b) for p in b.rglob("*.png"))
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


# --- vdtrain.evaluate: killed on rank 1, started again ---------------------------------------------------
# threads=1 everywhere: a busy 2-core machine runs several torch threads per process far slower than one
EVALUATE = ("eval=fast", "num_prompts=4", "batch_size=1", "temperatures=[1]", "acceptance.enabled=false",
            "plots=false", "threads=1", "speed_repeats=0")  # fmt: skip


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    from vdtrain.evaluate import run

    root = tmp_path_factory.mktemp("evaluate")
    run(compose_app("evaluate", *EVALUATE, f"out_dir={root / 'one'}"))
    script = root / "kill_rank_1.py"
    script.write_text(textwrap.dedent(KILL_RANK_1))
    out = root / "two"
    killed = torchrun(root, str(script), "vdtrain.evaluate", *EVALUATE, f"out_dir={out}")
    before = {p: p.stat().st_mtime_ns for p in (out / "units").rglob("*.pt")}
    half = sorted((out / "units").rglob("*.tmp"))
    merged = (out / "results.json").exists()
    again = torchrun(root, "-m", "vdtrain.evaluate", *EVALUATE, f"out_dir={out}")
    return root / "one", out, (killed, merged), before, half, again


def test_evaluate_killed_on_one_rank_resumes_only_its_unfinished_units(evaluated):
    _, out, (killed, merged), before, half, again = evaluated
    assert killed.returncode != 0 and "Signal 9" in killed.stderr and not merged
    assert [p.name for p in half] == ["000003.pt.tmp"]  # rank 1's second unit (prompts 2, 3 are its part)
    assert out / "units" / "ar_T1" / "000002.pt" in before  # its first, finished before the kill
    assert again.returncode == 0, again.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in before} == before  # finished units were not decoded again
    assert len(list((out / "units").rglob("*.pt"))) == 2 * 4 and not list(out.rglob("*.tmp"))


def test_evaluate_on_two_processes_gives_the_one_process_table(evaluated):
    one, two, *_ = evaluated
    rows = [json.loads((folder / "results.json").read_text()) for folder in (one, two)]
    same_values(rows[0]["results"], rows[1]["results"])
    assert {r["world_size"] for r in rows[1]["results"]} == {2} and rows[1]["settings"]["world_size"] == 2
    assert "cpu ×2" in (two / "results.md").read_text()
    same_images(one / "images", two / "images")


# --- vdtrain.generate --------------------------------------------------------------------------------
GENERATE = ("decode=eagle2", "num_prompts=4", "batch_size=2", "sampling.temperature=1", "save_grid=false",
            "threads=1")  # fmt: skip


def test_generate_on_two_processes_gives_the_one_process_samples(tmp_path):
    from vdtrain.generate import run

    run(compose_app("generate", *GENERATE, f"out_dir={tmp_path / 'one'}"))
    two = torchrun(tmp_path, "-m", "vdtrain.generate", *GENERATE, f"out_dir={tmp_path / 'two'}")
    assert two.returncode == 0, two.stderr[-3000:]
    stats = [json.loads((tmp_path / f / "stats.json").read_text()) for f in ("one", "two")]
    same_values(stats[0]["samples"], stats[1]["samples"])
    same_values([stats[0]["summary"]], [stats[1]["summary"]])
    assert stats[1]["summary"]["world_size"] == 2 and stats[1]["summary"]["images_per_second"] > 0
    same_images(tmp_path / "one", tmp_path / "two")


# --- data_prep.self_generate with an exact method ------------------------------------------------------
def test_self_generate_with_eagle2_on_two_processes_gives_the_one_process_shards(tmp_path):
    from data_prep.self_generate import run

    captions = tmp_path / "captions.txt"
    captions.write_text("\n".join(shapes_heldout_captions(4)) + "\n")
    args = (f"captions={captions}", "num_samples=4", "samples_per_shard=2", "batch_size=2", "method=eagle2",
            "drafter=checkpoints/shapes/drafter", "threads=1")  # fmt: skip
    run(compose_app("data_prep/self_generate", *args, f"out_dir={tmp_path / 'one'}"))
    two = torchrun(tmp_path, "-m", "data_prep.self_generate", *args, f"out_dir={tmp_path / 'two'}")
    assert two.returncode == 0, two.stderr[-3000:]
    samples = [list(read_shards(tmp_path / f)) for f in ("one", "two")]
    assert len(samples[0]) == 4 and {s["meta"]["method"] for s in samples[1]} == {"eagle2"}
    for a, b in zip(*samples, strict=True):
        assert a["key"] == b["key"] and a["meta"] == b["meta"] and np.array_equal(a["tokens"], b["tokens"])
    manifests = [json.loads((tmp_path / f / "manifest.json").read_text()) for f in ("one", "two")]
    assert manifests[1]["complete"] and manifests[1]["source"]["method"] == "eagle2"
    assert [s["samples"] for s in manifests[0]["shards"]] == [s["samples"] for s in manifests[1]["shards"]]


# --- the after-epoch callback under DDP ------------------------------------------------------------------
# lr 0: both runs measure the same (initial) drafter, whatever data each rank trained on. One step is
# one epoch (4 samples), so the callback decodes once.
CALLBACK = ("eval.enabled=true", "eval.num_prompts=4", "eval.batch_size=2", "optim.lr=0",
            "trainer.max_steps=1", "data.samples_per_epoch=4", "trainer.threads=1")  # fmt: skip


def test_the_callback_under_two_process_ddp_logs_the_one_process_numbers(tiny_folder, tmp_path):
    from vdtrain.fit import fit

    fit(fit_config(tiny_folder, tmp_path / "one", *CALLBACK))
    command = [sys.executable, "-m", "vdtrain.fit", "trainer=ddp_cpu", f"target.folder={tiny_folder}",
               f"hydra.run.dir={tmp_path / 'two'}", "data.batch_size=2", "data.val_samples=0",
               *CALLBACK]  # fmt: skip
    two = subprocess.run(command, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=400)
    assert two.returncode == 0, two.stderr[-3000:]
    latest = [tmp_path / f / "eval" / "latest" for f in ("one", "two")]
    rows = [json.loads((folder / "results.json").read_text())["results"] for folder in latest]
    same_values(rows[0], rows[1])
    assert [r["world_size"] for r in rows[1]] == [2, 2]
    reports = [json.loads((folder / "acceptance.json").read_text()) for folder in latest]
    assert reports[0] == reports[1]
