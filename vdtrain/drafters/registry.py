"""Drafter kinds by name: ``DRAFTERS`` maps ``DrafterConfig.kind`` to the kind's class.

A kind is a ``Drafter`` subclass with its options dataclass and its hooks (``vdtrain.drafters.base``).
The drafter, the engine, fit, the train module and the exporter call the hooks and compare no kind's
name. A new kind is one module and one entry here (docs/extending.md, "Adding a drafter kind"), and the
registry-driven tests (tests/test_drafter_kinds.py) train, export, reload and decode it.
"""

from __future__ import annotations

from vdtrain.drafters.base import Drafter
from vdtrain.drafters.eagle import Eagle1Drafter, Eagle3Drafter
from vdtrain.drafters.medusa import MedusaDrafter

DRAFTERS: dict[str, type[Drafter]] = {
    # The target's last hidden state, teacher-forced feature regression (EAGLE-1).
    "eagle1": Eagle1Drafter,
    # Fused target layers, trained on its own unrolled outputs (EAGLE-3).
    "eagle3": Eagle3Drafter,
    # Residual heads on the target's last hidden state, one per draft depth (Medusa).
    "medusa": MedusaDrafter,
}
