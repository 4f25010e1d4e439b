"""The Hugging Face Hub side of a drafter: the export folder, its checks, its download and its upload.

An export folder (docs/hub.md; file names in ``vdtrain.export_format``) holds ``config.json`` (the
drafter config with the identity of the target it serves, plus training metadata), ``model.safetensors``
(the drafter's own weights: the target's frozen embedding and head are borrowed at load time, never
saved) and ``README.md`` (the model card). Writing one is deterministic: the same drafter, metadata and
results give byte-identical files, so an export can be re-made and compared.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, HfApi, ModelCardData, get_token
from huggingface_hub.utils import validate_repo_id
from omegaconf import OmegaConf
from safetensors.torch import load_file

from vdtrain.checkpoint_io import CheckpointError, load_strict
from vdtrain.data.shards import ShardError, read_manifest
from vdtrain.drafters import Drafter, DrafterConfig
from vdtrain.eval.table import EvalRow, read_results, to_markdown
from vdtrain.export_format import CARD_FILE, CONFIG_FILE, EXPORT_FILES, WEIGHTS_FILE
from vdtrain.targets import kind_config
from vdtrain.targets.base import Target, TargetIdentity
from vdtrain.targets.shapes import REPO_ROOT

log = logging.getLogger(__name__)

RESULTS_FILE = "results.json"
TOKEN_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")  # huggingface_hub reads them in this order
# What an absolute path outside the repository becomes in an export: this prefix and its last component.
LOCAL_PATH = "<local>"
CARD_TAGS = ("vdtrain", "speculative-decoding", "drafter", "text-to-image")  # + the kind's (card_tags)
CARD_LICENSE = "apache-2.0"  # vdtrain's (pyproject.toml); the target's own license binds its weights
# Hub datasets a shard set's manifest kind was made from; the other sources (the procedural shapes world,
# the target's own samples) are no Hub dataset
HUB_DATASETS = {"laion_coco": "laion/laion-coco"}
# Unexpected weight names that give away a copied target embedding or head.
BORROWED_WORDS = ("embed", "head", "output")


class ExportError(ValueError):
    """An export folder that must not be used or pushed; the message lists every problem."""


class MissingTokenError(RuntimeError):
    pass


# --- export ----------------------------------------------------------------------------------------------
def export_drafter(
    drafter_or_source: Drafter | str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    target: Target,
    eval_results: str | os.PathLike[str] | None = None,
    training_command: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    overwrite_card: bool = False,
) -> Path:
    """Write the export folder of a drafter for ``target`` and check that it reloads; returns the folder.

    ``drafter_or_source`` is a ``Drafter`` or anything ``Drafter.from_pretrained`` takes. ``metadata``
    (training summary, config, ...) defaults to what the drafter was loaded with (``drafter.metadata``);
    ``training_command`` is recorded in it. Absolute local paths in the metadata are not exported
    (``redact_local_paths``): the folder is meant for the Hub.
    ``eval_results`` (a ``results.json`` of ``python -m vdtrain.evaluate``, or its folder) puts the
    evaluation table into the model card. A ``README.md`` already in ``out_dir`` that vdtrain did not
    write is refused (``ExportError``) unless ``overwrite_card``. Raises ``ExportError`` if the written
    folder does not validate.
    """
    if isinstance(drafter_or_source, Drafter):
        drafter = drafter_or_source.attach(target)  # the identity check
    else:
        drafter = Drafter.from_pretrained(drafter_or_source, target)
    if drafter.config.identity() is None:
        raise ExportError(
            "the drafter's config records no target identity: build it with DrafterConfig.for_target"
        )
    merged = dict(drafter.metadata if metadata is None else metadata)
    if training_command:
        merged["training_command"] = training_command
    data = merged["config"].get("data") if isinstance(merged.get("config"), Mapping) else None
    if "data" not in merged and data:
        merged["data"] = training_data(data)  # before its paths are redacted
    merged = redact_local_paths(merged)
    card_file = Path(out_dir) / CARD_FILE
    _check_card_overwrite(card_file, overwrite_card)
    results = None
    if eval_results is not None:
        found = find_results(eval_results)
        if found is None:
            raise FileNotFoundError(f"eval_results={str(eval_results)!r}: no {RESULTS_FILE} there")
        results = read_results(found)
    card = model_card(drafter, merged, results)
    if card_file.is_file() and card_file.read_text() != card:
        log.warning("replacing the model card %s (it was written by an earlier export)", card_file)
    out = drafter.save_pretrained(out_dir, merged)
    card_file.write_text(card)
    problems = validate_export(out, target)
    if problems:
        raise ExportError(f"the export at {str(out)!r} is not valid: " + "; ".join(problems))
    return out


def _check_card_overwrite(card_file: Path, overwrite: bool) -> None:
    """A README.md vdtrain did not write is the user's: refuse to replace it unless told to."""
    if overwrite or not card_file.is_file() or not _card_problems(card_file):
        return
    raise ExportError(
        f"{str(card_file)!r} exists and is not a vdtrain model card; the export would replace it: "
        "move it away, pick another out_dir, or pass overwrite_card=True (overwrite_card=true on the "
        "command line)"
    )


