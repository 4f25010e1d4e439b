"""Plain autoregressive generation: the baseline every speculative method is measured against.

A static KV cache; with CFG the conditional and null streams run as one batch of two. Every step has the
same shapes (the mask spans the whole image) and changes its run's tensors in place, with the image index
on the device, so on a GPU the step is recorded once as a CUDA graph and replayed
(``vdtrain.decode.graphs``), as gpt-fast does. The first token is drawn like every speculative method's
(``next_tokens`` with the row's generator); each later one from the row's counter stream (``RowRandom``,
purpose ``BONUS``: AR's token is the bonus of an empty tree), which needs no host state, so a replayed
step samples exactly what an eager one does; its horizon makes a step gather them from a table hashed
once per decode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vdtrain.decode.graphs import Recorder, StepGraph
from vdtrain.decode.kernels import shared_arange, step_kernel
from vdtrain.decode.rng import Purpose, RowRandom, inverse_cdf
from vdtrain.decode.rows import per_stream
from vdtrain.decode.sampling import SamplingConfig, cfg_batch, next_tokens, probabilities, split_cfg
from vdtrain.models.kv_cache import KVCache
from vdtrain.targets.base import Condition, Target


@dataclass
class ARRun:
    """What one AR decode changes, in place: a recorded step replays on these tensors."""

    stream: Condition  # the CFG batch (cond rows, then null rows)
    cache: KVCache
    out: torch.Tensor  # [B, N] tokens
    index: torch.Tensor  # [1] image index of the last token drawn (the next one fed)
    rng: RowRandom

    def restart(self, stream: Condition, generators: Sequence[torch.Generator | None]) -> None:
        self.stream.features.copy_(stream.features)
        self.stream.mask.copy_(stream.mask)
        self.cache.kv.zero_()
        self.out.zero_()
        self.index.zero_()
        self.rng.reseed(RowRandom.seeds_of(generators, self.out.device))


class ARDecoder:
    """AR decoding for one target and sampling setting; with a ``recorder`` (``ARMethod`` passes
    ``DecodeOptions.step_recorder``) each step is recorded once per batch shape and replayed."""

    def __init__(self, target: Target, sampling: SamplingConfig, recorder: Recorder | None = None) -> None:
        self.target, self.sampling, self.recorder = target, sampling, recorder
        self.run: ARRun | None = None
        self._recorded: tuple[tuple, ARRun, StepGraph] | None = None

    @torch.no_grad()
    def generate(
        self,
        cond: Condition,
        generators: Sequence[torch.Generator | None],
        on_step: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Image tokens [B, N] for the captions in ``cond``, one target forward per token;
        ``on_step()`` runs after each step (the prefill's draw is not one)."""
        target, sampling = self.target, self.sampling
        stream = cfg_batch(target, cond, sampling)
        device = target.token_embedding.weight.device
        key = (len(cond), *((t.shape, t.dtype) for t in (stream.features, stream.mask)), device)
        if self._recorded is not None and self._recorded[0] == key:
            _, run, step = self._recorded
            run.restart(stream, generators)
        else:
            run = self._new_run(stream, len(cond), generators)
            step = self._step
            if self.recorder is not None:
                step = StepGraph(self._step, self.recorder, device)
                self._recorded = (key, run, step)
        self.run = run
        logits = target.prefill(run.stream, run.cache).logits[:, -1]
        run.out[:, 0] = next_tokens(*split_cfg(logits, sampling), sampling, generators)
        for _ in range(target.num_image_tokens - 1):
            step()
            if on_step is not None:
                on_step()
        return run.out.clone()

    def _new_run(self, stream: Condition, batch: int, generators: Sequence[torch.Generator | None]) -> ARRun:
        device = self.target.token_embedding.weight.device
        return ARRun(
            stream=stream,
            cache=self.target.new_cache(len(stream)),
            out=torch.zeros(batch, self.target.num_image_tokens, dtype=torch.long, device=device),
            index=torch.zeros(1, dtype=torch.long, device=device),
            rng=RowRandom.from_generators(generators, device, horizon=self.target.num_image_tokens),
        )

    def _step(self) -> None:
        """Feed the last token, draw the next: the run's tensors change in place, no host reads."""
        run, target = self.run, self.target
        feed, visible = ar_inputs(run.out, run.index, len(run.stream) // run.out.shape[0])
        slots = target.image_slot(run.index)
        logits = target.forward_tokens(run.stream, feed, run.index, run.cache, slots, visible).logits[:, -1]
        uniforms = None if self.sampling.greedy else run.rng.uniform(Purpose.BONUS)
        draw_next(logits, run.out, run.index, uniforms, self.sampling)
        run.rng.advance()


@step_kernel
def ar_inputs(out: torch.Tensor, index: torch.Tensor, streams: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's input: the last token of ``out`` [B, N] at ``index`` [1] for every CFG stream [R, 1],
    and the image slots it sees [1, 1, N]."""
    batch, n_img = out.shape
    feed = per_stream(out.gather(1, index.expand(batch, 1)), streams)
    return feed, (shared_arange(n_img, index.device) <= index)[None, None]


@step_kernel
def draw_next(
    logits: torch.Tensor,
    out: torch.Tensor,
    index: torch.Tensor,
    uniforms: torch.Tensor | None,
    sampling: SamplingConfig,
) -> None:
    """AR's sampling tail: the target's last logits [R, V] → the next token, written to ``out`` [B, N]
    at ``index`` + 1 (``index`` [1] moves on); ``uniforms`` [B] are the run's draws (None at T = 0)."""
    batch = out.shape[0]
    cond, uncond = split_cfg(logits, sampling)
    if sampling.greedy:
        token = next_tokens(cond, uncond, sampling, [None] * batch)
    else:
        token = inverse_cdf(probabilities(cond, uncond, sampling), uniforms)
    out.scatter_(1, (index + 1).expand(batch, 1), token[:, None])
    index += 1


def generate_ar(
    target: Target,
    cond: Condition,
    sampling: SamplingConfig,
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Image tokens [B, N] for the captions in ``cond``, stepped from Python (``ARMethod`` records)."""
    return ARDecoder(target, sampling).generate(cond, generators)
