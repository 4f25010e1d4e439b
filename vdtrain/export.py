"""``python -m vdtrain.export``: turn a training run into a Hub export folder (config, trainable weights,
model card), check it, and optionally push it (a dry run by default). See docs/hub.md."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from omegaconf import DictConfig

from vdtrain.cli import run_app, user_errors
from vdtrain.export_format import CONFIG_FILE, is_run, no_drafter_here
from vdtrain.paths import CONF_DIR
from vdtrain.preflight import check_export
from vdtrain.zero_checkpoint import is_checkpoint

if TYPE_CHECKING:
    from vdtrain.hub import PushPlan


def resolve_source(source: str) -> tuple[str | Path, Path | None]:
    """The drafter to export and the run folder it came from (None when unknown).

    A run folder gives its exported ``drafter/`` (else its ``checkpoints/last.ckpt``, for a run that was
    stopped early); a drafter folder names its run in the saved fit summary or lies in it; a ``.ckpt`` (a
    file, or DeepSpeed ZeRO's folder) lies in ``<run>/checkpoints``. Anything else (a Hub repo id) goes to
    ``Drafter.from_pretrained`` as given.
    """
    from vdtrain.drafters.base import Drafter
    from vdtrain.targets.shapes import resolve_folder

    path = resolve_folder(source)
    if is_checkpoint(path):
        run = path.parent.parent
        return path, run if is_run(run) else None
    if (path / CONFIG_FILE).is_file():
        # an export records its run repo-relative (or not at all, outside the repo): else try the parent
        recorded = Drafter.read_metadata(path).get("fit", {}).get("run_dir")
        candidates = [resolve_folder(recorded)] if recorded else []
        return path, next((run for run in [*candidates, path.parent] if is_run(run)), None)
    if is_run(path):
        drafter = path / "drafter"
        return (drafter if drafter.is_dir() else path / "checkpoints" / "last.ckpt"), path
    if path.is_dir():
        raise no_drafter_here(source, path)
    return source, None


def export(cfg: DictConfig) -> tuple[Path, PushPlan | None]:
    """Export ``cfg.source`` for ``cfg.target``; push (or plan the push) when ``push.repo_id`` is set."""
    from vdtrain.drafters.base import Drafter
    from vdtrain.hub import export_drafter, find_results, push_to_hub, run_metadata
    from vdtrain.targets import target_for_run

    source, run = resolve_source(str(cfg.source))
    if cfg.out_dir is None and run is None:
        raise ValueError(f"source={cfg.source!r} belongs to no known run folder: set out_dir=<folder>")
    target = target_for_run(cfg)
    drafter = Drafter.from_pretrained(source, target)
    eval_results = cfg.eval_results or (find_results(run / "eval") if run else None)
    folder = export_drafter(
        drafter,
        Path(cfg.out_dir) if cfg.out_dir else run / "export",
        target=target,
        eval_results=eval_results,
        training_command=cfg.training_command,
        metadata={**(run_metadata(run) if run else {}), **drafter.metadata},
        overwrite_card=cfg.overwrite_card,
    )
    print(f"exported {source} -> {folder}")
    for file in sorted(folder.iterdir()):
        print(f"  {file.name:<20} {file.stat().st_size:>12,} bytes")
    print(f"evaluation table: {eval_results or 'none (no results.json found)'}")
    print(f"validation: passed (config, weights, model card; reloads for target {target.identity.name!r})")
    plan = None
    if cfg.push.repo_id:
        plan = push_to_hub(folder, cfg.push.repo_id, private=cfg.push.private, dry_run=cfg.push.dry_run)
        print(plan.describe())
    return folder, plan


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="export")
@user_errors("vdtrain.export")
def _main(cfg: DictConfig) -> None:
    export(cfg)


def main() -> None:
    run_app("vdtrain.export", "export", _main, check_export)


if __name__ == "__main__":
    main()
