"""Shared fixtures: tiny random LlamaGen-architecture targets that build in milliseconds."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from torch_settings import missing_settings, restore, setting_names

from vdtrain.decode.builders.base import StepOutcome
from vdtrain.decode.methods import register_part_schemas
from vdtrain.decode.rng import RowRandom
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.decode.schedule import StepPlan
from vdtrain.drafters import Drafter, DrafterConfig
from vdtrain.drafters.base import block_kind
from vdtrain.models.llamagen_gpt import GPTConfig, LlamaGenGPT
from vdtrain.models.vq import VQConfig, VQModel
from vdtrain.shapes.build import write_target_folder
from vdtrain.targets.base import Condition, Target
from vdtrain.targets.llamagen import LlamaGenTarget, VQTokenizer

register_part_schemas()  # conf/generate.yaml's method presets name their parts' config classes

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # workers share the cores: one thread pool each, not cores each
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

TINY_GPT = GPTConfig(
    dim=32,
    n_layer=2,
    n_head=4,
    multiple_of=16,
    caption_dim=12,
    vocab_size=24,
    cls_token_num=5,
    block_size=16,
    token_dropout_p=0.0,
    resid_dropout_p=0.0,
    ffn_dropout_p=0.0,
)
TINY_VQ = VQConfig(
    codebook_size=24,
    codebook_embed_dim=4,
    ch=8,
    ch_mult=(1, 2),
    num_res_blocks=1,
    z_channels=8,
    norm_groups=4,
)


def step_outcome(tree, verdict, verified, p_nodes, roots_at, rng=None, greedy=False) -> StepOutcome:
    """``observe``'s argument for a step decided by hand: the prompts ``verified`` [B] are the plan's;
    ``rng`` by default the seed-0 rows a test's ``StepState`` draws from."""
    rng = rng if rng is not None else RowRandom(torch.zeros(len(verified), dtype=torch.long))
    return StepOutcome(tree, verdict, StepPlan(verified, None, None), p_nodes, roots_at, rng, greedy)


def random_gpt(config: GPTConfig = TINY_GPT, seed: int = 0, std: float = 0.3) -> LlamaGenGPT:
    torch.manual_seed(seed)
    gpt = LlamaGenGPT(config)
    for p in gpt.parameters():
        torch.nn.init.normal_(p, std=std)
    return gpt.eval()


def random_vq(config: VQConfig = TINY_VQ, seed: int = 0) -> VQModel:
    torch.manual_seed(seed)
    return VQModel(config).eval()


def tiny_condition(batch: int = 2, seed: int = 1) -> Condition:
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(batch, TINY_GPT.cls_token_num, TINY_GPT.caption_dim, generator=g)
    mask = torch.ones(batch, TINY_GPT.cls_token_num, dtype=torch.bool)
    mask[0, :2] = False  # left padding, as LlamaGen lays captions out
    return Condition(feats * mask[..., None], mask)


@pytest.fixture
def tiny_target() -> LlamaGenTarget:
    return LlamaGenTarget(
        random_gpt(), VQTokenizer(random_vq(), image_size=8), None, "tiny", SamplingConfig(cfg_scale=2.0)
    )


TINY_FOLDER_TOKENS = 64  # tiny_folder's image tokens: 8×8


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> Path:
    """A 64 px / 8×8-token world with MiniLM captions, random weights: the shapes world's layout at a
    quarter of its image tokens, so that the many whole decodes and fits that use it stay cheap."""
    folder = tmp_path_factory.mktemp("tiny_target")
    gpt = random_gpt(replace(TINY_GPT, caption_dim=384, cls_token_num=48, block_size=64, vocab_size=32))
    vq = random_vq(
        VQConfig(
            codebook_size=32,
            codebook_embed_dim=4,
            ch=8,
            ch_mult=(1, 2, 2, 2),
            num_res_blocks=1,
            z_channels=8,
            norm_groups=4,
            codebook_show_usage=False,
        )
    )
    write_target_folder(folder, gpt, vq, {"cfg_scale": 3.0, "temperature": 1.0}, {})
    return folder


