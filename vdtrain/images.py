"""Images between tensors and pixels, their PSNR, and saving them: single PNGs and captioned grids."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont


def images_to_tensor(images: list[np.ndarray] | np.ndarray) -> torch.Tensor:
    """uint8 [N, H, W, 3] → float [N, 3, H, W] in [-1, 1]."""
    arr = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float()
    return arr / 127.5 - 1.0


def tensor_to_images(x: torch.Tensor) -> np.ndarray:
    """float [N, 3, H, W] in [-1, 1] → uint8 [N, H, W, 3]."""
    return ((x.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).cpu().numpy()


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of images in [-1, 1] (peak-to-peak 2)."""
    mse = (a.clamp(-1, 1) - b.clamp(-1, 1)).pow(2).mean().item()
    return 10 * math.log10(4.0 / max(mse, 1e-12))


def save_png(image: np.ndarray, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(path)


def captioned_grid(
    images: list[np.ndarray], captions: list[str], columns: int = 4, scale: int = 2
) -> Image.Image:
    """Images (uint8 HxWx3) upscaled by ``scale`` with their wrapped captions underneath, every line of
    the longest one (a long COCO caption is not cut)."""
    font = ImageFont.load_default()
    h, w = images[0].shape[:2]
    cell_w, chars = w * scale, max(12, w * scale // 6)
    wrapped = [textwrap.wrap(caption, chars) for caption in captions]
    cell_h = h * scale + 12 * max(1, *map(len, wrapped)) + 6
    rows = (len(images) + columns - 1) // columns
    grid = Image.new("RGB", (columns * (cell_w + 6), rows * cell_h), "white")
    draw = ImageDraw.Draw(grid)
    for i, (image, lines) in enumerate(zip(images, wrapped, strict=True)):
        x, y = (i % columns) * (cell_w + 6), (i // columns) * cell_h
        grid.paste(Image.fromarray(image).resize((cell_w, h * scale), Image.NEAREST), (x, y))
        for j, line in enumerate(lines):
            draw.text((x, y + h * scale + 2 + 12 * j), line, fill="black", font=font)
    return grid
