"""Caption files in every supported format, including the vendored MS-COCO and PartiPrompts sets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vdtrain.prompts import load_captions, read_captions, shapes_heldout_captions

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


BAD_FILES = {
    "latin1.txt": (b"caf\xe9 au lait\n", r"not UTF-8 text \(byte 0xe9 at offset 3\)"),
    "latin1.csv": (b"Prompt\ncaf\xe9\n", "not UTF-8 text"),
    "empty.csv": (b"", "no captions found"),
    "blank.tsv": (b"\n\n", "no captions found"),
    "header_only.csv": (b"Prompt,Category\n", "no captions found"),
    "broken.json": (b'["a red square", ', "not valid JSON"),
    "coco_without_captions.json": (b'{"annotations": [{"image_id": 1}]}', "without a string 'caption'"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_caption_files_are_value_errors_naming_the_file(tmp_path, name):
    content, message = BAD_FILES[name]
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=message) as info:
        read_captions(tmp_path / name)
    assert str(tmp_path / name) in str(info.value)


@pytest.mark.parametrize(
    ("name", "content", "cause"),
    [
        ("empty.csv", b"", "EmptyDataError"),
        ("latin1.csv", b"caption\ncaf\xe9\n", "UnicodeDecodeError"),
        ("empty.jsonl", b"", "StopIteration"),
        ("broken.jsonl", b'{"caption": "a"', "JSON parse error"),
    ],
)
def test_bad_tables_read_through_datasets_name_the_file(tmp_path, name, content, cause):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=f"cannot be read as a .{name.split('.')[1]} table") as info:
        load_captions(tmp_path / name, column="caption", cache_dir=tmp_path / "cache")
    assert str(tmp_path / name) in str(info.value) and cause in str(info.value)


def test_a_byte_order_mark_and_short_rows_are_read(tmp_path):
    (tmp_path / "excel.csv").write_bytes("\ufeffPrompt,Category\nfirst,a\n\nsecond\n".encode())
    (tmp_path / "ragged.csv").write_text("Category,Prompt\nc,p1\nonly-one-field\nc,p2\n")
    assert read_captions(tmp_path / "excel.csv") == ["first", "second"]
    assert read_captions(tmp_path / "ragged.csv") == ["p1", "p2"]


@pytest.mark.skipif(not SHARED.exists(), reason="shared data folder not beside the checkout")
def test_shared_prompt_sets():
    assert len(read_captions(SHARED / "prompts" / "PartiPrompts.tsv")) == 1632
    assert len(read_captions(SHARED / "prompts" / "captions_val2017_longest.json")) == 5000
    assert len(read_captions(SHARED / "prompts" / "coco2014_val_captions_30k.csv")) == 30000


def test_heldout_shapes_captions_are_deterministic():
    assert shapes_heldout_captions(5) == shapes_heldout_captions(5)
