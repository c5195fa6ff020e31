"""Row-invariant matmuls: a row's result must not depend on how many rows share the call.

Greedy speculative output equals plain output only if the verify (K+1 rows) computes each row
with the same arithmetic as the decode (1 row). BLAS and cuBLAS pick kernels (and reduction
orders) by the row count, so a 1-row GEMV and a 4-row GEMM differ in the last bits. Every call
with fewer than STEP_ROWS rows is therefore padded to STEP_ROWS rows: one GEMM shape for decode,
verify (K <= STEP_ROWS - 1) and short prefills, in which a row's result does not depend on its
position or its neighbours (tests/test_model.py checks this bitwise). At batch 1 the matmuls are
bound by reading the weights, so the padded rows cost little.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nextn.config import STEP_ROWS


def pad_rows(x: torch.Tensor, rows: int = STEP_ROWS) -> torch.Tensor:
    """x [M, D] -> [rows, D] with zero rows appended (M <= rows)."""
    return torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])]) if x.shape[0] < rows else x


def row_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear whose per-row result is the same for any number of rows < STEP_ROWS."""
    flat = x.reshape(-1, x.shape[-1])
    m = flat.shape[0]
    if 0 < m < STEP_ROWS:
        return F.linear(pad_rows(flat), weight, bias)[:m].reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)
