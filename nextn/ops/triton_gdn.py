"""Recurrent gated delta rule for decode / verify steps, writing the state after every token.

Reference: `nextn.layers.gdn` (l2norm of q and k, `beta = sigmoid(b)`,
`g = -exp(A_log) * softplus(a + dt_bias)`) then `nextn.ops.gdn.recurrent_gated_delta_rule`. Fused
here: one program per (value head, block of BLOCK_V value columns) keeps its [K, BLOCK_V] slice of
the float32 state in registers, walks the T tokens, and stores o_t and the state after each token
(the rollback point of a partial accept). Per token, so row t's result does not depend on T.
"""
from __future__ import annotations

import torch

from nextn.ops.triton_utils import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["T"])  # one compiled kernel for decode and verify
    def _recurrent_step_kernel(
        qkv_ptr, stride_qkv,  # [T, 2*H*K + HV*V]: conv outputs [q all | k all | v all]
        ba_ptr, stride_ba, b_col, a_col,  # b at columns b_col.., a at a_col.. of each row
        a_log_ptr, dt_bias_ptr,  # [HV]
        state_ptr,  # [HV, K, V] float32: the state before the step
        states_ptr, stride_states,  # [T, HV, K, V] float32 out: the state after each token
        o_ptr, stride_o,  # [T, HV*V] out
        T, scale, eps,
        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        hv = tl.program_id(0)
        h = hv // (HV // H)
        offs_k = tl.arange(0, K)
        offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        tile = hv * K * V + offs_k[:, None] * V + offs_v[None, :]
        S = tl.load(state_ptr + tile)
        decay_rate = tl.exp(tl.load(a_log_ptr + hv).to(tl.float32))
        dt_bias = tl.load(dt_bias_ptr + hv).to(tl.float32)
        in_dtype = qkv_ptr.dtype.element_ty
        for t in range(T):
            row = qkv_ptr + t * stride_qkv
            q = tl.load(row + h * K + offs_k).to(tl.float32)
            k = tl.load(row + H * K + h * K + offs_k).to(tl.float32)
            v = tl.load(row + 2 * H * K + hv * V + offs_v).to(tl.float32)
            q = q / tl.sqrt(tl.sum(q * q, axis=0) + eps) * scale
            k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps)
            b = tl.load(ba_ptr + t * stride_ba + b_col + hv).to(tl.float32)
            beta = (1.0 / (1.0 + tl.exp(-b))).to(in_dtype).to(tl.float32)
            a = tl.load(ba_ptr + t * stride_ba + a_col + hv).to(tl.float32) + dt_bias
            softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
            S = S * tl.exp(-decay_rate * softplus)
            kv_mem = tl.sum(S * k[:, None], axis=0)  # [BLOCK_V]
            delta = (v - kv_mem) * beta
            S = S + k[:, None] * delta[None, :]
            o = tl.sum(S * q[:, None], axis=0)
            tl.store(o_ptr + t * stride_o + hv * V + offs_v, o.to(o_ptr.dtype.element_ty))
            tl.store(states_ptr + t * stride_states + tile, S)


def recurrent_step(
    qkv: torch.Tensor,  # [T, 2*H*K + HV*V] conv outputs
    ba: torch.Tensor,  # [T, *] the rows holding b and a
    b_col: int,
    a_col: int,
    A_log: torch.Tensor,  # [HV]
    dt_bias: torch.Tensor,  # [HV]
    state: torch.Tensor,  # [HV, K, V] float32 contiguous
    states: torch.Tensor,  # [>= T, HV, K, V] float32 out (contiguous per token)
    num_k_heads: int,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,  # [T, HV*V]
) -> torch.Tensor:
    T = qkv.shape[0]
    HV, K, V = state.shape
    if out is None:
        out = torch.empty(T, HV * V, device=qkv.device, dtype=qkv.dtype)
    block_v = min(32, V)
    _recurrent_step_kernel[(HV, V // block_v)](
        qkv, qkv.stride(0), ba, ba.stride(0), b_col, a_col, A_log, dt_bias, state,
        states, states.stride(0), out, out.stride(0), T, K**-0.5, eps,
        H=num_k_heads, HV=HV, K=K, V=V, BLOCK_V=block_v, num_warps=4,
    )
    return out
