"""Data preparation steps, one function each, all writing resumable shard sets (``vdtrain.data.shards``).

- ``prepare_laion_coco``: img2dataset output (webdataset tars or folders of ``{key}.jpg`` + ``{key}.txt``)
  → centre-cropped, resized, VQ-encoded image tokens + captions (+ the encoded condition).
- ``prepare_self_generate``: captions → the target generates the tokens itself (AR or an exact method,
  its sampling pipeline), each sample with its own seed, recorded in ``meta.json``.
- ``prepare_features`` (offline mode): a shard set → the same samples plus fp16 target features, with
  null conditioning decided here per sample (seeded by key), so the expensive target runs once.

Every step takes a ``Target`` object (tests pass tiny random ones) and is resumable: shards are planned
up front from the inputs, and a shard already finished for the same inputs is skipped. The decoding
steps take ``ranks`` (``vdtrain.sharding``): under torchrun each process writes its part of the shards.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import tarfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from vdtrain.config import DataConfig
from vdtrain.data.shards import (
    ShardError,
    ShardReader,
    ShardSink,
    ShardWriter,
    check_identity,
    clean_key,
    feature_dtype,
    read_manifest,
    sample_bytes,
)
from vdtrain.decode.ar import generate_ar
from vdtrain.decode.compiled import DecodeOptions
from vdtrain.decode.methods import DecodeConfig, build_method
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.drafters.base import Drafter
from vdtrain.images import images_to_tensor
from vdtrain.prompts import load_captions
from vdtrain.sharding import Ranks
from vdtrain.targets.base import Condition, Target

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp")
BAD_PART_POLICIES = ("skip", "error")  # what an unreadable input tar does to a laion_coco run


def open_writer(
    ranks: Ranks, out_dir: str | os.PathLike[str], overwrite: bool, **settings: Any
) -> ShardWriter:
    """The shard set's writer on every process: the main one opens (or starts afresh) the set first, the
    others then join it; with several, each records its finished shards beside them (``shared``)."""
    shared = ranks.world > 1
    writer = ShardWriter(out_dir, overwrite=overwrite, shared=shared, **settings) if ranks.is_main else None
    ranks.barrier()
    return writer or ShardWriter(out_dir, shared=shared, **settings)


def close_writer(ranks: Ranks, writer: ShardWriter, planned: list[str]) -> dict[str, Any]:
    """Once every process is done: the main one completes the manifest, and every one returns it."""
    ranks.barrier()
    if ranks.is_main:
        writer.close(planned)
    ranks.barrier()
    return read_manifest(writer.out_dir)


def target_device(target: Target) -> torch.device:
    return next(target.parameters()).device


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def _cond_arrays(cond: Condition, row: int) -> dict[str, np.ndarray]:
    return {
        "cond": cond.features[row].detach().to("cpu", torch.float16).numpy(),
        "cond_mask": cond.mask[row].detach().to("cpu", torch.bool).numpy(),
    }


def _cond_dim(target: Target) -> int:
    """The caption feature width, from encoding one caption (cheap, and right for every adapter)."""
    return int(target.encode_captions(["a"]).features.shape[-1])


# --- img2dataset input --------------------------------------------------------------------------------


def center_crop_arr(image: Image.Image, image_size: int) -> np.ndarray:
    """LlamaGen's (ADM's) preprocessing: halve with a box filter while the short side is at least twice
    ``image_size``, resize the short side to ``image_size`` (bicubic), crop the centre square."""
    while min(*image.size) >= 2 * image_size:
        image = image.resize(tuple(x // 2 for x in image.size), resample=Image.BOX)
    scale = image_size / min(*image.size)
    image = image.resize(tuple(round(x * scale) for x in image.size), resample=Image.BICUBIC)
    arr = np.asarray(image)
    top, left = (arr.shape[0] - image_size) // 2, (arr.shape[1] - image_size) // 2
    return arr[top : top + image_size, left : left + image_size]


@dataclass
class InputItem:
    """One img2dataset sample: its key and a function reading (image bytes, caption, json meta)."""

    key: str
    read: Callable[[], tuple[bytes, str | None, dict[str, Any] | None]]


class InputPart:
    """A unit of img2dataset output (one tar, or one folder of files); output shards never span parts,
    so a part that changes only invalidates its own shards."""

    name: str

    def items(self) -> list[InputItem]:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _split_name(name: str) -> tuple[str, str]:
    base = name.rsplit("/", 1)[-1]
    key, _, suffix = base.partition(".")
    return key, suffix.lower()


class TarPart(InputPart):
    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = path.stem
        self._tar: tarfile.TarFile | None = None

    def items(self) -> list[InputItem]:
        try:
            self._tar = tarfile.open(self.path, "r")  # noqa: SIM115 (open while the part is processed)
            members = self._tar.getmembers()
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise ShardError(f"input tar {str(self.path)!r} is unreadable: {exc}") from exc
        groups: dict[str, dict[str, tarfile.TarInfo]] = {}
        for info in members:
            if info.isfile():
                key, suffix = _split_name(info.name)
                groups.setdefault(key, {})[suffix] = info
        return [
            InputItem(key, self._reader(group))
            for key, group in groups.items()
            if any(s in group for s in IMAGE_SUFFIXES)
        ]

    def _reader(self, group: dict[str, tarfile.TarInfo]):
        def read() -> tuple[bytes, str | None, dict[str, Any] | None]:
            def data(suffix: str) -> bytes | None:
                info = group.get(suffix)
                handle = None if info is None else self._tar.extractfile(info)
                return None if handle is None else handle.read()

            image = next(data(s) for s in IMAGE_SUFFIXES if s in group)
            caption, meta = data("txt"), data("json")
            return (
                image,
                None if caption is None else caption.decode("utf-8"),
                None if meta is None else json.loads(meta),
            )

        return read

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self._tar = None


class FolderPart(InputPart):
    def __init__(self, folder: Path, name: str) -> None:
        self.folder = folder
        self.name = name

    def items(self) -> list[InputItem]:
        images = sorted(
            p for p in self.folder.iterdir() if p.is_file() and p.suffix.lower().lstrip(".") in IMAGE_SUFFIXES
        )
        return [InputItem(p.stem, self._reader(p)) for p in images]

    @staticmethod
    def _reader(image: Path):
        def read() -> tuple[bytes, str | None, dict[str, Any] | None]:
            caption, meta = image.with_suffix(".txt"), image.with_suffix(".json")
            return (
                image.read_bytes(),
                caption.read_text(encoding="utf-8") if caption.is_file() else None,
                json.loads(meta.read_text()) if meta.is_file() else None,
            )

        return read


def img2dataset_parts(source: str | os.PathLike[str]) -> tuple[str, list[InputPart]]:
    """("webdataset" | "files", parts) for img2dataset output: a ``.tar``, a folder of ``*.tar``, or a
    folder (tree) of ``{key}.jpg`` + ``{key}.txt`` files, one part per folder holding images."""
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".tar":
        return "webdataset", [TarPart(path)]
    if not path.is_dir():
        raise FileNotFoundError(f"img2dataset output not found: {str(path)!r} (a .tar or a folder)")
    tars = sorted(path.glob("*.tar"))
    if tars:
        return "webdataset", [TarPart(t) for t in tars]
    folders = sorted(
        {p.parent for s in IMAGE_SUFFIXES for p in path.rglob(f"*.{s}")}
        | {p.parent for s in IMAGE_SUFFIXES for p in path.rglob(f"*.{s.upper()}")}
    )
    if not folders:
        raise FileNotFoundError(f"{path}: no *.tar and no images ({', '.join(IMAGE_SUFFIXES)}) found")
    parts = []
    for folder in folders:
        rel = folder.relative_to(path).as_posix()
        parts.append(FolderPart(folder, "root" if rel == "." else clean_key(rel)))
    return "files", parts


def _decode_input(item: InputItem, image_size: int) -> tuple[np.ndarray, str, dict[str, Any]]:
    data, caption, extra = item.read()
    if caption is None or not caption.strip():
        raise ValueError("no caption (.txt)")
    with Image.open(io.BytesIO(data)) as image:
        size = list(image.size)
        pixels = center_crop_arr(image.convert("RGB"), image_size)
    meta: dict[str, Any] = {"original_size": size}
    if extra:
        meta.update({k: extra[k] for k in ("url", "key", "similarity") if k in extra})
    return pixels, caption.strip(), meta


def _encode_chunk(
    target: Target,
    sink: ShardSink,
    part: str,
    chunk: list[InputItem],
    batch_size: int,
    store_cond: bool,
    bar: tqdm,
) -> None:
    """Decode, crop and VQ-encode one shard's worth of input samples into ``sink``."""
    device, image_size = target_device(target), int(target.tokenizer.image_size)
    for b in range(0, len(chunk), batch_size):
        batch = []
        for item in chunk[b : b + batch_size]:
            try:
                batch.append((item.key, *_decode_input(item, image_size)))
            except Exception as exc:  # a bad input sample is skipped and counted, not fatal
                log.warning("%s/%s: skipped input: %s: %s", part, item.key, type(exc).__name__, exc)
                sink.skipped += 1
        bar.update(min(batch_size, len(chunk) - b))
        if not batch:
            continue
        keys, pixels, captions, metas = zip(*batch, strict=True)
        tokens = target.tokenizer.encode(images_to_tensor(list(pixels)).to(device)).cpu()
        cond = target.encode_captions(list(captions)) if store_cond else None
        for i, key in enumerate(keys):
            meta = {"source": "laion_coco", "part": part, "input_key": key, **metas[i]}
            sample = {
                "key": clean_key(key),
                "tokens": tokens[i].numpy().astype(np.int64),
                "caption": captions[i],
                "meta": meta,
            }
            if cond is not None:
                sample.update(_cond_arrays(cond, i))
            sink.write(sample)


