"""Today's decodes, pinned (issue #56): the tokens at T = 0 and the samples at T = 1 on fixed seeds of every
preset (conf/decode/) with every drafter kind that can serve it. A refactor of the decode side must leave
them all as they are. (The step kernels' op counts are not pinned here: at XL depth one preset takes over a
minute on a loaded 2-core CPU; tests/test_kernel_budget.py bounds AR's, eagle2's and sjd's.)

The fixture (tests/data/pinned_decodes.json) was recorded on the code before that refactor; regenerate it,
only where a change of decodes is meant, with

    PIN_DECODES=write python -m pytest -q tests/test_pinned_decodes.py

Each decode runs on the tiny target of tests/conftest.py (a 4 × 4 image, 24 codes), batch 2, with a random
drafter of the kind (``random_drafter``): its drafts are partly accepted, so the committed tokens per step
and the drafter forwards are pinned with the tokens.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import random_drafter, random_gpt, random_vq, tiny_condition

from vdtrain.decode.methods import build_method, load_preset, preset_names
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.drafters import DRAFTERS
from vdtrain.targets.llamagen import LlamaGenTarget, VQTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

FIXTURE = Path(__file__).parent / "data" / "pinned_decodes.json"
WRITE = os.environ.get("PIN_DECODES") == "write"
TEMPERATURES = (0.0, 1.0)


def tiny_target() -> LlamaGenTarget:
    return LlamaGenTarget(
        random_gpt(), VQTokenizer(random_vq(), image_size=8), None, "tiny", SamplingConfig(cfg_scale=2.0)
    )


def cases() -> list[tuple[str, str | None]]:
    """(preset, drafter kind) for each kind that can serve it; kind ``None`` for a drafter-free preset."""
    target = tiny_target()
    block_kinds = {kind for kind in DRAFTERS if random_drafter(target, kind=kind).block_slots}
    out: list[tuple[str, str | None]] = []
    for name in preset_names():
        config = load_preset(name)
        if not config.needs_drafter:
            out.append((name, None))
            continue
        out += [(name, kind) for kind in DRAFTERS if not config.drafts_blocks or kind in block_kinds]
    return out


def decode(name: str, kind: str | None, temperature: float, cache_dir: Path) -> dict:
    """One decode of two prompts, seeds 100 and 101: the tokens and each prompt's per-step counts."""
    target = tiny_target()
    config = load_preset(name, {"acceptance": {"cache_dir": str(cache_dir)}})
    drafter = random_drafter(target, kind=kind) if kind else None
    sampling = SamplingConfig(cfg_scale=2.0, temperature=temperature)
    engine = build_method(config, target, drafter, sampling)
    gens = [torch.Generator().manual_seed(100 + i) for i in range(2)]
    result = engine.generate(tiny_condition(batch=2, seed=7), gens)
    return {
        "tokens": result.tokens.tolist(),
        "committed": [s.committed_per_step for s in result.stats],
        "drafter_forwards": [s.drafter_forwards for s in result.stats],
        "target_forwards": [s.target_forwards for s in result.stats],
    }


def key(name: str, kind: str | None, temperature: float) -> str:
    return f"{name}/{kind or '-'}/T={temperature:g}"


def record(cache_dir: Path) -> str:
    """The fixture's text: one decode a line, so a change shows as the lines of the decodes it changed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as ``one_thread``: tiny models decode fastest so
    try:
        decodes = {key(n, k, t): decode(n, k, t, cache_dir) for n, k in cases() for t in TEMPERATURES}
    finally:
        torch.set_num_threads(threads)
    lines = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in decodes.items())
    return '{"decodes": {\n' + lines + "\n}}\n"


@pytest.fixture(scope="module")
def pinned(tmp_path_factory) -> dict:
    if WRITE:
        FIXTURE.write_text(record(tmp_path_factory.mktemp("neighbours")))
    return json.loads(FIXTURE.read_text())


def test_every_preset_and_kind_is_pinned(pinned):
    assert set(pinned["decodes"]) == {key(n, k, t) for n, k in cases() for t in TEMPERATURES}


@pytest.mark.parametrize(("name", "kind"), cases(), ids=[f"{n}-{k}" for n, k in cases()])
def test_decodes_are_unchanged(pinned, name, kind, tmp_path):
    for temperature in TEMPERATURES:
        assert decode(name, kind, temperature, tmp_path) == pinned["decodes"][key(name, kind, temperature)], (
            f"{name} with {kind} at T = {temperature:g}"
        )
