"""Caption files in every supported format, including the vendored MS-COCO and PartiPrompts sets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vdtrain.prompts import read_captions, shapes_heldout_captions

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def test_formats(tmp_path):
    (tmp_path / "a.txt").write_text("one\n\ntwo\n")
    (tmp_path / "b.json").write_text(json.dumps(["x", " y "]))
    (tmp_path / "c.json").write_text(json.dumps({"annotations": [{"caption": "coco cap "}]}))
    (tmp_path / "d.csv").write_text('Prompt\n"first, with comma"\nsecond\n')
    (tmp_path / "e.tsv").write_text("Prompt\tCategory\np1\tc\np2\tc\n")
    assert read_captions(tmp_path / "a.txt") == ["one", "two"]
    assert read_captions(tmp_path / "b.json") == ["x", "y"]
    assert read_captions(tmp_path / "c.json") == ["coco cap"]
    assert read_captions(tmp_path / "d.csv") == ["first, with comma", "second"]
    assert read_captions(tmp_path / "e.tsv") == ["p1", "p2"]


def test_bad_caption_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.txt"):
        read_captions(tmp_path / "nope.txt")
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ValueError, match="no captions"):
        read_captions(tmp_path / "empty.txt")
    (tmp_path / "x.parquet").write_text("")
    with pytest.raises(ValueError, match="unsupported"):
        read_captions(tmp_path / "x.parquet")


@pytest.mark.skipif(not SHARED.exists(), reason="shared data folder not beside the checkout")
def test_shared_prompt_sets():
    assert len(read_captions(SHARED / "prompts" / "PartiPrompts.tsv")) == 1632
    assert len(read_captions(SHARED / "prompts" / "captions_val2017_longest.json")) == 5000
    assert len(read_captions(SHARED / "prompts" / "coco2014_val_captions_30k.csv")) == 30000


def test_heldout_shapes_captions_are_deterministic():
    assert shapes_heldout_captions(5) == shapes_heldout_captions(5)
