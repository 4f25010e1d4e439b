"""``topk_by_index``: the k largest values with ties in ascending index order, against a Python sort."""

from __future__ import annotations

import torch

from vdtrain.decode.ranking import topk_by_index


def test_matches_a_sort_by_value_then_index_on_tie_heavy_rows():
    """Few distinct values, −inf and −0.0, every k."""
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        n = int(torch.randint(1, 30, (1,), generator=g))
        k = int(torch.randint(1, n + 1, (1,), generator=g))
        values = torch.randint(-2, 3, (2, 3, n), generator=g).float()
        if trial % 2:
            values[values == -2] = float("-inf")
            values[values == 1] = -0.0
        got_values, got_index = topk_by_index(values, k)
        for row, index in zip(values.flatten(0, 1).tolist(), got_index.flatten(0, 1).tolist(), strict=True):
            assert index == sorted(range(n), key=lambda i, row=row: (-row[i], i))[:k], (row, k)
        assert torch.equal(got_values, values.gather(-1, got_index))


def test_bf16_is_ranked_as_float32():
    values = torch.tensor([[1.0, 3.0, 1.0, 2.0]], dtype=torch.bfloat16)
    got_values, got_index = topk_by_index(values, 3)
    assert got_index.tolist() == [[1, 3, 0]] and got_values.dtype == torch.float32
