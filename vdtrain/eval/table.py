"""Evaluation results as rows of plain values, and their Markdown / CSV / JSON renderings.

A row is one (method, temperature) pair: ``EvalRow``. Quality metrics are ``QualityValue``s: a number,
or ``None`` with the reason it is not available (missing weights, metric undefined for the prompts).
Tables never show a number that was not measured.
"""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class QualityValue:
    value: float | None
    note: str = ""  # why the value is missing (or how it was computed)

    def render(self) -> str:
        return f"{self.value:.4g}" if self.value is not None else "not available"


# EvalRow fields read off a clock: everything else is a function of the prompts, seeds and settings
WALL_CLOCK = (
    "speedup",
    "speedup_low",
    "speedup_high",
    "speedup_rounds",
    "speedup_with_vq_decode",
    "method_seconds",
    "ar_seconds",
    "startup_seconds",
    "device",
    "paper_speedup",
    "images_per_second",
    "world_size",  # not a clock, but how many processes shared the clock's work
)


@dataclass
class EvalRow:
    method: str
    temperature: float
    S: float
    tau: float
    mean_depth: float
    TPF: float
    speedup: float  # AR decode seconds / method decode seconds (same prompts, seeds, process, device)
    speedup_with_vq_decode: float
    method_seconds: float
    ar_seconds: float
    identical_to_ar: bool | None = None  # checked at T = 0 only
    # The first decode's extra seconds (step capture, compilation); None where nothing starts up (eager)
    startup_seconds: float | None = None
    device: str = ""  # where the speeds were measured (``cuda:0 (NVIDIA H200)``); "" if not recorded
    skipped_steps: float = 0.0
    relaxed_acceptances: float = 0.0
    target_forwards: float = 0.0
    drafter_forwards: float = 0.0
    verified_steps: float = 0.0
    # The speedup at the paper's S for this method's family (conf/papers.yaml): S_paper / r, with the step
    # cost r = S / speedup as measured here; None where no paper figure applies
    paper_speedup: float | None = None
    # Processes that decoded the row (vdtrain.sharding); method_seconds and ar_seconds add up all of
    # theirs, so speedups are per GPU whatever the world size
    world_size: int = 1
    # Images per second of all processes together: the row's images over the busiest process's seconds
    images_per_second: float | None = None
    # speedup's spread (vdtrain/eval/timing.py): the quartiles of AR's time over the method's in each of
    # speedup_rounds interleaved rounds of one fixed batch, speedup their median; None and 0 where the
    # speedup is the whole run's one ratio (a merge of stored units, or before this was measured)
    speedup_low: float | None = None
    speedup_high: float | None = None
    speedup_rounds: int = 0
    quality: dict[str, QualityValue] = field(default_factory=dict)

    def speedup_clear(self) -> bool:
        """The speedup's spread is no wider than its distance from 1 (``timing.Spread.clear``)."""
        if self.speedup_low is None or self.speedup_high is None:
            return True
        return self.speedup_high - self.speedup_low <= abs(self.speedup - 1.0)

    def score(self, metric: str) -> float:
        """A quality metric's value, NaN where it is not available (comparisons with it are False)."""
        value = self.quality.get(metric)
        return float("nan") if value is None or value.value is None else float(value.value)

    def measured(self) -> dict[str, Any]:
        """``flat`` without the columns that come from the clock (``WALL_CLOCK``): what the same prompts,
        seeds and settings reproduce on any device, process or world size."""
        return {k: v for k, v in self.flat().items() if k not in WALL_CLOCK}

    def flat(self) -> dict[str, Any]:
        """One level of plain values (for CSV and loggers): ``quality/<metric>`` is a float or None."""
        out = {k: v for k, v in asdict(self).items() if k != "quality"}
        for name, q in self.quality.items():
            out[f"quality/{name}"] = q.value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EvalRow:
        data = dict(data)
        quality = {k: QualityValue(**v) for k, v in data.pop("quality", {}).items()}
        return cls(**data, quality=quality)


COLUMNS = [  # (header, row -> cell)
    ("method", lambda r: r.method),
    ("T", lambda r: f"{r.temperature:g}"),
    ("S", lambda r: f"{r.S:.2f}"),
    ("τ", lambda r: f"{r.tau:.2f}"),
    ("d̄", lambda r: f"{r.mean_depth:.2f}"),
    ("TPF", lambda r: f"{r.TPF:.2f}"),
    ("skipped", lambda r: f"{r.skipped_steps:.1f}"),
    ("relaxed", lambda r: f"{r.relaxed_acceptances:.1f}"),
    ("latency speedup", lambda r: speedup_cell(r)),
    ("with VQ decode", lambda r: f"{r.speedup_with_vq_decode:.2f}×"),
    ("at paper S", lambda r: "–" if r.paper_speedup is None else f"{r.paper_speedup:.2f}×"),
    ("= AR", lambda r: {None: "–", True: "yes", False: "NO"}[r.identical_to_ar]),
    ("start-up s", lambda r: "–" if r.startup_seconds is None else f"{r.startup_seconds:.1f}"),
    ("img/s", lambda r: "–" if r.images_per_second is None else f"{r.images_per_second:.3g}"),
]


