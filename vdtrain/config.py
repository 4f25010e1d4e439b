"""Typed configs behind ``conf/``: Hydra merges the YAML files onto these dataclasses, so a misspelled
key or a wrong type fails at start-up instead of being silently ignored.

The YAML files hold the values; these classes hold the names, types and defaults. Each field's comment
is its documentation.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from vdtrain.paths import CONF_DIR


@dataclass
class TargetConfig:
    """The keys every target kind shares. The rest of a ``conf/target/*.yaml`` belongs to its kind's spec
    (``vdtrain.targets.registry.TARGET_KINDS``), which refuses any key it does not declare."""

    kind: str = "folder"  # a key of TARGET_KINDS: folder (the shapes world), llamagen, chameleon, janus, emu3
    quality: str | None = None  # per-image quality metric (shapes_consistency) or null
    dtype: str = "fp32"  # fp32 | bf16 | fp16: weights and KV cache (decoding, data_prep.features, fit)
    # this target's own decoding knobs: preset name -> keys merged over conf/decode/<preset>.yaml (a
    # world's relaxed thresholds and tree sizes; docs/grain_world.md), wherever it decodes
    # (vdtrain/target_settings.py)
    decode: dict[str, Any] = field(default_factory=dict)
    drafter: str | None = None  # the drafter shipped for it: generate's and evaluate's default drafter=
    # its other shipped drafters (other kinds): evaluate decodes a preset `drafter` cannot serve (a block
    # tree needs a drafter that drafts blocks) with the first of these that can (vdtrain/eval/serving.py)
    more_drafters: list[str] = field(default_factory=list)
    # its official Hub repo: the drafter's model card names it as base_model (docs/hub.md); null for the
    # embedded worlds, which exist only in this repository
    hub_id: str | None = None


@dataclass
class DataConfig:
    source: str = "shapes"  # shapes: procedural samples made on the fly | shards: a webdataset shard set
    shards: str | None = None  # source=shards: the folder with manifest.json
    features: str = "online"  # online: the frozen target computes features | offline: read feats.npy
    batch_size: int = 16  # per device
    samples_per_epoch: int = 4096  # source=shapes: samples that make an epoch (shards: the whole set)
    val_samples: int = 64  # held-out samples for validation (shapes: HELDOUT_SEED stream)
    val_shards: str | None = None  # source=shards: a held-out shard set (null: no validation)
    p_null: float = 0.1  # probability a sample is null-conditioned (online features)
    shuffle_buffer: int = 256  # source=shards: in-memory shuffle buffer
    on_corrupt: str = "error"  # error: stop at a bad sample | skip: log it and go on
    num_workers: int = 0  # DataLoader worker processes; each makes every num_workers-th batch (same order)


@dataclass
class OptimConfig:
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at trainer.max_steps or max_minutes
    grad_clip: float = 0.5


@dataclass
class DrafterTrainConfig:
    kind: str = "eagle1"  # a key of vdtrain.drafters.registry.DRAFTERS (eagle1, eagle3, block, ...)
    layer: dict[str, Any] = field(default_factory=dict)  # DrafterConfig layer overrides (n_head, ...)
    # the kind's own settings (its Options dataclass; unset: the kind's default for a new drafter of the
    # target), e.g. eagle3's feature_layers, input_norm and tap_norm, block's slots, width, heads, train_roots
    options: dict[str, Any] = field(default_factory=dict)
    w_cls: float = 0.1  # eagle1: weight of the soft cross-entropy term
    w_feature: float = 0.0  # eagle3: weight of the optional feature loss (EAGLE-3 drops it)
    # the token-distribution term: soft_ce (EAGLE's) | acceptance (1 - Σ min(p, q)) | log_acceptance
    cls_loss: str = "soft_ce"
    ttt_steps: int = 7  # eagle3: drafter steps unrolled on its own outputs per sample (EAGLE-3's 7)
    ttt_decay: float = (
        0.8  # unrolled kinds: weight decay^j of unrolled step j's loss (EAGLE-3's 0.8); block: of slot j's
    )
    feature_noise: float = 0.1  # uniform input-feature noise U(-a, a) (eagle3: on the fused layers)
    val_depth: int = 5  # draft depth unrolled at validation for per-depth agreement and tau_sim
    # the loss goes through the frozen head in this many chunks of rows, so it holds 1 / loss_chunks of the
    # [rows, V] logits at a time (a fixed count: as many kernels, and as much to compile, at any batch)
    loss_chunks: int = 8
    # block: also train the token loss on the CFG-combined logits of both streams, u + s·(c − u), at this
    # scale s (the decode's cfg_scale): every sample runs in both streams, so a step costs about twice.
    # null: each sample trains in its own stream only (docs/training.md, "Training for the guided decode")
    guided_scale: float | None = None
    init_from: str | None = None  # a saved drafter folder to start from


@dataclass
class TrainerConfig:
    accelerator: str = "auto"  # cpu | gpu | auto
    devices: Any = 1  # number of devices per node, or a list
    num_nodes: int = 1
    strategy: str = "auto"  # auto | ddp | ddp_cpu (gloo) | deepspeed_stage_2 | deepspeed_stage_3
    precision: str = "32-true"  # 32-true | bf16-mixed | 16-mixed
    # the frozen target's weights in fit (fp32 | bf16 | fp16); null: target.dtype. The GPU configs set bf16:
    # a 7B target in fp32 holds 28 GB a GPU before any activation (docs/training.md, "Precision")
    target_dtype: str | None = None
    max_steps: int = 300
    max_epochs: int = -1
    # stop after this wall-clock time (checkpoints are still written); the LR cosine then ends with it
    max_minutes: float | None = None
    accumulate_grad_batches: int = 1
    log_every_n_steps: int = 10
    # a plain progress line (step, loss, top-1, samples/s, ETA) this often; null: every max_steps // 10
    # steps, at most 25 (at least ten lines a run)
    progress_every_n_steps: int | None = None
    val_every_n_epochs: int = 1
    # last.ckpt this often; null: every max_steps // 10 steps, at most 100 (a short run has some too).
    # It is also written at the end of every epoch, at the end of training and on SIGTERM or Ctrl-C.
    checkpoint_every_n_steps: int | None = None
    deterministic: bool = False
    # torch.compile the drafter's passes and loss (the target's pass and the optimizer stay eager); the first
    # steps pay the compilation (docs/training.md, "Training speed")
    compile: bool = False
    threads: int | None = None  # torch CPU threads per process (null: torch's default)
    deepspeed: dict[str, Any] = field(default_factory=dict)  # extra DeepSpeed config entries
    # one device's memory (GiB): fit refuses, before loading anything, a run whose memory plan
    # (vdtrain/train/memory_plan.py) peaks above it; null: the GPU's total on a GPU run, no check on a CPU
    device_memory_gib: float | None = None


@dataclass
class LoggerConfig:
    kind: str = "csv"  # csv | tensorboard | wandb
    project: str = "vdtrain"  # wandb project
    offline: bool = True  # wandb: write locally, sync later with `wandb sync`
    name: str | None = None  # run name (default: the run folder's name)


@dataclass
class AcceptanceReportConfig:
    """The acceptance report (vdtrain/eval/acceptance.py): simulated vs real acceptance per draft depth."""

    enabled: bool = True
    # after-epoch evaluation (fit): false reports at the last evaluation only, whose drafter is the one
    # exported (its T = 1 decodes cost a CPU as much as the round itself); true: every round
    every_round: bool = False
    method: str = "eagle2"  # the conf/decode preset whose real decode is compared with the simulation
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])  # decoded even if eval's are not
    depth: int | None = None  # draft depths 1..depth; null: the deepest tree the real decode drafted


@dataclass
class EvalCallbackConfig:
    """EvalAfterEpoch (vdtrain/eval/callback.py): real decoding with the drafter being trained."""

    enabled: bool = True  # on by default: a small, fast setting (a few seconds per epoch on the shapes world)
    every_n_epochs: int = 1
    methods: list[str] = field(default_factory=lambda: ["eagle2"])  # conf/decode presets; AR always runs too
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    prompts: str | None = None  # null: held-out shapes captions | a caption file | a vendored set name
    caption_column: str | None = None  # a .csv/.tsv prompts file: its caption column (null: a known name)
    # 4: a round costs a 2-core CPU under a fifth of the main job (README, "Quick start"); a GPU decodes
    # 8 or 16 in about the same time
    num_prompts: int = 4
    batch_size: int = 8
    seed: int = 0  # prompt i uses seed + i, so epochs are compared on identical draws
    # the speedup: the median of this many interleaved rounds of AR and each method on the first batch, the
    # round's own decodes of it being round 1 (docs/evaluation.md, "How speed is measured"); 3 is the fewest
    # with quartiles, and each round more costs an epoch two decodes of the batch; 0: the round's one ratio
    speed_repeats: int = 3
    log_images: bool = True  # AR-vs-method sample grid to TensorBoard / wandb (always saved as PNG)
    at_fit_end: bool = True  # also measure the final drafter when training stops mid-epoch
    acceptance: AcceptanceReportConfig = field(
        default_factory=AcceptanceReportConfig
    )  # simulated vs real, per depth


@dataclass
class PushConfig:
    """The end-of-training Hub push of the exported drafter (vdtrain/hub.py)."""

    repo_id: str | None = None  # owner/name; null: no push
    private: bool = True  # visibility of a repo the push creates
    dry_run: bool = True  # validate and list the upload without network; false uploads (needs HF_TOKEN)


@dataclass
class FitConfig:
    # a conf/target/*.yaml: TargetConfig's keys and its kind's, checked against both when it is loaded
    target: dict[str, Any] = field(default_factory=dict)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterTrainConfig = field(default_factory=DrafterTrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    seed: int = 0  # every random choice of the run (null rows, feature noise, the data stream's order)
    run_dir: str = MISSING  # checkpoints, logs and the exported drafter go here
    # a checkpoint path, "last" (run_dir/checkpoints/last.ckpt) to resume, or "auto": "last" when that file
    # exists, else a fresh start (a requeued SLURM job's one command, docs/training.md)
    resume: str | None = None
    export_dir: str | None = None  # where the final drafter is saved (default run_dir/drafter)
    eval: EvalCallbackConfig = field(default_factory=EvalCallbackConfig)
    push: PushConfig = field(default_factory=PushConfig)
    # picks checkpoints/best.ckpt; null: the kind's estimate of S (val/tau_sim; a block drafter's
    # val/tau_block); e.g. eval/eagle2_T0/S (EvalAfterEpoch)
    best_metric: str | None = None
    best_mode: str = "max"  # max | min
    debug: bool = False  # a user error shows its full traceback (vdtrain.cli)
    # print the memory plan per GPU (one training step and the after-epoch evaluation) and exit without
    # training (docs/training.md, "Memory plan")
    plan: bool = False


def as_list(value: Any) -> list[Any]:
    """A list setting given as one value (``methods=eagle2``, ``temperatures=1``) is a one-item list."""
    return list(value) if isinstance(value, list | tuple) or OmegaConf.is_list(value) else [value]


RECORD = ".hydra"  # a run's own record of its launch: config.yaml, hydra.yaml, overrides.yaml


DECODE_PRESETS = CONF_DIR / "decode"


def presets_except(*left_out: str) -> list[str]:
    """Every method preset (``conf/decode/<name>.yaml``) but ``left_out``, sorted: the ``presets_except``
    resolver of conf/eval/default.yaml, so a preset added there is evaluated without a list to edit."""
    return sorted(p.stem for p in DECODE_PRESETS.glob("*.yaml") if p.stem not in left_out)


def preset_node(path: Path) -> DictConfig:
    """A preset file read without Hydra: its defaults list (``/decode_parts/<section>@<section>: <kind>``)
    becomes each section's ``kind``, under the keys the file sets itself (``_self_`` comes last). Light:
    the apps' checks read a preset's tree kind with it before torch loads."""
    node = OmegaConf.load(path)
    for entry in node.pop("defaults", []):
        if entry != "_self_":
            ((group, kind),) = entry.items()
            section = group.rpartition("@")[2]
            node[section] = OmegaConf.merge({"kind": kind}, node.get(section) or {})
    return node


def register_configs() -> None:
    """Make ``fit_schema`` available to ``conf/fit.yaml``'s defaults list (it types every group), the
    ``run_name`` resolver its ``hydra.run.dir`` uses and the ``run_record`` one its ``hydra.output_subdir``
    uses."""
    ConfigStore.instance().store(name="fit_schema", node=FitConfig)
    OmegaConf.register_new_resolver("run_name", run_name, replace=True)
    OmegaConf.register_new_resolver("run_record", run_record, replace=True)


@functools.cache
def run_record(run_dir: str, resume: str | None) -> str:
    """Hydra's ``output_subdir`` for a launch into ``run_dir``: ``.hydra`` for a new run (every rank of
    one writes the same record), ``resumes/<time>`` for a resume of a run that has its record (cached:
    Hydra asks more than once)."""
    if resume is not None and (Path(run_dir) / RECORD / "config.yaml").is_file():
        return f"resumes/{datetime.now():%Y-%m-%d_%H-%M-%S}"
    return RECORD


def run_name() -> str:
    """The run folder's name, the same in every process of one launch, so that all ranks and nodes write
    (and ``resume=last`` reads) one folder: ``VDTRAIN_RUN_NAME`` (``launch.sh`` sets it), else the SLURM
    job and step (the same again when the job is requeued), else a torchrun ``--rdzv-id``, else the time
    the process first asked (one process; Lightning's own DDP children are handed the parent's folder)."""
    env = os.environ
    if env.get("VDTRAIN_RUN_NAME"):
        name = env["VDTRAIN_RUN_NAME"]
        if "/" in name or name in (".", ".."):
            raise ValueError(f"VDTRAIN_RUN_NAME must be a plain folder name, got {name!r}")
        return name
    if env.get("SLURM_JOB_ID") and env.get("SLURM_STEP_ID"):
        job = env["SLURM_JOB_ID"]
        if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
            job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
        return f"slurm-{job}.{env['SLURM_STEP_ID']}"
    if env.get("TORCHELASTIC_RUN_ID", "none") != "none":
        return f"torchrun-{env['TORCHELASTIC_RUN_ID']}"
    if int(env.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            f"this is one of WORLD_SIZE={env['WORLD_SIZE']} processes with no shared run name, so each "
            "would make its own timestamped run folder: start them with ./launch.sh, set VDTRAIN_RUN_NAME "
            "to one name on every node, pass torchrun --rdzv-id, or give hydra.run.dir"
        )
    return launch_time().strftime("%Y-%m-%d_%H-%M-%S")


@functools.cache
def launch_time() -> datetime:
    """When this process first named its run: the time is read once, so every later resolution of
    ``${run_name:}`` in the launch (Hydra's folder, the app's ``out_dir``) names the same folder, not one
    a second later."""
    return datetime.now()


def unknown_keys(cfg: DictConfig, schema: type, prefix: str = "") -> list[str]:
    """Keys of ``cfg`` that ``schema`` (a config dataclass) does not declare, each with close matches.

    Hydra's ``+key=value`` adds a key even to a typed config; free-form ``dict`` fields (such as
    ``drafter.layer`` or ``trainer.deepspeed``) take any key and are not searched."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    found = []
    for key, child in cfg.items_ex(resolve=False):
        path = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=3, cutoff=0.6)
            hint = f" (did you mean {', '.join(prefix + c for c in close)}?)" if close else ""
            found.append(f"{path}{hint}")
            continue
        kind = OmegaConf.get_type(child)
        if isinstance(child, DictConfig) and kind is not None and dataclasses.is_dataclass(kind):
            found += unknown_keys(child, kind, f"{path}.")
    return found


class UnknownConfigKeyError(ValueError):
    pass


def check_known_keys(cfg: DictConfig, schema: type = FitConfig) -> None:
    unknown = unknown_keys(cfg, schema)
    if unknown:
        raise UnknownConfigKeyError(
            "unknown config key(s) " + "; ".join(unknown) + " — added with '+', which bypasses the typed "
            "config (vdtrain/config.py); '+' is only for the free-form maps (e.g. +drafter.layer.n_head=8)"
        )
