"""A live ZeRO-3 drafter's full weights, for code that decodes with it (the after-epoch evaluation)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from vdtrain.drafters import Drafter
from vdtrain.targets.base import Target


@contextlib.contextmanager
def whole_drafter(drafter: Drafter, target: Target) -> Iterator[Drafter]:
    """The drafter with all its weights, on every rank: ``drafter`` itself unless ZeRO-3 partitions it.

    Under ZeRO-3 a rank holds a slice of each parameter (``param.data`` is empty) and the module's hooks
    gather a layer's weights around each of its ``forward`` calls, collectively. Decoding calls the
    drafter's layers a different number of times on each rank (each decodes its own prompts), and through
    methods other than ``forward``: so every rank gathers the weights once, here, and decodes with a plain
    copy of them (the same dtype and device) that holds no hooks."""
    partitioned = [p for p in drafter.parameters() if hasattr(p, "ds_id")]
    if not partitioned:
        yield drafter
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):  # every rank, the same call
        state = {name: value.detach().clone() for name, value in drafter.state_dict().items()}
    copy = type(drafter)(drafter.config)  # its own kind
    copy.load_state_dict(state, assign=True)
    for name, buffer in drafter.named_buffers():  # never partitioned; a non-persistent one is in no state
        owner, _, leaf = name.rpartition(".")
        setattr(copy.get_submodule(owner), leaf, buffer)
    copy.metadata = drafter.metadata
    yield copy.attach(target).train(drafter.training)
