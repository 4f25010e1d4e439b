"""The drafter: what every kind shares (``base``), its configuration (``config``), the kinds
(``registry``), the drafter's rows against the target's slots (``rows``) and the unrolled training
pass's cache (``unroll_cache``)."""

from vdtrain.drafters.base import Drafter
from vdtrain.drafters.config import DrafterConfig, drafter_class
from vdtrain.drafters.registry import DRAFTERS

__all__ = ["DRAFTERS", "Drafter", "DrafterConfig", "drafter_class"]
