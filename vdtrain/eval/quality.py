"""Image quality of evaluation rows: shapes-world caption consistency, CLIP score, FID, HPSv2 and the
Fréchet distance to AR's images in the target's own VQ-encoder features (``frechet_ar``).

Real-image metrics are computed by their standard libraries from weights the user keeps locally (paths
in ``QualityConfig``, ``quality.*`` in ``conf/evaluate.yaml``); nothing is downloaded. A metric that
cannot be computed here — its package is not installed, its weights are not where the config says, or it
is not defined for the prompts — comes back as ``QualityValue(None, reason)``, so a table shows "not
available" and why, never a made-up number.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
from PIL import Image

from vdtrain.eval.frechet import (
    encoder_features,
    gaussian_frechet,
    has_encoder_latents,
    moments,
    moments_gaussian,
)
from vdtrain.eval.table import QualityValue
from vdtrain.shapes.scene import IMAGE_SIZE, parse_caption
from vdtrain.targets.base import ImageTokenizer

Scorer = Callable[[np.ndarray, str], float]


def _image_consistency(image: np.ndarray, caption: str) -> float:
    from vdtrain.shapes.consistency import score_image

    if not is_shapes_caption(caption):
        raise Unavailable("defined for shapes-world captions only (this prompt is not one)")
    return score_image(image, caption).score


# Per-image scores, for per-sample records (``vdtrain.generate``'s stats.json); ``Unavailable`` for a
# prompt the metric is not defined for.
SCORERS: dict[str, Scorer] = {"shapes_consistency": _image_consistency}


def quality_scorer(name: str | None) -> Scorer | None:
    """The per-image scorer a target config names (``quality:``), or None."""
    if name is None:
        return None
    if name not in SCORERS:
        raise ValueError(f"unknown per-image quality metric {name!r}; known: {sorted(SCORERS)}")
    return SCORERS[name]


@dataclass
class QualityConfig:
    """Which metrics, and where their weights are (nothing is downloaded)."""

    # null: shapes_consistency and frechet_ar when every prompt is a shapes-world caption, else
    # clip_score, fid, hpsv2
    metrics: list[str] | None = None
    clip_model: str | None = None  # a local transformers CLIP folder (CLIPModel + CLIPProcessor)
    fid_reference: str | None = None  # a folder of reference images (png/jpg), e.g. COCO val2017
    fid_inception: str | None = None  # torch-fidelity's Inception weights (pt_inception-2015-12-05-*.pth)
    hpsv2_checkpoint: str | None = None  # HPS_v2.1_compressed.pt (or HPS_v2_compressed.pt)
    batch_size: int = 32  # images per forward of the scoring models


class Unavailable(Exception):
    """The metric cannot be computed here; the message says why and how to make it available."""


def _package(module: str, extra: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        missing = error.name or module  # the module actually missing: the package or one of its dependencies
        raise Unavailable(f"{missing} is not installed (pip install 'vdtrain[{extra}]')") from error


def _local_path(path: str | None, what: str, key: str) -> Path:
    if not path:
        raise Unavailable(f"{what} not configured (set quality.{key})")
    found = Path(path).expanduser()
    if not found.exists():
        raise Unavailable(f"{what} not found at {found} (set quality.{key})")
    return found


def _batches(n: int, size: int) -> list[slice]:
    return [slice(start, start + size) for start in range(0, n, size)]


Partial = dict[str, np.ndarray]  # summable statistics of some images: {"n": count, ...}


def mean_partial(scores: Sequence[float] | torch.Tensor) -> Partial:
    """A per-image score's sum and count: the mean of several sets from their sums."""
    values = np.asarray(scores.double().cpu() if isinstance(scores, torch.Tensor) else scores, np.float64)
    return {"n": np.float64(len(values)), "sum": values.sum()}


def mean_value(total: Partial) -> float:
    return float(total["sum"] / total["n"])


def add_partials(parts: Sequence[Partial | str]) -> Partial | str:
    """The partials of several image sets summed in the given order, or the first reason one of them
    is not available."""
    for part in parts:
        if isinstance(part, str):
            return part
    total = dict(parts[0])  # type: ignore[arg-type]
    for part in parts[1:]:
        for key, value in part.items():  # type: ignore[union-attr]
            total[key] = total[key] + value
    return total


