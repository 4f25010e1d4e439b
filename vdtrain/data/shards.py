"""Shard sets on disk: the versioned sample schema, an atomic resumable writer, a validating reader.

A shard set is a folder with webdataset ``.tar`` shards and a ``manifest.json`` that says what every
sample must look like and lists the finished shards. A shard is written to ``name.tar.tmp`` and renamed
when complete, so a crash never leaves a half-written shard that looks finished, and a rerun skips the
shards already done. Reading validates every sample against the manifest; a bad one is a ``ShardError``
naming the shard and key, or with ``on_corrupt="skip"`` a warning. The sample fields and the manifest
are described in docs/training.md, "The shard format".
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import tarfile
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from vdtrain.targets.base import TargetIdentity

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
REQUIRED_FIELDS = ("tokens", "caption", "meta")
OPTIONAL_FIELDS = ("cond", "cond_mask", "feats", "feats_mask")
# field name -> tar member suffix
MEMBER_SUFFIX = {
    "tokens": "tokens.npy",
    "caption": "caption.txt",
    "meta": "meta.json",
    "cond": "cond.npy",
    "cond_mask": "cond_mask.npy",
    "feats": "feats.npy",
    "feats_mask": "feats_mask.npy",
}
FIELD_OF_SUFFIX = {v: k for k, v in MEMBER_SUFFIX.items()}
DTYPES = {
    "tokens": "int64",
    "cond": "float16",
    "cond_mask": "bool",
    "feats": "float16",
    "feats_mask": "bool",
}
# ``feats``' stored dtype, ``data_prep.features feats_dtype=`` (the manifest's ``dtypes`` records it; sets
# written before have fp16). numpy has no bfloat16: bf16 states are stored as their raw 16 bits, a uint16
# ``.npy`` (``np.load(...)`` then ``torch.from_numpy(a).view(torch.bfloat16)``), as training reads them
# (``vdtrain.data.shard_stream``).
FEATURE_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
STORED_AS = {"bfloat16": "uint16"}
OnCorrupt = Literal["error", "skip"]


def stored_dtype(name: str) -> np.dtype:
    """The numpy dtype a field of dtype ``name`` (a manifest's ``dtypes`` value) is stored in."""
    return np.dtype(STORED_AS.get(name, name))


def feature_dtype(short: str) -> str:
    """The manifest's dtype name of ``feats_dtype=`` ``short`` (fp32 | fp16 | bf16)."""
    if short not in FEATURE_DTYPES:
        raise ValueError(f"feats_dtype must be one of {list(FEATURE_DTYPES)}, got {short!r}")
    return FEATURE_DTYPES[short]


def as_float32(values: np.ndarray, name: str) -> np.ndarray:
    """Stored values of dtype ``name`` as float32 (bf16 bits are the high half of a float32's)."""
    if name == "bfloat16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32, copy=False)


class ShardError(RuntimeError):
    """A shard set that must not be trained on; the message names the shard file and sample key."""


def sample_problem(shard: str | os.PathLike[str], key: str | None, problem: str) -> str:
    where = f"shard {Path(shard).name!r}" + ("" if key is None else f", sample {key!r}")
    return f"{where}: {problem}"


def identity_from_dict(values: Mapping[str, Any]) -> TargetIdentity:
    data = dict(values)
    data["grid"] = tuple(data["grid"])
    return TargetIdentity(**data)


def _identity(value: TargetIdentity | Mapping[str, Any]) -> TargetIdentity:
    return value if isinstance(value, TargetIdentity) else identity_from_dict(value)


def sample_shapes(
    identity: TargetIdentity, fields: Iterable[str], cond_dim: int | None, feature_parts: int = 1
) -> dict[str, list]:
    """The array shapes a shard set's samples must have, given its target and optional fields;
    ``feature_parts``: the final-norm state plus the tapped layers ``feats`` holds (``feature_taps``)."""
    n = identity.grid[0] * identity.grid[1]
    length = identity.prefix_length
    shapes: dict[str, list] = {"tokens": [n]}
    fields = set(fields)
    if "cond" in fields:
        if cond_dim is None:
            raise ValueError("a shard set with 'cond' needs cond_dim (the caption feature width)")
        shapes["cond"] = [length, int(cond_dim)]
        shapes["cond_mask"] = [length]
    if "feats" in fields:
        shapes["feats"] = [length + n, identity.hidden_size * feature_parts]
    if "feats_mask" in fields:  # absent from feature sets written before it was stored
        shapes["feats_mask"] = [length]
    return shapes


def sample_bytes(shapes: Mapping[str, Sequence[int]], dtypes: Mapping[str, str] = DTYPES) -> int:
    """The array bytes one sample of these shapes stores (``sample_shapes``; ``dtypes``, a manifest's, or
    the defaults): what a features run writes per sample, before tar headers (512 B a member) and captions."""
    dtypes = {**DTYPES, **dtypes}
    return sum(int(np.prod(shape)) * stored_dtype(dtypes[name]).itemsize for name, shape in shapes.items())


def feature_taps(manifest: Mapping[str, Any]) -> list[int]:
    """The target layers a features shard set stores after the final-norm state (an eagle3 drafter's
    ``feature_layers``; empty for eagle1, and for sets written before taps were stored)."""
    return [int(k) for k in manifest.get("source", {}).get("taps", [])]


def clean_key(key: str) -> str:
    """Webdataset splits member names at the first dot, so keys carry no dots or slashes."""
    cleaned = str(key).replace(".", "_").replace("/", "_").replace("\\", "_").strip()
    if not cleaned:
        raise ValueError(f"empty sample key from {key!r}")
    return cleaned


# --- the sample schema ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleSpec:
    """What each sample of one shard set must look like (built from its manifest)."""

    fields: tuple[str, ...]  # all fields, required first
    shapes: dict[str, tuple[int, ...]]
    vocab_size: int
    dtypes: dict[str, str] = field(default_factory=lambda: dict(DTYPES))  # the manifest's: feats may differ

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any]) -> SampleSpec:
        optional = tuple(f for f in OPTIONAL_FIELDS if f in manifest["fields"])
        return cls(
            fields=REQUIRED_FIELDS + optional,
            shapes={k: tuple(v) for k, v in manifest["shapes"].items()},
            vocab_size=int(manifest["target"]["vocab_size"]),
            dtypes={**DTYPES, **manifest.get("dtypes", {})},
        )

    def check_arrays(self, sample: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` describing the first problem of a decoded sample."""
        missing = [f for f in self.fields if sample.get(f) is None]
        if missing:
            raise ValueError(f"missing field(s) {missing}")
        extra = [f for f in OPTIONAL_FIELDS if f not in self.fields and sample.get(f) is not None]
        if extra:
            raise ValueError(f"field(s) {extra} not declared in the manifest")
        for name, shape in self.shapes.items():
            arr = sample[name]
            if not isinstance(arr, np.ndarray):
                raise ValueError(f"{name} is a {type(arr).__name__}, not an array")
            if arr.dtype != stored_dtype(self.dtypes[name]):
                stored = stored_dtype(self.dtypes[name])
                as_bits = f" ({self.dtypes[name]} bits)" if stored.name != self.dtypes[name] else ""
                raise ValueError(f"{name} has dtype {arr.dtype}, expected {stored}{as_bits}")
            if arr.shape != shape:
                raise ValueError(f"{name} has shape {list(arr.shape)}, expected {list(shape)}")
        tokens = sample["tokens"]
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise ValueError(
                f"token ids out of range [0, {self.vocab_size}): min {tokens.min()}, max {tokens.max()}"
            )
        for name in ("cond", "feats"):
            if name in self.shapes and not np.isfinite(as_float32(sample[name], self.dtypes[name])).all():
                raise ValueError(f"{name} has non-finite values")
        if not isinstance(sample["caption"], str):
            raise ValueError("caption is not a string")
        if not isinstance(sample["meta"], dict):
            raise ValueError("meta.json is not a JSON object")

    def decode(self, key: str, members: Mapping[str, bytes]) -> dict[str, Any]:
        """A checked sample dict from raw member bytes (``{"tokens.npy": b"..", ...}``)."""
        unknown = sorted(set(members) - set(FIELD_OF_SUFFIX))
        if unknown:
            raise ValueError(f"unexpected member(s) {unknown}")
        sample: dict[str, Any] = {"key": key}
        for suffix, data in members.items():
            name = FIELD_OF_SUFFIX[suffix]
            try:
                if suffix.endswith(".npy"):
                    sample[name] = np.load(io.BytesIO(data), allow_pickle=False)
                elif suffix.endswith(".json"):
                    sample[name] = json.loads(data.decode("utf-8"))
                else:
                    sample[name] = data.decode("utf-8")
            except Exception as exc:  # any decoding failure is a corrupt member
                if "pickle" in str(exc):  # numpy's advice to load it unsafely is not for shards
                    raise ValueError(f"{suffix} holds pickled (object) data, which shards never do") from exc
                raise ValueError(f"cannot decode {suffix}: {type(exc).__name__}: {exc}") from exc
        self.check_arrays(sample)
        return sample

    def encode(self, sample: Mapping[str, Any]) -> dict[str, bytes]:
        """Member bytes for a sample dict, after checking it (the writer never writes garbage)."""
        self.check_arrays(sample)
        out = {}
        for name in self.fields:
            value = sample[name]
            if name == "caption":
                data = value.encode("utf-8")
            elif name == "meta":
                data = json.dumps(value, sort_keys=True).encode("utf-8")
            else:
                buf = io.BytesIO()
                np.save(buf, np.ascontiguousarray(value), allow_pickle=False)
                data = buf.getvalue()
            out[MEMBER_SUFFIX[name]] = data
        return out


# --- raw tar access -----------------------------------------------------------------------------------


def _split_member(name: str) -> tuple[str, str]:
    """``dir/key.tokens.npy`` → (``dir/key``, ``tokens.npy``), the webdataset convention."""
    head, _, base = name.rpartition("/")
    key, _, suffix = base.partition(".")
    return (f"{head}/{key}" if head else key), suffix


def iter_raw_samples(path: str | os.PathLike[str]) -> Iterator[tuple[str, dict[str, bytes]]]:
    """(key, {suffix: bytes}) per sample of a tar, in order; consecutive members with one key form a
    sample. Raises ``ShardError`` (naming the last key read) if the tar is unreadable, breaks off
    inside a member, or repeats a member within a sample."""
    path = Path(path)
    key, members = None, {}
    try:
        with open(path, "rb") as handle, tarfile.open(fileobj=handle, mode="r|") as tar:
            for info in tar:
                if not info.isfile():
                    continue
                k, suffix = _split_member(info.name)
                if k != key:
                    if key is not None:
                        yield key, members
                    key, members = k, {}
                if suffix in members:
                    raise ShardError(sample_problem(path, k, f"member {suffix!r} appears twice"))
                handle = tar.extractfile(info)
                members[suffix] = handle.read() if handle is not None else b""
                if len(members[suffix]) != info.size:
                    raise tarfile.ReadError(f"{info.name} is truncated")
    except (tarfile.TarError, OSError, EOFError, ValueError) as exc:
        after = "" if key is None else f" (last sample read: {key!r})"
        raise ShardError(
            sample_problem(path, key, f"unreadable tar{after}: {type(exc).__name__}: {exc}")
        ) from exc
    if key is not None:
        yield key, members


def sample_index(path: str | os.PathLike[str]) -> list[list[int]]:
    """[offset, length] of each sample's members in a tar (a scan of its headers, not its data): what a
    shard's manifest entry records as ``index`` so a reader seeks to its own samples."""
    index: list[list[int]] = []
    key = None
    try:
        with tarfile.open(path, "r:") as tar:
            for info in tar:
                if not info.isfile():
                    continue
                k, _ = _split_member(info.name)
                end = info.offset_data + -(-info.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
                if k != key:
                    key = k
                    index.append([info.offset, end - info.offset])
                else:
                    index[-1][1] = end - index[-1][0]
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise ShardError(sample_problem(path, key, f"unreadable tar: {type(exc).__name__}: {exc}")) from exc
    return index


def read_indexed_sample(handle: Any, path: Path, offset: int, length: int) -> tuple[str, dict[str, bytes]]:
    """(key, {suffix: bytes}) of the one sample at ``offset`` (``length`` bytes, headers included) of an
    open tar: only those bytes are read. Raises ``ShardError`` if they are not one whole sample."""
    handle.seek(offset)
    data = handle.read(length)
    key, members, pos = None, {}, 0
    try:
        if len(data) != length:
            raise tarfile.ReadError(f"{length - len(data)} bytes short at offset {offset}")
        while pos < length:
            info = tarfile.TarInfo.frombuf(data[pos : pos + tarfile.BLOCKSIZE], "utf-8", "surrogateescape")
            start = pos + tarfile.BLOCKSIZE
            pos = start + -(-info.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
            if not info.isfile():
                continue
            k, suffix = _split_member(info.name)
            if key is not None and k != key:
                raise tarfile.ReadError(f"members of {key!r} and {k!r} in one indexed span")
            if suffix in members:
                raise tarfile.ReadError(f"member {suffix!r} appears twice")
            key, members[suffix] = k, data[start : start + info.size]
            if len(members[suffix]) != info.size:
                raise tarfile.ReadError(f"{info.name} is truncated")
        if key is None:
            raise tarfile.ReadError(f"no member at offset {offset}")
    except tarfile.TarError as exc:
        raise ShardError(
            sample_problem(
                path,
                key,
                f"unreadable indexed sample: {type(exc).__name__}: {exc}; "
                f"re-index with `python -m vdtrain.data.shards index {path.parent}`",
            )
        ) from exc
    return key, members


def index_shard_set(folder: str | os.PathLike[str]) -> int:
    """Record the sample index of every shard of a set written before shards were indexed (reads the
    tar headers only); returns how many shards gained one."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    added = 0
    for entry in manifest["shards"]:
        path = folder / entry["name"]
        if "index" in entry or not path.is_file():
            continue
        entry["index"] = sample_index(path)
        if len(entry["index"]) != entry["samples"]:
            raise ShardError(
                sample_problem(
                    path, None, f"{len(entry['index'])} samples, the manifest records {entry['samples']}"
                )
            )
        added += 1
    _write_json_atomic(folder / MANIFEST, manifest)
    return added


# --- manifest -----------------------------------------------------------------------------------------


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def read_manifest(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of a shard set, after checking it exists and has this schema version."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise ShardError(f"{str(path)!r} not found: {folder} is not a shard set (or it was never finished)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ShardError(f"{path}: unreadable manifest: {exc}") from exc
    version = manifest.get("schema_version") if isinstance(manifest, dict) else None
    if version != SCHEMA_VERSION:
        raise ShardError(
            f"{path}: schema version {version!r}, this vdtrain reads version {SCHEMA_VERSION}; "
            "re-run the data preparation step"
        )
    for needed in ("target", "fields", "shapes", "shards"):
        if needed not in manifest:
            raise ShardError(f"{path}: manifest has no {needed!r}")
    return manifest


def check_identity(
    manifest: Mapping[str, Any], expected: TargetIdentity | Mapping[str, Any], where: str
) -> None:
    problems = identity_from_dict(manifest["target"]).mismatches(_identity(expected))
    if problems:
        raise ShardError(f"{where}: shards were made for another target: {'; '.join(problems)}")


# --- writer -------------------------------------------------------------------------------------------


class ShardSink:
    def __init__(self, writer: ShardWriter, name: str, tmp: Path) -> None:
        self.writer, self.name, self.tmp = writer, name, tmp
        self.tar = tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT)  # noqa: SIM115 (closed by shard())
        self.keys: set[str] = set()
        self.count = 0
        self.skipped = 0
        self.index: list[list[int]] = []  # [offset, length] of each sample's members in the tar

    def write(self, sample: Mapping[str, Any]) -> None:
        """Add one sample: ``key`` plus the fields of the schema (optional ones as declared)."""
        key = sample["key"]
        if key != clean_key(key):
            raise ValueError(f"sample key {key!r} contains '.', '/' or '\\'; pass it through clean_key")
        if key in self.keys:
            raise ValueError(f"{self.name}: duplicate sample key {key!r}")
        try:
            members = self.writer.spec.encode(sample)
        except ValueError as exc:
            raise ShardError(sample_problem(self.name, key, f"refusing to write: {exc}")) from exc
        start = self.tar.offset
        for suffix, data in members.items():
            info = tarfile.TarInfo(f"{key}.{suffix}")
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            self.tar.addfile(info, io.BytesIO(data))
        self.index.append([start, self.tar.offset - start])
        self.keys.add(key)
        self.count += 1


class ShardWriter:
    """Writes a shard set: ``out_dir/<name>.tar`` shards plus ``manifest.json``.

    Callers plan their shards (a name and a JSON-able ``plan`` describing the inputs each covers) and
    ask ``finished(name, plan)`` before doing the work; ``with writer.shard(name, plan) as sink:`` then
    ``sink.write(sample)`` writes ``name.tmp`` and, on a clean exit, renames it and records it. ``close``
    marks the set complete. Reopening a folder written with other settings (kind, target, source, fields,
    shapes, dtypes, samples per shard) is refused unless ``overwrite=True``, which starts the set afresh.
    ``feats_dtype``: the manifest dtype of ``feats`` (``FEATURE_DTYPES``' values; bf16 stored as its bits).

    ``shared``: several processes write the set at once (``vdtrain.sharding``), each its own shards. A
    finished shard is then recorded in ``<name>.json`` beside it, never in the manifest, which one process
    opens first (the others after it) and ``close``s last, folding those records in.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        *,
        kind: str,
        target_identity: TargetIdentity | Mapping[str, Any],
        source: Mapping[str, Any],
        optional_fields: Sequence[str] = (),
        cond_dim: int | None = None,
        samples_per_shard: int = 1000,
        overwrite: bool = False,
        feature_parts: int = 1,
        shared: bool = False,
        feats_dtype: str = DTYPES["feats"],
    ) -> None:
        if samples_per_shard < 1:
            raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
        unknown = set(optional_fields) - set(OPTIONAL_FIELDS)
        if unknown:
            raise ValueError(f"unknown optional field(s) {sorted(unknown)}; known: {OPTIONAL_FIELDS}")
        fields = list(REQUIRED_FIELDS) + [f for f in OPTIONAL_FIELDS if f in optional_fields]
        if "cond" in fields and "cond_mask" not in fields:
            fields.insert(fields.index("cond") + 1, "cond_mask")
        if "feats" in fields and "feats_mask" not in fields:
            fields.insert(fields.index("feats") + 1, "feats_mask")
        identity = _identity(target_identity)
        self.out_dir = Path(out_dir)
        self.samples_per_shard = samples_per_shard
        self.shared = shared
        header = {
            "schema_version": SCHEMA_VERSION,
            "kind": kind,
            "target": asdict(identity),
            "source": json.loads(json.dumps(dict(source))),  # normalised (tuples → lists)
            "fields": fields,
            "shapes": sample_shapes(identity, fields, cond_dim, feature_parts),
            "dtypes": {k: v for k, v in {**DTYPES, "feats": feats_dtype}.items() if k in fields},
            "samples_per_shard": samples_per_shard,
        }
        header["target"]["grid"] = list(identity.grid)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.manifest = self._open(header, overwrite)
        self.spec = SampleSpec.from_manifest(self.manifest)

    def _open(self, header: dict[str, Any], overwrite: bool) -> dict[str, Any]:
        path = self.out_dir / MANIFEST
        if path.exists() and not overwrite:
            try:
                old = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise ShardError(
                    f"{path}: unreadable manifest ({exc}); use overwrite=true to start again"
                ) from exc
            changed = [k for k in header if old.get(k) != header[k]]
            if changed:
                details = "; ".join(f"{k}: {old.get(k)!r} -> {header[k]!r}" for k in changed)
                raise ShardError(
                    f"{self.out_dir} holds shards written with other settings ({details}); "
                    "use a new out_dir, or overwrite=true to start again"
                )
            return old
        if overwrite:  # remove what an earlier run recorded, never other files in the folder
            with contextlib.suppress(OSError, json.JSONDecodeError, KeyError, TypeError):
                for entry in json.loads(path.read_text())["shards"]:
                    (self.out_dir / Path(entry["name"]).name).unlink(missing_ok=True)
            for stale in [*self.out_dir.glob("*.tar.tmp"), *self.out_dir.glob("*.tar.json")]:
                stale.unlink()
        manifest = {**header, "complete": False, "num_samples": 0, "shards": []}
        _write_json_atomic(path, manifest)
        return manifest

    def _entry(self, name: str) -> dict[str, Any] | None:
        record = self.out_dir / f"{name}.json"  # a shared set's record of a shard, until close
        if self.shared and record.is_file():
            return json.loads(record.read_text())
        return next((s for s in self.manifest["shards"] if s["name"] == name), None)

    def finished(self, name: str, plan: Any) -> bool:
        """True when ``name`` is recorded for the same ``plan`` and its file has the recorded size."""
        entry = self._entry(name)
        if entry is None or entry.get("plan") != json.loads(json.dumps(plan)):
            return False
        path = self.out_dir / name
        return path.is_file() and path.stat().st_size == entry["bytes"]

    @contextlib.contextmanager
    def shard(self, name: str, plan: Any) -> Iterator[ShardSink]:
        if not name.endswith(".tar") or "/" in name:
            raise ValueError(f"shard name must be a plain file name ending in .tar, got {name!r}")
        final = self.out_dir / name
        tmp = final.with_name(name + ".tmp")
        sink = ShardSink(self, name, tmp)
        try:
            yield sink
            sink.tar.close()
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            sink.tar.close()
            tmp.unlink(missing_ok=True)
            raise
        entry = {
            "name": name,
            "samples": sink.count,
            "skipped_inputs": sink.skipped,
            "bytes": final.stat().st_size,
            "plan": json.loads(json.dumps(plan)),
            "index": sink.index,
        }
        if self.shared:
            _write_json_atomic(self.out_dir / f"{name}.json", entry)
            return
        shards = [s for s in self.manifest["shards"] if s["name"] != name] + [entry]
        self.manifest["shards"] = sorted(shards, key=lambda s: s["name"])
        self.manifest["num_samples"] = sum(s["samples"] for s in self.manifest["shards"])
        self.manifest["complete"] = False
        _write_json_atomic(self.out_dir / MANIFEST, self.manifest)

    def close(self, planned: Iterable[str]) -> dict[str, Any]:
        """Mark the set complete with exactly the ``planned`` shards (others are dropped from the
        manifest; their files are left alone). Every planned shard must be finished."""
        planned = list(planned)
        records = sorted(self.out_dir.glob("*.tar.json")) if self.shared else []
        if records:  # a shared set's shards, recorded beside them
            entries = {s["name"]: s for s in self.manifest["shards"]}
            entries.update({e["name"]: e for e in (json.loads(r.read_text()) for r in records)})
            self.manifest["shards"] = list(entries.values())
        missing = [n for n in planned if self._entry(n) is None]
        if missing:
            raise ShardError(f"{self.out_dir}: planned shard(s) never written: {missing[:5]}")
        dropped = [s["name"] for s in self.manifest["shards"] if s["name"] not in planned]
        if dropped:
            log.warning(
                "%s: shards no longer in the plan left out of the manifest: %s", self.out_dir, dropped
            )
        order = {n: i for i, n in enumerate(planned)}
        self.manifest["shards"] = sorted(
            (s for s in self.manifest["shards"] if s["name"] in order), key=lambda s: order[s["name"]]
        )
        self.manifest["num_samples"] = sum(s["samples"] for s in self.manifest["shards"])
        self.manifest["complete"] = True
        _write_json_atomic(self.out_dir / MANIFEST, self.manifest)
        for record in records:  # folded into the manifest
            record.unlink()
        return self.manifest


# --- reader -------------------------------------------------------------------------------------------


class ShardReader:
    """Iterates the validated samples of a shard set, shard by shard in manifest order.

    Each sample is a dict: ``key``, ``shard`` (file name), ``tokens`` (int64 [N]), ``caption``,
    ``meta`` and, where the set has them, ``cond`` (float16 [L, D]) + ``cond_mask`` (bool [L]) and
    ``feats`` (float16 [L+N, H], or [L+N, (1 + k)·H] with ``k`` tapped layers) + ``feats_mask`` (bool [L]:
    the condition mask they were computed under, the null condition's on a null-conditioned sample).

    ``on_corrupt="error"`` (default) raises ``ShardError`` at the first bad sample or unreadable shard.
    ``on_corrupt="skip"`` logs a warning naming the shard and key and goes on: a bad sample is left
    out, a missing shard is left out, and a shard whose tar breaks off is read up to the break.
    ``skipped`` counts the problems passed over. Wrong schema versions, incomplete sets (unless
    ``allow_incomplete``) and target mismatches always raise.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        *,
        on_corrupt: OnCorrupt = "error",
        target_identity: TargetIdentity | Mapping[str, Any] | None = None,
        shards: Sequence[str] | None = None,
        allow_incomplete: bool = False,
    ) -> None:
        if on_corrupt not in ("error", "skip"):
            raise ValueError(f"on_corrupt must be 'error' or 'skip', got {on_corrupt!r}")
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        if not self.manifest.get("complete") and not allow_incomplete:
            raise ShardError(
                f"{self.folder}: the shard set is incomplete (its preparation did not finish); "
                "re-run the step to resume it"
            )
        if target_identity is not None:
            check_identity(self.manifest, target_identity, str(self.folder))
        self.spec = SampleSpec.from_manifest(self.manifest)
        self.on_corrupt = on_corrupt
        listed = [s["name"] for s in self.manifest["shards"]]
        if shards is not None:
            unknown = [s for s in shards if s not in listed]
            if unknown:
                raise ShardError(f"{self.folder}: shard(s) not in the manifest: {unknown}")
        self.shards = list(shards) if shards is not None else listed
        self.skipped = 0

    def __len__(self) -> int:
        counts = {s["name"]: s["samples"] for s in self.manifest["shards"]}
        return sum(counts[n] for n in self.shards)

    def _bad(self, message: str) -> None:
        if self.on_corrupt == "error":
            raise ShardError(message)
        self.skipped += 1
        log.warning("%s — skipped", message)

    def iter_shard(self, name: str) -> Iterator[dict[str, Any]]:
        for _, sample in self.iter_slots(name):
            if sample is not None:
                yield sample

    def iter_slots(
        self, name: str, wanted: Container[int] | None = None
    ) -> Iterator[tuple[int, dict[str, Any] | None]]:
        """(position in the shard, sample) for the ``wanted`` positions (all by default), in order.

        Only wanted samples are decoded and checked. Where the manifest records the shard's ``index``,
        only their bytes are read (a seek to each); a set written before shards were indexed is scanned
        whole (``index_shard_set`` adds the index). Under ``on_corrupt="skip"`` a bad wanted sample comes
        as ``(position, None)``; positions after a break in the tar (or of a missing shard) never come."""
        path = self.folder / name
        entry = next(s for s in self.manifest["shards"] if s["name"] == name)
        if not path.is_file():
            self._bad(sample_problem(path, None, "shard file missing"))
            return
        size = path.stat().st_size
        if size != entry["bytes"]:
            self._bad(sample_problem(path, None, f"{size} bytes, the manifest records {entry['bytes']}"))
        if wanted is not None and "index" in entry:
            yield from self._indexed_slots(path, entry["index"], wanted)
            return
        raw, count = iter_raw_samples(path), 0
        while True:
            try:
                key, members = next(raw)
            except StopIteration:
                break
            except ShardError as exc:
                self._bad(str(exc))
                return
            position, count = count, count + 1
            if wanted is not None and position not in wanted:
                continue
            try:
                sample = self.spec.decode(key, members)
            except ValueError as exc:
                self._bad(sample_problem(path, key, str(exc)))
                yield position, None
                continue
            sample["shard"] = name
            yield position, sample
        if count != entry["samples"]:
            self._bad(sample_problem(path, None, f"{count} samples, the manifest records {entry['samples']}"))

    def _indexed_slots(
        self, path: Path, index: Sequence[Sequence[int]], wanted: Container[int]
    ) -> Iterator[tuple[int, dict[str, Any] | None]]:
        with open(path, "rb", buffering=0) as handle:
            for position, (offset, length) in enumerate(index):
                if position not in wanted:
                    continue
                try:
                    key, members = read_indexed_sample(handle, path, offset, length)
                except ShardError as exc:
                    self._bad(str(exc))
                    return
                try:
                    sample = self.spec.decode(key, members)
                except ValueError as exc:
                    self._bad(sample_problem(path, key, str(exc)))
                    yield position, None
                    continue
                sample["shard"] = path.name
                yield position, sample

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for name in self.shards:
            yield from self.iter_shard(name)


def read_shards(
    folder: str | os.PathLike[str], on_corrupt: OnCorrupt = "error", **kwargs: Any
) -> Iterator[dict[str, Any]]:
    """Shorthand for ``iter(ShardReader(folder, on_corrupt=on_corrupt, ...))``."""
    return iter(ShardReader(folder, on_corrupt=on_corrupt, **kwargs))


# --- validator ----------------------------------------------------------------------------------------


@dataclass
class ValidationReport:
    folder: str
    ok: bool
    kind: str | None = None
    num_shards: int = 0
    num_samples: int = 0
    fields: list[str] = field(default_factory=list)
    shard_samples: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def validate_shards(
    folder: str | os.PathLike[str],
    target_identity: TargetIdentity | Mapping[str, Any] | None = None,
    *,
    raise_on_error: bool = True,
    max_problems: int = 50,
) -> ValidationReport:
    """Check a shard set before training: manifest present with this schema version and complete;
    target identity as given; every listed shard present, a readable tar of the recorded size, with
    the recorded sample count; every sample with the manifest's fields, dtypes and shapes, token ids
    below the vocabulary and unique keys.

    Collects the problems (each naming the shard and, where it applies, the sample key) into the
    report; with ``raise_on_error`` (default) any problem raises one ``ShardError`` listing them.
    """
    folder = Path(folder)
    report = ValidationReport(folder=str(folder), ok=False)

    def finish() -> ValidationReport:
        report.ok = not report.problems
        if report.problems and raise_on_error:
            shown = report.problems[:10]
            more = len(report.problems) - len(shown)
            tail = f"\n  ... and {more} more" if more else ""
            raise ShardError(f"{folder}: {len(report.problems)} problem(s):\n  " + "\n  ".join(shown) + tail)
        return report

    try:
        manifest = read_manifest(folder)
    except ShardError as exc:
        report.problems.append(str(exc))
        return finish()
    report.kind = manifest.get("kind")
    report.fields = list(manifest["fields"])
    if not manifest.get("complete"):
        report.problems.append(f"{folder / MANIFEST}: the set is incomplete (preparation did not finish)")
    if target_identity is not None:
        try:
            check_identity(manifest, target_identity, str(folder / MANIFEST))
        except ShardError as exc:
            report.problems.append(str(exc))
    try:
        spec = SampleSpec.from_manifest(manifest)
        expected = sample_shapes(
            identity_from_dict(manifest["target"]),
            manifest["fields"],
            manifest["shapes"]["cond"][1] if "cond" in manifest["shapes"] else None,
            1 + len(feature_taps(manifest)),
        )
        if expected != manifest["shapes"]:
            report.problems.append(
                f"{folder / MANIFEST}: shapes {manifest['shapes']} do not follow from the target "
                f"and fields (expected {expected})"
            )
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        report.problems.append(f"{folder / MANIFEST}: malformed manifest: {type(exc).__name__}: {exc}")
        return finish()

    seen: dict[str, str] = {}
    for entry in manifest["shards"]:
        name = entry["name"]
        path = folder / name
        report.num_shards += 1
        if not path.is_file():
            report.problems.append(sample_problem(path, None, "shard file missing"))
            continue
        size = path.stat().st_size
        if size != entry.get("bytes", size):
            report.problems.append(
                sample_problem(
                    path, None, f"{size} bytes, the manifest records {entry['bytes']} (truncated?)"
                )
            )
        count = 0
        try:
            for key, members in iter_raw_samples(path):
                count += 1
                if key in seen:
                    report.problems.append(sample_problem(path, key, f"key also in {seen[key]!r}"))
                seen[key] = name
                try:
                    spec.decode(key, members)
                except ValueError as exc:
                    report.problems.append(sample_problem(path, key, str(exc)))
                if len(report.problems) >= max_problems:
                    return finish()
        except ShardError as exc:
            report.problems.append(str(exc))
            continue
        report.shard_samples[name] = count
        report.num_samples += count
        if "index" in entry and entry["index"] != sample_index(path):
            report.problems.append(
                sample_problem(
                    path,
                    None,
                    "the manifest's sample index does not match the tar: re-index "
                    f"with `python -m vdtrain.data.shards index {folder}`",
                )
            )
        if count != entry["samples"]:
            report.problems.append(
                sample_problem(path, None, f"{count} samples, the manifest records {entry['samples']}")
            )
    return finish()


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m vdtrain.data.shards index FOLDER``: index a shard set written before shards were."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m vdtrain.data.shards")
    parser.add_argument("command", choices=["index"])
    parser.add_argument("folder")
    args = parser.parse_args(argv)
    print(f"{args.folder}: indexed {index_shard_set(args.folder)} shard(s)")


if __name__ == "__main__":
    main()