@torch.inference_mode()
def prepare_laion_coco(
    target: Target,
    source: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    samples_per_shard: int = 1000,
    batch_size: int = 32,
    store_cond: bool = False,
    overwrite: bool = False,
    on_bad_tar: str = "skip",
    progress: bool = True,
) -> dict[str, Any]:
    """VQ-encode img2dataset output into a shard set; returns its manifest, plus ``skipped_parts``.

    Each image is centre-cropped and resized to ``target.tokenizer.image_size`` (LlamaGen's
    preprocessing) and encoded with ``target.tokenizer``; its caption is the ``{key}.txt``. Samples
    whose image does not decode or whose caption is missing are skipped with a warning and counted
    (``skipped_inputs`` per shard). An input tar that cannot be read (truncated by a failed download)
    is skipped with a warning and listed in ``skipped_parts`` (``on_bad_tar="skip"``) or stops the run
    (``"error"``). Output shards are ``shard-<part>-<n>.tar``, ``samples_per_shard`` input samples each,
    never spanning two input parts; keys are the img2dataset keys. A shard whose every input was
    skipped is not taken as done on a re-run: it is tried again.
    """
    if on_bad_tar not in BAD_PART_POLICIES:
        raise ValueError(f"on_bad_tar must be one of {BAD_PART_POLICIES}, got {on_bad_tar!r}")
    if Path(out_dir).expanduser().resolve() == Path(source).expanduser().resolve():
        raise ValueError(f"out_dir {str(out_dir)!r} is the input folder; write the shards elsewhere")
    input_format, parts = img2dataset_parts(source)
    image_size = int(target.tokenizer.image_size)
    writer = ShardWriter(
        out_dir,
        kind="laion_coco",
        target_identity=target.identity,
        source={
            "input": str(Path(source).expanduser().resolve()),
            "input_format": input_format,
            "image_size": image_size,
            "preprocess": "center_crop_arr (LlamaGen/ADM)",
        },
        optional_fields=("cond",) if store_cond else (),
        cond_dim=_cond_dim(target) if store_cond else None,
        samples_per_shard=samples_per_shard,
        overwrite=overwrite,
    )
    planned: list[str] = []
    skipped_parts: dict[str, str] = {}
    bar = tqdm(total=0, desc="laion_coco", unit="img", disable=not progress)
    written = already_done = 0
    for part in parts:
        try:
            try:
                items = part.items()
            except ShardError as exc:
                if on_bad_tar == "error":
                    raise
                log.warning("laion_coco: skipped input part %s: %s", part.name, exc)
                skipped_parts[part.name] = str(exc)
                continue
            bar.total += len(items)
            bar.refresh()
            for c, (start, stop) in enumerate(_chunks(len(items), samples_per_shard)):
                name = f"shard-{part.name}-{c:04d}.tar"
                chunk = items[start:stop]
                plan = {
                    "part": part.name,
                    "start": start,
                    "stop": stop,
                    "first": chunk[0].key,
                    "last": chunk[-1].key,
                }
                planned.append(name)
                if _done_with_samples(writer, name, plan):
                    already_done += 1
                    bar.update(len(chunk))
                    bar.set_postfix(written=written, already_done=already_done)
                    continue
                with writer.shard(name, plan) as sink:
                    _encode_chunk(target, sink, part.name, chunk, batch_size, store_cond, bar)
                written += 1
                bar.set_postfix(written=written, already_done=already_done)
        finally:
            part.close()
    bar.close()
    manifest = writer.close(planned)
    skipped = sum(s["skipped_inputs"] for s in manifest["shards"])
    if skipped:
        log.warning("laion_coco: %d input samples skipped (no caption or undecodable image)", skipped)
    if skipped_parts:
        log.warning(
            "laion_coco: %d unreadable input part(s) skipped: %s", len(skipped_parts), sorted(skipped_parts)
        )
    if manifest["num_samples"] == 0:
        raise ShardError(
            f"{source}: no usable samples ({skipped} samples and {len(skipped_parts)} input parts skipped; "
            "see the warnings above)"
        )
    log.info(
        "laion_coco: %d shards (%d written, %d already done), %d samples in %s",
        len(planned),
        written,
        already_done,
        manifest["num_samples"],
        out_dir,
    )
    return {**manifest, "skipped_parts": skipped_parts}


