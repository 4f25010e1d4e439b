"""Batched acceptance (``accept_batch``) against the reference tree walk, and its cost contract.

Given the same uniforms, ``accept_batch`` must return exactly what ``walk`` returns row by row, for every
rule, deterministic and sampled drafts, T = 0 and T > 0, on random trees with ragged validity and on
distributions with zeros. It must never read the device and its op count must not depend on the batch.
"""

from __future__ import annotations

import zlib
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from unittest.mock import patch

import pytest
import torch
from reference_acceptance import Verdict, gumbel_topk, verdicts, walk
from scipy import stats
from torch.utils._python_dispatch import TorchDispatchMode

from vdtrain.decode.acceptance import (
    EXACT,
    Grouped,
    GsdConfig,
    Lantern,
    LanternConfig,
    LanternPP,
    LanternPPConfig,
    accept_batch,
)
from vdtrain.decode.kernels import plain_twins
from vdtrain.decode.phase_ops import launches_kernel
from vdtrain.decode.rng import Purpose, RowRandom, inverse_cdf_draws
from vdtrain.decode.trees import EAGLE1_PATHS, LANTERN_PP_PATHS, DraftTree, static_tree

VOCAB = 12


g_rules = torch.Generator().manual_seed(5)
# Random latent neighbours [V, V - 1] (self excluded) and token embeddings.
NEIGHBOURS = torch.stack(
    [(order := torch.randperm(VOCAB, generator=g_rules))[order != v] for v in range(VOCAB)]
)
EMBEDDINGS = torch.randn(VOCAB, 3, generator=g_rules)
RULES = {
    "exact": EXACT,
    "lantern": Lantern(LanternConfig(k=4, delta=0.8), NEIGHBOURS),
    "lantern_k_all": Lantern(LanternConfig(k=50, delta=0.6), NEIGHBOURS),
    "lantern_pp": LanternPP(LanternPPConfig(k=5, lam=20.0), NEIGHBOURS),
    "gsd": Grouped(GsdConfig(group_size=5, delta_p=0.5, max_distance=6.0), EMBEDDINGS),
    "gsd_even_wide": Grouped(GsdConfig(group_size=8, delta_p=1.0, max_distance=100.0), EMBEDDINGS),
    "lantern_delta_0": Lantern(LanternConfig(k=4, delta=0.0), NEIGHBOURS),
    "lantern_pp_lam_1": LanternPP(LanternPPConfig(k=4, lam=1.0), NEIGHBOURS),
    "gsd_g1": Grouped(GsdConfig(group_size=1), EMBEDDINGS),
}


def random_shape(size: int, style: str, g: torch.Generator) -> tuple[list[int], list[int]]:
    """Parents and depths of one row's tree: parents before children; ``wide`` hangs nodes anywhere,
    ``deep`` mostly under the previous node, ``chain`` always (``DraftTree.chain``), ``static`` uses
    LANTERN++'s tree (cut to ``size``)."""
    if style == "chain":
        return list(range(-1, size - 1)), list(range(size))
    if style == "static":
        tree = static_tree(LANTERN_PP_PATHS)
        return list(tree.parents[:size]), list(tree.depths[:size])
    parents, depths = [-1], [0]
    for i in range(1, size):
        chain = style == "deep" and torch.rand((), generator=g) < 0.7
        parent = i - 1 if chain else int(torch.randint(i, (), generator=g))
        parents.append(parent)
        depths.append(depths[parent] + 1)
    return parents, depths


