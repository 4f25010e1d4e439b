"""``compile=true``: compiled decoding gives the eager tokens; the CUDA-graph helpers keep addresses."""

from __future__ import annotations

import time
import zlib
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import TINY_GPT, random_drafter, random_gpt, random_vq, tiny_condition
from hydra import compose, initialize_config_dir

import vdtrain.generate
from vdtrain.decode import compiled as compiled_module
from vdtrain.decode.ar import generate_ar
from vdtrain.decode.builders.dynamic import DynamicTreeBuilder, DynamicTreeConfig
from vdtrain.decode.compiled import (
    DecodeOptions,
    compile_decoding,
    compile_options,
    prepare_decoding,
    wants_cuda_graphs,
)
from vdtrain.decode.engine import SpeculativeEngine
from vdtrain.decode.methods import build_method, load_preset
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.drafters.base import Drafter
from vdtrain.eval import runner
from vdtrain.prompts import shapes_heldout_captions
from vdtrain.targets.llamagen import LlamaGenTarget, VQTokenizer

CONF = Path(__file__).resolve().parents[1] / "conf"


def decode(
    target: LlamaGenTarget, drafter: Drafter, options: DecodeOptions | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """AR and EAGLE-2-like tokens at T = 0 for a batch of two captions."""
    cond, sampling = tiny_condition(), SamplingConfig(cfg_scale=2.0, temperature=0.0)
    ar = generate_ar(target, cond, sampling, [None, None])
    builder = DynamicTreeBuilder(DynamicTreeConfig(top_k=4, depth=3, total_tokens=16))
    engine = SpeculativeEngine(target, drafter, builder, sampling, options=options)
    tree = engine.generate(cond, [None, None]).tokens
    return ar, tree


@pytest.mark.slow
def test_compiled_decoding_gives_the_eager_tokens_on_cpu_inductor(tiny_target):
    drafter = random_drafter(tiny_target)
    eager = decode(tiny_target, drafter)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    options = DecodeOptions(compile_steps=compile_decoding(tiny_target, drafter))
    assert tiny_target.gpt._vdtrain_compiled and drafter._vdtrain_compiled
    assert options.compile_steps == "inductor"
    start = time.perf_counter()
    compiled = decode(tiny_target, drafter, options)
    print(f"compiled decode (with compilation): {time.perf_counter() - start:.1f} s")
    torch._dynamo.reset()
    # The target's and the drafter's forwards, and the step kernels: the root's children, two expansion
    # rounds, the last round, the verification rows, the verdict, the commit.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2 + 7
    assert torch.equal(compiled[0], eager[0])
    assert torch.equal(compiled[1], eager[1])


def forward_shapes(target: LlamaGenTarget, drafter: Drafter, preset: str, tmp_path: Path) -> dict[str, int]:
    """How many distinct input shapes the target's transformer and the drafter see in one decode."""
    from vdtrain.decode.methods import build_method, load_preset

    seen: dict[str, set] = {"target": set(), "drafter": set()}
    for label, module in (("target", target.transformer), ("drafter", drafter)):
        forward = module.forward

        def record(*args, _forward=forward, _label=label, **kwargs):
            seen[_label].add(tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))
            return _forward(*args, **kwargs)

        module.forward = record
    config = load_preset(preset, {"acceptance": {"cache_dir": str(tmp_path)}})
    method = build_method(
        config, target, drafter if config.needs_drafter else None, SamplingConfig(cfg_scale=2.0)
    )
    try:
        method.generate(tiny_condition(), [torch.Generator().manual_seed(i) for i in range(2)])
    finally:
        del target.transformer.forward, drafter.forward
    return {label: len(shapes) for label, shapes in seen.items()}


@pytest.mark.parametrize("preset", ["ar", "eagle1", "eagle2", "lantern_pp", "sjd", "sjd_pac", "vvs"])
def test_each_forward_compiles_to_a_few_graphs_whatever_the_image_length(preset, tmp_path):
    """CUDA graphs replay fixed shapes: the target runs one prefill and one step shape, and the drafter a
    fixed set (prefill, one per tree level, the catch-up), the same for 16 and 64 image tokens. PEANUT is
    left out: its trees change shape by design as they adapt."""
    small = LlamaGenTarget(
        random_gpt(), VQTokenizer(random_vq(), 8), None, "tiny", SamplingConfig(cfg_scale=2.0)
    )
    large = LlamaGenTarget(
        random_gpt(replace(TINY_GPT, block_size=64)),
        VQTokenizer(random_vq(), 16),
        None,
        "tiny",
        SamplingConfig(cfg_scale=2.0),
    )
    counts = [forward_shapes(t, random_drafter(t), preset, tmp_path) for t in (small, large)]
    assert counts[0] == counts[1]
    assert counts[0]["target"] == 2  # prefill, step
    assert counts[0]["drafter"] <= 6