def _done_with_samples(writer: ShardWriter, name: str, plan: dict[str, Any]) -> bool:
    """Finished for this plan, and not with every input skipped: such a shard is what a run whose
    inputs could not be read (captions missing, an image codec absent) left, and is tried again."""
    if not writer.finished(name, plan):
        return False
    entry = next(s for s in writer.manifest["shards"] if s["name"] == name)
    if entry["samples"] == 0 and entry["skipped_inputs"] > 0:
        log.info("%s: every input was skipped last time; trying it again", name)
        return False
    return True


# --- self-generated data ------------------------------------------------------------------------------


@torch.inference_mode()
def prepare_self_generate(
    target: Target,
    captions: Sequence[str] | str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    num_samples: int | None = None,
    sampling: SamplingConfig | None = None,
    seed: int = 0,
    samples_per_shard: int = 1000,
    batch_size: int = 16,
    store_cond: bool = False,
    caption_column: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    method: DecodeConfig | None = None,
    drafter: Drafter | None = None,
    drafter_source: str | None = None,
    options: DecodeOptions | None = None,
    ranks: Ranks | None = None,
) -> dict[str, Any]:
    """The target generates an image (tokens) for each of the first ``num_samples`` captions.

    ``captions`` is a list or a caption file / table / Hub id (``vdtrain.prompts.load_captions``).
    Sample ``i`` uses seed ``seed + i`` whatever its batch, and records caption index, seed, method and
    sampling settings (CFG scale, temperature, top-k, top-p; the target's defaults where not given)
    in ``meta.json``. Shards are ``shard-<n>.tar``; growing ``num_samples`` later reuses finished shards.
    ``method`` (default AR) may be any exact method, with its ``drafter`` (``drafter_source`` says where
    it came from, for the manifest): the samples then follow the target's distribution, faster. With
    ``ranks`` each process generates its part of the shards.
    """
    ranks = ranks or Ranks()
    if method is not None and not method.exact:
        raise ValueError(
            f"method {method.name!r} is relaxed (not exact): its samples would not follow the target's "
            "distribution; self_generate takes AR or an exact method (e.g. eagle2)"
        )
    name = "ar" if method is None else method.name
    if isinstance(captions, str | os.PathLike):
        described = str(captions)
        captions = load_captions(captions, column=caption_column)
    else:
        described = "<list>"
        captions = list(captions)
    if num_samples is not None:
        if num_samples > len(captions):
            raise ValueError(f"num_samples={num_samples} but only {len(captions)} captions")
        captions = captions[:num_samples]
    sampling = sampling or target.sampling_defaults
    device = target_device(target)
    source = {
        "captions": described,
        "caption_column": caption_column,
        "method": name,
        "sampling": asdict(sampling),
    }
    if drafter is not None:
        source["drafter"] = drafter_source
    writer = open_writer(
        ranks,
        out_dir,
        overwrite,
        kind="self_generate",
        target_identity=target.identity,
        source={**source, "seed": seed},
        optional_fields=("cond",) if store_cond else (),
        cond_dim=_cond_dim(target) if store_cond else None,
        samples_per_shard=samples_per_shard,
    )
    engine = None if method is None else build_method(method, target, drafter, sampling, options)
    plans = {}
    for index, (start, stop) in enumerate(_chunks(len(captions), samples_per_shard)):
        # the captions hash per shard: a changed caption file redoes exactly the shards it touches
        plans[f"shard-{index:06d}.tar"] = {
            "start": start,
            "stop": stop,
            "captions_sha256": hashlib.sha256("\n".join(captions[start:stop]).encode()).hexdigest()[:16],
        }
    mine = ranks.take(list(plans))
    total = sum(plans[n]["stop"] - plans[n]["start"] for n in mine)
    bar = tqdm(total=total, desc="self_generate", unit="img", disable=not (progress and ranks.is_main))
    for shard in mine:
        plan = plans[shard]
        start, stop = plan["start"], plan["stop"]
        if writer.finished(shard, plan):
            bar.update(stop - start)
            continue
        with writer.shard(shard, plan) as sink:
            for b in range(start, stop, batch_size):
                batch = captions[b : min(b + batch_size, stop)]
                seeds = [seed + b + i for i in range(len(batch))]
                generators = [torch.Generator(device).manual_seed(s) for s in seeds]
                cond = target.encode_captions(batch)
                if engine is None:
                    tokens = generate_ar(target, cond, sampling, generators).cpu()
                else:
                    tokens = engine.generate(cond, generators, planned_batch=batch_size).tokens.cpu()
                for i, caption in enumerate(batch):
                    sample = {
                        "key": f"{b + i:09d}",
                        "tokens": tokens[i].numpy().astype(np.int64),
                        "caption": caption,
                        "meta": {
                            "source": "self_generate",
                            "caption_index": b + i,
                            "seed": seeds[i],
                            "method": name,
                            "sampling": asdict(sampling),
                        },
                    }
                    if store_cond:
                        sample.update(_cond_arrays(cond, i))
                    sink.write(sample)
                bar.update(len(batch))
    bar.close()
    manifest = close_writer(ranks, writer, list(plans))
    log.info("self_generate: %d samples in %s", manifest["num_samples"], out_dir)
    return manifest


