"""The knobs of the one sampling pipeline (``vdtrain.decode.sampling``): plain data, so targets can carry
their defaults without importing the decoding code that uses them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingConfig:
    """``top_k = 0`` and ``top_p = 1`` disable those filters; ``temperature = 0`` means greedy."""

    cfg_scale: float = 1.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_cfg(self) -> bool:
        """LlamaGen's rule: guidance (and its unconditional stream) only when ``cfg_scale > 1``."""
        return self.cfg_scale > 1.0

    @property
    def streams(self) -> int:
        """Model rows per prompt: the conditional and the unconditional with guidance, else one."""
        return 2 if self.uses_cfg else 1
