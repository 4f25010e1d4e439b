"""Check a shard set before training; exits 1 (listing every problem, by shard and key) if it is bad.

python -m data_prep.validate shards=data/coco_mini
python -m data_prep.validate shards=data/coco_mini target=shapes   # also: made for this target?

Checks: manifest present, this schema version, complete; every listed shard present, a readable tar of
the recorded size and sample count; every sample's fields, dtypes and shapes (token count = grid h·w,
ids < vocabulary, features [L+N, H]); unique keys; the target identity when a target is given.
"""

from __future__ import annotations

import json
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from vdtrain.cli import user_errors
from vdtrain.data.shards import ValidationReport, validate_shards
from vdtrain.paths import CONF_DIR


def run(cfg: DictConfig) -> ValidationReport:
    identity = None
    if cfg.get("target") is not None:
        from vdtrain.targets import load_target

        identity = load_target(OmegaConf.to_container(cfg.target)).identity
    return validate_shards(cfg.shards, identity, raise_on_error=False, max_problems=cfg.max_problems)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="data_prep/validate")
@user_errors("data_prep.validate")
def main(cfg: DictConfig) -> None:
    report = run(cfg)
    print(json.dumps(report.to_dict(), indent=2))
    if not report.ok:
        print(f"INVALID: {len(report.problems)} problem(s) in {cfg.shards}", file=sys.stderr)
        sys.exit(1)
    print(f"OK: {report.num_samples} samples in {report.num_shards} shards", file=sys.stderr)


if __name__ == "__main__":
    main()
