"""Reading released Chameleon-family files: an HF model folder, Meta's VQGAN and the text tokenizer."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from vdtrain.checkpoint_io import CheckpointError, load_strict, read_state_dict
from vdtrain.models.chameleon import ChameleonConfig, ChameleonLM
from vdtrain.models.chameleon_vqgan import ChameleonVQConfig, ChameleonVQGAN

HF_VQ_PREFIX = "model.vqmodel."
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
QK_NORM_LAYOUTS = ("per_head", "per_shard")


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


def chameleon_config(config: Mapping[str, object]) -> ChameleonConfig:
    """From a released ``config.json`` (transformers 4.x ``rope_theta`` or 5.x ``rope_parameters``)."""
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"Chameleon config has hidden_act={act!r}; only 'silu' is released")
    rope = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise ValueError(
            f"Chameleon config asks for RoPE scaling {rope_type!r}; only plain RoPE is supported"
        )
    heads = int(config.get("num_attention_heads", 32))
    return ChameleonConfig(
        vocab_size=int(config.get("vocab_size", 65536)),
        hidden_size=int(config.get("hidden_size", 4096)),
        intermediate_size=int(config.get("intermediate_size", 11008)),
        num_hidden_layers=int(config.get("num_hidden_layers", 32)),
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        swin_norm=bool(config.get("swin_norm", False)),
        attention_bias=bool(config.get("attention_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)),
        model_parallel_size=int(config.get("model_parallel_size") or 1),
    )


def vqgan_config_hf(vq: Mapping[str, object]) -> ChameleonVQConfig:
    """From the ``vq_config`` of a released HF ``config.json``."""
    if vq.get("double_latent"):
        raise ValueError("vq_config.double_latent=true is not a released Chameleon VQGAN")
    return ChameleonVQConfig(
        embed_dim=int(vq.get("embed_dim", 256)),
        num_embeddings=int(vq.get("num_embeddings", 8192)),
        latent_channels=int(vq.get("latent_channels", 256)),
        base_channels=int(vq.get("base_channels", 128)),
        channel_multiplier=tuple(int(m) for m in vq.get("channel_multiplier", (1, 1, 2, 2, 4))),
        num_res_blocks=int(vq.get("num_res_blocks", 2)),
        attn_resolutions=tuple(int(r) for r in (vq.get("attn_resolutions") or ())),
        resolution=int(vq.get("resolution", 512)),
        in_channels=int(vq.get("in_channels", 3)),
    )


def vqgan_config_meta(params: Mapping[str, object]) -> ChameleonVQConfig:
    """From ``model.params`` of Meta's ``vqgan.yaml`` (``ddconfig``, ``n_embed``, ``embed_dim``)."""
    dd = params["ddconfig"]
    if dd.get("double_z"):
        raise ValueError("ddconfig.double_z=true is not a released Chameleon VQGAN")
    return ChameleonVQConfig(
        embed_dim=int(params["embed_dim"]),
        num_embeddings=int(params["n_embed"]),
        latent_channels=int(dd["z_channels"]),
        base_channels=int(dd["ch"]),
        channel_multiplier=tuple(int(m) for m in dd["ch_mult"]),
        num_res_blocks=int(dd["num_res_blocks"]),
        attn_resolutions=tuple(int(r) for r in (dd.get("attn_resolutions") or ())),
        resolution=int(dd["resolution"]),
        in_channels=int(dd["in_channels"]),
        out_channels=int(dd["out_ch"]),
    )


def per_head_state(
    state: Mapping[str, torch.Tensor], config: ChameleonConfig, layout: str
) -> dict[str, torch.Tensor]:
    """``state`` with q/k-norm weights and biases in the per-head ``[heads, head_dim]`` layout.

    ``per_shard`` (Lumina-mGPT) holds ``[model_parallel_size, head_dim]`` per norm; each shard's row is
    repeated for that shard's heads, as the vendored ``ChameleonLayerNorm.repeat_param`` does.
    """
    if layout not in QK_NORM_LAYOUTS:
        raise ValueError(f"qk_norm_layout must be one of {QK_NORM_LAYOUTS}, got {layout!r}")
    out = dict(state)
    if layout == "per_head":
        return out
    mp = config.model_parallel_size
    heads = {"q_norm": config.num_attention_heads, "k_norm": config.num_key_value_heads}
    for key, value in state.items():
        norm = key.split(".")[-2] if "." in key else ""
        if norm not in heads:
            continue
        if tuple(value.shape) != (mp, config.head_dim):
            raise ValueError(
                f"{key}: Lumina-mGPT layout expects [model_parallel_size={mp}, head_dim={config.head_dim}], "
                f"file has {tuple(value.shape)}"
            )
        if heads[norm] % mp:
            raise ValueError(f"{key}: {heads[norm]} heads do not split over model_parallel_size={mp}")
        out[key] = value.repeat_interleave(heads[norm] // mp, dim=0)
    return out


def vqgan_state(state: Mapping[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """The VQGAN's own entries of ``state``: keys under ``prefix`` (``model.vqmodel.`` in Anole's HF
    checkpoint, empty in Meta's ``vqgan.ckpt``), minus Meta's training-only ``loss.*`` (discriminator)."""
    parts = ("encoder.", "decoder.", "quantize.", "quant_conv.", "post_quant_conv.")
    out = {}
    for key, value in state.items():
        if key.startswith(prefix) and key[len(prefix) :].startswith(parts):
            out[key[len(prefix) :]] = value
    return out


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
    vq = ChameleonVQGAN(vqgan_config_hf(config["vq_config"]))
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
    vq = ChameleonVQGAN(vqgan_config_meta(params))
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
