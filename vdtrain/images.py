"""Saving generated images: single PNGs and captioned grids."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont


def save_png(image: np.ndarray, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(path)


def captioned_grid(
    images: list[np.ndarray], captions: list[str], columns: int = 4, scale: int = 2, text_lines: int = 4
) -> Image.Image:
    """Images (uint8 HxWx3) upscaled by ``scale`` with their wrapped captions underneath."""
    font = ImageFont.load_default()
    h, w = images[0].shape[:2]
    cell_w, chars = w * scale, max(12, w * scale // 6)
    cell_h = h * scale + 12 * text_lines + 6
    rows = (len(images) + columns - 1) // columns
    grid = Image.new("RGB", (columns * (cell_w + 6), rows * cell_h), "white")
    draw = ImageDraw.Draw(grid)
    for i, (image, caption) in enumerate(zip(images, captions, strict=True)):
        x, y = (i % columns) * (cell_w + 6), (i // columns) * cell_h
        grid.paste(Image.fromarray(image).resize((cell_w, h * scale), Image.NEAREST), (x, y))
        lines = textwrap.wrap(caption, chars)[:text_lines]
        for j, line in enumerate(lines):
            draw.text((x, y + h * scale + 2 + 12 * j), line, fill="black", font=font)
    return grid
