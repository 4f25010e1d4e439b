"""What every draft-tree builder is: the interface the engine's loop calls, the state it passes, and
the narrow ``DraftContext`` a builder drafts through (never the engine itself)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from vdtrain.decode.acceptance import BatchVerdict
from vdtrain.decode.budget import WHOLE_TREE, TreeBudget
from vdtrain.decode.rng import RowRandom
from vdtrain.decode.rows import DrafterRows, TargetGeometry
from vdtrain.decode.schedule import StepPlan
from vdtrain.decode.trees import DraftTree

if TYPE_CHECKING:
    from collections.abc import Sequence

    from vdtrain.drafters import Drafter
    from vdtrain.sampling_config import SamplingConfig


class DraftContext(Protocol):
    """What a builder may use while drafting: the sampling settings, the target's geometry, the
    drafter's distribution made by the one pipeline, and drafter forwards (``vdtrain.decode.drafting``).
    Row layouts come from ``vdtrain.decode.rows``. Shapes: R = streams·B rows, H the target's width (a
    drafter feature's too: ``vdtrain.drafters.base``)."""

    sampling: SamplingConfig
    target: TargetGeometry

    def draft_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Drafter logits [R, ..., V] → processed logits [B, ..., V] (CFG combined)."""
        ...

    def draft_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Drafter logits [R, ..., V] → q [B, ..., V] (at T = 0 the softmax of the filtered logits)."""
        ...

    def draft_confidence(self, logits: torch.Tensor) -> torch.Tensor:
        """Drafter logits [R, ..., V] → what a dynamic tree ranks by [B, ..., V]: the softmax before top-k
        and top-p (at T = 0 at temperature 1)."""
        ...

    def drafter_inputs(
        self,
        tokens: torch.Tensor | None,
        token_index: torch.Tensor,
        slots: torch.Tensor,
        image_vis: torch.Tensor,
        next_embeds: torch.Tensor | None = None,
        *,
        offset: int = 0,
    ) -> DrafterRows:
        """Drafter rows for the next ``tokens`` [B, S] at image indices ``token_index`` [B, S], every stream
        (``slots`` [B, S] drafter cache slots, ``image_vis`` [B, S, K] the image slots each row sees,
        ``next_embeds`` [R, S, H] instead of ``tokens``' embeddings, ``offset`` the rows' tree depth:
        ``DrafterRows.offset``)."""
        ...

    def drafter_embeds(self, tokens: torch.Tensor) -> torch.Tensor:
        """The drafter's embeddings [R, S, H] of the next ``tokens`` [B, S], every stream (rows made once
        by ``drafter_inputs`` can take new tokens: ``DrafterRows.embeds``)."""
        ...

    def drafter_forward(self, feats: torch.Tensor, rows: DrafterRows) -> tuple[torch.Tensor, torch.Tensor]:
        """Features ``feats`` [R, S, H] at ``rows`` → (f̂ [R, S, H], logits [R, S, V])."""
        ...

    def drafter_block(self, roots: torch.Tensor, rows: DrafterRows) -> tuple[torch.Tensor, torch.Tensor]:
        """A block drafter's query rows from the roots' features ``roots`` [R, H] at ``rows`` (S of them:
        the tokens 1 .. S past the root's child) → (f̂ [R, S, H], logits [R, S, V]): one forward."""
        ...


@dataclass
class TreeConfig:
    """A method's ``tree`` section: its ``kind``; each builder's module subclasses it with the kind's own
    keys. This class alone is kind ``none``: AR, nothing drafted."""

    kind: str = "none"
    # Verification rows (streams × prompts × tree nodes) above which a call's trees shrink
    # (``vdtrain.decode.budget.tree_budget``): None is the device's limit (GPU_MAX_ROWS on a GPU, none
    # elsewhere); 0: off. The engine reads it (``SpeculativeEngine(max_rows=)``), not the builder.
    max_rows: int | None = None
    # The CFG scale the drafter's two streams are combined at into q, its draft distribution (1: the
    # conditional stream alone); None: the target's cfg_scale. Verification always uses the target's: any
    # q keeps an exact rule exact, and a drafter whose streams are each a little off drafts better below
    # the target's scale, which multiplies their error (docs/decoding.md, "The draft's guidance").
    draft_cfg_scale: float | None = None


