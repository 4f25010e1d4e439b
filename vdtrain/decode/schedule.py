"""The verification schedule's interface and its default, ``always``: every drafted step is verified.

A schedule plans, after a step's trees are drafted, which prompts the target verifies
(``plan_on_device``); a skipping schedule (VVS, ``vdtrain.decode.vvs``) also says which unverified path
a skipping prompt commits. ``always`` is the plain engine, bit for bit and op for op.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from vdtrain.decode.rng import RowRandom
from vdtrain.decode.trees import DraftTree


@dataclass
class ScheduleConfig:
    """A method's ``schedule`` section: its ``kind``; each skipping schedule's config below adds its own
    keys. This class alone is kind ``always``: every step verified."""

    kind: str = "always"


@dataclass
class StepPlan:
    """One step's verification plan for the batch. ``skipped`` and ``lead`` are None for a schedule
    that never skips (no tensor work at all); the three flags are host booleans, read in one go from
    ``flags`` (``read``; the engine reads them between the two recorded parts of a step)."""

    verified: torch.Tensor  # [B] bool: prompts verified this step
    skipped: torch.Tensor | None  # [B] bool: prompts committing a drafted path without the target
    lead: torch.Tensor | None  # [B]: unverified tokens fed before each verified tree (0 elsewhere)
    any_verify: bool = True  # a target forward is needed
    any_lead: bool = False  # some verified prompt post-verifies tokens (the forward feeds a chain)
    any_skip: bool = False  # some prompt commits an unverified path
    paths: Any = None  # vvs.LeafPaths: the trees' leaf paths (skipping schedules), for the path pick
    flags: torch.Tensor | None = None  # [3] bool on the device: the three flags, until ``read``

    def flag_values(self) -> tuple[bool, bool, bool]:
        """(any_verify, any_lead, any_skip), read from the device if still there (the one read)."""
        if self.flags is None:
            return self.any_verify, self.any_lead, self.any_skip
        return tuple(self.flags.tolist())

    def with_flags(self, values: tuple[bool, bool, bool]) -> StepPlan:
        """The plan with these flag values on the host."""
        any_verify, any_lead, any_skip = values
        return replace(self, any_verify=any_verify, any_lead=any_lead, any_skip=any_skip, flags=None)

    def read(self) -> StepPlan:
        """The plan with its flags on the host."""
        return self if self.flags is None else self.with_flags(self.flag_values())


class VerificationSchedule:
    """``always``: every step is verified (the plain engine; its plan costs no tensor op). The skipping
    schedules (``vdtrain.decode.vvs``) derive from it."""

    can_skip: ClassVar[bool] = False

    def __init__(self, config: ScheduleConfig) -> None:
        self.config = config

    def reset(self, batch: int, device: torch.device | str | None = None) -> None:
        """A new ``generate`` call with ``batch`` prompts begins."""

    def plan(
        self, tree: DraftTree, active: torch.Tensor, committed: torch.Tensor, pending: torch.Tensor
    ) -> StepPlan:
        """Which of the ``active`` prompts verify this step; ``committed`` [B] tokens so far, of which
        the last ``pending`` [B] are unverified (a skip's path)."""
        return self.plan_on_device(tree, active, committed, pending).read()

    def plan_on_device(
        self, tree: DraftTree, active: torch.Tensor, committed: torch.Tensor, pending: torch.Tensor
    ) -> StepPlan:
        """``plan`` before its flags are read: tensor work only (a recorded step ends here, and the
        engine reads the flags before the rest of the step, recorded once per flag combination)."""
        return StepPlan(verified=active, skipped=None, lead=None)

    def unverified_paths(
        self, tree: DraftTree, plan: StepPlan, rng: RowRandom
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(nodes [B, D], γ [B]) of the path each prompt would commit without verification."""
        raise NotImplementedError(f"{type(self).__name__} never skips a step")
