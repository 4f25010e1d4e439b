"""Chameleon's image vocabulary: VQGAN codebook index ↔ BPE id, by token name.

Image codes live in the BPE vocabulary as tokens named ``IMGIMG<digits>Z`` whose digits are spelled with
the letters A–J (``IMGIMGBCZ`` is code 12). The ids of those tokens are not ``4 + code``: the released
vocabularies order them by name, so the mapping must be read from the names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from vdtrain.checkpoint_io import CheckpointError

IMAGE_TOKEN_PREFIX = "IMGIMG"
IMAGE_TOKEN_SUFFIX = "Z"
_DIGIT_OF_LETTER = {chr(ord("A") + d): str(d) for d in range(10)}


def image_code_of_name(name: str) -> int | None:
    """The codebook index an ``IMGIMG…Z`` token name spells, or None for any other token."""
    if not (name.startswith(IMAGE_TOKEN_PREFIX) and name.endswith(IMAGE_TOKEN_SUFFIX)):
        return None
    letters = name[len(IMAGE_TOKEN_PREFIX) : -len(IMAGE_TOKEN_SUFFIX)]
    if not letters or any(c not in _DIGIT_OF_LETTER for c in letters):
        return None
    return int("".join(_DIGIT_OF_LETTER[c] for c in letters))


def image_token_name(code: int) -> str:
    """The BPE token name of codebook index ``code`` (the inverse of ``image_code_of_name``)."""
    if code < 0:
        raise ValueError(f"codebook index must be >= 0, got {code}")
    letters = "".join(chr(ord("A") + int(d)) for d in str(code))
    return f"{IMAGE_TOKEN_PREFIX}{letters}{IMAGE_TOKEN_SUFFIX}"


def image_token_ids(
    vocabulary_map: Mapping[str, int],
    codebook_size: int,
    code_of_name: Callable[[str], int | None] = image_code_of_name,
    name_of_code: Callable[[int], str] = image_token_name,
) -> torch.Tensor:
    """``ids[c]`` = the BPE id of codebook index ``c``, for every code of a ``codebook_size`` codebook.
    The token names are Chameleon's unless ``code_of_name`` / ``name_of_code`` spell another family's."""
    ids = torch.full((codebook_size,), -1, dtype=torch.long)
    for name, token_id in vocabulary_map.items():
        code = code_of_name(name)
        if code is None:
            continue
        if code >= codebook_size:
            raise ValueError(
                f"image token {name!r} spells code {code}, outside the {codebook_size}-code codebook"
            )
        if ids[code] >= 0:
            raise ValueError(f"codebook index {code} is named twice in the vocabulary ({name!r})")
        ids[code] = int(token_id)
    missing = (ids < 0).nonzero().flatten()
    if len(missing):
        raise ValueError(
            f"the vocabulary names {codebook_size - len(missing)} of {codebook_size} image codes; "
            f"missing e.g. {name_of_code(int(missing[0]))!r} (code {int(missing[0])})"
        )
    return ids


def token_id(vocabulary_map: Mapping[str, int], name: str) -> int:
    """The id of special token ``name``, with an error naming it when the checkpoint's vocabulary lacks it
    (Chameleon family, Emu3)."""
    if name not in vocabulary_map:
        raise CheckpointError(f"the checkpoint's vocabulary has no token {name!r}")
    return int(vocabulary_map[name])