def hashed_captions(captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """A stand-in caption encoder for the tiny target: fixed random features per caption."""
    gens = [torch.Generator().manual_seed(zlib.crc32(c.encode())) for c in captions]
    features = torch.stack([torch.randn(5, 12, generator=g) for g in gens])
    return features, torch.ones(len(captions), 5, dtype=torch.bool)


@pytest.fixture
def recorded(monkeypatch) -> list[tuple[object, object]]:
    """``compile_decoding`` calls made by the apps, run with the ``eager`` backend (no kernels to build)."""
    calls: list[tuple[object, object]] = []

    compile = compiled_module.compile_decoding

    def record(target, drafter=None, **kwargs):
        calls.append((target, drafter))
        compile(target, drafter, **{**kwargs, "backend": "eager"})

    monkeypatch.setattr(compiled_module, "compile_decoding", record)
    return calls


def test_the_runner_compiles_once_when_asked(recorded):
    target = LlamaGenTarget(
        random_gpt(), VQTokenizer(random_vq(), 8), hashed_captions, "tiny", SamplingConfig(cfg_scale=2.0)
    )
    drafter = random_drafter(target)
    prompts = shapes_heldout_captions(2)
    result = runner.evaluate(target, drafter, prompts, ["eagle2"], [0], progress=False, compile=True)
    assert recorded == [(target, drafter)] and target.gpt._vdtrain_compiled
    assert [(r.method, r.identical_to_ar) for r in result.rows] == [("ar", True), ("eagle2", True)]
    runner.evaluate(target, drafter, prompts[:1], [], [0], progress=False)
    assert len(recorded) == 1  # compile=False (the default) leaves it alone


def test_generate_compiles_when_compile_is_set(recorded, tiny_folder, tmp_path):
    with initialize_config_dir(str(CONF), version_base=None):
        cfg = compose(
            "generate",
            overrides=[
                f"target.folder={tiny_folder}",
                f"out_dir={tmp_path}",
                "num_prompts=1",
                "compile=true",
            ],
        )
    summary = vdtrain.generate.run(cfg)
    assert summary["compile"] is True and len(recorded) == 1
    assert summary["dtype"] == "float32"  # conf/target's default


def test_missing_compile_options_fall_back_to_the_process_wide_limit(tiny_target, monkeypatch):
    """torch 2.11 has no per-function ``recompile_limit`` / ``isolate_recompiles``: the same code runs
    (dynamo's own limit raised instead) and decodes the eager tokens."""
    from vdtrain.decode import kernels

    real = torch.compile
    seen = []

    def old_compile(model=None, *, fullgraph=False, dynamic=None, backend="inductor", mode=None):
        seen.append(backend)
        return real(model, fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode)

    assert set(compile_options()) == {"recompile_limit"}  # this torch has it
    assert compile_options(old_compile) == {}
    drafter = random_drafter(tiny_target)
    eager = decode(tiny_target, drafter)
    monkeypatch.setattr(torch, "compile", old_compile)
    # torch's own patch: monkeypatch's undo deletes a config module's setting under pytest ≥ 9
    with torch._dynamo.config.patch({kernels._limit_name(): 8}):
        torch._dynamo.reset()
        compile_decoding(tiny_target, drafter, backend="eager")
        assert seen and set(seen) == {"eager"} and kernels.recompile_limit() >= kernels.RECOMPILE_LIMIT
        compiled = decode(tiny_target, drafter)
    torch._dynamo.reset()
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])


def test_the_target_compiles_one_layer_for_all_its_layers():
    """Regional compilation: 4 decoder layers, 2 shapes (prefill, AR step), 2 graphs; the same tokens."""
    target = LlamaGenTarget(
        random_gpt(replace(TINY_GPT, n_layer=4)), VQTokenizer(random_vq(), 8), None, "tiny", SamplingConfig()
    )
    sampling = SamplingConfig(cfg_scale=2.0, temperature=0.0)
    eager = generate_ar(target, tiny_condition(), sampling, [None, None])
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compile_decoding(target, backend="eager")
    compiled = generate_ar(target, tiny_condition(), sampling, [None, None])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    torch._dynamo.reset()
    assert torch.equal(compiled, eager)


def test_cuda_graphs_key_is_auto_on_a_gpu_and_refused_elsewhere(tiny_target):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert wants_cuda_graphs("auto", gpu) and not wants_cuda_graphs("auto", cpu)
    assert wants_cuda_graphs(None, gpu) and not wants_cuda_graphs(False, gpu)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        wants_cuda_graphs(True, cpu)
    with pytest.raises(ValueError, match="auto, true or false"):
        wants_cuda_graphs("yes", gpu)
    assert prepare_decoding(tiny_target, None, compile=False) == DecodeOptions()


def test_compiling_twice_is_refused(tiny_target):
    drafter = random_drafter(tiny_target)
    compile_decoding(tiny_target, drafter, backend="eager")
    with pytest.raises(RuntimeError, match="already applied"):
        compile_decoding(tiny_target)


