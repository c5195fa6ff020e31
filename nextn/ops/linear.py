"""Row-invariant matmuls: a row's result must not depend on how many rows share the call.

Greedy speculative output equals plain output only if the verify (K+1 rows) computes each row
with the same arithmetic as the decode (1 row). BLAS and cuBLAS pick kernels (and reduction
orders) by the row count, so a 1-row GEMV and a 4-row GEMM differ in the last bits. Every call
is therefore padded to a multiple of STEP_ROWS rows: decode, verify (K <= STEP_ROWS - 1) and a
batch of sequences' step rows run GEMMs whose rows come in whole tiles of STEP_ROWS, in which a
row's result does not depend on its position or its neighbours (tests/test_model.py checks this
bitwise). Decoding is bound by reading the weights, so the padded rows cost little.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nextn.config import STEP_ROWS


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, D] -> [a multiple of STEP_ROWS (at least one), D] with zero rows appended."""
    pad = -x.shape[0] % STEP_ROWS if x.shape[0] else STEP_ROWS
    return torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x


def pad_dim1(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [B, T, ...] -> [B, rows, ...] with zeros appended along dim 1 (T <= rows)."""
    return torch.cat([x, x.new_zeros(x.shape[0], rows - x.shape[1], *x.shape[2:])], dim=1) if x.shape[1] < rows else x


def row_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear whose per-row result does not depend on the number of rows."""
    flat = x.reshape(-1, x.shape[-1])
    m = flat.shape[0]
    if m % STEP_ROWS:
        return F.linear(pad_rows(flat), weight, bias)[:m].reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)