def _is_local_path(text: str) -> bool:
    return os.path.isabs(text) or text.startswith("~")


def _redact_path(text: str) -> str:
    path = Path(text).expanduser()
    try:
        return path.resolve().relative_to(REPO_ROOT).as_posix() or "."
    except ValueError:
        return f"{LOCAL_PATH}/{path.name}"


def _redact_command(command: str) -> str:
    """The command with every absolute path argument (``key=/a/b`` or ``/a/b``) redacted; any other
    text with spaces comes back unchanged."""
    try:
        words = shlex.split(command)
    except ValueError:  # not shell-like (an unbalanced quote): no arguments to redact
        return command
    redacted = []
    for word in words:
        key, sep, value = word.partition("=")
        if sep and _is_local_path(value):
            word = f"{key}={_redact_path(value)}"
        elif _is_local_path(word):
            word = _redact_path(word)
        redacted.append(word)
    return command if redacted == words else shlex.join(redacted)


def training_data(data: Mapping[str, Any]) -> dict[str, Any]:
    """What a drafter trained on, for its card: the data source and, for a shard set, what its manifest
    says made it (the target's own samples, VQ-encoded images or stored features). Read at export time,
    while the shards' folder is still the one the run read."""
    out: dict[str, Any] = {"source": data.get("source"), "p_null": data.get("p_null")}
    if data.get("source") != "shards" or not data.get("shards"):
        return out
    try:
        manifest = read_manifest(data["shards"])
    except ShardError:
        return out
    source = manifest.get("source") or {}
    out |= {"kind": manifest.get("kind"), "num_samples": manifest.get("num_samples")}
    if manifest.get("kind") == "self_generate":
        captions = source.get("captions")
        out |= {
            "method": source.get("method"),
            "sampling": source.get("sampling"),
            "seed": source.get("seed"),
            "captions": Path(captions).name if captions else None,
        }
    return out


def _data_sentence(data: Mapping[str, Any], samples_seen: int | None) -> str:
    kind, n = data.get("kind"), data.get("num_samples") or 0
    if kind == "self_generate":
        s = data.get("sampling") or {}
        how = f"{data.get('method')}, CFG {s.get('cfg_scale')}, T {s.get('temperature')}"
        how += f", top-k {s.get('top_k')}"
        what = (
            f"{n:,} images the target drew itself (`python -m data_prep.self_generate`: {how}, "
            f"seed {data.get('seed')}) from the captions of `{data.get('captions')}`"
        )
    elif kind:
        what = f"a `{kind}` shard set of {n:,} samples"
    elif data.get("source") == "shapes":
        what = "procedural images of the target's world, drawn on the fly (`data=shapes`)"
    elif data.get("source") == "shards":
        what = "a shard set whose manifest was not readable at export"
    else:
        what = f"`data.source={data.get('source')}`"
    seen = f"; {samples_seen:,} samples seen" if samples_seen else ""
    if samples_seen and n:
        seen += f" ({samples_seen / n:.1f} epochs)"
    null = f"; {data['p_null']:.0%} of rows null-conditioned" if data.get("p_null") is not None else ""
    return f"Data: {what}{seen}{null}."


