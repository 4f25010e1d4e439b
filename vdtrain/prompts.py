"""Prompt sets: caption files in the common formats, the vendored sets (``eval/prompt_sets``) and the
shapes world's held-out captions."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vdtrain.shapes.scene import HELDOUT_SEED, TRAIN_SEED, VALIDATION_SEED, generate

log = logging.getLogger(__name__)

PROMPT_SETS_DIR = Path(__file__).resolve().parent / "eval" / "prompt_sets"
# Vendored prompt sets by name (sources, licences and derivation: eval/prompt_sets/README.md).
PROMPT_SETS = {
    "partiprompts": "PartiPrompts.tsv",
    "coco2017_val": "coco2017_val.txt",
    "coco2014_val_30k": "coco2014_val_30k.csv",
}


def shapes_heldout_captions(n: int) -> list[str]:
    return [s.caption for s in generate(n, HELDOUT_SEED)]


def shapes_validation_captions(n: int) -> list[str]:
    """Captions for choosing decoding knobs (the embedded worlds share them); never the held-out ones."""
    return [s.caption for s in generate(n, VALIDATION_SEED)]


def shapes_training_captions(n: int) -> list[str]:
    """The first ``n`` captions of ``fit``'s procedural training stream (``data=shapes``): a run that
    consumes ``n`` samples or fewer, over all ranks, trains on these (to cache them for a GPU machine
    without the caption encoder)."""
    return [s.caption for s in generate(n, TRAIN_SEED)]


def prompt_set(name: str) -> list[str]:
    """A vendored prompt set by name: ``partiprompts`` (1632), ``coco2017_val`` (5000) or
    ``coco2014_val_30k`` (30 000)."""
    if name not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {name!r}; vendored: {sorted(PROMPT_SETS)}")
    return read_captions(PROMPT_SETS_DIR / PROMPT_SETS[name])


def prompts_for_run(
    source: str | os.PathLike[str] | None, n: int, column: str | None = None, note_fewer: bool = True
) -> list[str]:
    """The first ``n`` prompts of ``source``: held-out shapes captions (None), the validation ones
    (``shapes_validation``), the training stream's (``shapes_training``), a vendored set's name, or a
    caption file (``read_captions``; ``column`` names a table's caption column). ``n`` < 1 is refused
    before anything is read. A source with fewer captions gives them all, with a note (``note_fewer``)
    that more were asked for."""
    if n < 1:
        raise ValueError(f"num_prompts must be at least 1, got {n}")
    if source is None:
        captions = shapes_heldout_captions(n)
    elif str(source) == "shapes_validation":
        captions = shapes_validation_captions(n)
    elif str(source) == "shapes_training":
        captions = shapes_training_captions(n)
    elif str(source) in PROMPT_SETS:
        captions = prompt_set(str(source))
    else:
        captions = read_captions(source, column)
    if note_fewer and len(captions) < n:
        have = len(captions)
        log.warning(
            "%s holds %d captions, num_prompts=%d asked for more: using those %d", source, have, n, have
        )
    return captions[:n]


def _read_text(path: Path) -> str:
    """The file as UTF-8 text (a leading byte-order mark dropped), or an error naming the file and the
    first bad byte."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}); "
            "save the caption file as UTF-8"
        ) from err


def _json_captions(path: Path) -> list[str]:
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from err
    if isinstance(data, dict) and isinstance(data.get("annotations"), list):
        data = [a.get("caption") if isinstance(a, dict) else None for a in data["annotations"]]
        if not all(isinstance(c, str) for c in data):
            raise ValueError(f"{path}: a COCO annotation without a string 'caption'")
    elif not (isinstance(data, list) and all(isinstance(c, str) for c in data)):
        raise ValueError(f"{path}: expected a JSON list of strings or a COCO captions file")
    return [c.strip() for c in data]


def _table_captions(path: Path, delimiter: str, column: str | None) -> list[str]:
    """The caption column of a table with a header row: ``column``, else the first of
    ``CAPTION_COLUMNS`` (a header without one is refused rather than read as a caption)."""
    rows = [row for row in csv.reader(io.StringIO(_read_text(path), newline=""), delimiter=delimiter) if row]
    if not rows:
        return []
    header = [h.strip() for h in rows[0]]
    try:
        index = header.index(caption_column(header, column))
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err
    return [row[index].strip() for row in rows[1:] if len(row) > index]


