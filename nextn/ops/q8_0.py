"""GGUF's Q8_0 weights kept quantized: its bytes into nextn's layout and back, its quantization, and
the reference dequantization.

Q8_0 (llama.cpp's ggml-quants.c) stores each row of a weight [N, K] as K / 32 blocks of 34 bytes: an
fp16 scale d then 32 int8 values q, the weight being d * q. nextn holds it as a QuantWeight
(nextn.ops.fp8, format Q8_0) of two aligned planes, `weight` int8 [N, K] (the q) and `scale` float16
[K / 32, N] (the d, a row's scales down a column as FP8's are), the same bytes as GGUF's (1.0625 per
weight) split so the kernels load 16-byte vectors of each. Stacks of experts [E, N, K] take
[E, K / 32, N] scales, as FP8 experts do.

`q8_0_quantize` is gguf.quants' Q8_0 (ggml's reference quantizer) in torch, bit for bit: what
`quantization="q8_0"` makes of a bf16 checkpoint at load, on the device. `dequantize` is the
reference every Q8_0 kernel is tested against: d * q in float32 (exact) rounded to the compute dtype.
"""

from __future__ import annotations

import numpy as np
import torch

from nextn.ops.fp8 import Q8_0, QuantWeight, dequantize

__all__ = ["BLOCK", "BLOCK_BYTES", "dequantize", "q8_0_from_blocks", "q8_0_quantize", "q8_0_to_blocks"]

BLOCK = Q8_0.block  # weights per block (and per scale)
BLOCK_BYTES = 2 + BLOCK  # GGUF's block: fp16 d, then 32 int8 q
Q_MAX = 127.0


def q8_0_from_blocks(raw: torch.Tensor | np.ndarray) -> QuantWeight:
    """GGUF Q8_0 bytes, uint8 [..., N, K / 32 * 34] (a matrix, or a stack of experts [E, N, ...]) ->
    the weight in nextn's layout: int8 [..., N, K] and float16 scales [..., K / 32, N] (copies, on
    raw's device)."""
    if isinstance(raw, np.ndarray):
        raw = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True))  # (a reader's memmap is read-only)
    if raw.dtype != torch.uint8 or raw.dim() < 2 or raw.shape[-1] % BLOCK_BYTES:
        raise ValueError(f"Q8_0 blocks are uint8 [..., N, K / 32 * {BLOCK_BYTES}], got {raw.dtype} {tuple(raw.shape)}")
    *lead, n, row_bytes = raw.shape
    kb = row_bytes // BLOCK_BYTES
    blocks = raw.reshape(*lead, n, kb, BLOCK_BYTES)
    d = blocks[..., :2].contiguous().view(torch.float16).reshape(*lead, n, kb)
    q = blocks[..., 2:].contiguous().view(torch.int8).reshape(*lead, n, kb * BLOCK)
    return QuantWeight(q, d.transpose(-1, -2).contiguous())


def q8_0_to_blocks(w: QuantWeight) -> torch.Tensor:
    """The inverse of q8_0_from_blocks: GGUF's bytes, uint8 [..., N, K / 32 * 34]."""
    q, d = w.weight, w.scale
    if q.dtype != Q8_0.values or d.dtype != Q8_0.scale or w.rows != 1:
        raise ValueError(f"not a Q8_0 weight: {q.dtype} values, {d.dtype} scales, {w.rows} rows per scale")
    *lead, n, k = q.shape
    kb = k // BLOCK
    d_bytes = d.transpose(-1, -2).reshape(-1).view(torch.uint8).reshape(*lead, n, kb, 2)  # (flat: any strides)
    q_bytes = q.reshape(-1).view(torch.uint8).reshape(*lead, n, kb, BLOCK)
    return torch.cat([d_bytes, q_bytes], dim=-1).reshape(*lead, n, kb * BLOCK_BYTES)


def q8_0_quantize(w: torch.Tensor) -> QuantWeight:
    """w [..., N, K] (K a multiple of 32) -> its Q8_0, bit for bit gguf.quants' (ggml's reference):
    in float32 per block d = amax / 127, q = round-half-away(w * (1 / d)) (0 where d is 0), stored
    d rounded to fp16. Each matrix of a stack (an expert) row by row, as GGUF quantizes."""
    *lead, n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"Q8_0 quantizes rows of a multiple of {BLOCK} columns, got {k}")
    blocks = w.float().reshape(*lead, n, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    d = amax / torch.full_like(amax, Q_MAX)  # (a tensor divisor: correctly rounded on every device)
    inv = torch.where(d == 0, torch.zeros_like(d), torch.ones_like(d) / d)
    x = blocks * inv
    a = x.abs()
    floored = a.floor()
    q = torch.sign(x) * (floored + (2 * (a - floored)).floor())  # gguf's np_roundf: halves away from 0
    return QuantWeight(q.to(torch.int8).reshape(*lead, n, k), d.squeeze(-1).half().transpose(-1, -2).contiguous())