def redact_local_paths(value: Any) -> Any:
    """``value`` with every absolute path made shareable: a path inside this repository becomes relative
    to it (``checkpoints/shapes/target``), any other becomes ``<local>/<its last component>``, also as an
    argument of a command (the training command). Export metadata goes to the Hub, where a user's folder
    layout (home, run folders, data) has no business."""
    if isinstance(value, Mapping):
        return {k: redact_local_paths(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_local_paths(v) for v in value]
    if not isinstance(value, str):
        return value
    if _is_local_path(value):
        return _redact_path(value)
    return _redact_command(value) if " " in value else value


def find_results(path: str | os.PathLike[str]) -> Path | None:
    """The ``results.json`` at ``path``: the file itself, in the folder, or in the folder's ``latest/``."""
    path = Path(path)
    for candidate in (path, path / RESULTS_FILE, path / "latest" / RESULTS_FILE):
        if candidate.is_file():
            return candidate
    return None


def run_metadata(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """What a ``vdtrain.fit`` run folder records about itself: the final summary, the config and the
    command that started it (each only when present)."""
    run = Path(run_dir)
    out: dict[str, Any] = {}
    if (run / "summary.json").is_file():
        out["fit"] = json.loads((run / "summary.json").read_text())
    if (run / ".hydra" / "config.yaml").is_file():
        config = OmegaConf.to_container(OmegaConf.load(run / ".hydra" / "config.yaml"), resolve=False)
        if "run_dir" in config:  # Hydra's runtime interpolation: resolve it to the folder itself
            config["run_dir"] = str(run)
        out["config"] = config
    command = training_command(run)
    if command:
        out["training_command"] = command
    return out


def training_command(run_dir: str | os.PathLike[str]) -> str | None:
    """``python -m vdtrain.<app>`` with the overrides Hydra recorded for the run (``.hydra/hydra.yaml``)."""
    file = Path(run_dir) / ".hydra" / "hydra.yaml"
    if not file.is_file():
        return None
    hydra = OmegaConf.load(file).hydra
    launch = [o for o in hydra.overrides.hydra if not o.startswith("hydra.mode=")]
    overrides = [*hydra.overrides.task, *launch]
    return shlex.join(["python", "-m", f"vdtrain.{hydra.job.name}", *overrides])


# --- the model card ----------------------------------------------------------------------------------------
def model_card(
    drafter: Drafter, metadata: Mapping[str, Any], results: tuple[list[EvalRow], dict[str, Any]] | None
) -> str:
    """``README.md``: what the drafter is, the target it serves, how to load, evaluate and re-train it,
    and the latest evaluation table."""
    ident = drafter.config.identity()
    sections = [
        _front_matter(ident, type(drafter).card_tags, metadata, results),
        _intro(drafter, ident),
        _target_section(ident),
        _usage_section(metadata, type(drafter).method),
        _training_section(metadata),
        _evaluation_section(results),
    ]
    return "\n\n".join(sections) + "\n"


def _front_matter(
    ident: TargetIdentity,
    kind_tags: tuple[str, ...],
    metadata: Mapping[str, Any],
    results: tuple[list[EvalRow], dict[str, Any]] | None,
) -> str:
    """The Hub's metadata (``ModelCardData``): the target's Hub repo as ``base_model`` (``target.hub_id``;
    none for the embedded worlds), the training data's Hub dataset, and the evaluation's S, τ and quality
    per method and temperature as a model-index."""
    target = metadata.get("config", {}).get("target", {})
    dataset = HUB_DATASETS.get(metadata.get("data", {}).get("kind"))
    data = ModelCardData(
        library_name="vdtrain",
        license=CARD_LICENSE,
        base_model=target.get("hub_id"),
        datasets=[dataset] if dataset else None,
        pipeline_tag="text-to-image",
        tags=list(dict.fromkeys((*CARD_TAGS, *kind_tags, ident.family))),
        model_name=f"vdtrain-drafter-{ident.name}" if results else None,
        eval_results=_eval_results(ident, results) if results else None,
    )
    return f"---\n{data.to_yaml()}\n---"


def _eval_results(ident: TargetIdentity, results: tuple[list[EvalRow], dict[str, Any]]) -> list[EvalResult]:
    """One model-index entry per (row, figure): S and τ always, each quality metric the row measured."""
    rows, settings = results
    prompts = f"{ident.name} evaluation prompts ({settings.get('num_prompts', '?')})"
    out = []
    for row in rows:
        figures = {"S": row.S, "tau": row.tau}
        figures |= {m: row.score(m) for m in row.quality if row.score(m) == row.score(m)}  # not NaN
        out += [
            EvalResult(
                task_type="text-to-image",
                dataset_type="prompts",
                dataset_name=prompts,
                metric_type=name,
                metric_value=round(float(value), 4),
                metric_name=f"{name} ({row.method}, T={row.temperature:g})",
            )
            for name, value in figures.items()
        ]
    return out


def _intro(drafter: Drafter, ident: TargetIdentity) -> str:
    """The card's first paragraph: the kind's design sentence (``Drafter.card``) and shape line."""
    c = drafter.config
    params = sum(p.numel() for p in drafter.parameters())
    return (
        f"# {drafter.title} for `{ident.name}`\n\n"
        + drafter.card()
        + "the target's own head turns it into draft tokens that the target then verifies (with exact "
        "acceptance the images are the target's own samples). The target's token embedding and output "
        f"head are borrowed when the drafter is loaded, so `{WEIGHTS_FILE}` holds only the drafter's "
        f"{params:,} parameters.\n\n"
        f"{drafter.shape()}; condition prefix {c.prefix_length} rows, image grid {c.grid[0]}×{c.grid[1]}."
    )


def _target_section(ident: TargetIdentity) -> str:
    rows = "\n".join(f"| {name} | `{value}` |" for name, value in vars(ident).items())
    return (
        "## Target\n\n"
        "The drafter serves exactly this target; `Drafter.from_pretrained` compares these fields and "
        "refuses any other.\n\n| field | value |\n|---|---|\n" + rows
    )


def _usage_section(metadata: Mapping[str, Any], method: str) -> str:
    recorded = metadata.get("config", {}).get("target", {})
    target_config = kind_config(recorded) if recorded.get("kind") else {}
    load = (
        f"target = load_target({json.dumps(target_config)})"
        if target_config
        else "target = load_target({...})  # the target above, as a conf/target/*.yaml"
    )
    return (
        "## Use\n\n```python\nfrom vdtrain.drafters import Drafter\n"
        f"from vdtrain.targets import load_target\n\n{load}\n"
        'drafter = Drafter.from_pretrained("<this repo id or a local copy>", target)\n```\n\n'
        "Evaluate it (speed-up against plain AR decoding, acceptance, quality; `<path>` is this repo id "
        "or a local copy) and sample with it (from a local copy: `hf download <repo id> --local-dir "
        "<folder>`):\n\n```bash\npython -m vdtrain.evaluate drafter=<path>\n"
        f"python -m vdtrain.generate method={method} drafter=<folder>\n```"
    )


def _training_section(metadata: Mapping[str, Any]) -> str:
    lines = ["## Training"]
    fit = metadata.get("fit")
    if fit:
        speed = f" ({fit['samples_per_s']:.1f} samples/s)" if "samples_per_s" in fit else ""
        lines.append(f"Trained for {fit.get('steps', '?')} steps in {fit.get('minutes', 0):.1f} min{speed}.")
    if metadata.get("data"):
        seen = round(fit["samples_per_s"] * fit["minutes"] * 60) if fit and "samples_per_s" in fit else None
        lines.append(_data_sentence(metadata["data"], seen))
    if fit:
        metrics = {k: v for k, v in fit.items() if k.startswith("val/")}
        if metrics:
            lines.append(
                "| validation metric | value |\n|---|---|\n"
                + "\n".join(f"| {k} | {v:.4g} |" for k, v in metrics.items())
            )
    ckpt = metadata.get("checkpoint")
    if ckpt:
        note = f"Weights from the Lightning checkpoint `{ckpt['file']}` (step {ckpt['global_step']})."
        if fit and fit.get("steps") != ckpt["global_step"]:
            note += " The numbers above are the run's final ones, not this checkpoint's."
        lines.append(note)
    if not (fit or ckpt):
        lines.append("No training summary was recorded.")
    command = metadata.get("training_command")
    lines.append(f"```bash\n{command}\n```" if command else "The training command was not recorded.")
    return "\n\n".join(lines)


def _evaluation_section(results: tuple[list[EvalRow], dict[str, Any]] | None) -> str:
    if results is None:
        return (
            "## Evaluation\n\nNo evaluation was run for this export "
            "(`python -m vdtrain.evaluate drafter=<path>` makes one)."
        )
    rows, settings = results
    settings = redact_local_paths(settings)  # the evaluation's command and drafter folder
    scalars = ", ".join(f"`{k}={v}`" for k, v in settings.items() if isinstance(v, str | int | float | bool))
    text = "## Evaluation\n\n" + to_markdown(rows).rstrip()
    return text + (f"\n\nSettings: {scalars}." if scalars else "")


# --- validation ------------------------------------------------------------------------------------------
def validate_export(folder: str | os.PathLike[str], target: Target | None = None) -> list[str]:
    """Every problem that makes an export folder unusable or misleading (empty when it is fine); with
    ``target`` it must also reload for that target."""
    path = Path(folder)
    problems = [f"{name} is missing" for name in EXPORT_FILES if not (path / name).is_file()]
    config = None
    if (path / CONFIG_FILE).is_file():
        config, found = _config_problems(path / CONFIG_FILE)
        problems += found
    if config is not None and (path / WEIGHTS_FILE).is_file():
        problems += _weight_problems(path / WEIGHTS_FILE, config)
    if (path / CARD_FILE).is_file():
        problems += _card_problems(path / CARD_FILE)
    if target is not None and not problems:
        try:
            Drafter.from_pretrained(path, target)
        except (ValueError, OSError, CheckpointError) as err:
            problems.append(f"does not reload for target {target.identity.name!r}: {err}")
    return problems


def _config_problems(file: Path) -> tuple[DrafterConfig | None, list[str]]:
    try:
        data = json.loads(file.read_text())
        data.pop("metadata", None)
        config = DrafterConfig.from_dict(data)
    except (ValueError, TypeError) as err:
        return None, [f"{CONFIG_FILE} is not a drafter config: {err}"]
    try:
        if config.identity() is None:
            return config, [f"{CONFIG_FILE} records no target identity (the 'target' entry is empty)"]
    except TypeError as err:
        return config, [f"{CONFIG_FILE} has an incomplete target identity: {err}"]
    return config, []


def _weight_problems(file: Path, config: DrafterConfig) -> list[str]:
    try:
        state = load_file(str(file))
    except Exception as err:  # safetensors raises its own error type for a corrupt header
        return [f"{WEIGHTS_FILE} does not load: {err}"]
    drafter = Drafter.make(config)
    expected = drafter.state_dict()
    borrowed_shapes = {(config.vocab_size, config.hidden_size), (config.hidden_size, config.vocab_size)}
    borrowed = sorted(
        k
        for k in set(state) - set(expected)
        if tuple(state[k].shape) in borrowed_shapes or any(w in k for w in BORROWED_WORDS)
    )
    problems = []
    if borrowed:
        problems.append(
            f"{WEIGHTS_FILE} holds frozen target weights {borrowed} (the embedding and head are "
            "borrowed from the target at load time and must not be saved)"
        )
    try:
        load_strict(drafter, {k: v for k, v in state.items() if k not in borrowed}, WEIGHTS_FILE)
    except CheckpointError as err:
        problems.append(str(err))
    return problems


def _card_problems(file: Path) -> list[str]:
    text = file.read_text()
    end = text.find("\n---\n", 3)
    if not text.startswith("---\n") or end < 0:
        return [f"{CARD_FILE} has no YAML front matter"]
    if "library_name: vdtrain" not in text[:end].splitlines():
        return [f"{CARD_FILE}'s front matter does not say library_name: vdtrain"]
    return []


# --- upload ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PushPlan:
    """What a push sends (or, for a dry run, would send) and where."""

    repo_id: str
    private: bool
    files: tuple[tuple[str, int], ...]  # (path in the repo, bytes)
    dry_run: bool
    token_source: str  # "argument", the environment variable it came from, "saved login" or "none"
    url: str | None = None  # the commit, after a real push

    def describe(self) -> str:
        total = sum(size for _, size in self.files)
        head = "dry run: would push" if self.dry_run else "pushed"
        visibility = "private" if self.private else "public"
        lines = [
            f"{head} {len(self.files)} files ({total:,} bytes) to {visibility} Hub repo {self.repo_id} "
            f"(token: {self.token_source})"
        ]
        width = max(len(name) for name, _ in self.files)
        lines += [f"  {name:<{width}}  {size:>12,} bytes" for name, size in self.files]
        if self.url:
            lines.append(f"commit: {self.url}")
        return "\n".join(lines)


def find_token(token: str | None = None) -> tuple[str | None, str]:
    """The Hub token and where it came from: the argument, else huggingface_hub's own lookup
    (``HF_TOKEN`` / ``HUGGING_FACE_HUB_TOKEN``, then the token ``hf auth login`` saved)."""
    if token:
        return token, "argument"
    found = get_token()
    if found is None:
        return None, "none"
    source = next((name for name in TOKEN_ENV if os.environ.get(name, "").strip() == found), "saved login")
    return found, source


def push_to_hub(
    folder: str | os.PathLike[str],
    repo_id: str,
    *,
    private: bool = True,
    token: str | None = None,
    dry_run: bool = False,
    commit_message: str = "Upload vdtrain drafter",
) -> PushPlan:
    """Validate an export folder, then create ``repo_id`` (if needed) and upload the folder to it.

    ``dry_run`` does everything but the network calls and returns the plan (files, sizes, repo,
    visibility). ``private`` applies when the repo is created; an existing repo keeps its visibility.
    """
    path = Path(folder)
    problems = validate_export(path)
    if problems:
        raise ExportError(f"not pushing {str(path)!r}, it is not a valid export: " + "; ".join(problems))
    validate_repo_id(repo_id)
    token, source = find_token(token)
    files = tuple(
        (f.relative_to(path).as_posix(), f.stat().st_size)
        for f in sorted(path.rglob("*"))
        if f.is_file() and not any(part.startswith(".") for part in f.relative_to(path).parts)
    )
    plan = PushPlan(repo_id, private, files, dry_run, source)
    if dry_run:
        return plan
    if token is None:
        raise MissingTokenError(
            f"no Hugging Face token to push to {repo_id!r}: run `hf auth login`, pass token=..., or set "
            "HF_TOKEN to a token with write access (https://huggingface.co/settings/tokens); a dry run "
            "shows what would be uploaded without one"
        )
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    commit = api.upload_folder(
        repo_id=repo_id,
        folder_path=path,
        repo_type="model",
        commit_message=commit_message,
        allow_patterns=[name for name, _ in files],
    )
    return dataclasses.replace(plan, url=commit.commit_url)
