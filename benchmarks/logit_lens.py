"""The logit lens of a target, per layer: what an EAGLE-3 drafter's taps read (docs/training.md).

    python -m benchmarks.logit_lens                          # the shapes target, 16 held-out captions
    python -m benchmarks.logit_lens target=grain num_prompts=32 out=lens.json
    python -m benchmarks.logit_lens target=llamagen_t2i_xl_stage1 target.gpt_ckpt=... prompts=coco2017_val

Prints one table row per layer ``k``: the agreement of ``head(norm(hidden_states[k]))`` with the target's
argmax, and which ``k`` the target's default taps (``Target.default_feature_layers``) read.
"""

from __future__ import annotations

import json
from pathlib import Path

import hydra
from omegaconf import DictConfig

from vdtrain.cli import user_errors
from vdtrain.eval.logit_lens import logit_lens
from vdtrain.prompts import prompts_for_run
from vdtrain.targets import target_for_run


@hydra.main(version_base=None, config_path="../conf", config_name="logit_lens")
@user_errors("benchmarks.logit_lens")
def main(cfg: DictConfig) -> dict:
    target = target_for_run(cfg)
    captions = prompts_for_run(cfg.prompts, cfg.num_prompts)
    agreement = logit_lens(target, captions, cfg.seed, cfg.batch_size)
    taps = target.default_feature_layers()
    print(f"{target.name}: {target.num_layers} layers, {len(captions)} captions, default taps {list(taps)}")
    print("| k | top-1 agreement with the target | default tap |")
    print("|---|---|---|")
    for k, a in enumerate(agreement):
        print(f"| {k} | {a:.3f} | {'yes' if k in taps else ''} |")
    result = {
        "target": target.name,
        "layers": target.num_layers,
        "captions": len(captions),
        "seed": cfg.seed,
        "agreement": agreement,
        "default_taps": list(taps),
    }
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
