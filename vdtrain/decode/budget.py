"""How many tree nodes one ``generate`` call verifies per prompt: a value the engine makes once per call.

A verification forward checks ``streams × prompts × nodes`` rows. Past a GPU's compute/bandwidth ridge a
bigger tree costs more than it gains, so each call's trees are cut to fit a row limit
(``TreeConfig.max_rows``, else the device's), counted for the run's planned batch so that a prompt's
sample does not depend on the batch it lands in. docs/decoding.md, "Trees that fit the batch".
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Rows one GPU forward verifies at about the cost of one (its compute/bandwidth ridge: H200 ~206 rows,
# H100 ~295 in bf16). Past it verification is compute-bound and a bigger tree costs more than it gains.
GPU_MAX_ROWS = 256


@dataclass(frozen=True)
class TreeBudget:
    """The most nodes (root included, at least 2) a tree of this call may have; None: the configured
    tree. A builder whose trees cannot shrink ignores it."""

    nodes: int | None = None

    def cap(self, configured: int) -> int:
        """``configured`` nodes cut to the budget."""
        return configured if self.nodes is None else min(configured, self.nodes)


WHOLE_TREE = TreeBudget()  # no limit: every tree as configured


def tree_budget(max_rows: int | None, prompts: int, streams: int, device: torch.device) -> TreeBudget:
    """The budget that keeps ``streams × prompts`` trees under ``max_rows`` verified rows
    (``TreeConfig.max_rows``: None the device's limit, ``GPU_MAX_ROWS`` on a GPU and none elsewhere; 0
    none)."""
    limit = (GPU_MAX_ROWS if device.type == "cuda" else 0) if max_rows is None else max_rows
    return TreeBudget(max(2, limit // (streams * prompts))) if limit > 0 else WHOLE_TREE


def call_budget(
    tree_size: Callable[[TreeBudget], int],
    max_rows: int | None,
    *,
    batch: int,
    planned: int | None,
    streams: int,
    device: torch.device,
) -> TreeBudget:
    """The budget of a ``generate`` call of ``batch`` prompts, counted for the run's ``planned`` batch (a
    larger batch counts itself), for a builder whose trees under a budget have ``tree_size`` nodes. None
    ``planned``: this batch's, with a warning where that shrinks the trees below one prompt's."""
    if planned is not None and planned < 1:
        raise ValueError(f"planned_batch must be a positive number of prompts, got {planned}")
    budget = tree_budget(max_rows, max(planned or batch, batch), streams, device)
    nodes, alone = tree_size(budget), tree_size(tree_budget(max_rows, 1, streams, device))
    if planned is None and nodes < alone:
        warnings.warn(
            f"generate() got no planned_batch, so its {batch} prompts' trees shrink to {nodes} nodes "
            f"(tree.max_rows; {alone} for one prompt): T = 1 samples and acceptance then depend on the "
            "batch's size. Pass planned_batch=<the run's prompts per batch> to give every batch the "
            "same trees",
            stacklevel=4,
        )
    return budget
