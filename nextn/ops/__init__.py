"""Ops with a fast kernel beside their PyTorch reference, chosen by name: `OPS[name]()` gives the
`Ops` table the runner (or the trainer) passes down through the reference modules' forward, so
the modules call whatever the table holds and hold no choice themselves. Kernel modules are
imported only when their table is asked for (they need triton, or fla).

The decode / verify step has its own fused forward (nextn.models.qwen3_5_step); these are the ops
the reference modules run over many rows: prefill and training.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple


class Ops(NamedTuple):
    chunk_rule: Callable  # (q, k, v, g, beta, initial_state) -> (o, final_state): nextn.ops.gdn
    routed_experts: Callable  # (x, top_idx, top_w, gate_up, down) -> [N, H]: nextn.ops.moe
    attention: Callable  # (q, keys, values, start) -> o: a prefill's causal attention, nextn.ops.attention
    rms_norm: Callable  # (x, weight=, eps=) -> zero-centred RMSNorm: nextn.ops.norm


@functools.cache
def _torch() -> Ops:
    from nextn.ops import attention, gdn, moe, norm

    return Ops(gdn.chunk_gated_delta_rule, moe.routed_experts, attention.prefill_attention, norm.rms_norm)


@functools.cache
def _triton() -> Ops:
    from nextn.ops import triton_utils

    triton_utils.require_triton()
    from nextn.ops.triton_attention import prefill_attention
    from nextn.ops.triton_gdn_chunk import chunk_gated_delta_rule
    from nextn.ops.triton_moe_grouped import grouped_experts
    from nextn.ops.triton_norm import rms_norm_rows

    return Ops(chunk_gated_delta_rule, grouped_experts, prefill_attention, rms_norm_rows)


@functools.cache
def _fla() -> Ops:
    from nextn.ops import attention, moe, norm

    try:
        from nextn.ops import gdn_fla
    except ImportError as e:
        raise RuntimeError("the 'fla' kernels need flash-linear-attention (pip install fla-core)") from e
    return Ops(gdn_fla.chunk_gated_delta_rule, moe.routed_experts, attention.prefill_attention, norm.rms_norm)


OPS: dict[str, Callable[[], Ops]] = {"torch": _torch, "triton": _triton, "fla": _fla}