def is_shapes_caption(caption: str) -> bool:
    try:
        parse_caption(caption)
    except ValueError:
        return False
    return True


class ShapesConsistency:
    """Mean caption consistency (``vdtrain.shapes.consistency``), defined for shapes-world captions and
    64×64 images only."""

    def __init__(self, config: QualityConfig, device: torch.device) -> None:
        pass

    def partial(self, images: np.ndarray, prompts: Sequence[str]) -> Partial:
        if images.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE, 3):
            raise Unavailable(f"defined for the shapes world's {IMAGE_SIZE}×{IMAGE_SIZE} images only")
        if not all(map(is_shapes_caption, prompts)):
            raise Unavailable("defined for shapes-world captions only (these prompts are not)")
        scores = [_image_consistency(im, p) for im, p in zip(images, prompts, strict=True)]
        return mean_partial(scores)

    def value(self, total: Partial, reference: Partial | None) -> float:
        return mean_value(total)


class ClipScore:
    """CLIP score (Hessel et al., 2021; as torchmetrics defines it): mean over images of
    100 · max(cos(image embedding, caption embedding), 0), captions cut to the text tower's length."""

    def __init__(self, config: QualityConfig, device: torch.device) -> None:
        from transformers import CLIPModel, CLIPProcessor

        path = _local_path(config.clip_model, "CLIP weights", "clip_model")
        try:
            self.model = CLIPModel.from_pretrained(path).eval().to(device)
            self.processor = CLIPProcessor.from_pretrained(path)
        except OSError as error:
            raise Unavailable(f"no CLIP model and processor in {path} ({error})") from error
        self.device, self.batch_size = device, config.batch_size
        self.max_length = self.model.config.text_config.max_position_embeddings

    @torch.no_grad()
    def partial(self, images: np.ndarray, prompts: Sequence[str]) -> Partial:
        scores = []
        for part in _batches(len(images), self.batch_size):
            inputs = self.processor(
                text=list(prompts[part]),
                images=list(images[part]),
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=self.max_length,
            ).to(self.device)
            out = self.model(**inputs)
            cos = torch.nn.functional.cosine_similarity(out.image_embeds, out.text_embeds, dim=-1)
            scores.append(100 * cos.clamp(min=0))
        return mean_partial(torch.cat(scores))

    def value(self, total: Partial, reference: Partial | None) -> float:
        return mean_value(total)


REFERENCE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def reference_images(folder: Path, size: tuple[int, int]) -> np.ndarray:
    """The folder's images as uint8 [N, H, W, 3] at the generated ``size`` (centre crop to the aspect
    ratio, then bicubic resize), so FID compares images at one resolution."""
    images = []
    for path in sorted(p for p in folder.rglob("*") if p.suffix.lower() in REFERENCE_SUFFIXES):
        with Image.open(path) as image:
            image = image.convert("RGB")
            h, w = size
            scale = min(image.width / w, image.height / h)
            cw, ch = round(w * scale), round(h * scale)
            left, top = (image.width - cw) // 2, (image.height - ch) // 2
            crop = image.crop((left, top, left + cw, top + ch)).resize((w, h), Image.BICUBIC)
            images.append(np.asarray(crop))
    return np.stack(images) if images else np.zeros((0, *size, 3), np.uint8)


