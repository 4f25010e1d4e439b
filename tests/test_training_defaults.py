"""One home per training default: ``vdtrain/config.py``'s dataclasses (``FitConfig`` and its parts). The
fit group options (``conf/data``, ``conf/trainer``, ``conf/logger``) and ``conf/fit.yaml`` write only what
differs from them, and no function of the library restates one as its own default (the decode presets
have the same rule: tests/test_method_registry.py)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from vdtrain.config import DataConfig, DrafterTrainConfig, FitConfig, LoggerConfig, TrainerConfig

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
GROUPS = {"data": DataConfig, "trainer": TrainerConfig, "logger": LoggerConfig}
# Keys fit.yaml must write although they are not FitConfig defaults to differ from: Hydra's own sections
# and the run folder, which only Hydra's interpolation knows.
HYDRA_ONLY = {"defaults", "hydra", "run_dir"}
# Training knobs a library function might be tempted to default itself.
TRAINING_KNOBS = {f.name for cls in (DataConfig, DrafterTrainConfig) for f in dataclasses.fields(cls)} - {
    "batch_size",
    "kind",
    "layer",
    "options",
    "source",
    "shards",
    "num_workers",
    "init_from",
    "on_corrupt",
}


def _default(cls: type, name: str) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _repeated(written: dict, cls: type, path: str) -> list[str]:
    """The keys of ``written`` that equal ``cls``'s defaults, nested dataclasses walked."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    out = []
    for key, value in written.items():
        assert key in names, f"{path}{key} is not a {cls.__name__} key"
        default = _default(cls, key)
        if dataclasses.is_dataclass(default) and isinstance(value, dict):
            out += _repeated(value, type(default), f"{path}{key}.")
        elif value == (list(default) if isinstance(default, tuple) else default):
            out.append(f"{path}{key}")
    return out


@pytest.mark.parametrize(
    "path", [p for group in GROUPS for p in sorted((CONF / group).glob("*.yaml"))], ids=lambda p: p.stem
)
def test_a_fit_group_option_writes_only_what_differs_from_its_defaults(path):
    written = OmegaConf.to_container(OmegaConf.load(path))
    assert not _repeated(written, GROUPS[path.parent.name], f"{path.parent.name}."), path


def test_fit_yaml_writes_only_what_differs_from_fit_config():
    written = OmegaConf.to_container(OmegaConf.load(CONF / "fit.yaml"), resolve=False)
    own = {k: v for k, v in written.items() if k not in HYDRA_ONLY}
    assert not _repeated(own, FitConfig, ""), own


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None]
            yield node, pairs


def test_no_function_restates_a_training_default():
    """``p_null=0.1``, ``w_cls=0.1``, ``ttt_decay=0.8`` and their kin are written once, in their config
    class: a library function that defaults one names the class's field instead. So is the default
    drafter kind."""
    found = []
    for path in sorted((ROOT / "vdtrain").rglob("*.py")) + sorted((ROOT / "data_prep").rglob("*.py")):
        if path == ROOT / "vdtrain" / "config.py":
            continue
        for node, pairs in _functions(path):
            for arg, default in pairs:
                literal = isinstance(default, ast.Constant) and default.value is not None
                if literal and (arg.arg in TRAINING_KNOBS or default.value == DrafterTrainConfig.kind):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {arg.arg}={default.value!r}")
    assert not found, found
