"""Counter-based randomness per batch row, and the samplers that turn uniforms into tokens.

``RowRandom`` derives every uniform from a hash of ``(seed_b, step_b, purpose, element index)`` in plain
int64 ops (``_mix``, 53 random bits a double): one op sequence for the whole batch, row ``b``'s draws
depend on its own seed and step only (a prompt draws the same numbers in any batch), and the values are
the same on a CPU and a GPU. One ``(step, purpose)`` pair is one stream: ``uniform(purpose, n)[:, :m]``
equals ``uniform(purpose, m)``, so draw each purpose once per step and ``advance`` between steps. With a
``horizon``, each set of blocks is hashed for every step of the decode once and later steps gather from
that table: one op per draw instead of about fifty. The plain twin hashes every draw when it is made
(``kernels.plain_kernels()``); the values are the same, and docs/decoding.md, "Fast kernels and their
plain twins", has what the table saves."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vdtrain.decode.kernels import plain_kernels

_MASK = 0xFFFFFFFF
_MUL_A = 0x7FEB352D  # odd, < 2^31: a product with a 32-bit word stays below 2^63
_MUL_B = 0x2C1B3C6D
_SEED_SALT = 0x243F6A88  # digits of pi: keep a zero seed away from the all-zero word
_PURPOSE_SALT = 0x9E3779B9  # 2^32 / golden ratio: spreads small purpose numbers over the word
_MAX_TABLE = 1 << 22  # float64 elements of one step table (32 MB); larger draws are hashed each step


class Purpose:
    """The streams a decoding step draws from; each is used at most once per step. Plain ints, not an
    enum: traced code (torch.compile, dynamo of torch 2.11) must compare numbers, not Python objects."""

    ACCEPT = 1  # one uniform per tree node: the test when the node is tried as a child
    BONUS = 2  # one uniform per row: the bonus / residual token by inverse CDF (AR's token too)
    DRAFT = 3  # a tree's drafts: children drawn without replacement, fresh window tokens
    SHAPE = 4  # PEANUT's random initialisation of a tree's (depth, width)
    CONTINUE = 5  # SJD-PAC's continuation: per later position a keep test and a redraw
    REFINE = 6  # SJD's refinement: per window position a redraw from the distribution just computed
    PATH = 7  # VVS: the root-to-leaf path a skipped step commits
    GUMBEL = 8  # SCD's Gumbel coupling: per image position, noise over the vocabulary (``keyed``)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A bijection of 32-bit words (int64 holding [0, 2^32)) with good avalanche."""
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _MASK
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _MASK
    return x ^ (x >> 16)


def _check_purpose(purpose: int) -> None:
    if not isinstance(purpose, int) or not 0 <= purpose <= _MASK:
        raise ValueError(f"purpose must be in [0, 2^32), got {purpose}")


