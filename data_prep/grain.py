"""Build the grain world: the shapes world's scenes under grain and a random light, a redundant
4096-code tokenizer, and an 8-layer target that is as unsure of its next token as a real VQ model
(conf/grain_world.yaml; docs/grain_world.md).

python -m data_prep.grain                                       # every stage, into checkpoints/grain/target
python -m data_prep.grain stages=[target] target.max_minutes=30  # continue or retrain the target only
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from data_prep.shapes import build_world
from vdtrain.cli import user_errors
from vdtrain.paths import CONF_DIR


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="grain_world")
@user_errors("data_prep.grain")
def main(cfg: DictConfig) -> None:
    build_world(cfg)


if __name__ == "__main__":
    main()
