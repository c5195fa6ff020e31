"""Block-quantized weights, FP8 (e4m3) and GGUF's Q8_0 (int8; nextn.ops.q8_0): nextn's layout of
them, FP8 quantization into it, and the reference dequantization of both; and the rows of an fp8
K/V cache (`quantize_rows` / `dequantize_rows`, the reference of the step kernels' in-kernel
quantization in nextn.ops.triton_attention).

nextn holds a quantized weight [N, K] as `weight` float8_e4m3fn [N, K] and `scale` float32
[ceil(K / 128), N], the weight's value being weight[n, k] * scale[k // 128, n]: every row has its
own scale per 128 columns. Both published layouts map onto it exactly (a 128x128 block's scale is
repeated over the block's rows; a per-channel scale over the row's column blocks), and row blocks
of several weights stay valid when concatenated, whatever their sizes (the fused projections, an
expert's gate | up rows, Qwen3-Next's regrouped rows). The scales of a 128-column block are
contiguous, so the skinny GEMM (nextn.ops.triton_linear) reads them as one vector per k-tile.
The scales cost 4 bytes per 128 weights (3% over the e4m3 bytes).

Q8_0 weights (`Format` Q8_0) take the same layout with other dtypes and blocks: `weight` int8 [N, K]
and `scale` float16 [K / 32, N], one scale per row per 32 columns: GGUF's own bytes (34 per 32
weights, 1.0625 per weight), its fp16 d and its 32 int8 q of a block stored as two aligned planes
so a kernel loads 16-byte vectors of each. A weight's format follows from its values' dtype
(`format_of`), so every path that takes a QuantWeight takes a Q8_0 one through the same code.

An fp8 K/V cache (`kv_cache_dtype="fp8"`) stores each row of D values (one position, one kv head)
as e4m3 with its own float32 scale, amax / 448: a row's bytes depend on that row alone, never on
other tokens or the batch, so a verify writes what the decodes of the same tokens write.

The reference path (the modules' forward: the CPU, prefill) dequantizes to the activations' dtype
through float32 (`dequantize`); the step kernels read the e4m3 bytes, and where a weight's scales
are the same over every aligned group of 128 rows (the block layouts, 128-row aligned projections)
they read one scale per group (`compact_scales`: 4 bytes per 128x128 weights, not per 128).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

BLOCK = 128  # columns per scale (FP8)
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3fn value


class Format(NamedTuple):
    """How a block-quantized weight stores its values: their dtype, columns per scale, the scales' dtype."""

    name: str  # the `quantization=` value that makes it at load
    values: torch.dtype
    block: int
    scale: torch.dtype


FP8 = Format("fp8", E4M3, BLOCK, torch.float32)
Q8_0 = Format("q8_0", torch.int8, 32, torch.float16)  # GGUF's Q8_0 (nextn.ops.q8_0)
FORMATS = {f.name: f for f in (FP8, Q8_0)}


def format_of(values: torch.Tensor) -> Format:
    """The format whose values `values` are (by dtype)."""
    for f in FORMATS.values():
        if f.values == values.dtype:
            return f
    raise ValueError(f"no quantized weight format holds {values.dtype} values")


class QuantWeight(NamedTuple):
    """A block-quantized weight in nextn's layout (FP8, or Q8_0 by its int8 values), what the step
    kernels take in place of a tensor: weight[n, k] * scale[k // block, n // rows]."""

    weight: torch.Tensor  # [N, K] float8_e4m3fn (FP8) or int8 (Q8_0)
    scale: torch.Tensor  # [ceil(K / block), ceil(N / rows)] float32 (FP8) or float16 (Q8_0), last dim contiguous
    rows: int = 1  # rows per scale: 1 (nextn's layout), or 128 (compact_scales)
    exponent: int = 0  # compact_scales: 2^exponent puts the largest scale in [1, 2) (the skinny GEMM's fp16 range)

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def format(self) -> Format:
        return format_of(self.weight)