@dataclass
class StepState:
    """What a tree builder needs to know about the current step (device tensors, no host copies)."""

    roots: torch.Tensor  # [B] root tokens
    root_feats: torch.Tensor | None  # [R, H] drafter feature predicted for the root's slot (R = streams·B)
    root_logits: torch.Tensor | None  # [R, V] drafter logits for the root's children (None: no drafter)
    committed: torch.Tensor  # [B] m
    depth_limit: torch.Tensor  # [B] max tree depth allowed (image tokens left to draft)
    generators: Sequence[torch.Generator | None]
    rng: RowRandom | None = None  # the run's per-row counter-based uniforms (this step's draws)
    budget: TreeBudget = WHOLE_TREE  # the call's node budget, the same every step (``max_nodes``)
    tokens: torch.Tensor | None = None  # [B, N + spare] the committed image tokens (read, never write)


@dataclass
class StepOutcome:
    """What one step's verification decided, all ``observe`` reads: a builder keeps nothing of a step
    (its randomness, its temperature) for later."""

    tree: DraftTree  # the step's trees [B, T]
    verdict: BatchVerdict  # every row's walk; meaningful where ``plan.verified``
    plan: StepPlan  # ``plan.verified`` [B] bool: the prompts the target verified this step
    p_nodes: torch.Tensor  # [B, T, V] the target's distribution at every node
    roots_at: torch.Tensor  # [B] the image index of each tree's root
    rng: RowRandom | None  # the run's per-row uniforms at this step's counter (as ``StepState.rng``)
    greedy: bool  # T = 0: a redraw is the argmax

    @property
    def verified(self) -> torch.Tensor:
        return self.plan.verified


class DraftTreeBuilder:
    """Builds each step's tree; subclasses decide its shape (static, dynamic, adaptive, Jacobi).

    ``reset`` and ``observe`` let a builder keep per-prompt state across steps (PEANUT's depth/width
    grid, SJD's window); the plain trees ignore them.

    A ``generate`` call's node budget (``TreeBudget``, made by the engine once per call) reaches the
    builder as ``StepState.budget`` in every ``build`` and as the argument of ``max_nodes`` and
    ``tree_size``; a builder keeps none of it (the same builder serves calls of other budgets).
    """

    # What the builder drafts with, declared once: the method registry's row reads it (``methods.Part``).
    needs_drafter: ClassVar[bool] = True  # False: drafts without a drafter model (SJD)
    drafts_blocks: ClassVar[bool] = False  # True: one forward drafts a block (``DraftContext.drafter_block``)
    # True: every step has the same shapes and host work and the builder keeps no Python state across
    # steps, so the engine may record a step once and replay it (vdtrain.decode.graphs).
    graph_safe: ClassVar[bool] = False

    def max_nodes(self, budget: TreeBudget) -> int:
        """The larger of the nodes (root included) of a tree built under ``budget`` and the drafter
        scratch slots its build uses: the engine's room past the image, for the call."""
        raise NotImplementedError

    def tree_size(self, budget: TreeBudget) -> int:
        """Nodes (root included) of the trees built under ``budget``: fewer than under ``WHOLE_TREE`` where
        the budget shrinks them. By default ``max_nodes`` (a builder whose scratch outgrows its trees
        says otherwise)."""
        return self.max_nodes(budget)

    def for_vocabulary(self, vocab_size: int) -> DraftTreeBuilder:
        """The builder that drafts over ``vocab_size`` image tokens (the engine asks once): this one where
        its settings fit, else a copy with them cut to fit; or refuse them. This one is left as it is."""
        return self

    def check_drafter(self, drafter: Drafter) -> None:
        """Refuse a ``drafter`` this builder cannot draft with (the engine asks; every kind drafts one
        depth per call, only some draft blocks: ``Drafter.block_slots``)."""

    def build(self, ctx: DraftContext, state: StepState) -> DraftTree:
        raise NotImplementedError

    def reset(self, batch: int) -> None:
        """A new ``generate`` call with ``batch`` prompts begins."""

    def observe(self, outcome: StepOutcome) -> None:
        """After verification: what the step decided (``StepOutcome``)."""


def write_in_place(state: object, new: object) -> None:
    """Copy the tensor fields of dataclass ``new`` into those of ``state`` (same class): a builder that
    keeps state across steps updates it this way, so a recorded step replays on the same tensors."""
    for f in fields(state):
        old, value = getattr(state, f.name), getattr(new, f.name)
        if isinstance(old, torch.Tensor) and value is not old:
            old.copy_(value)
