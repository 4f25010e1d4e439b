"""The measuring tools: host-sync and ATen-op counts (as a GPU would see them) and phase times per step."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from conftest import random_gpt, random_vq, tiny_condition

from vdtrain.decode import profiling
from vdtrain.decode.builders.static import StaticTreeBuilder, StaticTreeConfig
from vdtrain.decode.engine import SpeculativeEngine
from vdtrain.decode.profiling import OpCounter, PhaseTimer, count_steps
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.decode.trees import EAGLE1_PATHS
from vdtrain.drafters import Drafter, DrafterConfig
from vdtrain.targets.llamagen import LlamaGenTarget, VQTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

# Each reads a (device) tensor's values into Python once.
SYNCS = {
    "item": lambda t: t[0].item(),
    "bool": lambda t: bool(t[0] > 1),
    "int": lambda t: int(t.argmax()),
    "tolist": lambda t: t.tolist(),
    "numpy": lambda t: t.numpy(),
    "np.asarray": lambda t: np.asarray(t),
    "bool mask index": lambda t: t[t > 2],
    "bool mask assign a tensor": lambda t: t.__setitem__(t > 2, t.new_ones(3)),
    "nonzero": lambda t: t.nonzero(),
    "masked_select": lambda t: t.masked_select(t > 2),
    "unique": lambda t: t.unique(),
    "equal": lambda t: torch.equal(t, t + 0),
    "cpu": lambda t: t.cpu(),
    "to('cpu')": lambda t: t.to("cpu"),
}
FREE = {
    "arithmetic": lambda t: (t * 2 + 1).sum(),
    "topk": lambda t: t.topk(2),
    "gather": lambda t: t.gather(0, torch.tensor([0, 2], device=t.device)),
    "where": lambda t: torch.where(t > 2, t, 0),
    "argmax kept on device": lambda t: t.argmax(),
    "masked_fill": lambda t: t.masked_fill(t > 2, 0),
    "bool mask assign a scalar": lambda t: t.__setitem__(t > 2, 0),
    "cat": lambda t: torch.cat([t, t]),
    "multinomial": lambda t: torch.multinomial(t.softmax(0), 1),
    "dtype change": lambda t: t.to(torch.float64),
    "a device factory": lambda t: torch.arange(4, device=t.device),
}


@pytest.mark.parametrize("read", list(SYNCS.values()), ids=list(SYNCS))
def test_each_read_of_device_values_is_one_sync(read):
    device_tensor = torch.arange(6.0)  # made before the counter: a device tensor (weights, caches)
    with OpCounter(as_if_gpu=True) as counter:
        read(device_tensor.clone())
    assert counter.counts.syncs == 1, counter.sites


@pytest.mark.parametrize("op", list(FREE.values()), ids=list(FREE))
def test_ops_that_stay_on_the_device_are_no_syncs(op):
    device_tensor = torch.arange(6.0)
    with OpCounter(as_if_gpu=True) as counter:
        op(device_tensor.clone())
    assert counter.counts.syncs == 0, counter.sites
    assert counter.counts.ops >= 1


def test_host_copies_are_read_freely_as_on_a_gpu():
    device_tensor = torch.arange(6.0)
    with OpCounter(as_if_gpu=True) as counter:
        host = device_tensor.cpu()  # the one sync
        values = [float(v) for v in host.topk(3).values]
        int(host[0]), host.tolist(), bool((host > 1).any())
        built = torch.zeros(3)  # a factory without a device makes a host tensor
        built[1:] = host[:2]
        int(built.argmax())
    assert values == [5.0, 4.0, 3.0]
    assert counter.counts.syncs == 1, counter.sites


def test_host_to_device_copies_are_counted_apart_from_syncs():
    device = torch.arange(3).device  # how the engine spells the model's device
    with OpCounter(as_if_gpu=True) as counter:
        torch.tensor([1, 2], device=device)
        torch.zeros(4, dtype=torch.bool).to(device)
        torch.tensor([1, 2])  # stays on the host: no copy
    assert (counter.counts.h2d, counter.counts.syncs) == (2, 0), counter.sites


def test_a_python_number_copied_into_one_device_element_is_a_host_to_device_copy():
    """A Python number written where the destination is 0-dim (``t[i] = 0.0`` on a 1-D tensor) is a copy
    of a 0-dim host tensor (``lift_fresh`` then ``copy_``), which a CUDA graph capture refuses (issue #45's
    Lumina-mGPT bug); where it is a view of dim > 0 it is a capture-safe ``fill_``."""
    device_tensor = torch.zeros(2, 6)
    with OpCounter(as_if_gpu=True) as counter:
        rows = device_tensor.clone()
        rows[..., 2] = 1.0
        rows[0, 1:3] = 2.0
        rows[1].narrow(0, 4, 1).fill_(3.0)
    assert (counter.counts.h2d, counter.counts.syncs) == (0, 0), counter.sites
    with OpCounter(as_if_gpu=True) as counter:
        device_tensor.clone()[0, 2] = 1.0
    assert counter.counts.h2d == 1, counter.sites


def test_real_devices_decide_outside_the_as_if_gpu_mode():
    with OpCounter(as_if_gpu=False) as counter:
        for read in SYNCS.values():
            read(torch.arange(6.0))
    assert counter.counts.syncs == 0  # every tensor here is really on the host
    assert counter.counts.ops > 0


def test_sites_name_the_line_that_synced():
    device_tensor = torch.arange(6.0)
    with OpCounter(as_if_gpu=True) as counter:
        device_tensor.tolist()
    [site] = counter.sites
    assert site.startswith("tolist @ test_profiling.py:")


def tiny_engine(cfg_scale: float = 2.0) -> SpeculativeEngine:
    target = LlamaGenTarget(
        random_gpt(), VQTokenizer(random_vq(), image_size=8), None, "tiny", SamplingConfig()
    )
    torch.manual_seed(0)
    drafter = Drafter.make(DrafterConfig.for_target(target))
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.2)
    builder = StaticTreeBuilder(StaticTreeConfig(paths=EAGLE1_PATHS))
    sampling = SamplingConfig(cfg_scale=cfg_scale, temperature=0)
    return SpeculativeEngine(target, drafter.eval(), builder, sampling)


class SyncingBuilder(StaticTreeBuilder):
    """EAGLE-1's tree plus one deliberate device read per step."""

    def build(self, engine, state):
        state.committed.max().item()
        return super().build(engine, state)


