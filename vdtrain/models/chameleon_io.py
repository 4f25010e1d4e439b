"""Reading released Chameleon-family files: an HF model folder, Meta's VQGAN and the text tokenizer."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from vdtrain.checkpoint_io import CheckpointError, load_strict, read_state_dict
from vdtrain.models.chameleon import ChameleonConfig, ChameleonLM, per_head_state
from vdtrain.models.chameleon_vqgan import ChameleonVQConfig, ChameleonVQGAN, vqgan_state

HF_VQ_PREFIX = "model.vqmodel."
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def read_hf_config(model_dir: str | os.PathLike[str]) -> dict[str, object]:
    path = Path(model_dir).expanduser() / "config.json"
    if not path.is_file():
        raise CheckpointError(f"no config.json in the Chameleon model folder {str(model_dir)!r}")
    return json.loads(path.read_text())


def read_hf_weights(model_dir: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder: one ``model.safetensors``/``pytorch_model.bin`` or the shards its
    ``*.index.json`` lists."""
    folder = Path(model_dir).expanduser()
    for name in WEIGHT_FILES:
        index = folder / f"{name}.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            state: dict[str, torch.Tensor] = {}
            for shard in shards:
                state.update(read_state_dict(folder / shard))
            return state
        if (folder / name).is_file():
            return read_state_dict(folder / name)
    raise CheckpointError(
        f"no weights in {str(model_dir)!r}: looked for {WEIGHT_FILES} and their .index.json"
    )


def load_chameleon_lm(
    config: ChameleonConfig, state: dict[str, torch.Tensor], qk_norm_layout: str, what: str
) -> ChameleonLM:
    """The decoder from a released state dict; its ``model.vqmodel.*`` entries are ignored here."""
    own = {k: v for k, v in state.items() if not k.startswith(HF_VQ_PREFIX)}
    lm = ChameleonLM(config)
    load_strict(lm, per_head_state(own, config, qk_norm_layout), what)
    return lm.eval()


def load_vqgan_hf(config: dict[str, object], state: dict[str, torch.Tensor], what: str) -> ChameleonVQGAN:
    """Anole's VQGAN: ``model.vqmodel.*`` of its HF checkpoint (encoder and ``vqmodel.decoder.*``)."""
    if "vq_config" not in config:
        raise CheckpointError(f"{what}: config.json has no vq_config")
    vq = ChameleonVQGAN(ChameleonVQConfig.from_hf(config["vq_config"]))
    own = vqgan_state(state, HF_VQ_PREFIX)
    if not any(k.startswith("decoder.") for k in own):
        raise CheckpointError(
            f"{what}: the checkpoint has no {HF_VQ_PREFIX}decoder.* keys (transformers' Chameleon "
            "export drops the decoder); use Anole's HF release or point vqgan_ckpt at Meta's vqgan.ckpt"
        )
    load_strict(vq, own, what)
    return vq.eval()


def load_vqgan_meta(ckpt: str | os.PathLike[str], yaml_path: str | os.PathLike[str]) -> ChameleonVQGAN:
    """Meta's ``vqgan.ckpt`` with its ``vqgan.yaml`` (what Lumina-mGPT decodes with)."""
    import yaml

    path = Path(yaml_path).expanduser()
    if not path.is_file():
        raise CheckpointError(f"VQGAN config not found: {str(path)!r}")
    params = yaml.safe_load(path.read_text())["model"]["params"]
    vq = ChameleonVQGAN(ChameleonVQConfig.from_meta(params))
    load_strict(vq, vqgan_state(read_state_dict(ckpt)), f"Chameleon VQGAN ({ckpt})")
    return vq.eval()


def text_tokenizer(path: str | os.PathLike[str]) -> Callable[[str], list[int]]:
    """A ``tokenizer.json``'s encoder without special tokens (the adapters add bos themselves, as both
    official pipelines do)."""
    from tokenizers import Tokenizer

    file = Path(path).expanduser()
    if not file.is_file():
        raise CheckpointError(f"text tokenizer not found: {str(file)!r}")
    tok = Tokenizer.from_file(str(file))
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def vocabulary_map(
    config: dict[str, object], tokenizer_path: str | os.PathLike[str] | None
) -> dict[str, int]:
    """Token name → id: ``config.json``'s ``vocabulary_map`` (HF releases) or the tokenizer's vocabulary."""
    if config.get("vocabulary_map"):
        return {str(k): int(v) for k, v in config["vocabulary_map"].items()}
    if tokenizer_path is None:
        raise CheckpointError("config.json has no vocabulary_map and no tokenizer file was given")
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(tokenizer_path).expanduser())).get_vocab()
