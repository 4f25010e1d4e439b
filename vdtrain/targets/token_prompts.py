"""Token-id prompts as the condition prefix (Chameleon family, Emu3, Janus-Pro).

These targets are conditioned on a prompt of BPE ids, not on caption features: the prompt is embedded
by the decoder's own token table and left-padded to ``prefix_length`` rows, padded rows hidden from
every query. RoPE is relative, so a left-padded prompt gives the logits of the unpadded one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

CAPTION_OVERFLOW = ("error", "truncate")


def check_caption_overflow(mode: str) -> str:
    if mode not in CAPTION_OVERFLOW:
        raise ValueError(f"caption_overflow must be one of {CAPTION_OVERFLOW}, got {mode!r}")
    return mode


def fit_text(text: list[int], room: int, mode: str, prefix_length: int, caption: str) -> list[int]:
    """``text`` within the ``room`` tokens the prompt frame leaves: cut (``truncate``) or refused
    (``error``, naming the caption and what to change)."""
    if len(text) <= room:
        return text
    if mode == "error":
        raise ValueError(
            f"caption of {len(text)} prompt tokens exceeds the {room} that prefix_length {prefix_length} "
            f"leaves ({caption[:60]!r}); raise prefix_length or use caption_overflow=truncate"
        )
    return text[:room]


def left_padded(
    prompts: Sequence[Sequence[int]], length: int, device: torch.device, shortest: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids [B, length] with each prompt at the end of its row (zeros before it) and the mask of its rows."""
    ids = torch.zeros(len(prompts), length, dtype=torch.long, device=device)
    mask = torch.zeros(len(prompts), length, dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        if not shortest <= len(prompt) <= length:
            raise ValueError(f"a prompt of {len(prompt)} tokens does not fit prefix_length {length}")
        ids[row, length - len(prompt) :] = torch.tensor(list(prompt), device=device)
        mask[row, length - len(prompt) :] = True
    return ids, mask