def test_counts_are_split_at_the_engine_steps():
    engine = tiny_engine()
    steps = []
    engine.generate(tiny_condition(2), [None, None], on_step=lambda *a: steps.append(1))
    counts, counter = count_steps(engine, tiny_condition(2), [None, None])
    assert len(counts.steps) == len(steps) - 1 >= 2
    assert counts.total == counter.counts
    assert counts.first.ops > counts.mean_ops  # the prefill is reported apart
    assert all(s.syncs > 0 and s.ops > 0 for s in counts.steps)

    engine.builder = SyncingBuilder(StaticTreeConfig(paths=EAGLE1_PATHS))
    more, _ = count_steps(engine, tiny_condition(2), [None, None])
    assert [s.syncs for s in more.steps] == [s.syncs + 1 for s in counts.steps]
    assert more.first.syncs == counts.first.syncs + 1


class SlowBuilder(StaticTreeBuilder):
    def build(self, engine, state):
        time.sleep(0.02)
        return super().build(engine, state)


def test_the_phase_timer_charges_each_phase_and_leaves_the_engine_as_it_was():
    engine = tiny_engine()
    engine.builder = SlowBuilder(StaticTreeConfig(paths=EAGLE1_PATHS))
    accept = engine.accept
    with PhaseTimer(engine) as timer:
        engine.generate(tiny_condition(1), [None], on_step=timer.on_step)
    first, steps = timer.steps()
    assert first is not None and len(steps) >= 2
    for step in steps:
        assert step.phases["draft"] >= 0.02
        assert all(step.phases[p] > 0 for p in profiling.PHASES if p != "draft")
        assert sum(step.phases.values()) <= step.seconds
        assert 0 < step.forward < step.seconds and step.verified
    assert engine.accept is accept and "_verify" not in vars(engine) and "build" not in vars(engine.builder)


def test_the_phase_timer_names_a_method_the_engine_no_longer_has(monkeypatch):
    engine = tiny_engine()
    monkeypatch.setattr(profiling, "phase_methods", lambda e: {"verify": [(e, "_verify_all_trees")]})
    with pytest.raises(AttributeError, match=r"_verify_all_trees.*phase_methods"), PhaseTimer(engine):
        pass


# --- DeviceGuard: the as-if-GPU provenance refuses what CUDA refuses -----------------------------------
# Each hands a host tensor (dim > 0) to an op beside a device tensor, as "tokens left on the CPU" would.
# (``torch.from_numpy`` is not seen: it takes no part in torch's function overrides.)
MIXED = {
    "embedding of host ids": lambda w: torch.nn.functional.embedding(w.long().cpu(), w[:, None]),
    "arithmetic with a host tensor": lambda w: w + torch.ones(6),
    "cat with a moved-out tensor": lambda w: torch.cat([w, w.cpu()]),
    "index_select by host ids": lambda w: w.index_select(0, torch.tensor([0, 1])),
}
# What CUDA accepts: host indices and masks, copies both ways, 0-dim host scalars, tensors moved back.
ACCEPTED = {
    "host index tensor": lambda w: w[torch.tensor([0, 2])],
    "host bool mask": lambda w: w[torch.ones(6, dtype=torch.bool)],
    "copy from the host": lambda w: w.clone().copy_(torch.zeros(6)),
    "0-dim host scalar": lambda w: w * torch.tensor(2.0),
    "moved to the model's device": lambda w: w + torch.ones(6).to(w.device),
    "a device factory": lambda w: w + torch.ones(6, device=w.device),
    "host-only arithmetic": lambda w: w.cpu() + torch.ones(6),
}


@pytest.mark.parametrize("op", list(MIXED.values()), ids=list(MIXED))
def test_the_device_guard_refuses_host_tensors_beside_device_ones(op):
    weights = torch.arange(6.0)  # made before the guard: on the device, as a model's are
    with profiling.DeviceGuard(), pytest.raises(RuntimeError, match="same device"):
        op(weights)


@pytest.mark.parametrize("op", list(ACCEPTED.values()), ids=list(ACCEPTED))
def test_the_device_guard_accepts_what_cuda_accepts(op):
    weights = torch.arange(6.0)
    with profiling.DeviceGuard():
        op(weights)