STEP_KERNEL_PRESETS = ["ar", "eagle1", "eagle2", "lantern", "lantern_pp", "gsd_tree", "peanut", "sjd", "gsd"]
STEP_KERNEL_PRESETS += ["sjd_pac", "vvs"]
# At T = 0 AR and one preset per tree builder (the relaxed rules' greedy branches are left to T = 1's
# trace of the same kernels): tracing every preset twice cost minutes of the suite on a shared CPU.
GREEDY_KERNEL_PRESETS = ["ar", "eagle1", "eagle2", "peanut", "sjd", "sjd_pac"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_step_kernels_trace_whole_and_keep_every_token(temperature, tmp_path):
    """Every preset's step kernels trace into whole graphs (``fullgraph``: a break raises) and decode the
    eager tokens with the same seeds at T = 1 (one preset per builder at T = 0), and at T = 1 compile
    nothing new after one decode. The ``eager`` backend runs the traced graphs without generating code;
    the inductor test above runs generated kernels."""
    from vdtrain.decode.methods import build_method, load_preset

    target = LlamaGenTarget(
        random_gpt(), VQTokenizer(random_vq(), 8), None, "tiny", SamplingConfig(cfg_scale=2.0)
    )
    drafter = random_drafter(target)
    sampling = SamplingConfig(cfg_scale=2.0, temperature=temperature)
    torch._dynamo.reset()
    for preset in STEP_KERNEL_PRESETS if temperature else GREEDY_KERNEL_PRESETS:
        config = load_preset(preset, {"acceptance": {"cache_dir": str(tmp_path)}})
        method = build_method(config, target, drafter if config.needs_drafter else None, sampling)
        tokens = []
        for backend in (None, "eager"):
            method.options.compile_steps = backend
            gens = [torch.Generator().manual_seed(i) for i in range(2)]
            tokens.append(method.generate(tiny_condition(), gens).tokens)
        assert torch.equal(tokens[0], tokens[1]), preset
        if preset == "peanut" or not temperature:  # PEANUT: new (depth, width) envelopes, new shapes
            continue
        # Kernels are pure functions of their arguments: a second decode (other prompts, other seeds)
        # reuses the graphs the first one made.
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        gens = [torch.Generator().manual_seed(10 + i) for i in range(2)]
        method.generate(tiny_condition(seed=5), gens)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, preset
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    torch._dynamo.reset()


def test_step_kernels_raise_the_recompile_limit_for_their_block_only():
    from vdtrain.decode.kernels import RECOMPILE_LIMIT, compiled_step_kernels

    before = torch._dynamo.config.recompile_limit
    with compiled_step_kernels(backend="eager"):
        assert torch._dynamo.config.recompile_limit == max(before, RECOMPILE_LIMIT)
    assert torch._dynamo.config.recompile_limit == before  # AR decoding outside keeps torch's limit
    with compiled_step_kernels(enabled=False):
        assert torch._dynamo.config.recompile_limit == before


def test_the_runner_reports_start_up_where_a_first_decode_records(monkeypatch):
    """With recorded steps each row says what its method's first decode cost beyond a warm one; eager
    rows have nothing to start up and say so (None), and the recorded decode keeps the eager tokens."""
    from vdtrain.decode.graphs import record_fx

    target = LlamaGenTarget(
        random_gpt(), VQTokenizer(random_vq(), 8), hashed_captions, "tiny", SamplingConfig(cfg_scale=2.0)
    )
    drafter = random_drafter(target)
    prompts = shapes_heldout_captions(2)
    eager = runner.evaluate(target, drafter, prompts, ["eagle2"], [1], progress=False, batch_size=2)
    assert [r.startup_seconds for r in eager.rows] == [None, None]
    monkeypatch.setattr(runner, "prepare_decoding", lambda *_, **__: DecodeOptions(step_recorder=record_fx))
    recorded = runner.evaluate(target, drafter, prompts, ["eagle2"], [1], progress=False, batch_size=2)
    assert all(r.startup_seconds is not None and r.startup_seconds >= 0 for r in recorded.rows)
    for key, images in eager.images.items():
        assert (recorded.images[key] == images).all(), key


@pytest.mark.parametrize("name", ["ar", "eagle2", "sjd"])
def test_a_whole_step_traces_without_graph_breaks(name, tmp_path):
    """Issue #46: dynamo traces AR's step and the eagle2 and sjd steps in one graph each (the forwards, the
    sampling tail and the builder's bookkeeping), with LlamaGen's sampling shape (CFG, top-k)."""
    sampling = SamplingConfig(cfg_scale=2.0, temperature=1.0, top_k=12)
    target = LlamaGenTarget(random_gpt(), VQTokenizer(random_vq(), image_size=8), None, "tiny", sampling)
    config = load_preset(name, {"acceptance": {"cache_dir": str(tmp_path)}})
    method = build_method(config, target, random_drafter(target), sampling)
    steps = []  # the decode runs its first step (the run's tensors), then stops

    def stop(*_: object) -> None:
        steps.append(1)
        raise StopIteration

    with torch.no_grad():
        with pytest.raises(StopIteration):
            method.generate(tiny_condition(2), [torch.Generator().manual_seed(i) for i in range(2)], stop)
        step = method.decoder._step if name == "ar" else method._step
        torch._dynamo.reset()
        explained = torch._dynamo.explain(step)()
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    assert explained.graph_count == 1 and steps == [1]