def scale_shape(n: int, k: int, block: int = BLOCK) -> tuple[int, int]:
    """The shape of nextn's scales for a weight [n, k] with `block` columns per scale."""
    return (-(-k // block), n)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight [..., N, K] (e4m3 or int8), scale [..., ceil(K/block), N] -> [..., N, K] in dtype: each
    value times its scale in float32 (exact for Q8_0: an int8 times an fp16), then rounded to dtype.
    The Q8_0 kernels dequantize a tile exactly so."""
    block = format_of(weight).block
    *lead, n, k = weight.shape
    kb = scale.shape[-2]
    s = scale.float().transpose(-1, -2)[..., None]  # [..., n, kb, 1]
    if k != kb * block:  # a partial last block: padded to whole blocks
        w = F.pad(weight.float(), (0, kb * block - k)).view(*lead, n, kb, block)
        return (w * s).view(*lead, n, kb * block)[..., :k].to(dtype)
    # whole blocks (every Q8_0 weight): int8 widens exactly inside the multiply, e4m3 in a copy scaled
    # in place; the same values as above with fewer passes over the weight (the module forward, a
    # chunked prefill's, dequantizes every weight of every chunk)
    w = weight.reshape(*lead, n, kb, block)
    w = torch.mul(w, s) if weight.dtype == torch.int8 else w.float().mul_(s)
    return w.view(*lead, n, k).to(dtype)


def dense(w: torch.Tensor | QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """w as a dense tensor in dtype (a QuantWeight in nextn's layout dequantized; a tensor as it is)."""
    if not isinstance(w, QuantWeight):
        return w
    if w.rows != 1:
        raise ValueError("dense: a weight with compacted scales (compact_scales) is the step's, not the reference's")
    return dequantize(w.weight, w.scale, dtype)


def select_rows(w: torch.Tensor | QuantWeight, rows: torch.Tensor) -> torch.Tensor | QuantWeight:
    """Rows `rows` of a weight [N, K], a contiguous copy (a draft vocabulary's lm_head rows); a
    QuantWeight's with their scales, where each row has its own (Q8_0's: nextn's layout, rows=1)."""
    if not isinstance(w, QuantWeight):
        return w.detach().index_select(0, rows)
    if w.rows != 1 or w.scale.shape[-1] != w.weight.shape[0]:
        raise ValueError(f"select_rows: a {w.format.name} weight whose rows share scales cannot be cut by rows")
    return QuantWeight(w.weight.index_select(0, rows), w.scale.index_select(1, rows).contiguous())


def quantize_blocks(w: torch.Tensor, block_n: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The publisher's block-wise FP8 of w [..., N, K] (each matrix of a stack alone): (e4m3 [..., N,
    K], float32 scale [..., ceil(N/block_n), ceil(K/128)]) with each block's scale amax / 448 (1 for
    an all-zero block), values w / scale rounded to nearest."""
    *lead, n, k = w.shape
    nb, kb = -(-n // block_n), -(-k // BLOCK)
    blocks = F.pad(w.float(), (0, kb * BLOCK - k, 0, nb * block_n - n)).view(*lead, nb, block_n, kb, BLOCK)
    scale = _scale(blocks.abs().amax(dim=(-3, -1)))  # [..., nb, kb]
    q = _to_e4m3(blocks / scale[..., :, None, :, None])
    return q.view(*lead, nb * block_n, kb * BLOCK)[..., :n, :k].contiguous(), scale


def _scale(amax: torch.Tensor) -> torch.Tensor:
    """The scale that maps amax onto e4m3's largest value (1 where amax is 0), correctly rounded
    (a tensor divisor: torch's CUDA division by a Python scalar multiplies by its reciprocal, 1 ulp
    off the kernels' div_rn at times, H200 run 46)."""
    return torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))


def _to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float32 values within the range -> e4m3, rounded to nearest even."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (e4m3 [..., D], float32 scale [...]): each row divided by its scale amax / 448
    (1 for an all-zero row) in float32 and rounded to nearest, so |error| <= 2^-4 of each value
    (half an e4m3 ulp; below 2^-6 * scale, in e4m3's subnormals, at most 2^-10 * scale)."""
    x = x.float()
    scale = _scale(x.abs().amax(dim=-1))
    return _to_e4m3(x / scale[..., None]), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 rows [..., D] with their scales [...] -> float32 [..., D] (each value times its row's scale)."""
    return q.float() * scale[..., None]


def block_scale(scale_inv: torch.Tensor, n: int, block_n: int) -> torch.Tensor:
    """A block-wise checkpoint's `weight_scale_inv` [..., ceil(N/block_n), ceil(K/128)] -> nextn's
    scales [..., ceil(K/128), N]."""
    return scale_inv.float().repeat_interleave(block_n, dim=-2)[..., :n, :].transpose(-1, -2).contiguous()


def channel_scale(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """A compressed-tensors `weight_scale` per output channel [N, 1] (or per tensor, [1] / []) ->
    nextn's scales."""
    return scale.float().reshape(1, -1).expand(scale_shape(n, k)).contiguous()


def compact(scale: torch.Tensor, rows: int = BLOCK) -> torch.Tensor | None:
    """Scales [K blocks, N] with one column per `rows` columns, if every aligned group of `rows`
    columns holds one value (else None)."""
    kb, n = scale.shape
    if n % rows:
        return None
    grouped = scale.view(kb, n // rows, rows)
    return grouped[..., 0].contiguous() if torch.equal(grouped, grouped[..., :1].expand_as(grouped)) else None


def compact_scales(w: QuantWeight, rows: int = BLOCK) -> QuantWeight:
    """w with one scale per `rows` rows where that is the same weight, else w (and Q8_0 weights,
    whose kernels read a scale per row)."""
    scale = compact(w.scale, rows) if w.rows == 1 and w.format == FP8 else None
    if scale is None:
        return w
    top = scale.abs().max().item()
    exponent = -math.floor(math.log2(top)) if 0 < top < math.inf else 0
    return QuantWeight(w.weight, scale, rows, max(-100, min(100, exponent)))  # (2^exponent: a float32)


def quantize(w: torch.Tensor) -> QuantWeight:
    """w [..., N, K] -> its 128x128 block-wise FP8 in nextn's layout (what `quantization="fp8"`
    makes), each matrix of a stack (an expert) quantized alone."""
    q, scale_inv = quantize_blocks(w)
    return QuantWeight(q, block_scale(scale_inv, w.shape[-2], BLOCK))
