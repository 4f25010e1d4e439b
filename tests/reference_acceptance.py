"""The per-row acceptance walk that batched acceptance (``vdtrain.decode.acceptance.accept_batch``)
replaced, kept as the reference its tests compare verdicts against: one row at a time on the host, one
child at a time, with each rule's group of one token (docs/decoding.md, "Exact acceptance" and
"Relaxed acceptance", derive them). ``gumbel_topk`` draws sampled drafts for the tests' trees."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vdtrain.decode.acceptance import EXACT, BatchVerdict, Grouped, Rule, _NeighbourRule
from vdtrain.decode.rng import inverse_cdf
from vdtrain.decode.trees import DraftTree


@dataclass
class Verdict:
    path: list[int]  # accepted tree nodes, depth 1, 2, ... (the root is not included)
    bonus: int  # the token drawn after the last accepted node
    relaxed: int = 0  # accepted nodes that only a relaxed rule accepted


def from_verdicts(verdicts: list[Verdict], depth: int) -> BatchVerdict:
    """The batch form of per-row ``Verdict``s, paths padded with −1 to ``depth``."""
    path = torch.full((len(verdicts), depth), -1, dtype=torch.long)
    for b, v in enumerate(verdicts):
        path[b, : len(v.path)] = torch.tensor(v.path, dtype=torch.long)
    return BatchVerdict(
        path,
        torch.tensor([len(v.path) for v in verdicts]),
        torch.tensor([v.bonus for v in verdicts]),
        torch.tensor([v.relaxed for v in verdicts]),
    )


def verdicts(batch: BatchVerdict) -> list[Verdict]:
    """Per-row ``Verdict``s of a batch verdict, read back in one transfer."""
    rows = torch.cat([batch.path, batch.bonus[:, None], batch.relaxed[:, None]], dim=1).tolist()
    return [Verdict([n for n in row[:-2] if n >= 0], row[-2], row[-1]) for row in rows]


def _normalise(p: torch.Tensor) -> torch.Tensor:
    total = p.sum()
    if total <= 0:  # numerically exhausted: nothing left to reject into; keep the argmax mass
        return torch.zeros_like(p).scatter_(0, p.argmax().view(1), 1.0)
    return p / total


def _uniform(generator: torch.Generator | None) -> float:
    device = generator.device if generator is not None else None  # a CUDA generator draws on its GPU
    return float(torch.rand((), generator=generator, device=device))


def residual(p: torch.Tensor, q: torch.Tensor, removed: torch.Tensor) -> torch.Tensor:
    """The distribution to continue with after rejecting a child: ``norm(max(0, p_G − q))`` where
    ``p_G`` is ``p`` with the tokens ``removed`` set to 0 (LANTERN's A(x); empty for exact and GSD)."""
    if len(removed):
        p = p.index_fill(0, removed, 0.0)
    return _normalise((p - q).clamp_min(0))


def group(rule: Rule, p: torch.Tensor, token: int) -> torch.Tensor:
    """Other tokens whose target mass ``rule`` credits to ``token`` (LongTensor, may be empty)."""
    if isinstance(rule, _NeighbourRule):
        # A(x): the longest prefix of x's first k neighbours whose cumulative mass stays <= the bound.
        near = rule.neighbours[token, : rule.k].to(p.device)
        cumulative = p[near].cumsum(0)
        return near[: int((cumulative <= rule.bound(float(p[token]))).sum())]
    if isinstance(rule, Grouped) and rule.config.group_size > 1:
        order = p.sort(descending=True, stable=True).indices
        rank = int((p > p[token]).sum() + (p[:token] == p[token]).sum())  # x's place in ``order``
        lo = max(0, rank - rule.config.group_size // 2)
        window = order[lo : max(0, rank - rule.config.group_size // 2 + rule.config.group_size)]
        window = window[window != token]
        close_p = (p[window] - p[token]).abs() < rule.config.delta_p
        emb = rule.embeddings.to(p.device)
        dist = (emb[window] - emb[token]).pow(2).sum(-1)
        return window[close_p & (dist < rule.config.max_distance)]
    return p.new_zeros(0, dtype=torch.long)


def masses(
    rule: Rule, p: torch.Tensor, q: torch.Tensor, token: int, group: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, Q): the child is accepted iff ``u · Q < P``."""
    if not len(group):
        return p[token], q[token]
    q_mass = q[token] + q[group].sum() if rule.credits_q else q[token]
    return p[token] + p[group].sum(), q_mass


def walk(
    rule: Rule,
    tree: DraftTree,
    row: int,
    p_nodes: torch.Tensor,
    greedy: bool,
    generator: torch.Generator | None,
    p_relax: torch.Tensor | None = None,
    u_accept: torch.Tensor | None = None,
    u_bonus: torch.Tensor | float | None = None,
) -> Verdict:
    """The one tree walk. ``p_nodes`` [T, V]: the target distribution at every node (what its children
    should be drawn from), made by the one sampling pipeline; ``p_relax`` [T, V]: at T = 0 the softmax
    of the same filtered logits, where relaxed rules look for the argmax's group.

    ``u_accept`` [T] and ``u_bonus`` (a scalar) are pre-drawn uniforms that replace the generator: node
    ``c`` is tested with ``u_accept[c]`` when tried as a child, and the bonus token is
    ``inverse_cdf(p, u_bonus)``. Given the same uniforms, ``accept_batch`` returns what this walk does."""
    if (u_accept is None) != (u_bonus is None):
        raise ValueError("pass both u_accept and u_bonus (pre-drawn uniforms) or neither")
    tokens = tree.tokens[row]
    node, path, relaxed = 0, [], 0
    while True:
        p = p_nodes[node].double()
        kids = tree.children(row, node)
        accepted = None
        if greedy:
            best = int(p.argmax())
            accepted = next((c for c in kids if int(tokens[c]) == best), None)
            if accepted is None and p_relax is not None:
                soft = p_relax[node].double()
                accepted = next((c for c in kids if best in group(rule, soft, int(tokens[c])).tolist()), None)
                relaxed += accepted is not None
        else:
            q = tree.q[row, node].double() if tree.sampled else None
            for c in kids:
                tok = int(tokens[c])
                if tree.sampled:
                    q = _normalise(q)
                    q_c = q
                else:  # deterministic draft: a point mass on the child
                    q_c = torch.zeros_like(p)
                    q_c[tok] = 1.0
                credited = group(rule, p, tok)
                p_mass, q_mass = masses(rule, p, q_c, tok, credited)
                u = _uniform(generator) if u_accept is None else float(u_accept[c])
                if u * q_mass < p_mass:  # u < P/Q without dividing by a zero Q
                    accepted = c
                    relaxed += not bool(u * q_c[tok] < p[tok])
                    break
                p = residual(p, q_c, credited if rule.removes_group else credited[:0])
                if tree.sampled and not tree.with_replacement:
                    q = q.clone()
                    q[tok] = 0  # the next sibling was drawn without this one
        if accepted is None:
            if greedy:
                bonus = int(p.argmax())
            elif u_bonus is None:
                bonus = int(torch.multinomial(p.float(), 1, generator=generator))
            else:
                bonus = int(inverse_cdf(p, torch.as_tensor(u_bonus, dtype=p.dtype, device=p.device)))
            return Verdict(path, bonus, relaxed)
        path.append(accepted)
        node = accepted


def verify_exact(
    tree: DraftTree, row: int, p_nodes: torch.Tensor, greedy: bool, generator: torch.Generator | None
) -> Verdict:
    """Exact acceptance for one row (lossless): the output has exactly the target's distribution."""
    return walk(EXACT, tree, row, p_nodes, greedy, generator)


def gumbel_topk(logq: torch.Tensor, u: torch.Tensor, k: int) -> torch.Tensor:
    """``k`` indices per row drawn without replacement from ``softmax(logq)`` [..., V] (the Gumbel-top-k
    trick), in the order they would be drawn one by one, with the uniforms ``u`` [..., V]. Zero-mass
    indices (``logq = -inf``) come last, so ``k`` must not exceed the support for a true sample."""
    gumbel = -torch.log(-torch.log(u.double()))  # u = 0 gives -inf: never ahead of a real draw
    return (logq.double() + gumbel).topk(k, dim=-1).indices