def random_drafter(
    target: Target, seed: int = 0, std: float = 0.2, kind: str = "eagle1", **options: object
) -> Drafter:
    """A ``kind`` drafter of ``target``'s family (with ``options``) with random weights, attached: its
    drafts are neither all right nor all wrong, so trees are partly accepted."""
    torch.manual_seed(seed)
    drafter = Drafter.make(DrafterConfig.for_target(target, kind=kind, **options))
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=std)
    return drafter.attach(target).eval()


def drafter_kind_for(config) -> str:
    """The drafter kind the registry-driven tests draft a method (a ``DecodeConfig``) with: one that
    drafts blocks for a block tree (``DecodeConfig.drafts_blocks``), eagle1 for every other tree."""
    return block_kind() if config.drafts_blocks else "eagle1"


_TORCH_SETTINGS = setting_names()


@pytest.fixture(autouse=True)
def torch_settings_stay_readable():
    """Fails the test that deleted one of torch's settings (tests/torch_settings.py: ``monkeypatch``'s
    undo does so under pytest ≥ 9), and brings the setting back so the tests after it still run."""
    yield
    missing = missing_settings(_TORCH_SETTINGS)
    if missing:
        restore(missing)
        pytest.fail(
            f"this test deleted torch settings {missing}: patch them with torch's own "
            "torch._dynamo.config.patch(...), never monkeypatch.setattr or mock.patch",
            pytrace=False,
        )


@pytest.fixture
def one_thread():
    """Tiny models decode fastest on one thread, and a shared CPU is not oversubscribed; modules opt in
    with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_cached_passes_match_the_sequence_pass(
    target: Target, cond: Condition, tokens: torch.Tensor
) -> None:
    """The prefill and one cached pass over image ``tokens`` [B, N] give the logits of one uncached pass."""
    batch, n = tokens.shape
    length = target.prefix_length
    full = target.forward_sequence(cond, tokens).logits
    cache = target.new_cache(batch)
    first = target.prefill(cond, cache).logits[:, -1]
    index = torch.arange(n)
    visibility = target.causal_visibility(0, n, "cpu")
    rest = target.forward_tokens(
        cond, tokens, index[None].expand(batch, -1), cache, index + length, visibility
    )
    torch.testing.assert_close(first, full[:, length - 1], rtol=0, atol=1e-5)
    torch.testing.assert_close(rest.logits[:, :-1], full[:, length:-1], rtol=0, atol=1e-5)


def eagle2_and_ar_tokens(
    target: Target, cond: Condition, cfg_scale: float, cache_dir: Path
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy (T = 0) tokens of eagle2 with a random drafter and of AR, for the same prompts."""
    from vdtrain.decode.ar import generate_ar
    from vdtrain.decode.methods import build_method, load_preset

    sampling = SamplingConfig(cfg_scale=cfg_scale, temperature=0.0)
    expected = generate_ar(target, cond, sampling, [None] * len(cond))
    config = load_preset("eagle2", {"acceptance": {"cache_dir": str(cache_dir)}})
    engine = build_method(config, target, random_drafter(target), sampling)
    gens = [torch.Generator().manual_seed(i) for i in range(len(cond))]
    return engine.generate(cond, gens).tokens, expected


def one_per_part(names: list[str]) -> list[str]:
    """The first of ``names`` to use each tree kind, acceptance rule and schedule: every part once."""
    from vdtrain.decode.methods import load_preset

    configs = {name: load_preset(name) for name in names}
    chosen: list[str] = []
    for section in ("tree", "acceptance", "schedule"):
        for name in names:
            kind = getattr(configs[name], section).kind
            if all(getattr(configs[c], section).kind != kind for c in chosen):
                chosen.append(name)
    return chosen
