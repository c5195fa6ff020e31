"""Chunked gated delta rule through flash-linear-attention's Triton kernels (GPU training path).

Same signature and result as `nextn.ops.gdn.chunk_gated_delta_rule` (its reference, which
tests/test_train.py compares against on a GPU). Importing this module needs the `fla` package
(fla-core, pure Triton); nothing imports it unless a caller asks for the "fla" kernel by name.

Seen on the H200 image (Triton 3.6, fla-core 0.6.0): the forward runs, but fla's backward raises
"Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results for gated
chunk_bwd_dqkwg (see #640)" unless tilelang is installed, so training there uses the torch kernel.
"""

from __future__ import annotations

import torch
from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk


@torch.compiler.disable  # a Triton autograd function: leave it out of compiled graphs
def chunk_gated_delta_rule(
    q: torch.Tensor,  # [B, T, H, K] L2-normalised
    k: torch.Tensor,  # [B, T, H, K] L2-normalised
    v: torch.Tensor,  # [B, T, HV, V]
    g: torch.Tensor,  # [B, T, HV] log decay
    beta: torch.Tensor,  # [B, T, HV]
    initial_state: torch.Tensor | None = None,  # [B, HV, K, V] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (o [B, T, HV, V] in v's dtype, final_state [B, HV, K, V] float32)."""
    dtype = v.dtype
    # keyword arguments only: fla's positional order differs from ours past `beta`
    o, final_state = _fla_chunk(
        q=q.to(dtype),
        k=k.to(dtype),
        v=v,
        g=g.float(),
        beta=beta.to(dtype),
        scale=q.shape[-1] ** -0.5,
        initial_state=None if initial_state is None else initial_state.float(),
        output_final_state=True,
    )
    return o.to(dtype), final_state.float()
