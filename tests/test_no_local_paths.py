"""No tracked JSON or YAML file holds an absolute local path: what ships must not carry one machine's
folder layout (a run folder, a home directory), as exports redact theirs (``redact_local_paths``)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _strings(value: object) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _tracked(*suffixes: str) -> list[Path]:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / f for f in files.stdout.split() if f.endswith(suffixes)]


def _absolute_paths(text: str) -> list[str]:
    """Absolute paths among a string's words (a command keeps them as ``key=/a/b`` or ``/a/b``)."""
    words = [w.partition("=")[2] or w for w in text.split()]
    words = [w for w in words if not w.startswith("/hydra/")]  # Hydra's config groups, not folders
    return [w for w in words if (os.path.isabs(w) and len(w) > 1 and "/" in w[1:]) or w.startswith("~/")]


def _without_defaults_list(data: object) -> object:
    """A Hydra defaults list names config groups (``/decode_parts/tree@tree``), not folders."""
    if isinstance(data, dict):
        return {k: v for k, v in data.items() if k != "defaults"}
    return data


def _local_paths(data: object) -> list[str]:
    return [p for s in _strings(data) for p in _absolute_paths(s)]


def test_no_tracked_config_or_result_names_a_local_folder():
    files = _tracked(".json", ".yaml", ".yml")
    assert any(f.name == "config.json" and "drafter" in f.parts for f in files)
    found = {}
    for path in files:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else _without_defaults_list(yaml.safe_load(text))
        bad = _local_paths(data)
        if bad:
            found[str(path.relative_to(ROOT))] = bad[:3]
    assert not found, found


def test_the_check_sees_an_absolute_path():
    assert _absolute_paths("python -m vdtrain.fit out_dir=/work/runs/a") == ["/work/runs/a"]
    assert _absolute_paths("/home/me/drafter") == ["/home/me/drafter"]
    assert _absolute_paths("checkpoints/shapes/target $OUT/shapes.json a/b /hydra/job_logging") == []


def test_a_defaults_list_is_not_read_as_folders_but_its_values_still_are():
    preset = yaml.safe_load("defaults:\n  - /decode_parts/tree@tree: dynamic\nout_dir: /work/runs/a\n")
    assert _local_paths(_without_defaults_list(preset)) == ["/work/runs/a"]