def read_captions(path: str | os.PathLike[str], column: str | None = None) -> list[str]:
    """Captions from ``.txt`` (one per line), ``.json`` (a list of strings, or COCO ``annotations``),
    ``.csv``/``.tsv`` (a header row, and the ``column`` named, else a caption/top_caption/text/prompt
    column). Files are UTF-8; a file that is not, or does not parse, is a ``ValueError`` naming it."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"caption file not found: {str(path)!r}")
    suffix = path.suffix.lower()
    if suffix == ".txt":
        captions = [line.strip() for line in _read_text(path).splitlines()]
    elif suffix == ".json":
        captions = _json_captions(path)
    elif suffix in (".csv", ".tsv"):
        captions = _table_captions(path, "\t" if suffix == ".tsv" else ",", column)
    else:
        raise ValueError(f"{path}: unsupported caption file type {suffix!r} (use .txt, .json, .csv or .tsv)")
    captions = [c for c in captions if c]
    if not captions:
        raise ValueError(f"{path}: no captions found")
    return captions


# Table formats ``datasets`` reads from local files, by suffix: (builder, extra load_dataset arguments).
TABLE_FORMATS: dict[str, tuple[str, dict[str, Any]]] = {
    ".parquet": ("parquet", {}),
    ".csv": ("csv", {}),
    ".tsv": ("csv", {"delimiter": "\t"}),
    ".json": ("json", {}),
    ".jsonl": ("json", {}),
    ".arrow": ("arrow", {}),
}
CAPTION_COLUMNS = ("caption", "top_caption", "text", "prompt")  # matched case-insensitively, in order


def load_table(
    source: str | os.PathLike[str],
    split: str = "train",
    cache_dir: str | os.PathLike[str] | None = None,
    **kwargs: Any,
):
    """A ``datasets.Dataset`` from a local table file (parquet, csv, tsv, json/jsonl, arrow), a local
    dataset folder, or a Hub dataset id (e.g. ``laion/laion-coco``, which needs network).

    Local files go through ``datasets.load_dataset(<format>, data_files=...)``; ``kwargs`` pass on
    (e.g. ``field="annotations"`` for a COCO captions json).
    """
    import datasets

    path = Path(source).expanduser()
    cache = None if cache_dir is None else str(cache_dir)
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix not in TABLE_FORMATS:
            raise ValueError(f"{path}: unsupported table type {suffix!r}; use one of {sorted(TABLE_FORMATS)}")
        builder, extra = TABLE_FORMATS[suffix]
        with _naming(path, f"a {suffix} table"):
            return datasets.load_dataset(
                builder, data_files=str(path), split=split, cache_dir=cache, **{**extra, **kwargs}
            )
    if path.exists() or str(source).startswith((".", "/", "~")):
        if not path.exists():
            raise FileNotFoundError(f"table not found: {str(path)!r}")
        with _naming(path, "a dataset folder"):
            return datasets.load_dataset(str(path), split=split, cache_dir=cache, **kwargs)
    return datasets.load_dataset(str(source), split=split, cache_dir=cache, **kwargs)


@contextlib.contextmanager
def _naming(path: Path, what: str) -> Iterator[None]:
    """``datasets`` reports a bad local file as "An error occurred while generating the dataset" (or a
    bare StopIteration for an empty one): say which file, and what the underlying error was."""
    try:
        yield
    except Exception as err:
        cause = err.__cause__ or err.__context__ or err
        raise ValueError(
            f"{path}: cannot be read as {what} (is it UTF-8, well-formed and not empty?): "
            f"{type(cause).__name__}: {cause}"
        ) from err


def caption_column(columns: list[str], column: str | None = None) -> str:
    """``column`` if given (it must exist), else the first of ``CAPTION_COLUMNS`` present."""
    if column is not None:
        if column not in columns:
            raise ValueError(f"no column caption_column={column!r}; the table has columns {columns}")
        return column
    lower = {c.lower(): c for c in columns}
    found = next((lower[n] for n in CAPTION_COLUMNS if n in lower), None)
    if found is None:
        raise ValueError(
            f"no caption column ({', '.join(CAPTION_COLUMNS)}) among the columns {columns}; "
            "name the one that holds captions with caption_column=<name>"
        )
    return found


def read_caption_table(
    source: str | os.PathLike[str],
    column: str | None = None,
    split: str = "train",
    cache_dir: str | os.PathLike[str] | None = None,
    **kwargs: Any,
) -> list[str]:
    """Captions from a table read through ``datasets`` (see ``load_table``): the ``column`` named, else
    the first of caption / top_caption / text / prompt. Empty and missing captions are dropped."""
    table = load_table(source, split=split, cache_dir=cache_dir, **kwargs)
    name = caption_column(list(table.column_names), column)
    captions = [c.strip() for c in table[name] if isinstance(c, str) and c.strip()]
    if not captions:
        raise ValueError(f"{source}: no captions found in column {name!r}")
    return captions


def load_captions(
    source: str | os.PathLike[str],
    column: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    **kwargs: Any,
) -> list[str]:
    """Captions from any supported source: ``.txt``/``.json``/``.csv``/``.tsv`` files through
    ``read_captions`` (COCO json and the vendored prompt sets included) unless a ``column`` or extra
    ``load_dataset`` arguments are given; parquet, jsonl, arrow, dataset folders and Hub dataset ids
    through ``read_caption_table``."""
    path = Path(source).expanduser()
    simple = path.suffix.lower() in (".txt", ".json", ".csv", ".tsv")
    if column is None and not kwargs and path.is_file() and simple:
        return read_captions(path)
    return read_caption_table(source, column=column, cache_dir=cache_dir, **kwargs)
