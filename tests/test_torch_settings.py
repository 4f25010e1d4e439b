"""No code patches torch's config modules in a way pytest ≥ 9 undoes by deleting (issue #53)."""

from pathlib import Path

import pytest
import torch
from torch_settings import missing_settings, restore, setting_names, settings_patches

ROOT = Path(__file__).resolve().parent.parent


def test_no_code_patches_torch_settings_with_monkeypatch_or_mock():
    folders = ("vdtrain", "tests", "benchmarks", "data_prep")
    paths = [p for folder in folders for p in (ROOT / folder).rglob("*.py")]
    assert len(paths) > 100
    found = list(settings_patches(paths))
    assert not found, "use torch._dynamo.config.patch(...) instead: " + "; ".join(found)


def test_the_scan_finds_each_way_of_patching(tmp_path):
    source = tmp_path / "bad.py"
    source.write_text(
        "def test(monkeypatch):\n"
        "    monkeypatch.setattr(torch._dynamo.config, 'recompile_limit', 8)\n"
        "    monkeypatch.setattr('torch._inductor.config.max_autotune', True)\n"
        "    mock.patch.object(torch._functorch.config, 'donated_buffer', False)\n"
        "    patch('torch.backends.cuda.matmul.allow_tf32', True)\n"
        "    with torch._dynamo.config.patch({'recompile_limit': 8}):\n"  # torch's own: fine
        "        pass\n"
    )
    lines = [found.split(": ")[0].rsplit(":", 1)[1] for found in settings_patches([source])]
    assert lines == ["2", "3", "4", "5"]


def test_the_guard_sees_a_deleted_setting_and_brings_it_back():
    names = setting_names()
    assert "recompile_limit" in names["torch._dynamo.config"] and names["torch._inductor.config"]
    before = torch._dynamo.config.recompile_limit
    delattr(torch._dynamo.config, "recompile_limit")  # what monkeypatch's undo does under pytest ≥ 9
    missing = missing_settings(names)
    restore(missing)
    assert "torch._dynamo.config.recompile_limit" in missing  # with its alias cache_size_limit
    assert torch._dynamo.config.recompile_limit == before and not missing_settings(names)


@pytest.mark.parametrize("setting", ["recompile_limit"])
def test_torchs_own_patch_restores_the_setting(setting):
    before = getattr(torch._dynamo.config, setting)
    with torch._dynamo.config.patch({setting: before + 3}):
        assert getattr(torch._dynamo.config, setting) == before + 3
    assert getattr(torch._dynamo.config, setting) == before
