"""Q8_0 weights kept quantized (nextn.ops.q8_0): GGUF's bytes in and out of nextn's layout and its
quantizer, bit for bit against gguf.quants (llama.cpp's own); the skinny GEMM and the MoE kernels
reading int8 with fp16 scales against the dequantize-then-matmul reference, rows invariant to the
row count; and `quantization="q8_0"` at load: spec == plain, a request the same alone or batched.

On CPU the Triton kernels run under Triton's interpreter (triton_interp.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from nextn.ops.fp8 import Q8_0, FP8Weight
from nextn.ops.q8_0 import dequantize, q8_0_from_blocks, q8_0_quantize, q8_0_to_blocks

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _weights(*shape, seed=0) -> torch.Tensor:
    """Rows of varied magnitude, with the cases the rounding has to get right: an all-zero block,
    exact halves (w * (1 / d) on .5), the largest value negative."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g) * 4
    flat = w.view(-1, shape[-1])
    flat[0, :32] = 0
    flat[1, :32] = torch.arange(32) - 15.5
    flat[2, :32] = -torch.arange(32) * 0.37
    return w


def test_q8_0_quantize_is_gguf_bit_for_bit():
    w = _weights(3, 8, 96)
    raw = gguf_quantize(w.numpy(), GGMLQuantizationType.Q8_0)
    q = q8_0_quantize(w)
    assert q.weight.dtype == Q8_0.values and q.scale.dtype == Q8_0.scale
    assert q.weight.shape == (3, 8, 96) and q.scale.shape == (3, 3, 8)
    assert np.array_equal(q8_0_to_blocks(q).numpy(), raw)
    bf16 = w.bfloat16()  # a bf16 checkpoint's weights (quantized through float32, as gguf's)
    assert np.array_equal(
        q8_0_to_blocks(q8_0_quantize(bf16)).numpy(), gguf_quantize(bf16.float().numpy(), GGMLQuantizationType.Q8_0)
    )


def test_q8_0_from_blocks_reads_gguf_bytes():
    """A matrix and a stack of experts; the reference dequantize equals gguf's (float32)."""
    for shape in ((8, 64), (3, 8, 96)):
        w = _weights(*shape, seed=len(shape))
        raw = gguf_quantize(w.numpy(), GGMLQuantizationType.Q8_0)
        q = q8_0_from_blocks(raw)
        assert isinstance(q, FP8Weight) and q.format == Q8_0
        assert q.weight.shape == shape and q.scale.shape == (*shape[:-2], shape[-1] // 32, shape[-2])
        assert q.scale.is_contiguous()
        assert torch.equal(q.weight, q8_0_quantize(w).weight) and torch.equal(q.scale, q8_0_quantize(w).scale)
        assert np.array_equal(q8_0_to_blocks(q).numpy(), raw)
        ref = gguf_dequantize(raw, GGMLQuantizationType.Q8_0)
        assert np.array_equal(dequantize(q.weight, q.scale, torch.float32).numpy(), ref)
        assert torch.equal(q8_0_from_blocks(torch.from_numpy(raw)).weight, q.weight)


def test_q8_0_bad_bytes_are_named():
    with pytest.raises(ValueError, match="Q8_0 blocks are uint8"):
        q8_0_from_blocks(torch.zeros(4, 35, dtype=torch.uint8))
    with pytest.raises(ValueError, match="Q8_0 blocks are uint8"):
        q8_0_from_blocks(torch.zeros(4, 34, dtype=torch.int8))
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_0_quantize(torch.zeros(4, 40))
