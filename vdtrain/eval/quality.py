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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
from PIL import Image

from vdtrain.eval.frechet import encoder_features, frechet_distance, has_encoder_latents
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


def is_shapes_caption(caption: str) -> bool:
    try:
        parse_caption(caption)
    except ValueError:
        return False
    return True


def shapes_consistency(images: np.ndarray, prompts: Sequence[str]) -> float:
    """Mean caption consistency (``vdtrain.shapes.consistency``), defined for shapes-world captions and
    64×64 images only."""
    if images.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE, 3):
        raise Unavailable(f"defined for the shapes world's {IMAGE_SIZE}×{IMAGE_SIZE} images only")
    if not all(map(is_shapes_caption, prompts)):
        raise Unavailable("defined for shapes-world captions only (these prompts are not)")
    return float(np.mean([_image_consistency(im, p) for im, p in zip(images, prompts, strict=True)]))


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
    def __call__(self, images: np.ndarray, prompts: Sequence[str]) -> float:
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
        return float(torch.cat(scores).mean())


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
    """FID (torchmetrics ``FrechetInceptionDistance``, 2048-d pool features of torch-fidelity's
    Inception from local weights) between a row's images and the reference folder, both at the
    generated resolution. Reference features are computed once."""

    def __init__(self, config: QualityConfig, device: torch.device) -> None:
        _package("torch_fidelity", "quality")
        fid = _package("torchmetrics.image.fid", "quality")
        weights = _local_path(config.fid_inception, "Inception weights for FID", "fid_inception")
        self.reference = _local_path(config.fid_reference, "FID reference images", "fid_reference")
        self.metric = fid.FrechetInceptionDistance(
            feature=2048, reset_real_features=False, feature_extractor_weights_path=str(weights)
        ).to(device)
        self.device, self.batch_size = device, config.batch_size
        self.size: tuple[int, int] | None = None

    def _update(self, images: np.ndarray, real: bool) -> None:
        for part in _batches(len(images), self.batch_size):
            self.metric.update(torch.from_numpy(images[part]).permute(0, 3, 1, 2).to(self.device), real=real)

    @torch.no_grad()
    def __call__(self, images: np.ndarray, prompts: Sequence[str]) -> float:
        if len(images) < 2:
            raise Unavailable("FID needs at least 2 images per row")
        size = images.shape[1:3]
        if self.size is None:
            reference = reference_images(self.reference, size)
            if len(reference) < 2:
                raise Unavailable(f"FID needs at least 2 reference images in {self.reference}")
            self._update(reference, real=True)
            self.size = size
        elif self.size != size:
            raise ValueError(f"FID of {size} images against a reference read at {self.size}")
        self._update(images, real=False)
        value = float(self.metric.compute())
        self.metric.reset()  # the generated images only: reset_real_features=False keeps the reference
        return value


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
    def __call__(self, images: np.ndarray, prompts: Sequence[str]) -> float:
        scores = []
        for part in _batches(len(images), self.batch_size):
            pixels = torch.stack([self.preprocess(Image.fromarray(im)) for im in images[part]])
            out = self.model(pixels.to(self.device), self.tokenizer(list(prompts[part])).to(self.device))
            scores.append((out["image_features"] * out["text_features"]).sum(-1))
        return float(torch.cat(scores).mean())


class FrechetToAR:
    """``frechet_ar``: the Fréchet distance between a row's images and a reference set of the same
    prompts, AR's images at the same temperature and seeds (``vdtrain.eval.frechet`` for the features).
    The runner passes the reference; the reference's features are kept while it is the same array."""

    def __init__(self, tokenizer: ImageTokenizer | None, batch_size: int) -> None:
        if tokenizer is None or not has_encoder_latents(tokenizer):
            name = "no tokenizer" if tokenizer is None else type(tokenizer).__name__
            raise Unavailable(f"needs a LlamaGen-family VQ tokenizer's encoder latents ({name} has none)")
        self.tokenizer, self.batch_size = tokenizer, batch_size
        self._reference: tuple[np.ndarray, np.ndarray] | None = None  # (images, their features)

    def features(self, images: np.ndarray) -> np.ndarray:
        return encoder_features(self.tokenizer, images, self.batch_size)

    def __call__(self, images: np.ndarray, reference: np.ndarray | None) -> float:
        if reference is None:
            raise Unavailable("needs AR's images on the same prompts and seeds (computed by the runner)")
        if len(images) < 2:
            raise Unavailable("a Fréchet distance needs at least 2 images per row")
        if self._reference is None or self._reference[0] is not reference:
            self._reference = (reference, self.features(reference))
        return frechet_distance(self.features(images), self._reference[1])


Metric = Callable[[np.ndarray, Sequence[str]], float]
METRICS: dict[str, Callable[[QualityConfig, torch.device], Metric]] = {
    "shapes_consistency": lambda config, device: shapes_consistency,
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
        self._loaded: dict[str, Metric | FrechetToAR | str] = {}  # a metric, or why it is not available

    def metrics_for(self, prompts: Sequence[str]) -> list[str]:
        if self.config.metrics is not None:
            return list(self.config.metrics)
        return SHAPES_METRICS if all(map(is_shapes_caption, prompts)) else REAL_IMAGE_METRICS

    def wants_reference(self, prompts: Sequence[str]) -> bool:
        """Whether a metric for these prompts compares with AR's images (the runner then decodes AR's
        noise floor too)."""
        return any(name in REFERENCE_METRICS for name in self.metrics_for(prompts))

    def _metric(self, name: str) -> Metric | FrechetToAR:
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

    def score(
        self, images: np.ndarray, prompts: Sequence[str], reference: np.ndarray | None = None
    ) -> dict[str, QualityValue]:
        """``{metric: QualityValue}`` for uint8 ``images`` [N, H, W, 3] and their ``prompts``;
        ``reference``: the images ``frechet_ar`` compares with (AR's, same prompts and seeds)."""
        values = {}
        for name in self.metrics_for(prompts):
            try:
                metric = self._metric(name)
                if isinstance(metric, FrechetToAR):
                    values[name] = QualityValue(metric(images, reference))
                else:
                    values[name] = QualityValue(metric(images, prompts))
            except Unavailable as why:
                values[name] = QualityValue(None, str(why))
        return values