class Fid:
    """FID: 2048-d pool features of torch-fidelity's Inception (through torchmetrics'
    ``FrechetInceptionDistance``, from local weights), streamed as moments per image set and compared
    with the reference's. ``fid_reference`` is a folder of images, read at the generated resolution, or a
    statistics file (``.npz`` with ``mu`` and ``sigma``, as pytorch-fid and the ADM suite write them)."""

    def __init__(self, config: QualityConfig, device: torch.device) -> None:
        _package("torch_fidelity", "quality")
        fid = _package("torchmetrics.image.fid", "quality")
        weights = _local_path(config.fid_inception, "Inception weights for FID", "fid_inception")
        self.reference = _local_path(config.fid_reference, "FID reference images", "fid_reference")
        metric = fid.FrechetInceptionDistance(feature=2048, feature_extractor_weights_path=str(weights))
        self.inception = metric.inception.to(device)
        self.device, self.batch_size = device, config.batch_size
        self._reference: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    @torch.no_grad()
    def partial(self, images: np.ndarray, prompts: Sequence[str]) -> Partial:
        feats = [
            self.inception(torch.from_numpy(images[part]).permute(0, 3, 1, 2).to(self.device)).cpu()
            for part in _batches(len(images), self.batch_size)
        ]
        return moments(torch.cat(feats))

    def reference_gaussian(self, size: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        if size not in self._reference:
            if self.reference.suffix == ".npz":
                with np.load(self.reference) as stats:
                    self._reference[size] = (stats["mu"], stats["sigma"])
            else:
                reference = reference_images(self.reference, size)
                if len(reference) < 2:
                    raise Unavailable(f"FID needs at least 2 reference images in {self.reference}")
                self._reference[size] = moments_gaussian(self.partial(reference, []))
        return self._reference[size]

    def value(self, total: Partial, reference: Partial | None, size: tuple[int, int] = (0, 0)) -> float:
        if total["n"] < 2:
            raise Unavailable("FID needs at least 2 images per row")
        return gaussian_frechet(*moments_gaussian(total), *self.reference_gaussian(size))


class Hpsv2:
    """HPSv2 (Wu et al., 2023) as the ``hpsv2`` package scores: its open_clip ViT-H-14 with the HPSv2
    checkpoint, the dot product of the normalised image and caption features."""

    def __init__(self, config: QualityConfig, device: torch.device) -> None:
        open_clip = _package("hpsv2.src.open_clip", "hpsv2")
        checkpoint = _local_path(config.hpsv2_checkpoint, "HPSv2 checkpoint", "hpsv2_checkpoint")
        # pretrained=None: the HPSv2 checkpoint holds every weight, so no open_clip download.
        model, _, self.preprocess = open_clip.create_model_and_transforms(
            "ViT-H-14", None, precision="fp32", device=device, output_dict=True
        )
        model.load_state_dict(torch.load(checkpoint, map_location=device)["state_dict"])
        self.model, self.tokenizer = model.eval(), open_clip.get_tokenizer("ViT-H-14")
        self.device, self.batch_size = device, config.batch_size

    @torch.no_grad()
    def partial(self, images: np.ndarray, prompts: Sequence[str]) -> Partial:
        scores = []
        for part in _batches(len(images), self.batch_size):
            pixels = torch.stack([self.preprocess(Image.fromarray(im)) for im in images[part]])
            out = self.model(pixels.to(self.device), self.tokenizer(list(prompts[part])).to(self.device))
            scores.append((out["image_features"] * out["text_features"]).sum(-1))
        return mean_partial(torch.cat(scores))

    def value(self, total: Partial, reference: Partial | None) -> float:
        return mean_value(total)


class FrechetToAR:
    """``frechet_ar``: the Fréchet distance between a row's images and a reference set of the same
    prompts, AR's images at the same temperature and seeds (``vdtrain.eval.frechet`` for the features).
    The runner passes the reference's partial."""

    def __init__(self, tokenizer: ImageTokenizer | None, batch_size: int) -> None:
        if tokenizer is None or not has_encoder_latents(tokenizer):
            name = "no tokenizer" if tokenizer is None else type(tokenizer).__name__
            raise Unavailable(f"needs a LlamaGen-family VQ tokenizer's encoder latents ({name} has none)")
        self.tokenizer, self.batch_size = tokenizer, batch_size

    def partial(self, images: np.ndarray, prompts: Sequence[str]) -> Partial:
        return moments(encoder_features(self.tokenizer, images, self.batch_size))

    def value(self, total: Partial, reference: Partial | None) -> float:
        if reference is None:
            raise Unavailable("needs AR's images on the same prompts and seeds (computed by the runner)")
        if total["n"] < 2 or reference["n"] < 2:
            raise Unavailable("a Fréchet distance needs at least 2 images per row")
        return gaussian_frechet(*moments_gaussian(total), *moments_gaussian(reference))


Metric = ShapesConsistency | ClipScore | Fid | Hpsv2 | FrechetToAR
METRICS: dict[str, Callable[[QualityConfig, torch.device], Metric]] = {
    "shapes_consistency": ShapesConsistency,
    "clip_score": ClipScore,
    "fid": Fid,
    "hpsv2": Hpsv2,
}
REAL_IMAGE_METRICS = ["clip_score", "fid", "hpsv2"]
SHAPES_METRICS = ["shapes_consistency", "frechet_ar"]
REFERENCE_METRICS = ["frechet_ar"]  # scored against AR's images of the same prompts and seeds


class QualityScorer:
    """Scores one evaluation row's images; each metric's model is loaded once, on first use."""

    def __init__(
        self,
        config: QualityConfig | None = None,
        device: str | torch.device = "cpu",
        tokenizer: ImageTokenizer | None = None,
    ) -> None:
        self.config = config or QualityConfig()
        known = sorted([*METRICS, *REFERENCE_METRICS])
        unknown = sorted(set(self.config.metrics or []) - set(known))
        if unknown:
            raise ValueError(f"unknown quality metrics {unknown}; known: {known}")
        self.device = torch.device(device)
        self.tokenizer = tokenizer  # the target's, for frechet_ar's features
        self._loaded: dict[str, Metric | str] = {}  # a metric, or why it is not available

    def metrics_for(self, prompts: Sequence[str]) -> list[str]:
        if self.config.metrics is not None:
            return list(self.config.metrics)
        return SHAPES_METRICS if all(map(is_shapes_caption, prompts)) else REAL_IMAGE_METRICS

    def wants_reference(self, prompts: Sequence[str]) -> bool:
        """Whether a metric for these prompts compares with AR's images (the runner then decodes AR's
        noise floor too)."""
        return any(name in REFERENCE_METRICS for name in self.metrics_for(prompts))

    def _metric(self, name: str) -> Metric:
        if name not in self._loaded:
            try:
                if name == "frechet_ar":
                    self._loaded[name] = FrechetToAR(self.tokenizer, self.config.batch_size)
                else:
                    self._loaded[name] = METRICS[name](self.config, self.device)
            except Unavailable as why:
                self._loaded[name] = str(why)
        loaded = self._loaded[name]
        if isinstance(loaded, str):
            raise Unavailable(loaded)
        return loaded

    def partials(
        self, images: np.ndarray, prompts: Sequence[str], names: Sequence[str]
    ) -> dict[str, Partial | str]:
        """Per metric of ``names``, the summable statistics of these images (``add_partials`` sums the
        units of a row), or why the metric is not available."""
        out: dict[str, Partial | str] = {}
        for name in names:
            try:
                out[name] = self._metric(name).partial(images, prompts)
            except Unavailable as why:
                out[name] = str(why)
        return out

    def finish(
        self,
        totals: Mapping[str, Partial | str],
        references: Mapping[str, Partial | str] | None = None,
        size: tuple[int, int] = (0, 0),
    ) -> dict[str, QualityValue]:
        """The row's values from its summed partials; ``references``: the summed partials of the images
        ``frechet_ar`` compares with; ``size``: the images' (height, width), at which FID reads its
        reference folder."""
        values = {}
        for name, total in totals.items():
            reference = (references or {}).get(name)
            try:
                if isinstance(total, str):
                    raise Unavailable(total)
                if isinstance(reference, str):
                    raise Unavailable(reference)
                metric = self._metric(name)
                if isinstance(metric, Fid):
                    values[name] = QualityValue(metric.value(total, reference, size))
                else:
                    values[name] = QualityValue(metric.value(total, reference))
            except Unavailable as why:
                values[name] = QualityValue(None, str(why))
        return values

    def score(
        self, images: np.ndarray, prompts: Sequence[str], reference: np.ndarray | None = None
    ) -> dict[str, QualityValue]:
        """``{metric: QualityValue}`` for uint8 ``images`` [N, H, W, 3] and their ``prompts``, all at once;
        ``reference``: the images ``frechet_ar`` compares with (AR's, same prompts and seeds)."""
        names = self.metrics_for(prompts)
        refs = None if reference is None else self.partials(reference, prompts, REFERENCE_METRICS)
        return self.finish(self.partials(images, prompts, names), refs, images.shape[1:3])
