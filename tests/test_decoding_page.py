"""docs/decoding.md's one-screen speculative sampling loop gives the engine's tokens: the same target,
EAGLE drafter and draws (the engine's ``RowRandom`` uniforms), a static chain tree, T = 1."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from conftest import tiny_condition
from test_engine import make_drafter, make_target

from vdtrain.decode.builders.static import StaticTreeBuilder, StaticTreeConfig
from vdtrain.decode.engine import SpeculativeEngine
from vdtrain.decode.rng import Purpose, RowRandom
from vdtrain.decode.sampling import SamplingConfig, probabilities, sample_rows
from vdtrain.drafters.rows import teacher_inputs, teacher_mask
from vdtrain.targets.base import Condition

PAGE = Path(__file__).resolve().parents[1] / "docs" / "decoding.md"
SAMPLING = SamplingConfig(cfg_scale=1.0, temperature=1.0)  # batch 1, one stream: no CFG
K = 3


def page_code() -> dict:
    code = re.search(r'^```python title="speculative_chain"\n(.*?)^```$', PAGE.read_text(), re.M | re.S)
    namespace: dict = {}
    exec(compile(code.group(1), f"{PAGE}: speculative_chain", "exec"), namespace)
    return namespace


def models(target, drafter, cond: Condition):
    """The page's target_p and draft_q for one prompt, from whole-sequence passes (no cache)."""
    length = target.prefix_length

    def target_p(tokens: list[int]) -> torch.Tensor:
        logits = target.forward_sequence(cond, torch.tensor([tokens])).logits[0, length:]
        return probabilities(logits, None, SAMPLING)

    def draft_q(tokens: list[int], drafts: list[int]) -> torch.Tensor:
        seq = torch.tensor([tokens])
        feats, embeds = teacher_inputs(target.sequence_features(cond, seq), seq, length, drafter.embed)
        for x in [*drafts, None]:  # a draft row: the drafter's own output, the drafted token's embedding
            rows = feats.shape[1]
            out = drafter(feats, embeds, torch.arange(rows), teacher_mask(cond.mask, rows))
            if x is None:
                return probabilities(drafter.logits(out[:, -1]), None, SAMPLING)[0]
            feats = torch.cat([feats, out[:, -1:]], 1)
            embeds = torch.cat([embeds, drafter.embed(torch.tensor([[x]]))], 1)

    return target_p, draft_q


def test_the_pages_loop_gives_the_engines_tokens():
    target = make_target()
    drafter = make_drafter(target, seed=4, std=0.5)
    chain = StaticTreeBuilder(StaticTreeConfig(paths=[(0,) * d for d in range(1, K + 1)]))
    engine = SpeculativeEngine(target, drafter, chain, SAMPLING)
    speculative_chain = page_code()["speculative_chain"]
    kept = 0
    for seed in range(2):
        cond = tiny_condition(batch=1, seed=seed)
        result = engine.generate(cond, [torch.Generator().manual_seed(100 + seed)])
        rng = RowRandom.from_generators([torch.Generator().manual_seed(100 + seed)])

        def uniforms(step: int, rng: RowRandom = rng):
            rng.steps.fill_(step)  # the engine's counter: one step per verification
            u_draft = rng.uniform(Purpose.DRAFT, K + 1)[0]
            u_accept, u_bonus = rng.uniforms((Purpose.ACCEPT, (K + 1,)), (Purpose.BONUS, ()))
            return u_draft.tolist(), u_accept[0].tolist(), float(u_bonus[0])

        target_p, draft_q = models(target, drafter, cond)
        with torch.no_grad():  # the first token as AR draws it: from the prefix's p, with the generator
            prefix = target.forward_sequence(cond, torch.zeros(1, 0, dtype=torch.long)).logits[:, -1]
            first = sample_rows(
                probabilities(prefix, None, SAMPLING), [torch.Generator().manual_seed(100 + seed)]
            )
            tokens = speculative_chain(target_p, draft_q, int(first), target.num_image_tokens, K, uniforms)
        assert tokens == result.tokens[0].tolist(), seed
        steps = result.stats[0].committed_per_step
        kept += sum(steps) - len(steps)
    assert kept > 0  # some drafts were kept and some rejected: both branches of the loop ran
