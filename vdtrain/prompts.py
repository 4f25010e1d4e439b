"""Prompt sets: caption files in the common formats, and the shapes world's held-out captions."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

from vdtrain.shapes.scene import HELDOUT_SEED, generate


def shapes_heldout_captions(n: int) -> list[str]:
    return [s.caption for s in generate(n, HELDOUT_SEED)]


def read_captions(path: str | os.PathLike[str]) -> list[str]:
    """Captions from ``.txt`` (one per line), ``.json`` (a list of strings, or COCO ``annotations``),
    ``.csv``/``.tsv`` (the ``Prompt``/``caption`` column, else the first)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"caption file not found: {str(path)!r}")
    suffix = path.suffix.lower()
    if suffix == ".txt":
        captions = [line.strip() for line in path.read_text().splitlines()]
    elif suffix == ".json":
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "annotations" in data:
            captions = [a["caption"].strip() for a in data["annotations"]]
        elif isinstance(data, list) and all(isinstance(c, str) for c in data):
            captions = [c.strip() for c in data]
        else:
            raise ValueError(f"{path}: expected a JSON list of strings or a COCO captions file")
    elif suffix in (".csv", ".tsv"):
        with path.open(newline="") as f:
            rows = list(csv.reader(f, delimiter="\t" if suffix == ".tsv" else ","))
        header = [h.strip().lower() for h in rows[0]]
        column = next((header.index(n) for n in ("prompt", "caption", "text") if n in header), None)
        captions = [row[column or 0].strip() for row in (rows[1:] if column is not None else rows) if row]
    else:
        raise ValueError(f"{path}: unsupported caption file type {suffix!r} (use .txt, .json, .csv or .tsv)")
    captions = [c for c in captions if c]
    if not captions:
        raise ValueError(f"{path}: no captions found")
    return captions