def random_distributions(shape: tuple[int, ...], g: torch.Generator, favour: torch.Tensor) -> torch.Tensor:
    """Random distributions [..., V] with top-p-like truncated supports, some one-hot, and extra mass on
    the two ``favour`` tokens [..., 2] (a child's, a neighbour's) so that paths get deep."""
    logits = torch.randn(*shape, VOCAB, generator=g, dtype=torch.float64) * 2
    boost = (
        torch.tensor([3.0, 2.0], dtype=torch.float64)
        + torch.rand(*shape, 2, generator=g, dtype=torch.float64) * 4
    )
    logits.scatter_add_(-1, favour, boost)
    keep = torch.rand(*shape, VOCAB, generator=g) < torch.rand(*shape, 1, generator=g)
    keep.scatter_(-1, favour, True)  # the favoured tokens and the argmax are in the support
    keep.scatter_(-1, logits.argmax(-1, keepdim=True), True)
    one_hot = torch.rand(*shape, 1, generator=g) < 0.1
    keep &= ~one_hot | (logits == logits.amax(-1, keepdim=True))
    return logits.masked_fill(~keep, float("-inf")).softmax(-1)


def random_case(batch: int, size: int, style: str, sampled: bool | str, greedy: bool, seed: int):
    """A batch of random trees with their target distributions and uniforms; ``sampled`` "iid": children
    drawn i.i.d. from q (``DraftTree.with_replacement``), so sibling tokens repeat."""
    g = torch.Generator().manual_seed(seed)
    parents, depths, valid = [], [], []
    for _ in range(batch):
        par, dep = random_shape(size, style, g)
        limit = int(torch.randint(1, max(dep) + 2, (), generator=g))
        ok = [d <= limit for d in dep]
        pad = int(torch.randint(0, size // 3 + 1, (), generator=g))  # dynamic-tree style padding at the end
        for i in range(size - pad, size):
            ok[i] = False
            if style != "chain":  # a chain keeps its shape: its padding is its tail
                par[i], dep[i] = 0, 1
        ok[0] = True
        parents.append(par)
        depths.append(dep)
        valid.append(ok)
    parents_t = torch.tensor(parents)
    tokens = torch.randint(VOCAB, (batch, size), generator=g)
    # Each node favours one of its children's tokens, or a near neighbour of one (what relaxed rules
    # accept), or a random token: paths then get deep and relaxations happen.
    favour = torch.randint(VOCAB, (batch, size, 2), generator=g)
    for b in range(batch):
        for i in reversed(range(1, size)):
            pick, x = float(torch.rand((), generator=g)), int(tokens[b, i])
            if pick < 0.5:
                favour[b, parents[b][i], 0] = x
            elif pick < 0.8:
                favour[b, parents[b][i]] = torch.tensor([NEIGHBOURS[x, 0], x])
    q = random_distributions((batch, size), g, favour) if sampled else None
    if sampled == "iid":
        for b in range(batch):
            for n in range(size):
                kids = [i for i in range(size) if parents[b][i] == n and valid[b][i]]
                if kids:
                    tokens[b, kids] = torch.multinomial(q[b, n], len(kids), replacement=True, generator=g)
    elif sampled:  # children drawn without replacement from their parent's q, as DraftTree.sampled says
        for b in range(batch):
            for n in range(size):
                kids = [i for i in range(size) if parents[b][i] == n and valid[b][i]]
                if len(kids) > int((q[b, n] > 0).sum()):  # widen q's support (a builder would stop)
                    q[b, n] = 0.5 * q[b, n] + 0.5 / VOCAB
                for late in kids[VOCAB:]:  # past the vocabulary: undrafted, with its subtree
                    valid[b][late] = False
                for i in range(size):
                    valid[b][i] = valid[b][i] and (parents[b][i] < 0 or valid[b][parents[b][i]])
                kids = kids[:VOCAB]
                if kids:
                    tokens[b, kids] = torch.multinomial(q[b, n], len(kids), generator=g)
    tree = DraftTree(
        tokens,
        parents_t,
        torch.tensor(depths),
        torch.tensor(valid),
        q,
        bool(sampled),
        chain=style == "chain",
        with_replacement=sampled == "iid",
    )
    soft = random_distributions((batch, size), g, favour)
    p_nodes = torch.zeros_like(soft).scatter_(-1, soft.argmax(-1, keepdim=True), 1.0) if greedy else soft
    u_accept = torch.rand(batch, size, generator=g, dtype=torch.float64)
    u_accept[torch.rand(batch, size, generator=g) < 0.05] = 0.0
    u_bonus = torch.rand(batch, generator=g, dtype=torch.float64)
    return tree, p_nodes.float(), soft.float(), u_accept, u_bonus


def with_bounds(tree: DraftTree) -> DraftTree:
    """The tree with the tight host-side bounds a builder would give."""
    depth = int(torch.where(tree.valid, tree.depths, 0).max())
    width = max(len(tree.children(b, n)) for b in range(len(tree.tokens)) for n in range(tree.size))
    return replace(tree, depth_bound=depth, width_bound=width)


def reference(rule, tree, p_nodes, greedy, u_accept, u_bonus, p_relax) -> list[Verdict]:
    return [
        walk(
            rule,
            tree,
            b,
            p_nodes[b],
            greedy,
            None,
            None if p_relax is None else p_relax[b],
            u_accept[b],
            u_bonus[b],
        )
        for b in range(len(tree.tokens))
    ]


DRAFTS = {False: "det", True: "q", "iid": "iid"}  # deterministic, sampled without replacement, i.i.d.
CASES = [
    pytest.param(style, sampled, greedy, relax,
                 id=f"{style}-{DRAFTS[sampled]}-T{int(not greedy)}{'-relax' if relax else ''}")
    for style in ("wide", "deep", "chain", "static")
    for sampled, greedy in ((False, True), (False, False), (True, False), ("iid", False))
    for relax in ((False, True) if greedy else (False,))
]  # fmt: skip


@pytest.mark.parametrize("rule_name", list(RULES))
@pytest.mark.parametrize(("style", "sampled", "greedy", "relax"), CASES)
def test_accept_batch_equals_the_walk_row_by_row(rule_name, style, sampled, greedy, relax):
    rule = RULES[rule_name]
    seed = zlib.crc32(f"{rule_name}-{style}-{sampled}-{greedy}-{relax}".encode()) % 10_000
    for trial, size in enumerate((12, 30, 58)):
        tree, p_nodes, soft, u_accept, u_bonus = random_case(6, size, style, sampled, greedy, seed + trial)
        p_relax = soft if relax else None
        want = reference(rule, tree, p_nodes, greedy, u_accept, u_bonus, p_relax)
        for t in (tree, with_bounds(tree)):
            got = accept_batch(rule, t, p_nodes, greedy, u_accept, u_bonus, p_relax)
            assert verdicts(got) == want, f"trial {trial}"
            assert got.accepted.tolist() == [len(v.path) for v in want]


@pytest.mark.parametrize("greedy", [False, True])
def test_the_chain_shortcut_is_taken_and_judging_against_another_node_is_caught(greedy):
    """The chain verdict (``DraftTree.chain``) is the walk's; the same verdict with each child judged against
    the next node's distributions instead of its parent's (its own slot's q at T > 0, the next argmax at
    T = 0) is not, so the test above would catch it."""
    tree, p_nodes, _, u_accept, u_bonus = random_case(6, 30, "chain", not greedy, greedy, 18)
    want = reference(EXACT, tree, p_nodes, greedy, u_accept, u_bonus, None)
    general = "_greedy_choices" if greedy else "_tried_choices"
    with patch(f"vdtrain.decode.acceptance.{general}", side_effect=AssertionError("not the shortcut")):
        assert verdicts(accept_batch(EXACT, tree, p_nodes, greedy, u_accept, u_bonus)) == want
    assert max(len(v.path) for v in want) >= 3  # deep enough to tell
    if greedy:  # node i's argmax read as node i + 1's
        wrong = accept_batch(EXACT, tree, torch.roll(p_nodes, -1, dims=1), greedy, u_accept, u_bonus)
    else:  # node i's q read as node i + 1's
        shifted = replace(tree, q=torch.roll(tree.q, -1, dims=1))
        wrong = accept_batch(EXACT, shifted, p_nodes, greedy, u_accept, u_bonus)
    assert verdicts(wrong) != want


@pytest.mark.parametrize("style", ["wide", "static"])
def test_the_sampled_closed_form_is_taken_and_forgetting_earlier_siblings_is_caught(style):
    """A sampled tree's verdict at T > 0 (``_sampled_verdict``: each rank's residual in closed form) is the
    walk's, without the general pass over sibling ranks; the same verdict with every child judged as if it
    were its parent's first (against p and q before its earlier siblings were rejected) is not."""
    tree, p_nodes, _, u_accept, u_bonus = with_bounds_case(random_case(8, 30, style, True, False, 23))
    want = reference(EXACT, tree, p_nodes, False, u_accept, u_bonus, None)
    with patch("vdtrain.decode.acceptance._tried_choices", side_effect=AssertionError("not the closed form")):
        assert verdicts(accept_batch(EXACT, tree, p_nodes, False, u_accept, u_bonus)) == want
    first = [[tree.children(b, int(tree.parents[b, n]))[0] for n in v.path] for b, v in enumerate(want)]
    later_rank = sum(v.path != row for v, row in zip(want, first, strict=True))  # rows with one past rank 0
    assert later_rank >= 3  # children past the first rank accepted: the residuals matter
    ranks = tree.earlier_siblings().sum(-1)  # what a static builder gives as DraftTree.sibling_ranks
    assert (
        verdicts(accept_batch(EXACT, replace(tree, sibling_ranks=ranks), p_nodes, False, u_accept, u_bonus))
        == want
    )
    none_earlier = torch.zeros_like(tree.earlier_siblings())
    with patch.object(DraftTree, "earlier_siblings", lambda self: none_earlier):
        wrong = accept_batch(EXACT, tree, p_nodes, False, u_accept, u_bonus)
    assert verdicts(wrong) != want


@pytest.mark.parametrize("style", ["wide", "static"])
def test_the_iid_closed_form_is_taken_and_the_rule_without_replacement_is_caught(style):
    """Children drawn i.i.d. (``DraftTree.with_replacement``, sibling tokens repeated): the closed form is
    the walk's, without the general pass, and the rule for draws without replacement (q's tried tokens
    removed) gives other verdicts on the same tree."""
    tree, p_nodes, _, u_accept, u_bonus = with_bounds_case(random_case(8, 30, style, "iid", False, 29))
    want = reference(EXACT, tree, p_nodes, False, u_accept, u_bonus, None)
    with patch("vdtrain.decode.acceptance._tried_choices", side_effect=AssertionError("not the closed form")):
        assert verdicts(accept_batch(EXACT, tree, p_nodes, False, u_accept, u_bonus)) == want
    repeats = tree.earlier_siblings() & (tree.tokens[:, :, None] == tree.tokens[:, None, :])
    assert repeats.any(-1).sum() >= 5  # the draws repeat tokens among siblings
    wrong = accept_batch(EXACT, replace(tree, with_replacement=False), p_nodes, False, u_accept, u_bonus)
    assert verdicts(wrong) != want


def test_the_sampled_closed_form_leaves_out_children_past_a_low_width_bound_as_the_general_pass_does():
    """A width bound below the truth cuts the later-ranked children off (``DraftTree.width_bound``): the
    closed form then gives the plain twin's verdict, never an index past its tables."""
    tree, p_nodes, _, u_accept, u_bonus = random_case(8, 30, "wide", True, False, 5)
    widest = with_bounds(tree).width_bound
    for width in (2, 3):
        low = replace(tree, width_bound=width, depth_bound=with_bounds(tree).depth_bound)
        with plain_twins():
            want = verdicts(accept_batch(EXACT, low, p_nodes, False, u_accept, u_bonus))
        assert verdicts(accept_batch(EXACT, low, p_nodes, False, u_accept, u_bonus)) == want
    assert widest > 3  # children were cut off


def with_bounds_case(case):
    tree, *rest = case
    return (with_bounds(tree), *rest)


@pytest.mark.parametrize("rule_name", ["lantern", "lantern_k_all", "lantern_pp", "gsd", "gsd_even_wide"])
def test_the_random_cases_exercise_relaxations(rule_name):
    """Guards the equality test against vacuous cases: each relaxed rule relaxes at T = 0 and T > 0,
    with deterministic and sampled drafts."""
    for sampled, greedy in ((False, True), (False, False), (True, False)):
        relaxed = 0
        for seed in range(3):
            tree, p_nodes, soft, u_accept, u_bonus = random_case(8, 30, "wide", sampled, greedy, seed)
            relaxed += sum(
                v.relaxed for v in reference(RULES[rule_name], tree, p_nodes, greedy, u_accept, u_bonus, soft)
            )
        assert relaxed >= 2, (sampled, greedy)


def test_the_random_cases_exercise_deep_paths_and_bonus_draws():
    depths, bonus_not_argmax = Counter(), 0
    for seed in range(4):
        tree, p_nodes, _, u_accept, u_bonus = random_case(8, 30, "deep", False, False, seed)
        out = accept_batch(EXACT, tree, p_nodes, False, u_accept, u_bonus)
        for b, v in enumerate(verdicts(out)):
            depths[len(v.path)] += 1
            bonus_not_argmax += int(p_nodes[b, v.path[-1] if v.path else 0].argmax()) != v.bonus
    assert max(depths) >= 4 and len(depths) >= 4 and bonus_not_argmax >= 5


def test_repeated_sibling_tokens_match_the_walk():
    """A token drafted twice under one parent has no mass left the second time (the walk zeroed it)."""
    tree, p_nodes, _, u_accept, u_bonus = random_case(8, 20, "wide", False, False, 3)
    tokens = tree.tokens.clone()
    tokens[:, 2] = tokens[:, 1]
    tree = DraftTree(tokens, tree.parents, tree.depths, tree.valid, None, False)
    tree.parents[:, 2] = tree.parents[:, 1]
    tree.depths[:, 2] = tree.depths[:, 1]
    want = reference(EXACT, tree, p_nodes, False, u_accept, u_bonus, None)
    assert verdicts(accept_batch(EXACT, tree, p_nodes, False, u_accept, u_bonus)) == want


def test_shapes_are_checked():
    tree, p_nodes, _, u_accept, u_bonus = random_case(2, 6, "wide", False, False, 0)
    with pytest.raises(ValueError, match="p_nodes must be"):
        accept_batch(EXACT, tree, p_nodes[:, :5], False, u_accept, u_bonus)
    with pytest.raises(ValueError, match="u_accept must be"):
        accept_batch(EXACT, tree, p_nodes, False, u_accept[:, :5], u_bonus)
    with pytest.raises(ValueError, match="needs q"):
        accept_batch(EXACT, DraftTree(tree.tokens, tree.parents, tree.depths, tree.valid, None, True),
                     p_nodes, False, u_accept, u_bonus)  # fmt: skip


def test_walk_wants_both_uniforms_or_none():
    tree, p_nodes, _, u_accept, _ = random_case(1, 6, "wide", False, False, 0)
    with pytest.raises(ValueError, match="both"):
        walk(EXACT, tree, 0, p_nodes[0], False, None, u_accept=u_accept[0])


# --- losslessness through the uniforms ----------------------------------------------------------------


@pytest.mark.parametrize("sampled", [False, True, "iid"], ids=["deterministic", "sampled", "iid"])
def test_first_committed_token_has_the_target_distribution(sampled):
    """One level of 3 drafts from q (top-3, Gumbel-top-3 samples from q, or 3 i.i.d. draws), verified
    with RowRandom's uniforms: the first committed token (accepted draft or bonus) must follow p exactly.
    I.i.d. drafts judged by the rule for draws without replacement must not."""
    rows = 6000
    p = torch.tensor([0.3, 0.25, 0.2, 0.1, 0.1, 0.05, 0.0, 0.0], dtype=torch.float64)
    q = torch.tensor([0.05, 0.1, 0.3, 0.2, 0.1, 0.05, 0.2, 0.0], dtype=torch.float64)
    rng = RowRandom(torch.arange(rows) + 100)
    if sampled == "iid":
        drafts = inverse_cdf_draws(q.expand(rows, -1), rng.uniform(Purpose.DRAFT, 3))
    elif sampled:
        drafts = gumbel_topk(q.log().expand(rows, -1), rng.uniform(Purpose.DRAFT, len(q)), 3)
    else:
        drafts = q.topk(3).indices.expand(rows, -1)
    size = 4
    tree = DraftTree(
        tokens=torch.cat([torch.zeros(rows, 1, dtype=torch.long), drafts], 1),
        parents=torch.tensor([-1, 0, 0, 0]).expand(rows, -1),
        depths=torch.tensor([0, 1, 1, 1]).expand(rows, -1),
        valid=torch.ones(rows, size, dtype=torch.bool),
        q=q.expand(rows, size, -1) if sampled else None,
        sampled=bool(sampled),
        depth_bound=1,
        width_bound=3,
        with_replacement=sampled == "iid",
    )

    def pvalue(tree: DraftTree) -> float:
        out = accept_batch(
            EXACT,
            tree,
            p.expand(rows, size, -1),
            False,
            rng.uniform(Purpose.ACCEPT, size),
            rng.uniform(Purpose.BONUS),
        )
        first = torch.where(
            out.accepted > 0, tree.tokens.gather(1, out.path[:, :1].clamp_min(0)).squeeze(1), out.bonus
        )
        counts = torch.bincount(first, minlength=len(p)).double()
        assert counts[p == 0].sum() == 0
        support = p > 0
        return stats.chisquare(counts[support].numpy(), (p[support] * rows).numpy()).pvalue

    assert pvalue(tree) > 1e-3
    if sampled == "iid":
        assert pvalue(replace(tree, with_replacement=False)) < 1e-6


# --- the cost contract: no host syncs, ops independent of the batch ----------------------------------

SYNCING_OPS = {"_local_scalar_dense", "nonzero", "equal", "is_nonzero", "masked_select", "item"}


class OpLog(TorchDispatchMode):
    """Counts every dispatched aten op and fails on the ones that read a device tensor on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.kernels = 0  # the ops that launch a kernel on a GPU (``phase_ops``' rule: no views)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNCING_OPS:
            raise AssertionError(f"host sync: aten.{name}")
        for a in args:  # boolean-mask indexing waits for the mask's size
            if (
                name == "index"
                and isinstance(a, list | tuple)
                and any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in a)
            ):
                raise AssertionError("host sync: boolean-mask indexing")
        self.ops[name] += 1
        self.kernels += launches_kernel(func)
        return func(*args, **(kwargs or {}))


@contextmanager
def no_host_reads():
    """Tensor methods that copy device values to the host raise inside this block."""

    def refuse(name):
        def method(*args, **kwargs):
            raise AssertionError(f"host sync: Tensor.{name}")

        return method

    names = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
    with ExitStack() as stack:
        for name in names:
            stack.enter_context(patch.object(torch.Tensor, name, refuse(name)))
        yield


PATHS = {  # rule, sampled, greedy, relaxed at T = 0, tree style
    "greedy_relaxed": ("gsd", False, True, True, "wide"),
    "greedy_lantern": ("lantern", False, True, True, "wide"),
    "exact_deterministic": ("exact", False, False, False, "wide"),
    "exact_sampled": ("exact", True, False, False, "wide"),
    "exact_sampled_iid": ("exact", "iid", False, False, "wide"),
    "lantern_pp_deterministic": ("lantern_pp", False, False, False, "wide"),
    "gsd_sampled": ("gsd", True, False, False, "wide"),
    "chain_greedy": ("exact", False, True, False, "chain"),
    "chain_sampled": ("exact", True, False, False, "chain"),
}


def accept_log(path: str, batch: int, shortcut: bool = True) -> OpLog:
    """What ``accept_batch`` dispatches on a 30-node tree of ``batch`` rows, refusing host reads; a chain
    not marked as one where ``shortcut`` is False (the general code)."""
    rule_name, sampled, greedy, relax, style = PATHS[path]
    tree, p_nodes, soft, u_accept, u_bonus = random_case(batch, 30, style, sampled, greedy, batch)
    tree = replace(tree, depth_bound=8, width_bound=1 if tree.chain else 6, chain=tree.chain and shortcut)
    args = (RULES[rule_name], tree, p_nodes, greedy, u_accept, u_bonus, soft if relax else None)
    accept_batch(*args)  # the shared constants (``kernels.shared_full``) made once, outside the count
    log = OpLog()
    with no_host_reads(), log:
        out = accept_batch(*args)
    assert out.path.shape == (batch, 8)
    return log


@pytest.mark.parametrize("path", list(PATHS))
def test_accept_batch_never_reads_the_device_and_its_op_count_does_not_grow_with_the_batch(path):
    assert accept_log(path, 8).ops == accept_log(path, 1).ops


@pytest.mark.parametrize(("path", "fast", "general"), [("chain_sampled", 33, 55), ("chain_greedy", 8, 30)])
def test_the_chain_shortcut_launches_fewer_kernels_than_the_general_code(path, fast, general):
    """The counts docs/decoding.md quotes ("Exact acceptance"): kernel-launching ops of a 30-node chain
    of depth bound 8, B = 1, with and without ``DraftTree.chain``."""
    assert (accept_log(path, 1).kernels, accept_log(path, 1, shortcut=False).kernels) == (fast, general)


def test_the_sampled_closed_form_launches_fewer_kernels_than_its_plain_twin():
    """The counts docs/decoding.md quotes ("Exact acceptance"): kernel-launching ops of a 30-node sampled
    tree of depth bound 8 and width bound 6, B = 1, T > 0, siblings drawn without replacement and i.i.d.,
    against the plain twins (the general pass over sibling ranks, the path followed level by level)."""
    with plain_twins():
        plain, plain_iid = accept_log("exact_sampled", 1).kernels, accept_log("exact_sampled_iid", 1).kernels
    assert (accept_log("exact_sampled", 1).kernels, plain) == (110, 287)
    assert (accept_log("exact_sampled_iid", 1).kernels, plain_iid) == (99, 281)  # i.i.d.: q's total as M_s


def test_the_sync_guards_catch_the_walk():
    """The guards are live: the reference walk reads the device, and each guard refuses it."""
    tree, p_nodes, _, u_accept, u_bonus = random_case(1, 6, "wide", False, False, 0)
    for guard in (OpLog, no_host_reads):
        with pytest.raises(AssertionError, match="host sync"), guard():
            walk(EXACT, tree, 0, p_nodes[0], False, None, None, u_accept[0], u_bonus[0])


def test_eagle1_static_tree_bounds_give_the_same_verdicts():
    """Bounds from a StaticTree (what the engine's builder knows) change nothing but the loop counts."""
    shape = static_tree(EAGLE1_PATHS)
    batch, g = 4, torch.Generator().manual_seed(9)
    tokens = torch.randint(VOCAB, (batch, shape.size), generator=g)
    favour = tokens[:, 1:3, None].expand(batch, 2, shape.size).transpose(1, 2)
    p = random_distributions((batch, shape.size), g, favour).float()
    tree = DraftTree(
        tokens,
        torch.tensor(shape.parents).expand(batch, -1),
        torch.tensor(shape.depths).expand(batch, -1),
        torch.ones(batch, shape.size, dtype=torch.bool),
        None,
        False,
        depth_bound=shape.depth,
        width_bound=max(shape.width(n) for n in range(shape.size)),
    )
    u_accept, u_bonus = (
        torch.rand(batch, shape.size, generator=g).double(),
        torch.rand(batch, generator=g).double(),
    )
    for rule in (EXACT, RULES["lantern_pp"]):
        want = reference(rule, tree, p, False, u_accept, u_bonus, None)
        assert verdicts(accept_batch(rule, tree, p, False, u_accept, u_bonus)) == want


def test_random_distributions_are_distributions():
    p = random_distributions((50, 7), torch.Generator().manual_seed(0), torch.randint(VOCAB, (50, 7, 2)))
    assert torch.isfinite(p).all() and torch.allclose(p.sum(-1), torch.ones(50, 7, dtype=torch.float64))
    assert (p == 0).any() and ((p > 0).sum(-1) == 1).any()  # truncated supports and one-hot rows


def test_sibling_order_and_child_table_skip_invalid_nodes():
    #        0
    #   1    2(invalid)   3        4 is 1's child, 5 is 3's child; 6 is padding.
    tree = DraftTree(
        tokens=torch.zeros(1, 7, dtype=torch.long),
        parents=torch.tensor([[-1, 0, 0, 0, 1, 3, 0]]),
        depths=torch.tensor([[0, 1, 1, 1, 2, 2, 1]]),
        valid=torch.tensor([[True, True, False, True, True, True, False]]),
        q=None,
        sampled=False,
    )
    earlier = tree.earlier_siblings()[0]
    assert [earlier[i].nonzero().flatten().tolist() for i in range(7)] == [[], [], [], [1], [], [], []]
    assert tree.child_table(3)[0].tolist() == [
        [1, 3, -1],
        [4, -1, -1],
        [-1] * 3,
        [5, -1, -1],
        *[[-1] * 3] * 3,
    ]
    assert tree.child_table(1)[0, 0].tolist() == [1]  # ranks past the width are left out
    assert [tree.children(0, n) for n in range(7)] == [[1, 3], [4], [], [5], [], [], []]


@pytest.mark.parametrize(
    "parents",
    [[-1, 0, 0, 1, 1, 2, 2], [-1, 0, 0, 0, 0, 0, 0], [-1, 0, 0, 0, 1, 1, 1]],
    ids=["binary", "star", "two_fans"],
)
@pytest.mark.parametrize("rule_name", ["exact", "lantern_pp", "gsd_even_wide"])
def test_passes_over_later_ranks_hold_every_node_of_a_tight_tree(parents, rule_name):
    """Pass r works on (T − 1) // (r + 1) nodes: trees where exactly that many have an r-th child."""
    size, batch = len(parents), 64
    g = torch.Generator().manual_seed(size)
    depths = [0] * size
    for i in range(1, size):
        depths[i] = depths[parents[i]] + 1
    tokens = torch.randint(VOCAB, (batch, size), generator=g)
    favour = torch.randint(VOCAB, (batch, size, 2), generator=g)
    for i in reversed(range(1, size)):  # each node favours its first two children's tokens
        favour[:, parents[i]] = torch.stack([tokens[:, i], favour[:, parents[i], 0]], -1)
    for sampled in (False, True):
        q = random_distributions((batch, size), g, favour).float() if sampled else None
        p = random_distributions((batch, size), g, favour).float()
        tree = DraftTree(
            tokens,
            torch.tensor(parents).expand(batch, -1),
            torch.tensor(depths).expand(batch, -1),
            torch.ones(batch, size, dtype=torch.bool),
            q,
            sampled,
        )
        u_accept = torch.rand(batch, size, generator=g, dtype=torch.float64)
        u_bonus = torch.rand(batch, generator=g, dtype=torch.float64)
        want = reference(RULES[rule_name], tree, p, False, u_accept, u_bonus, None)
        # Siblings repeat tokens here, which no sampled builder draws: the exact rule's closed form
        # (``_sampled_verdict``) assumes draws without replacement, the plain twin takes any tree.
        with plain_twins(sampled):
            got = verdicts(accept_batch(RULES[rule_name], tree, p, False, u_accept, u_bonus))
        assert got == want
        assert sum(len(v.path) for v in want) > 10
        assert any(v.path[:1] != [1] for v in want)  # the root's first child rejected: later ranks ran
