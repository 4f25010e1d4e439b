"""A speculative step recorded once and replayed (``vdtrain.decode.graphs``) decodes what eager steps do.

A CUDA graph replays the kernels its capture saw, on the tensors it saw: a step that rebinds run state,
reads the device or bakes a per-step host value into its ops would replay wrongly. On the CPU ``record_fx``
records the same way (``make_fx``: the step's ATen ops, replayed on the same tensors), so these tests
check every speculative preset without a GPU: the same tokens and counts as eager steps at T = 0 and
T > 0, and no host sync or host-to-device copy inside a step.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import drafter_kind_for, one_per_part, random_drafter, random_gpt, random_vq, tiny_condition

from vdtrain.decode import graphs
from vdtrain.decode.builders.peanut import PeanutTreeBuilder
from vdtrain.decode.compiled import DecodeOptions, compile_decoding
from vdtrain.decode.graphs import StepGraph, record_fx
from vdtrain.decode.methods import SCHEDULES, TREES, build_method, load_preset, preset_names, tree_builder
from vdtrain.decode.profiling import Counts, OpCounter
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.targets.llamagen import LlamaGenTarget, VQTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
# The lists come from the registries, so a preset added later is recorded and checked here too.
CONFIGS = {name: load_preset(name) for name in preset_names()}
SPECULATIVE = [n for n, c in CONFIGS.items() if TREES[c.tree.kind].make is not None]
# Recorded in two parts around the plan's read of the device: the skipping schedules.
VVS = [n for n in SPECULATIVE if not SCHEDULES[CONFIGS[n].schedule.kind].lossless]
# Its recorded step pads to the envelope (more drafter forwards than an eager step).
PEANUT = [n for n in SPECULATIVE if TREES[CONFIGS[n].tree.kind].make is PeanutTreeBuilder]
GRAPH_SAFE = [n for n in SPECULATIVE if tree_builder(CONFIGS[n].tree).graph_safe]
RECORDED = [n for n in preset_names() if n not in SPECULATIVE or n in GRAPH_SAFE]  # AR's step too


# Every recorded preset at T > 0, where it samples; at T = 0 (argmax in the same kernels) each part once.
REPLAYED = [(n, 1.0) for n in RECORDED] + [(n, 0.0) for n in one_per_part(RECORDED)]


def _engine(
    name: str, temperature: float, cache_dir, recorder=None, device: str = "cpu", compile=False, tree=None
):
    target = LlamaGenTarget(
        random_gpt(), VQTokenizer(random_vq(), image_size=8), None, "tiny", SamplingConfig(cfg_scale=2.0)
    ).to(device)
    sampling = replace(target.sampling_defaults, temperature=temperature)
    overrides = {"acceptance": {"cache_dir": str(cache_dir)}, "tree": dict(tree or {})}
    if name == "sjd_pac":  # its 64-node window would draw the tiny image in a step or two
        overrides["tree"].update(tokens_per_forward=8, width=2)
    config = load_preset(name, overrides)
    drafter = (
        random_drafter(target, kind=drafter_kind_for(config)).to(device) if config.needs_drafter else None
    )
    options = DecodeOptions(step_recorder=recorder)
    if compile:
        options.compile_steps = compile_decoding(target, drafter)
    return build_method(config, target, drafter, sampling, options)


def _decode(engine, batch: int = 3, seed: int = 10):
    device = engine.target.device
    generators = [torch.Generator(device).manual_seed(seed + i) for i in range(batch)]
    return engine.generate(tiny_condition(batch, seed=seed).to(device), generators)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("neighbours")


def test_every_speculative_preset_records_its_steps(cache_dir):
    """Every speculative preset's builder is graph-safe: a preset added later must be recorded or say why."""
    for name in SPECULATIVE:
        assert _engine(name, 1.0, cache_dir, record_fx).recorder is not None, name
    assert GRAPH_SAFE == SPECULATIVE


def _comparable(stats, name: str):
    """A recorded PEANUT step drafts its padded envelope, the deepest tree any step may plan, so it runs
    more drafter forwards than a step of the same tree stepped from Python; the rest is the same."""
    return [replace(st, drafter_forwards=0) for st in stats] if name in PEANUT else stats


@pytest.mark.parametrize(("name", "temperature"), REPLAYED)
def test_a_recorded_step_replays_the_eager_decode(name, temperature, cache_dir):
    """Two decodes of other prompts and seeds: the first records the step, the second replays it on the
    same buffers without recording again; both decode what eager steps do."""
    recordings, replays = [], []

    def counted(step, stream):
        result, replay, ran = record_fx(step, stream)
        recordings.append(1)
        return result, lambda: replays.append(replay()), ran

    eager = _engine(name, temperature, cache_dir)
    engine = _engine(name, temperature, cache_dir, counted)
    for seed in (10, 20):
        want, got = _decode(eager, seed=seed), _decode(engine, seed=seed)
        assert torch.equal(got.tokens, want.tokens), f"{name}: decode {seed}"
        assert _comparable(got.stats, name) == _comparable(want.stats, name)
    parts = 2 if name in VVS else 1  # VVS: the draft-and-plan graph, then one graph per plan seen
    assert parts <= len(recordings) <= 1 + 8 * (parts - 1), f"{name}: {len(recordings)} recordings"
    assert len(replays) >= 4, f"{name}: {len(replays)} replays"