def speedup_cell(row: EvalRow) -> str:
    """``0.43× (0.40–0.47)``: the median over rounds and its quartiles; ``?`` marks a ratio whose spread
    is wider than its distance from 1 (it cannot tell faster from slower)."""
    if row.speedup_low is None or row.speedup_high is None:
        return f"{row.speedup:.2f}×"
    mark = "" if row.speedup_clear() else " ?"
    return f"{row.speedup:.2f}× ({row.speedup_low:.2f}–{row.speedup_high:.2f}){mark}"


def quality_names(rows: list[EvalRow]) -> list[str]:
    names: list[str] = []
    for row in rows:
        names += [n for n in row.quality if n not in names]
    return names


SPEED_COLUMNS = ("latency speedup", "with VQ decode", "at paper S", "img/s")
CPU_NOTE = (
    "Speeds on a CPU: tree methods are compute-bound there (a tree of n nodes costs about n times an AR "
    "step's arithmetic), so only GPU tables say what a method gains (docs/evaluation.md)."
)
UNCLEAR_NOTE = (
    "? : the speedup's spread over {rounds} interleaved rounds (in brackets, quartiles) is wider than its "
    "distance from 1: this machine's load hid which is faster; measure again on a quiet machine."
)
WORLD_NOTE = (
    "Decoded by {world} processes, one per device: speedups and start-up are per device (every process's "
    "decode seconds added up), img/s is all processes together (the images over the busiest process's "
    "decode seconds)."
)


def to_markdown(rows: list[EvalRow]) -> str:
    """The table; speed columns name the device they were measured on, with a note when it is a CPU."""
    metrics = quality_names(rows)
    devices = sorted({r.device for r in rows if r.device})
    where = devices[0].split(" ")[0] if len(devices) == 1 else None
    worlds = sorted({r.world_size for r in rows})
    if where and worlds != [1]:
        where += " ×" + "/".join(map(str, worlds))
    header = [f"{h} ({where})" if h in SPEED_COLUMNS and where else h for h, _ in COLUMNS] + metrics
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    notes: dict[str, str] = {}
    for row in rows:
        cells = [cell(row) for _, cell in COLUMNS]
        for name in metrics:
            q = row.quality.get(name)
            cells.append("–" if q is None else q.render())
            if q is not None and q.value is None and q.note:
                notes[name] = q.note
        lines.append("| " + " | ".join(cells) + " |")
    lines += [""] + [f"- {name}: not available — {why}" for name, why in notes.items()]
    if devices:
        lines += [f"Speeds measured on {', '.join(devices)}."]
        if worlds != [1]:
            lines.append(WORLD_NOTE.format(world="/".join(map(str, worlds))))
        if any(d.startswith("cpu") for d in devices):
            lines.append(CPU_NOTE)
    unclear = [r for r in rows if not r.speedup_clear()]
    if unclear:
        lines.append(UNCLEAR_NOTE.format(rounds=unclear[0].speedup_rounds))
    return "\n".join(lines).rstrip() + "\n"


def to_csv(rows: list[EvalRow]) -> str:
    flat = [r.flat() for r in rows]
    fields = list(dict.fromkeys(k for f in flat for k in f))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=fields)
    writer.writeheader()
    for f in flat:
        writer.writerow({k: "" if v is None else v for k, v in f.items()})
    return buffer.getvalue()


def to_json(rows: list[EvalRow], settings: dict[str, Any]) -> str:
    """The rows plus the settings that made them (``read_results`` reads it back)."""
    payload = {"settings": settings, "results": [asdict(r) for r in rows]}
    return json.dumps(payload, indent=2) + "\n"


def write_tables(rows: list[EvalRow], folder: str | os.PathLike[str], settings: dict[str, Any]) -> Path:
    """``results.md``, ``results.csv`` and ``results.json`` (rows plus the settings that made them)."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(to_markdown(rows))
    (out / "results.csv").write_text(to_csv(rows))
    (out / "results.json").write_text(to_json(rows, settings))
    return out


def read_results(path: str | os.PathLike[str]) -> tuple[list[EvalRow], dict[str, Any]]:
    """Rows and settings back from a ``results.json`` (or the folder holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    data = json.loads(path.read_text())
    return [EvalRow.from_dict(r) for r in data["results"]], data.get("settings", {})
