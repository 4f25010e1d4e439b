"""The step-cost guard: each measured r against the r recorded for the same row at a named commit
(``conf/benchmarks/step_cost_reference.yaml``), so a slower step shows up in the benchmark that measures
it instead of weeks later. ``step_cost`` exits with ``EXCEEDED`` when a row's r passes its reference by
more than the device's margin; the margins are wide on a shared CPU, where r moves by a quarter from run
to run (docs/decoding.md, "Step cost")."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REFERENCE = Path(__file__).resolve().parents[1] / "conf" / "benchmarks" / "step_cost_reference.yaml"
EXCEEDED = 3  # step_cost's exit status when a row's r passed its reference by more than the margin


@dataclass(frozen=True)
class Reference:
    """The r of one step_cost row (target, preset, batch, mode, device type, dtype, temperature: None for
    the target's own) as measured at ``commit``."""

    target: str
    preset: str
    batch: int
    mode: str
    device: str
    dtype: str
    temperature: float | None
    r: float
    ar_step_ms: float  # AR's step then: a row whose AR step is far from it ran on a busier machine
    commit: str
    where: str  # the machine and command it was measured with

    @property
    def key(self) -> tuple:
        return (self.target, self.preset, self.batch, self.mode, self.device, self.dtype, self.temperature)


def load(path: Path = REFERENCE) -> tuple[dict[str, float], float, dict[tuple, Reference]]:
    """(margin per device type, load factor, references by row key)."""
    raw = yaml.safe_load(path.read_text())
    refs = {}
    for entry in raw["references"]:
        ref = Reference(**{**raw["defaults"], **entry})
        refs[ref.key] = ref
    return raw["margin"], raw["load_factor"], refs


def check(rows: Iterable[Any], settings: Mapping[str, Any], path: Path = REFERENCE) -> int:
    """Print each row's r beside its reference; ``EXCEEDED`` when some r passed it by more than the
    margin, else 0. ``rows`` are step_cost rows; ``settings`` its arguments (device, dtype, temperature)."""
    margins, load_factor, refs = load(path)
    device = str(settings["device"]).split(":")[0]
    status = 0
    for row in rows:
        key = (
            row.target,
            row.preset,
            row.batch,
            row.mode,
            device,
            settings["dtype"],
            settings["temperature"],
        )
        ref = refs.get(key)
        if ref is None:
            continue
        change = row.r / ref.r - 1
        label = f"{row.target} {row.preset} B {row.batch} {row.mode}: r {row.r:.2f}"
        label += f" vs {ref.r:.2f} at {ref.commit}"
        if not 1 / load_factor <= row.ar_step_ms / ref.ar_step_ms <= load_factor:
            print(
                f"step_cost guard: {label} not compared: AR step {row.ar_step_ms:.2f} ms vs "
                f"{ref.ar_step_ms:.2f} ms then (another load or machine; r moves with it)"
            )
        elif change > margins[device]:
            status = EXCEEDED
            print(
                f"step_cost guard: {label} ({ref.where}), {change:+.0%}, over the {margins[device]:.0%} "
                "margin: a slower step since that commit, or a busier machine (rerun before bisecting)"
            )
        else:
            print(f"step_cost guard: {label}, {change:+.0%} (margin {margins[device]:.0%})")
    return status