def test_a_step_recorded_for_one_tree_budget_is_not_replayed_for_another(cache_dir):
    """The same batch with another planned batch verifies trees of another size (``tree.max_rows`` 24: 6
    nodes for 2 prompts with CFG, 2 for a planned 6): it records its own step rather than replaying the
    other budget's, even where the buffers are the same size (a dynamic tree's drafter scratch)."""
    name = "eagle2"
    eager = _engine(name, 1.0, cache_dir, tree={"max_rows": 24})
    engine = _engine(name, 1.0, cache_dir, record_fx, tree={"max_rows": 24})
    cond = tiny_condition(2, seed=10)
    for planned in (6, 2, 6):
        want, got = (
            e.generate(cond, [torch.Generator().manual_seed(10 + i) for i in range(2)], planned_batch=planned)
            for e in (eager, engine)
        )
        assert torch.equal(got.tokens, want.tokens), f"{name}: planned batch {planned}"
        assert got.stats == want.stats, f"{name}: planned batch {planned}"


def test_an_ar_step_neither_reads_the_device_nor_copies_host_data_to_it(cache_dir):
    method = _engine("ar", 1.0, cache_dir)
    inside, step = [], method.decoder._step

    def counted():
        with graphs._recording(), OpCounter(as_if_gpu=True) as counter:
            step()
        inside.append(counter.counts)

    method.decoder._step = counted
    _decode(method)
    assert inside and all(c.syncs == 0 and c.h2d == 0 for c in inside), [c for c in inside if c != Counts()]


@pytest.mark.parametrize("name", GRAPH_SAFE)
def test_a_step_neither_reads_the_device_nor_copies_host_data_to_it(name, cache_dir):
    """Counted in the parts a recording captures: the step up to the plan, and the rest (between them a
    skipping schedule reads its plan's flags)."""
    engine = _engine(name, 1.0, cache_dir)
    inside = []

    def counted(part):
        def run(*args):
            with graphs._recording(), OpCounter(as_if_gpu=True) as counter:  # as while recording
                out = part(*args)
            inside.append(counter.counts)
            return out

        return run

    engine._draft, engine._finish = counted(engine._draft), counted(engine._finish)
    _decode(engine)
    later = inside[2:]  # the first step may build a builder's index tensors once
    assert later and all(c.syncs == 0 and c.h2d == 0 for c in later), [c for c in later if c != Counts()]


def test_the_step_graph_warms_up_records_once_and_replays():
    calls, state = [], torch.zeros(2)

    def step():
        calls.append(len(calls))
        state.add_(1)
        return "calls"

    graph = StepGraph(step, record_fx, warmup=2)
    results = [graph() for _ in range(5)]
    assert results == ["calls"] * 5
    assert calls == [0, 1, 2]  # two warm-up steps, then the recording (make_fx runs the step once)
    assert state.tolist() == [5.0, 5.0]  # every call stepped once: the replays too


@pytest.mark.parametrize(
    "step",
    [lambda t: t.sum().item(), lambda t: t.__setitem__(0, 1.0), lambda t: t.add_(torch.ones(4).to(t.device))],
    ids=["a read of the device", "a host scalar copied in", "a host tensor moved in"],
)
def test_the_cpu_recorder_refuses_what_a_capture_refuses(step):
    state = torch.zeros(4)
    with pytest.raises(RuntimeError, match=r"capture refuses|tracing tensor"):
        record_fx(lambda: step(state))
    record_fx(lambda: state[..., 0].fill_(1.0))  # a fill of a view is capture-safe


def _graph_replays_eager(name: str, compile: bool, cache_dir) -> None:
    """Two decodes with the real recorder, the second only replaying, decode what the same code stepped
    from Python decodes on the GPU."""
    from vdtrain.decode.graphs import record_cuda_graph

    eager = _engine(name, 1.0, cache_dir, device="cuda", compile=compile)
    graphed = _engine(name, 1.0, cache_dir, record_cuda_graph, device="cuda", compile=compile)
    assert graphed.recorder is record_cuda_graph
    for seed in (10, 20):
        want, got = _decode(eager, seed=seed), _decode(graphed, seed=seed)
        assert torch.equal(got.tokens, want.tokens), f"{name}: decode {seed}"
        assert _comparable(got.stats, name) == _comparable(want.stats, name), f"{name}: decode {seed}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", RECORDED)
def test_a_cuda_graph_of_the_step_replays_the_eager_decode(name, cache_dir):
    """``cuda_graphs``, the default on a GPU: eager kernels recorded, no code generated (seconds)."""
    _graph_replays_eager(name, False, cache_dir)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", ["ar", "eagle2"])
def test_a_cuda_graph_of_compiled_forwards_replays_the_eager_decode(name, cache_dir):
    """``compile=true`` on top: inductor's forwards inside the recorded step."""
    _graph_replays_eager(name, True, cache_dir)