# --- offline target features --------------------------------------------------------------------------


def null_decision(seed: int, key: str, p_null: float) -> bool:
    """Whether sample ``key`` is null-conditioned: a uniform draw from a hash of (seed, key), so the
    decision depends on neither order, batching nor resumption."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < p_null


@torch.inference_mode()
def prepare_features(
    target: Target,
    in_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    p_null: float = DataConfig.p_null,
    seed: int = 0,
    batch_size: int = 16,
    on_corrupt: str = "error",
    overwrite: bool = False,
    progress: bool = True,
    taps: tuple[int, ...] = (),
    ranks: Ranks | None = None,
    warn_bytes: float | None = None,
    feats_dtype: str = "fp16",
) -> dict[str, Any]:
    """A copy of shard set ``in_dir`` with ``feats.npy`` per sample: the target hidden states [L+N, H] =
    ``target.sequence_features(cond, tokens)`` (final norm applied), followed by the ``taps`` layers an
    eagle3 drafter fuses ([L+N, (1 + k)·H], as online training reads them; the manifest's ``source.taps``
    records them), stored in ``feats_dtype`` (fp16, bf16: half fp32's bytes; bf16 keeps fp32's range,
    which a 7B target's pre-norm taps may need).

    ``cond`` is the stored condition when the input has one, else the encoded caption. With probability
    ``p_null`` (per sample, seeded by ``seed`` and the key) the sample is null-conditioned: its features
    come from ``target.with_null`` and ``meta.json`` records ``null_conditioned: true`` (stored ``cond``
    stays the caption's). Output shards mirror the input's names; an input shard that changes (size or
    count) redoes its output shard. With ``ranks`` each process does its part of the shards. A set that
    would hold more than ``warn_bytes`` is warned about before the target runs.
    """
    ranks = ranks or Ranks()
    if not 0.0 <= p_null <= 1.0:
        raise ValueError(f"p_null must be in [0, 1], got {p_null}")
    stored = feature_dtype(feats_dtype)
    if Path(out_dir).expanduser().resolve() == Path(in_dir).expanduser().resolve():
        raise ValueError(f"out_dir {str(out_dir)!r} is in_dir; features go to a new shard set")
    in_manifest = read_manifest(in_dir)
    check_identity(in_manifest, target.identity, str(in_dir))
    if "feats" in in_manifest["fields"]:
        raise ShardError(f"{in_dir} already has features; point in_dir at a shard set without them")
    reader = ShardReader(in_dir, on_corrupt=on_corrupt)
    has_cond = "cond" in in_manifest["fields"]
    device = target_device(target)
    writer = open_writer(
        ranks,
        out_dir,
        overwrite,
        kind="features",
        target_identity=target.identity,
        source={
            "input": str(Path(in_dir).expanduser().resolve()),
            "input_kind": in_manifest.get("kind"),
            "input_source": in_manifest.get("source"),
            "p_null": p_null,
            "seed": seed,
            "features": f"sequence_features(cond, tokens, taps), {feats_dtype}",
            "taps": list(taps),
        },
        optional_fields=(*(("cond",) if has_cond else ()), "feats"),
        cond_dim=in_manifest["shapes"]["cond"][1] if has_cond else None,
        samples_per_shard=in_manifest["samples_per_shard"],
        feature_parts=1 + len(taps),
        feats_dtype=stored,
    )
    one = sample_bytes(writer.manifest["shapes"], writer.manifest["dtypes"])
    size = in_manifest["num_samples"] * one
    if warn_bytes is not None and size > warn_bytes and ranks.is_main:
        log.warning(
            "%s will hold about %.3g GB (%d samples × %.3g MB of %s states and tokens), more "
            "than warn_bytes=%.3g: store fewer feature_layers, or train online (data.features=online)",
            out_dir,
            size / 1e9,
            in_manifest["num_samples"],
            one / 1e6,
            feats_dtype,
            warn_bytes,
        )
    planned = [entry["name"] for entry in in_manifest["shards"]]
    mine = ranks.take(in_manifest["shards"])
    total = sum(entry["samples"] for entry in mine)
    bar = tqdm(total=total, desc="features", unit="sample", disable=not (progress and ranks.is_main))
    for entry in mine:
        name = entry["name"]
        plan = {"input_shard": name, "input_bytes": entry["bytes"], "input_samples": entry["samples"]}
        if writer.finished(name, plan):
            bar.update(entry["samples"])
            continue
        with writer.shard(name, plan) as sink:
            for batch in _batched(reader.iter_shard(name), batch_size):
                tokens = torch.from_numpy(np.stack([s["tokens"] for s in batch])).to(device)
                if has_cond:
                    cond = Condition(
                        torch.from_numpy(np.stack([s["cond"] for s in batch])).float().to(device),
                        torch.from_numpy(np.stack([s["cond_mask"] for s in batch])).to(device),
                    )
                else:
                    cond = target.encode_captions([s["caption"] for s in batch])
                null = torch.tensor([null_decision(seed, s["key"], p_null) for s in batch], device=device)
                if null.any():
                    cond = target.with_null(cond, null)
                hidden = stored_features(target.sequence_features(cond, tokens, taps), stored)
                masks = cond.mask.to("cpu", torch.bool).numpy()  # training reads it: no caption encoder there
                for i, s in enumerate(batch):
                    out = {k: s[k] for k in ("key", "tokens", "caption", "cond", "cond_mask") if k in s}
                    out["meta"] = {**s["meta"], "null_conditioned": bool(null[i])}
                    out["feats"] = hidden[i]
                    out["feats_mask"] = masks[i]
                    sink.write(out)
                bar.update(len(batch))
    bar.close()
    manifest = close_writer(ranks, writer, planned)
    log.info("features: %d samples in %s", manifest["num_samples"], out_dir)
    return manifest


def stored_features(states: torch.Tensor, dtype: str) -> np.ndarray:
    """``states`` as ``feats.npy`` stores them in manifest dtype ``dtype`` (bfloat16: its raw bits)."""
    if dtype == "bfloat16":
        return states.to("cpu", torch.bfloat16).view(torch.uint16).numpy()
    return states.to("cpu", getattr(torch, dtype)).numpy()


def _batched(samples: Iterator[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    batch: list[dict[str, Any]] = []
    for sample in samples:
        batch.append(sample)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
