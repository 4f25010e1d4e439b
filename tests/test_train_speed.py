"""Issue #47: the drafter's loss through the frozen head a chunk of rows at a time equals the loss it replaced
(tests/reference_losses.py, every [rows, V] logits tensor whole) in value, parts and gradients; the part of
a training step ``trainer.compile`` compiles has no graph break and no complex op; a bf16-autocast step
runs every RMSNorm fused.

Tolerance (fp32): the loss and its parts to rtol 1e-5 / atol 1e-6, the drafter's gradients to rtol 1e-4 /
atol 1e-6; measured differences are float rounding (about 5e-7 relative).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import random_gpt, random_vq, tiny_condition
from omegaconf import OmegaConf
from reference_losses import block_loss, cls_per_row, drafter_loss
from reference_losses import unrolled_loss as reference_unrolled_loss

from vdtrain.config import DrafterTrainConfig, OptimConfig
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.drafters import Drafter, DrafterConfig
from vdtrain.drafters.base import LossInputs
from vdtrain.drafters.head_loss import head_token_loss, token_loss
from vdtrain.drafters.losses import image_target_mask, teacher_loss, unrolled_loss
from vdtrain.drafters.rows import chain_rows
from vdtrain.models.janus import GenerationHead
from vdtrain.targets.base import split_taps
from vdtrain.targets.llamagen import LlamaGenTarget, VQTokenizer
from vdtrain.train.module import DrafterModule

LOSS = {"rtol": 1e-5, "atol": 1e-6}
GRAD = {"rtol": 1e-4, "atol": 1e-6}
KINDS = {
    "eagle1": {},
    "eagle3": {"feature_layers": (0, 1, 2)},
    "medusa": {"heads": 3},
    "block": {"slots": 4, "train_roots": 6},
}
CHUNKS = 5  # 48 trained rows: 10 a chunk, the last one shorter


@pytest.fixture(scope="module")
def target() -> LlamaGenTarget:
    return LlamaGenTarget(
        random_gpt(), VQTokenizer(random_vq(), image_size=8), None, "tiny", SamplingConfig()
    )


def drafter_of(target: LlamaGenTarget, kind: str) -> Drafter:
    torch.manual_seed(0)
    drafter = Drafter.make(DrafterConfig.for_target(target, kind=kind, **KINDS[kind]), target)
    with torch.no_grad():  # every part matters: no zero-initialised weights (medusa's heads start at 0)
        for p in drafter.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return drafter


def batch(target: LlamaGenTarget, taps: tuple[int, ...]):
    """Three samples, the first caption left-padded by two rows."""
    cond = tiny_condition(3)
    cond.mask[0, :2] = False
    tokens = torch.randint(0, target.vocab_size, (3, target.num_image_tokens), generator=torch.Generator())
    hidden, tapped = split_taps(target.sequence_features(cond, tokens, taps).detach(), 32, len(taps))
    return cond.mask, tokens, hidden, tapped


def losses_of(drafter: Drafter, cond_mask, tokens, hidden, tapped, cls_loss: str, chunked: bool):
    """(loss, parts, the drafter's gradients) of the loss ``DrafterModule.score`` computes, or of the
    reference."""
    drafter.zero_grad()
    feats = drafter.input_features(hidden, tapped)
    prefix, image = cond_mask.shape[1], tokens.shape[1]
    if drafter.unroll_steps(7) is None:
        pred = drafter.forward_teacher(feats, tokens, cond_mask)
        if chunked:
            loss, parts = teacher_loss(
                pred,
                hidden[:, 1:],
                drafter.normed,
                drafter.head,
                prefix,
                w_cls=0.1,
                cls_loss=cls_loss,
                chunks=CHUNKS,
            )
        else:
            rows = image_target_mask(cond_mask, image)
            loss, parts = drafter_loss(pred, hidden[:, 1:], drafter.logits, rows, 0.1, cls_loss)
    else:
        steps = drafter.unroll(feats, tokens, cond_mask, 3)
        w_feature = 0.3 if drafter.feature_loss else 0.0
        if chunked:
            loss, parts = unrolled_loss(
                steps, hidden[:, 1:], drafter.normed, drafter.head, prefix,
                decay=0.8, w_feature=w_feature, cls_loss=cls_loss, chunks=CHUNKS,
            )  # fmt: skip
        else:
            rows = image_target_mask(cond_mask, image)
            chains = [chain_rows(cond_mask, rows.shape[1], j) for j in range(3)]
            loss, parts = reference_unrolled_loss(
                steps,
                hidden[:, 1:],
                drafter.normed,
                drafter.head_logits,
                rows,
                chains,
                0.8,
                w_feature,
                cls_loss,
            )
    loss.backward()
    return loss.detach(), parts, {n: p.grad.clone() for n, p in drafter.named_parameters()}


@pytest.mark.parametrize("kind", ["eagle1", "eagle3", "medusa"])
def test_the_chunked_loss_equals_the_reference_loss_and_gradients(target, kind):
    drafter = drafter_of(target, kind)
    inputs = batch(target, drafter.taps)
    for cls_loss in ("soft_ce", "acceptance", "log_acceptance"):
        loss, parts, grads = losses_of(drafter, *inputs, cls_loss, chunked=True)
        ref_loss, ref_parts, ref_grads = losses_of(drafter, *inputs, cls_loss, chunked=False)
        torch.testing.assert_close(loss, ref_loss, **LOSS)
        assert set(parts) == set(ref_parts)
        for name, value in ref_parts.items():
            torch.testing.assert_close(parts[name], value, **LOSS, msg=f"{kind} {cls_loss} {name}")
        for name, grad in ref_grads.items():
            assert grad.abs().sum() > 0, f"{kind}: {name} gets no gradient"
            torch.testing.assert_close(grads[name], grad, **GRAD, msg=f"{kind} {cls_loss} {name}")


def test_token_loss_gradients_are_autograds_also_at_the_acceptance_floor():
    """One row a one-hot target (exact zeros in p), one whose α is below log_acceptance's floor (no
    gradient), two random."""
    torch.manual_seed(0)
    logits = torch.randn(4, 9) * 3
    logits[1] = torch.tensor([-40.0] + [10.0] * 8)  # q(0) ≈ 0 where p is one-hot at 0: α < 1e-6
    probs = torch.randn(4, 9).softmax(-1)
    probs[0] = torch.nn.functional.one_hot(torch.tensor(3), 9).float()
    probs[1] = torch.nn.functional.one_hot(torch.tensor(0), 9).float()
    for kind in ("soft_ce", "acceptance", "log_acceptance"):
        z = logits.clone().requires_grad_()
        cls_per_row(probs, z, kind).sum().backward()
        loss, grad = token_loss(probs, logits, kind)
        torch.testing.assert_close(loss, cls_per_row(probs, logits, kind), **LOSS)
        torch.testing.assert_close(grad, z.grad, **GRAD)
    assert not grad[1].any()  # log_acceptance clamped α on row 1


def test_a_head_with_an_inner_part_and_a_bias_chunks_its_last_linear():
    """Janus's generation head (Linear, GELU, Linear with a bias): the chunked loss runs the inner part on
    every row and the last linear a chunk at a time; more chunks than rows leaves some empty."""
    torch.manual_seed(0)
    head = GenerationHead(8, 6, 11).requires_grad_(False)
    target = torch.randn(5, 8)
    expected_drafted = torch.randn(5, 2, 8, requires_grad=True)
    expected = cls_per_row(head(target).softmax(-1)[:, None], head(expected_drafted))
    expected.sum().backward()
    for chunks in (3, 8):
        drafted = expected_drafted.detach().clone().requires_grad_()
        losses, hits = head_token_loss(drafted, target, head, "soft_ce", chunks)
        losses.sum().backward()
        torch.testing.assert_close(losses, expected, **LOSS)
        torch.testing.assert_close(drafted.grad, expected_drafted.grad, **GRAD)
        assert torch.equal(hits, head(drafted).argmax(-1) == head(target).argmax(-1)[:, None])


def module_of(
    target: LlamaGenTarget, kind: str, compile: bool = False, guided_scale: float | None = None
) -> DrafterModule:
    train = DrafterTrainConfig(kind=kind, ttt_steps=3, loss_chunks=CHUNKS, guided_scale=guided_scale)
    # as fit hands it: a structured DictConfig, whose attribute reads would break the compiled graph
    train = OmegaConf.structured(train)
    return DrafterModule(target, drafter_of(target, kind), train, OptimConfig(), compile=compile)


@pytest.mark.parametrize(
    "kind, guided_scale",
    [("eagle1", None), ("eagle3", None), ("block", None), ("block", 3.0)],  # medusa's loss is eagle3's
    ids=["eagle1", "eagle3", "block", "block_guided"],
)
def test_the_compiled_part_of_a_training_step_has_no_graph_break_and_no_complex_op(
    target, kind, guided_scale
):
    """What ``trainer.compile`` compiles (the drafter's passes and loss, a left-padded caption) traces as one
    graph, from the settings fit hands it; RoPE runs in real arithmetic there, which Inductor generates code
    for. The guided block loss reads a batch of both streams (any even batch traces the same)."""
    module = module_of(target, kind, guided_scale=guided_scale)
    cond_mask, tokens, hidden, tapped = batch(target, module.drafter.taps)
    if guided_scale is not None:  # two streams of one sample
        cond_mask, tokens, hidden = cond_mask[:2], tokens[:2], hidden[:2]
    roots = module.drafter.training_roots(tokens.shape[1], torch.Generator().manual_seed(0), tokens.device)
    inputs = LossInputs(tokens, cond_mask, hidden, hidden, tapped, roots)
    explained = torch._dynamo.explain(module.drafter_loss)(inputs)
    torch._dynamo.reset()
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    ops = {str(node.target) for graph in explained.graphs for node in graph.graph.nodes}
    assert not [op for op in ops if "complex" in op]


def test_the_block_loss_equals_its_data_dependent_reference(target):
    """The block kind's fixed-shape loss (every query row scored, those past the image weighted 0) equals
    the loss it replaced (tests/reference_losses.py: those rows dropped) in value, parts and gradients, with
    roots whose blocks run past the 4 x 4 image (roots 10..13 of 16 tokens, 3 query rows each)."""
    train = DrafterTrainConfig(kind="block", cls_loss="acceptance", w_cls=1.0, loss_chunks=CHUNKS)
    drafter = drafter_of(target, "block")
    cond_mask, tokens, hidden, _ = batch(target, ())
    roots = torch.tensor([0, 5, 10, 12, 13])
    inputs = LossInputs(tokens, cond_mask, hidden, hidden, None, roots)
    results = []
    for loss_of in (drafter.training_loss, lambda inputs, train: block_loss(drafter, inputs, train)):
        drafter.zero_grad()
        loss, parts = loss_of(inputs, train)
        loss.backward()
        results.append((loss.detach(), parts, {n: p.grad.clone() for n, p in drafter.named_parameters()}))
    (loss, parts, grads), (ref_loss, ref_parts, ref_grads) = results
    torch.testing.assert_close(loss, ref_loss, **LOSS)
    assert set(parts) == set(ref_parts)
    for name, value in ref_parts.items():
        torch.testing.assert_close(parts[name], value.to(parts[name].dtype), **LOSS, msg=name)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, **GRAD, msg=name)


def test_a_compiled_step_gives_the_eager_loss_and_gradients(target, monkeypatch):
    """``trainer.compile=true`` through AOTAutograd (the ``aot_eager`` backend: the graphs Inductor would
    get, run without generating code): an eagle3 step's loss and gradients are the eager step's."""
    compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn: compile(fn, backend="aot_eager"))
    results = []
    for compiled in (False, True):
        module = module_of(target, "eagle3", compile=compiled)
        cond_mask, tokens, hidden, tapped = batch(target, module.drafter.taps)
        states = torch.cat([hidden, tapped], -1)
        loss, _ = module.loss_on(tokens, cond_mask, states, torch.Generator().manual_seed(0), 0.1)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in module.drafter.named_parameters()}))
    torch._dynamo.reset()
    (eager, eager_grads), (compiled, compiled_grads) = results
    torch.testing.assert_close(compiled, eager, **LOSS)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, **GRAD)


def test_the_losses_keep_their_gradient_under_inductor():
    """Inductor folds ``x + 0 · y`` into ``x``; a loss so folded, returned beside its detached parts, lost
    its gradient (torch 2.13): both losses leave a zero-weighted term out (eagle3's default w_feature, a
    teacher-forced w_cls of 0)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 13, bias=False).requires_grad_(False)
    steps = [torch.randn(2, 9, 8, requires_grad=True) for _ in range(2)]
    target = torch.randn(2, 9, 8)

    def normed(features, offset):
        return torch.nn.functional.silu(features)

    def unrolled(steps, target):
        return unrolled_loss(
            steps, target, normed, head, 3, decay=0.8, w_feature=0.0, cls_loss="soft_ce", chunks=2
        )

    def teacher(steps, target):
        return teacher_loss(
            steps[0], target, torch.nn.functional.silu, head, 3, w_cls=0.0, cls_loss="soft_ce", chunks=2
        )

    for loss_of in (unrolled, teacher):
        compiled, _ = torch.compile(loss_of, backend="inductor")(steps, target)
        torch._dynamo.reset()
        assert compiled.requires_grad, loss_of.__name__
        torch.testing.assert_close(compiled, loss_of(steps, target)[0], **LOSS)


def test_a_bf16_autocast_step_runs_every_rms_norm_fused(target):
    """Under bf16 autocast a drafter layer's activations are bf16 and its weights fp32: every RMSNorm takes
    its input's dtype, so torch never falls back from its fused kernel (it warns when it does)."""
    module = module_of(target, "eagle1")
    cond_mask, tokens, hidden, _ = batch(target, ())
    with warnings.catch_warnings(record=True) as caught, torch.autocast("cpu", torch.bfloat16):
        warnings.simplefilter("always")
        loss, _ = module.loss_on(tokens, cond_mask, hidden, None, 0.0)
    assert torch.isfinite(loss)
    assert not [w for w in caught if "Mismatch dtype" in str(w.message)]
