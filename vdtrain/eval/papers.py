"""The step compression S the methods' papers report (``conf/papers.yaml``), and the speedup this
engine would give at that S.

A shipped world's S says little about a real model (the shapes world is far too easy), while the step
cost r (a verified step in AR steps) is this engine's own. ``S_paper / r`` is the speedup a user of a
real LlamaGen-XL can expect from the engine, next to the measured one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

from omegaconf import OmegaConf

PAPERS_FILE = Path(__file__).resolve().parents[2] / "conf" / "papers.yaml"


@dataclass(frozen=True)
class PaperS:
    family: str
    s: float
    source: str


@cache
def _by_preset() -> dict[str, PaperS]:
    families = OmegaConf.to_container(OmegaConf.load(PAPERS_FILE))
    out = {}
    for family, entry in families.items():
        for preset in entry["presets"]:
            if preset in out:
                raise ValueError(f"{PAPERS_FILE}: preset {preset!r} is in two families")
            out[preset] = PaperS(family, float(entry["s"]), str(entry["source"]))
    return out


def paper_s(preset: str) -> PaperS | None:
    """The paper's S for ``preset``'s family, or None when no paper figure applies to it."""
    return _by_preset().get(preset)


def projected_speedup(preset: str, r: float) -> float | None:
    """``S_paper / r``: the speedup at the paper's S for a verified step costing ``r`` AR steps."""
    paper = paper_s(preset)
    return None if paper is None or r <= 0 else paper.s / r
