"""``python -m vdtrain.evaluate``: every method against AR on the same prompts, seeds and device.

Writes ``results.md`` / ``.csv`` / ``.json`` (one row per method and temperature, with the settings that
made them), ``acceptance.md`` / ``.json`` (simulated vs real acceptance per draft depth), ``plots/`` and
``images/`` to ``out_dir``, and prints the Markdown tables.

Under ``torchrun`` / ``launch.sh`` every process decodes its part of the prompts (``vdtrain.sharding``)
and keeps each finished batch in ``units/``; the same command run again (any world size) decodes only
what is missing, and rank 0 merges the units into the tables (``merge=true``: merge only).
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from omegaconf import DictConfig, OmegaConf

from vdtrain.cli import job_arguments, run_app, sweep_job_folder, user_errors
from vdtrain.config import as_list, presets_except
from vdtrain.paths import CONF_DIR
from vdtrain.preflight import check_decoding
from vdtrain.target_settings import world_knobs

OmegaConf.register_new_resolver("presets_except", presets_except, replace=True)  # conf/eval/default.yaml

if TYPE_CHECKING:
    from vdtrain.config import AcceptanceReportConfig
    from vdtrain.decode.methods import DecodeConfig
    from vdtrain.drafters.base import Drafter
    from vdtrain.eval.runner import EvalResult
    from vdtrain.sharding import Ranks
    from vdtrain.targets.base import Target

log = logging.getLogger(__name__)


# What decides an evaluation's outputs: a folder of finished units is reused only for the same values.
OUTPUT_SETTINGS = (
    "target",
    "drafter",
    "prompts",
    "num_prompts",
    "caption_column",
    "seed",
    "batch_size",
    "methods",
    "temperatures",
    "exact_only_at_zero",
    "quality",
)
PLOT_PROMPTS = 4  # images per row kept in memory for plots/samples_T<t>.png (plot_samples' default)


def run(cfg: DictConfig) -> EvalResult | None:
    """Every rank of a launch decodes its part; the main rank returns the result, the others None."""
    from vdtrain.sharding import decoding_processes

    with decoding_processes(str(cfg.device)) as ranks:
        return run_on(cfg, ranks)


def run_on(cfg: DictConfig, ranks: Ranks) -> EvalResult | None:
    import torch

    from vdtrain.config import AcceptanceReportConfig
    from vdtrain.eval.acceptance import acceptance_markdown, measure, write_report
    from vdtrain.eval.plots import plot_acceptance, write_plots
    from vdtrain.eval.quality import QualityConfig
    from vdtrain.eval.runner import device_description, evaluate, method_configs
    from vdtrain.eval.table import write_tables
    from vdtrain.prompts import prompts_for_run
    from vdtrain.sharding import UnitStore
    from vdtrain.targets import target_for_run

    decode_overrides = world_knobs(cfg.target)
    configs = method_configs(as_list(cfg.methods), decode_overrides)
    temperatures = as_list(cfg.temperatures)
    quality = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(QualityConfig), cfg.quality))
    acceptance = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(AcceptanceReportConfig), cfg.acceptance)
    )
    prompts = prompts_for_run(cfg.prompts, cfg.num_prompts, cfg.caption_column)
    target = target_for_run(cfg, apply_dtype=True)
    device = target.token_embedding.weight.device
    drafters, sources = method_drafters(cfg, configs, acceptance, target)
    # the acceptance report compares the drafter's simulation with its decode: the drafter of its method
    drafter = drafters.get(acceptance.method) if acceptance.enabled else None
    out = Path(ranks.broadcast(str(cfg.out_dir)))  # rank 0's, should a timestamp differ
    store = UnitStore(out / "units")
    store.check_settings(
        {k: OmegaConf.to_container(cfg, resolve=True).get(k) for k in OUTPUT_SETTINGS}, ranks
    )
    log.info(
        "%s against AR at T = %s on %d prompts, %s",
        [c.name for c in configs],
        temperatures,
        len(prompts),
        device,
    )
    result = evaluate(
        target,
        drafters,
        prompts,
        configs,
        temperatures,
        exact_only_at_zero=cfg.exact_only_at_zero,
        seed=cfg.seed,
        batch_size=cfg.batch_size,
        quality=quality,
        image_dir=out / "images" if cfg.save_images else None,
        warmup=cfg.warmup,
        compile=cfg.get("compile", False),
        cuda_graphs=cfg.get("cuda_graphs", "auto"),
        ranks=ranks,
        store=store,
        keep_images=PLOT_PROMPTS,
        merge_only=cfg.merge,
        speed_repeats=cfg.speed_repeats,
        keep_decoded=acceptance.enabled
        and drafter is not None,  # the report reads them; else one row at a time
    )
    if result is None:  # not the main rank: it merges, writes and reports
        return None
    settings: dict[str, Any] = {
        "command": " ".join(["python -m vdtrain.evaluate", *job_arguments()]),
        "device": device_description(device),
        "torch": torch.__version__,
        "dtype": str(target.dtype).removeprefix("torch."),
        "target": asdict(target.identity),
        "sampling_defaults": asdict(target.sampling_defaults),
        "drafter": str(cfg.drafter) if drafters else None,
        "drafters": sources,  # method -> the drafter it decoded with
        "num_prompts": len(prompts),
        "world_size": ranks.world,
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    write_tables(result.rows, out, settings)
    if cfg.plots:
        write_plots(result, out / "plots")
    if acceptance.enabled and drafter is not None:
        reports = measure(
            target,
            drafter,
            result,
            acceptance,
            seed=cfg.seed,
            batch_size=cfg.batch_size,
            cuda_graphs=cfg.get("cuda_graphs", "auto"),
            decode_overrides=decode_overrides,
        )
        write_report(reports, out)
        log.info("simulated vs real acceptance:\n%s", acceptance_markdown(reports))
        if cfg.plots:
            plot_acceptance(reports, out / "plots" / "acceptance.png")
    log.info("wrote results, plots and images to %s", out)
    return result


def method_drafters(
    cfg: DictConfig, configs: list[DecodeConfig], acceptance: AcceptanceReportConfig, target: Target
) -> tuple[dict[str, Drafter], dict[str, str]]:
    """Each method's drafter (and its source), the acceptance report's method included: the user's
    ``drafter=`` checked against every method, else the target's shipped drafter of the kind each needs
    (``vdtrain.eval.serving``; ``drafter=null``: none). Refused before anything decodes."""
    from vdtrain.eval.runner import method_configs
    from vdtrain.eval.serving import drafters_for
    from vdtrain.target_settings import load_drafter

    own = cfg.target.get("drafter")
    shipped = [str(s) for s in [own, *(cfg.target.get("more_drafters") or [])] if s]
    given = str(cfg.drafter) if cfg.drafter and cfg.drafter != own else None
    if not cfg.drafter:  # drafter=null: no drafter at all, not the target's
        shipped = []
    loaded: dict[str, Drafter] = {}

    def load(source: str) -> Drafter:
        if source not in loaded:
            loaded[source] = load_drafter(source, target, own)
        return loaded[source]

    sources = drafters_for(configs, given, shipped, load)
    if acceptance.enabled and acceptance.method not in sources:
        try:
            report = method_configs([acceptance.method], world_knobs(cfg.target))
            sources |= drafters_for(report, given, shipped, load)
        except ValueError as err:  # the report is an extra: the table goes on without it
            log.info("no acceptance report for %s: %s", acceptance.method, err)
    return {name: load(source) for name, source in sources.items()}, sources


def _kept(cfg: DictConfig) -> str:
    return f"the finished methods are kept in {cfg.out_dir}/units: the same command goes on from them"


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="evaluate")
@sweep_job_folder("out_dir")
@user_errors("vdtrain.evaluate", _kept)
def _main(cfg: DictConfig) -> None:
    from vdtrain.eval.table import to_markdown

    result = run(cfg)
    if result is not None:
        print(to_markdown(result.rows))


def main() -> None:
    run_app("vdtrain.evaluate", "evaluate", _main, check_decoding)


if __name__ == "__main__":
    main()