def _as_int64_seed(seed: int) -> int:
    """Generators report seeds as unsigned 64-bit integers; store them as the int64 with the same bits."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


class RowRandom:
    """Uniform draws for a batch of rows from per-row seeds and step counters (see the module docstring)."""

    def __init__(self, seeds: torch.Tensor, horizon: int | None = None) -> None:
        self.seed_key = self._key(seeds)  # [B]: fixed for the whole decode
        self.steps = torch.zeros_like(seeds)  # [B]: advanced once per step by the rows still decoding
        self.horizon = horizon  # steps a row takes at most (None: hash every draw when it is made)
        self._tables: dict[tuple, torch.Tensor] = {}  # blocks -> [B, horizon, total] for steps 0..

    @staticmethod
    def _key(seeds: torch.Tensor) -> torch.Tensor:
        if seeds.dim() != 1 or seeds.dtype != torch.long:
            raise ValueError(
                f"seeds must be a 1-D LongTensor [B], got {seeds.dtype} of shape {tuple(seeds.shape)}"
            )
        lo, hi = seeds & _MASK, (seeds >> 32) & _MASK
        return _mix(_mix(lo ^ _SEED_SALT) ^ hi)

    @staticmethod
    def seeds_of(
        generators: Sequence[torch.Generator | None], device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Row seeds like the generators the engine is given (their ``initial_seed``); a ``None`` row
        gets a seed from torch's global generator, so ``torch.manual_seed`` still fixes it."""
        seeds = [
            _as_int64_seed(g.initial_seed() if g is not None else int(torch.randint(1 << 62, ())))
            for g in generators
        ]
        return torch.tensor(seeds, dtype=torch.long, device=device)

    @classmethod
    def from_generators(
        cls,
        generators: Sequence[torch.Generator | None],
        device: torch.device | str | None = None,
        horizon: int | None = None,
    ) -> RowRandom:
        """Rows seeded from ``generators`` (``seeds_of``)."""
        return cls(cls.seeds_of(generators, device), horizon)

    def reseed(self, seeds: torch.Tensor) -> None:
        """Start over from new seeds, in place (a recorded step replays on these tensors and tables)."""
        self.seed_key.copy_(self._key(seeds))
        self.steps.zero_()
        for blocks, table in self._tables.items():
            table.copy_(self._hash(self._every_step(), blocks))

    @property
    def batch(self) -> int:
        return len(self.steps)

    def advance(self, active: torch.Tensor | None = None) -> None:
        """Move to the next step: every row, or only those where ``active`` [B] (bool) is set, so a
        finished row's counter stays where it stopped."""
        self.steps.add_(1 if active is None else active)  # in place: a recorded step replays it

    def uniform(self, purpose: int, *shape: int) -> torch.Tensor:
        """float64 [B, *shape] in [0, 1): a function of each row's (seed, step), ``purpose`` and the
        element's row-major index only."""
        return self.uniforms((purpose, shape))[0]

    def uniforms(self, *blocks: tuple[int, tuple[int, ...]]) -> list[torch.Tensor]:
        """``uniform(purpose, *shape)`` for each ``(purpose, shape)`` block, hashed in one pass (the same
        values as separate calls, in about half the ops for two blocks); with a horizon, gathered from
        the blocks' table of every step."""
        counts = [_count(purpose, shape) for purpose, shape in blocks]
        total = sum(counts)
        # Compiled code hashes inline (inductor fuses the hash into a kernel or two): it grows no table.
        # The table saves, at the LlamaGen-XL shape (B = 1, `step_kernels --phases`), AR 81 → 29 ops a step
        # outside the layers, eagle2 514 → 450 and sjd 340 → 172 beyond them.
        tabled = self.horizon is not None and not torch.compiler.is_compiling() and not plain_kernels()
        if tabled and self.batch * self.horizon * total <= _MAX_TABLE:
            if blocks not in self._tables:
                self._tables[blocks] = self._hash(self._every_step(), blocks)
            table = self._tables[blocks]  # [B, horizon, total]
            flat = table.gather(1, self.steps[:, None, None].expand(-1, 1, total))[:, 0]
        else:
            flat = self._hash(self.steps, blocks)
        parts = flat.split(counts, dim=1)
        return [part.reshape(self.batch, *shape) for part, (_, shape) in zip(parts, blocks, strict=True)]

    def _every_step(self) -> torch.Tensor:
        """[B, horizon]: steps 0 .. horizon - 1 of every row."""
        return torch.arange(self.horizon, device=self.steps.device).expand(self.batch, -1)

    def _hash(self, steps: torch.Tensor, blocks: tuple[tuple[int, tuple[int, ...]], ...]) -> torch.Tensor:
        """float64 [*steps.shape, total]: the blocks' uniforms, flat, at ``steps`` ([B] or [B, T])."""
        counts = [_count(purpose, shape) for purpose, shape in blocks]
        seed_key = self.seed_key.view(-1, *[1] * (steps.dim() - 1))
        step_key = _mix(seed_key ^ (steps & _MASK))  # [B] or [B, T]
        device = step_key.device
        keys = [_mix(step_key ^ ((purpose * _PURPOSE_SALT) & _MASK)) for purpose, _ in blocks]
        key = torch.cat([k[..., None].expand(*k.shape, 2 * c) for k, c in zip(keys, counts, strict=True)], -1)
        counters = torch.cat([torch.arange(2 * c, dtype=torch.long, device=device) for c in counts])
        words = _mix(_mix(key ^ counters))  # [..., 2 * total]
        high, low = words[..., 0::2] >> 5, words[..., 1::2] >> 6  # 27 and 26 bits
        return (high * (1 << 26) + low).double() / float(1 << 53)

    def keyed(self, purpose: int, keys: torch.Tensor, width: int) -> torch.Tensor:
        """float64 [B, K, width] in [0, 1): a function of each row's seed, ``purpose``, ``keys`` [B, K]
        (say, absolute image positions) and the element's index only, not of the step. A row that asks
        again for a key gets the same numbers, in any batch: noise fixed per position until it is
        committed (SCD's Gumbel coupling)."""
        _check_purpose(purpose)
        if keys.dim() != 2 or keys.shape[0] != self.batch:
            raise ValueError(f"keys must be [B={self.batch}, K], got shape {tuple(keys.shape)}")
        row = _mix(self.seed_key ^ ((purpose * _PURPOSE_SALT) & _MASK))  # [B]: no step in it
        key = _mix(_mix(row[:, None] ^ (keys & _MASK)) ^ _SEED_SALT)  # [B, K]
        counters = torch.arange(2 * width, dtype=torch.long, device=key.device)
        words = _mix(_mix(key[..., None] ^ counters))  # [B, K, 2 * width]
        high, low = words[..., 0::2] >> 5, words[..., 1::2] >> 6
        return (high * (1 << 26) + low).double() / float(1 << 53)


def _count(purpose: int, shape: tuple[int, ...]) -> int:
    """Elements of a ``(purpose, shape)`` block, both checked."""
    _check_purpose(purpose)
    count = 1
    for n in shape:
        count *= n
    if any(n < 0 for n in shape) or 2 * count > _MASK:
        raise ValueError(f"cannot draw a block of shape {shape}: at most 2^31 non-negative elements")
    return count


def inverse_cdf(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample one index per row of ``p`` [..., V] with the uniforms ``u`` [...]: the first index whose
    cumulative mass exceeds ``u`` times the row's total, so ``p`` need not sum exactly to 1 and a
    zero-mass index is never returned (the cumulative sum does not grow there). A row with no mass at all
    gives index 0. No host synchronisation; six kernels."""
    return inverse_cdf_draws(p, u.unsqueeze(-1)).squeeze(-1)


def inverse_cdf_draws(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``inverse_cdf`` for ``k`` independent draws per row at once (with replacement): ``u`` [..., k]
    gives [..., k] long, in the same six kernels as one draw."""
    cdf = p.cumsum(-1, dtype=torch.float64)
    total = cdf.amax(-1, keepdim=True)  # the last entry, but contiguous, as searchsorted wants its values
    index = torch.searchsorted(cdf, u.double() * total, right=True)
    # Rounding can put u · total at the total itself (index V): then take the first index where the
    # cumulative mass reaches the total, which has mass (0 for a row with none).
    return torch.minimum(index, torch.searchsorted(cdf, total))
