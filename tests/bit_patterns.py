"""A tensor's bit patterns, for bitwise comparisons in the tests (tests/ is on sys.path)."""

from __future__ import annotations

import torch

_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(x: torch.Tensor) -> torch.Tensor:
    """x's bytes as integers of its element size, so that equality holds NaN for NaN (an untouched
    poisoned entry) and tells -0 from 0."""
    return x.contiguous().view(_INTS[x.element_size()])
