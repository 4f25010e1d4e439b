"""The drafter: what every kind shares (``base``), its configuration (``config``), the kinds by name
(``registry``), the drafter's rows against the target's slots (``rows``), the losses every kind trains
with (``losses``, through the frozen head in chunks: ``head_loss``) and the unrolled training pass's cache
(``unroll_cache``). Each kind's module is imported here, which registers it."""

from vdtrain.drafters import block as block
from vdtrain.drafters import eagle as eagle
from vdtrain.drafters import medusa as medusa
from vdtrain.drafters.base import Drafter
from vdtrain.drafters.config import DrafterConfig
from vdtrain.drafters.registry import DRAFTERS, drafter_class, register

__all__ = ["DRAFTERS", "Drafter", "DrafterConfig", "drafter_class", "register"]
