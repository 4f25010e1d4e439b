"""The drafter: the module each kind fills (``base``), the kinds (``registry``), the drafter's rows against
the target's slots (``rows``) and the unrolled training pass's cache (``unroll_cache``)."""

from vdtrain.drafters.base import Drafter, DrafterConfig
from vdtrain.drafters.registry import DRAFTERS, drafter_kind

__all__ = ["DRAFTERS", "Drafter", "DrafterConfig", "drafter_kind"]
