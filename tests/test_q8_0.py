"""Q8_0 weights kept quantized (nextn.ops.q8_0): GGUF's bytes in and out of nextn's layout and its
quantizer, bit for bit against gguf.quants (llama.cpp's own); the skinny GEMM and the MoE kernels
reading int8 with fp16 scales against the dequantize-then-matmul reference, rows invariant to the
row count; and `quantization="q8_0"` at load: spec == plain, a request the same alone or batched.

On CPU the Triton kernels run under Triton's interpreter (triton_interp.py).
"""

from __future__ import annotations

import functools
import shutil

import hf_fixtures as hf
import numpy as np
import pytest
import torch
import triton_interp  # noqa: F401  (before triton)
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from hf_fixtures import FIT_PROMPTS
from test_batching import CASES, _run
from test_fp8 import _close as _fp8_close
from test_fp8 import _fp8_variants
from test_kv_fp8 import _spec_equals_plain

import nextn
from nextn.config import check_quantization
from nextn.config.model import QuantConfig
from nextn.layers.ffn import QuantExperts
from nextn.layers.linear import QuantLinear
from nextn.models.loader import fuse_weights, load_model, quantize_model
from nextn.ops.fp8 import Q8_0, QuantWeight
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
        assert isinstance(q, QuantWeight) and q.format == Q8_0
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


# ---------------------------------------------------------------------------------------------
# the skinny GEMM over int8 with fp16 scales


def _q8_case(M, N, K, dtype, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w, w2 = (torch.randn(N, K, generator=g, device=DEVICE) * K**-0.5 for _ in range(2))
    x = torch.randn(M, K, generator=g, device=DEVICE).to(dtype)
    res = torch.randn(M, N, generator=g, device=DEVICE).to(dtype)
    return x, q8_0_quantize(w), q8_0_quantize(w2), res


# test_fp8's: skinny_linear's kwargs and the reference (the weights dequantized, then F.linear) per
# fusion; and its tolerance (float32 to 1e-5; bf16 within a few ulps of the output's scale: a dot over
# a tile's dequantized bf16 weights sums in another order than F.linear, a 32-column tile scales
# exact products instead)
_q8_variants, _close = _fp8_variants, _fp8_close


# (BLOCK_N, BLOCK_K, warps, stages, split): None the picked config (tiles over several 32-column
# groups, dequantized), 32 / 16 columns a tile (within one group: scaled products), 64 split in two
CONFIGS = [None, (16, 32, 4, 2, 1), (16, 16, 4, 2, 1), (16, 64, 4, 2, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("M,N,K", [(3, 40, 64), (2, 48, 256), (5, 24, 160)])
def test_q8_0_skinny_linear_matches_dequantized_reference(M, N, K, dtype, config):
    """K = 160: a partial last k-tile at BLOCK_K 64 / 128 (masked, its scales too)."""
    from nextn.ops.triton_linear import skinny_linear

    if config is not None and config[4] > 1 and K % (config[4] * config[1]):
        pytest.skip("split does not fit K")
    args = _q8_case(M, N, K, dtype, seed=M * 100 + K)
    for name, (kw, ref) in _q8_variants(*args).items():
        out = skinny_linear(args[0], args[1], config=config, **kw)
        assert out.dtype == dtype, name
        _close(out, ref, dtype)


@pytest.mark.parametrize("config", CONFIGS)
def test_q8_0_skinny_linear_rows_do_not_depend_on_the_batch(config):
    """A row of 37 (three 16-row tiles) equals that row alone, bitwise, in every fusion."""
    from nextn.ops.triton_linear import skinny_linear

    x, w8, w28, res = _q8_case(37, 40, 256, torch.bfloat16, seed=7)
    for kw, _ in _q8_variants(x, w8, w28, res).values():
        _each_row_alone(x, w8, kw, config, skinny_linear(x, w8, config=config, **kw), (0, 5, 17, 36))


def _each_row_alone(x, w8, kw, config, full, rows):
    """Rows of x computed alone equal those rows of `full`, bitwise."""
    from nextn.ops.triton_linear import skinny_linear

    for m in rows:
        one = {k: (v[m : m + 1] if k == "residual" else v) for k, v in kw.items()}
        assert torch.equal(skinny_linear(x[m : m + 1], w8, config=config, **one)[0], full[m]), (kw.keys(), m)


def test_q8_0_skinny_linear_names_what_it_does_not_take():
    from nextn.ops.fp8 import quantize
    from nextn.ops.triton_linear import skinny_linear

    x, w8, w28, _ = _q8_case(2, 32, 128, torch.float32, seed=1)
    with pytest.raises(ValueError, match="both be FP8"):
        skinny_linear(x, w8, up_weight=quantize(dequantize(w28.weight, w28.scale, torch.float32)))
    with pytest.raises(ValueError, match="q8_0 weights take BLOCK_K dividing 32 or a multiple of it"):
        skinny_linear(x, w8, config=(16, 48, 4, 2, 1))
    with pytest.raises(ValueError, match=r"2 \(x-major\) FP8"):
        skinny_linear(x, w8, config=(16, 32, 4, 2, 1, 2))
    with pytest.raises(ValueError, match="q8_0 scales"):
        skinny_linear(x, QuantWeight(w8.weight, w8.scale.float()))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize(
    "N,K,kind",
    [(12288, 4096, "plain"), (10240, 4096, "plain"), (12288, 4096, "silu_mul"), (4096, 4096, "residual"),
     (4096, 12288, "residual")],
)  # fmt: skip
@pytest.mark.parametrize("config", [None, (64, 32, 4, 4, 1), (64, 256, 4, 3, 1), (64, 128, 4, 4, 4)])
def test_q8_0_skinny_linear_9b_shapes_gpu(N, K, kind, config):
    """Qwen3.5-9B's projections in Q8_0 compiled (the picked config, and others): the reference, and
    9 rows == each row alone."""
    from nextn.ops.triton_linear import skinny_linear

    x, w8, w28, res = _q8_case(9, N, K, torch.bfloat16, seed=N + K)
    kw, ref = _q8_variants(x, w8, w28, res)[kind]
    out = skinny_linear(x, w8, config=config, **kw)
    _close(out, ref, torch.bfloat16)
    _each_row_alone(x, w8, kw, config, out, (0, 3, 8))


def _wide_rows_alone(N, K, seed, rows, monkeypatch):
    """A default call of WIDE_ROWS + 4 rows over Q8_0 weights runs in wide tiles (wide_tile asked for
    q8_0's config), and its rows equal the rows alone (16-row tiles), bitwise, in each fusion and in
    the norm between two GEMMs (norm_out, then a projection reading its sums)."""
    from nextn.ops import triton_linear
    from nextn.ops.linear_configs import WIDE_ROWS
    from nextn.ops.norm import rms_norm as reference_rms_norm
    from nextn.ops.triton_linear import skinny_linear

    asked = []

    def spy(*args, **kwargs):
        out = wide_tile(*args, **kwargs)
        asked.append((args, kwargs, out))
        return out

    wide_tile = triton_linear.wide_tile
    monkeypatch.setattr(triton_linear, "wide_tile", spy)
    M = WIDE_ROWS + 4
    x, w8, w28, res = _q8_case(M, N, K, torch.bfloat16, seed=seed)
    for kw, ref in _q8_variants(x, w8, w28, res).values():
        out = skinny_linear(x, w8, **kw)
        _close(out, ref, torch.bfloat16)
        _each_row_alone(x, w8, kw, None, out, rows)
    assert len(asked) == 3 and all(args[5] == "q8_0" and block_m > 16 for args, _, (block_m, _) in asked)
    g = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    nw = (1 + 0.3 * torch.randn(N, generator=g, device=DEVICE)).to(torch.bfloat16)
    w3 = q8_0_quantize(torch.randn(96, N, generator=g, device=DEVICE) * N**-0.5)
    y, ni = skinny_linear(x, w8, residual=res, norm_out=nw)
    out = skinny_linear(None, w3, rms=ni, eps=1e-6)
    want = torch.nn.functional.linear(reference_rms_norm(y, nw, 1e-6), dequantize(w3.weight, w3.scale, y.dtype))
    _close(out, want, torch.bfloat16)
    for m in rows:
        y1, n1 = skinny_linear(x[m : m + 1], w8, residual=res[m : m + 1], norm_out=nw)
        assert torch.equal(y1[0], y[m]) and torch.equal(n1.ss[:, 0], ni.ss[:, m]), m
        assert torch.equal(skinny_linear(None, w3, rms=n1, eps=1e-6)[0], out[m]), m


def test_q8_0_wide_tiles_keep_each_rows_bits(monkeypatch):
    """K = 512: a split-K shape (its two splits summed in the wide program, in split order)."""
    _wide_rows_alone(64, 512, 11, (0, 130, 259), monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("N,K", [(12288, 4096), (4096, 12288), (4096, 4096)])
def test_q8_0_wide_tiles_keep_each_rows_bits_9b_shapes_gpu(N, K, monkeypatch):
    """Qwen3.5-9B's projections in Q8_0 compiled: a prefill's rows in wide tiles are the decode's."""
    _wide_rows_alone(N, K, N + K, (0, 17, 130, 259), monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("N,K", [(2048, 4096), (9216, 2048)])
def test_q8_0_default_narrow_wide_tiles_keep_each_rows_bits_gpu(N, K, monkeypatch):
    """The 35B-A3B's untabled dense shapes compiled at pick_config's 16 / 32-row defaults (what serve
    runs them at, untuned): a prefill's rows in wide tiles of that BLOCK_N are the decode's."""
    from nextn.ops.linear_configs import WGMMA_ROWS, pick_config

    assert pick_config(N, K, "q8_0")[0] < WGMMA_ROWS
    _wide_rows_alone(N, K, N + K, (0, 17, 130, 259), monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("config", [(16, 256, 4, 3, 1), (32, 256, 4, 4, 4)])
@pytest.mark.parametrize("N,K", [(1024, 2048), (2048, 4096)])
def test_q8_0_narrow_wide_tiles_keep_the_bits_gpu(N, K, config):
    """Compiled, Q8_0 weights at 16- and 32-row configs (mma.sync on Hopper; the 35B-A3B's untabled
    dense shapes take such defaults): wide tiles of the same BLOCK_N and warps (block_m x rows as the
    dot's N) give the 16-row tiles' bits in each fusion (what wide_tile takes below WGMMA_ROWS;
    passed on an H100, run 175)."""
    from nextn.ops.linear_configs import WIDE_SMEM
    from nextn.ops.triton_linear import skinny_linear

    x, w8, w28, res = _q8_case(300, N, K, torch.bfloat16, seed=N + K)
    for name, (kw, _) in _q8_variants(x, w8, w28, res).items():
        narrow = skinny_linear(x, w8, config=config, **kw)
        dual = "up_weight" in kw
        for block_m in (64, 128):
            stages = min(3, WIDE_SMEM // (((2 if dual else 1) * config[0] + 2 * block_m) * config[1]))
            wide = skinny_linear(x, w8, config=config[:3] + (stages,) + config[4:], block_m=block_m, **kw)
            assert torch.equal(wide.view(torch.int16), narrow.view(torch.int16)), (name, block_m)


def test_scores_dequantize_a_quantized_lm_head_a_slice_at_a_time(monkeypatch):
    """The reference path's logits over a Q8_0 lm_head (a GGUF file's) dequantize SCORE_ROWS rows at
    a time, not the whole head (the 9B's: ~6 GB of temporaries), and give the logits of the whole
    dequantized head."""
    from nextn.models import qwen3_5
    from nextn.ops import fp8

    w = q8_0_quantize(_weights(50, 64, seed=3))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    whole = x @ dequantize(w.weight, w.scale, torch.float32).T
    sizes = []
    monkeypatch.setattr(qwen3_5, "SCORE_ROWS", 16)
    monkeypatch.setattr(qwen3_5, "dense", lambda q, dtype: sizes.append(q.weight.shape[0]) or fp8.dense(q, dtype))
    got = qwen3_5.scores(x, w)
    assert sizes == [16, 16, 16, 2] and got.dtype == torch.float32
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5)  # (matmuls over other row counts)


# ---------------------------------------------------------------------------------------------
# quantization="q8_0" at load


def _llm(ckpt, kernels="torch", dtype="float32", k=0, **kw):
    return nextn.LLM(
        model=ckpt, device=DEVICE, dtype=dtype, kernels=kernels, num_speculative_tokens=k, quantization="q8_0", **kw
    )


@pytest.mark.parametrize("src", ["dense_ckpt", "moe_ckpt", "next_ckpt"])
def test_quantization_q8_0_at_load(src, request):
    """quantization="q8_0" on a bf16 checkpoint: the decoder layers' projections and experts (but
    what FP8 keeps, and rows not whole blocks of 32) become int8 with float16 scales, each weight
    what gguf.quants makes of the checkpoint's; quantize_model (the bench's random weights) gives the
    same bits; the reference path computes exactly what the dequantized weights give."""
    ckpt = request.getfixturevalue(src)
    plain = load_model(ckpt)
    at_load = load_model(ckpt, quantization="q8_0")
    assert at_load.cfg.quantization == QuantConfig("q8_0", (1, 32), at_load=True)
    quantized = {n: m for n, m in at_load.named_modules() if isinstance(m, QuantLinear | QuantExperts)}
    assert quantized and all(p.dtype in (torch.int8, torch.float16) for m in quantized.values() for p in m.parameters())
    assert any(isinstance(m, QuantExperts) for m in quantized.values()) == (src != "dense_ckpt")
    whole = dict(plain.named_parameters())
    for name, m in quantized.items():
        for attr in ("weight",) if isinstance(m, QuantLinear) else ("gate_up_proj", "down_proj"):
            w = whole[f"{name}.{attr}"]
            raw = gguf_quantize(w.detach().float().numpy(), GGMLQuantizationType.Q8_0)
            assert np.array_equal(q8_0_to_blocks(QuantWeight(getattr(m, attr), getattr(m, f"{attr}_scale"))), raw)
    in_memory = fuse_weights(quantize_model(load_model(ckpt), "q8_0")).state_dict()
    state = at_load.state_dict()
    assert state.keys() == in_memory.keys()
    for name, t in state.items():
        assert t.dtype == in_memory[name].dtype and torch.equal(t, in_memory[name]), name
    for m in quantized.values():  # the dequantized model
        for attr in ("weight",) if isinstance(m, QuantLinear) else ("gate_up_proj", "down_proj"):
            w = dequantize(getattr(m, attr), getattr(m, f"{attr}_scale"), torch.float32)
            plain.get_submodule(next(n for n, x in at_load.named_modules() if x is m)).get_parameter(attr).data = w
    ids = torch.tensor([list(FIT_PROMPTS[0])])
    with torch.no_grad():
        assert torch.equal(at_load(ids), fuse_weights(plain)(ids))


def test_quantization_names_q8_0():
    with pytest.raises(ValueError, match="fp8 or q8_0"):
        check_quantization("q4_k")


# ---------------------------------------------------------------------------------------------
# the MoE kernels over Q8_0 experts


def _q8_stack(g, *shape):
    """Q8_0 weights and their dequantized float32 copy."""
    q = q8_0_quantize(torch.randn(*shape, generator=g, device=DEVICE) * shape[-1] ** -0.5)
    return q, dequantize(q.weight, q.scale, torch.float32)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit on the interpreter; on a GPU an int8 tile's in-tile sums may add in another order
    than its dequantized copy's (test_fp8_moe's rule)."""
    if not CUDA:
        return torch.equal(a, b)
    tol = 1e-5 if a.dtype == torch.float32 else 2**-7
    return bool(((a.float() - b.float()).abs() <= tol * (1 + b.float().abs())).all())


GPU = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]
# (E, k, H, I, Is): tiny (I of three 32-column groups, a partial k tile), and Qwen3.5-35B-A3B's on a GPU
MOE_SHAPES = [(8, 2, 64, 96, 64), pytest.param((256, 8, 2048, 512, 512), marks=GPU, id="35b-a3b-gpu")]


@pytest.mark.parametrize("shape", MOE_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q8_0_moe_decode_block_computes_its_dequantized_weights(dtype, shape):
    """The decode block (nextn.ops.triton_moe) over Q8_0 experts and shared expert: the same kernels
    over the dequantized copies (MOE_SHAPES), each row alone bit
    for bit its row of the batch; a mix of formats is an error naming it."""
    from nextn.ops.fp8 import quantize
    from nextn.ops.triton_moe import moe_step

    g = torch.Generator(device=DEVICE).manual_seed(5)
    (E, k, H, I, Is), T = shape, 3
    (gu8, gu), (dn8, dn) = _q8_stack(g, E, 2 * I, H), _q8_stack(g, E, H, I)
    shared = [_q8_stack(g, *shape) for shape in ((Is, H), (Is, H), (H, Is))]
    gates = (torch.randn(E + 1, H, generator=g, device=DEVICE) * H**-0.5).to(dtype)
    x, norm = torch.randn(T, H, generator=g, device=DEVICE).to(dtype), torch.zeros(H, device=DEVICE, dtype=dtype)

    def run(rows, *ws):
        return moe_step(rows, norm, 1e-6, gates, *ws, k, True)

    q8 = (gu8, dn8, *(q for q, _ in shared))
    out = run(x, *q8)
    assert _same(out, run(x, *(w.to(dtype) for w in (gu, dn, *(d for _, d in shared)))))
    for t in range(T):
        assert torch.equal(run(x[t : t + 1], *q8)[0], out[t]), t
    fp8_shared = [quantize(d) for _, d in shared]
    with pytest.raises(ValueError, match="share one format"):
        run(x, gu8, dn8, *fp8_shared)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_moe_block_rounds_quantized_weights_by_the_packed_convert_bit_for_bit_gpu():
    """bf16 on a GPU the decode block rounds its dequantized Q8_0 and FP8 weights by
    `triton_moe.bf16_rounded` (a packed convert a pair): the same bits as Triton's convert a value
    (moe_step(asm_round=False)), at the 35B-A3B's shapes, through both kernels."""
    from nextn.ops.fp8 import quantize
    from nextn.ops.triton_moe import moe_step

    g = torch.Generator(device=DEVICE).manual_seed(8)
    E, k, H, I, Is, T = 256, 8, 2048, 512, 512, 4
    gates = (torch.randn(E + 1, H, generator=g, device=DEVICE) * H**-0.5).bfloat16()
    x, norm = torch.randn(T, H, generator=g, device=DEVICE).bfloat16(), torch.zeros(H, device=DEVICE).bfloat16()
    for quant in (lambda w: w[0], lambda w: quantize(w[1])):
        ws = [quant(_q8_stack(g, *shape)) for shape in ((E, 2 * I, H), (E, H, I), (Is, H), (Is, H), (H, Is))]
        out = moe_step(x, norm, 1e-6, gates, *ws, k, True)
        assert torch.equal(out, moe_step(x, norm, 1e-6, gates, *ws, k, True, asm_round=False))


@pytest.mark.parametrize("shape", MOE_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q8_0_grouped_experts_compute_their_dequantized_weights(dtype, shape):
    """The prefill's grouped GEMMs read int8 experts, each k tile of two 32-column groups dequantized
    as `dequantize` does: the grouped GEMMs over the dequantized copies (bit for bit on the
    interpreter) and the reference's values; the reference over Q8_0 weights (a routed expert
    dequantized at a time) bit for bit the reference over the dequantized stack."""
    from test_fp8_moe import grouped_matches_dequantized

    from nextn.ops.fp8 import quantize
    from nextn.ops.triton_moe_grouped import grouped_experts

    g = torch.Generator(device=DEVICE).manual_seed(6)
    E, k, H, I, _ = shape
    (gu8, gu), (dn8, dn) = _q8_stack(g, E, 2 * I, H), _q8_stack(g, E, H, I)
    x, top_idx, top_w = grouped_matches_dequantized(gu8, dn8, gu, dn, k, 9, dtype, g)
    with pytest.raises(ValueError, match="one format"):
        grouped_experts(x, top_idx, top_w, gu8, quantize(dn))


# ---------------------------------------------------------------------------------------------
# a Q8_0 model: the Triton step, spec == plain, a request alone or batched


@pytest.fixture(scope="module")
def q8_fitted(tmp_path_factory, request):
    """A source checkpoint whose trunk weights are their own Q8_0 round trip (float32: what loading
    it with quantization="q8_0" quantizes to the same bits), with an MTP head fitted to that trunk
    (hf_fixtures.fit_mtp_head): Q8_0 changes the greedy continuations the bf16 fit memorised."""
    made = {}

    def make(src: str):
        if src not in made:
            out = tmp_path_factory.mktemp(f"{src}_q8_0")
            shutil.copytree(request.getfixturevalue(src), out, dirs_exist_ok=True)
            tensors = hf.read_tensors(out)
            for name, t in tensors.items():
                if name.startswith("model.layers.") and t.dim() >= 2 and t.shape[-1] % 32 == 0:
                    q = q8_0_quantize(t)
                    tensors[name] = dequantize(q.weight, q.scale, torch.float32)
            hf.write_tensors(tensors, out, None)
            hf.fit_mtp_head(out, [list(p) for p in FIT_PROMPTS])
            made[src] = out
        return made[src]

    return make


@functools.lru_cache(maxsize=4)
def _engine(ckpt, kernels="torch", dtype="float32", k=8):
    return _llm(ckpt, kernels, dtype, k=k, max_model_len=96, max_num_seqs=8).engine


def test_triton_step_reads_q8_0_and_matches_the_reference_step(moe_ckpt):
    """float32: the fused step over Q8_0 projections and experts (int8 with fp16 scales, as loaded;
    the shared expert, 48 wide, not whole blocks of 32, in float32) gives the reference step's logits
    and hiddens."""
    from test_step import _prefilled, _step

    ref, fast = _engine(moe_ckpt), _engine(moe_ckpt, "triton")
    step = fast.runner.step
    attn = next(w for w in step.layers if hasattr(w, "qkv"))
    moe = next(w.mlp for w in step.layers if hasattr(w.mlp, "gate_up"))
    assert isinstance(attn.qkv, QuantWeight) and attn.qkv.format == Q8_0 and attn.qkv.rows == 1
    assert moe.gate_up.format == moe.down.format == Q8_0 and moe.shared_down.dtype == torch.float32
    outs = [_step(e, _prefilled(e, 0), [5, 77, 300]) for e in (ref, fast)]
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_triton_step_q8_0_verify_rows_equal_decode_rows_bitwise(dense_ckpt):
    """bf16: a verify of 4 tokens committing 3 == 3 single-token decodes (logits and hiddens)."""
    from test_fp8 import verify_rows_equal_decode_rows

    engine = _engine(dense_ckpt, "triton", "bfloat16")
    assert engine.runner.step.layers[0].out_proj.format == Q8_0
    verify_rows_equal_decode_rows(engine)


@pytest.mark.parametrize("src,prompt", [("dense_ckpt", 1), ("moe_ckpt", 0)])
def test_greedy_spec_equals_plain_under_q8_0(src, prompt, q8_fitted):
    """The reference path (float32) on a Q8_0 trunk: K = 1..8 emit plain greedy's tokens; the
    fitted heads get drafts accepted."""
    engine = _engine(q8_fitted(src))
    mlp = engine.model.model.layers[0].mlp
    assert isinstance(mlp.down_proj if src == "dense_ckpt" else mlp.experts, QuantLinear | QuantExperts)
    assert _spec_equals_plain(engine, list(FIT_PROMPTS[prompt]), 14, ks=range(1, 9)) > 0


def test_triton_greedy_spec_equals_plain_under_q8_0_bf16(q8_fitted):
    """The fused step in bf16 (the interpreter on CPU, about 40 s) over a Q8_0 trunk: K = 3 emits
    plain greedy's tokens (the GPU test below runs K = 1..8; its rows' invariance, which makes it
    so, is the kernel tests' above)."""
    engine = _engine(q8_fitted("dense_ckpt"), "triton", "bfloat16")
    assert _spec_equals_plain(engine, list(FIT_PROMPTS[1]), 8, ks=(3,)) > 0


def test_each_request_equals_itself_alone_under_q8_0(q8_fitted):
    """test_batching's requests (greedy and seeded sampled, K = 0, 1, 3, arriving at different
    steps) on a Q8_0 trunk, the reference path: each one's output batched is its output alone."""
    _alone_equals_batched(_engine(q8_fitted("dense_ckpt")), range(len(CASES)))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_triton_q8_0_spec_equals_plain_and_batched_equals_alone_gpu(q8_fitted):
    """The fused step in bf16 over a Q8_0 trunk, compiled (CUDA graphs): K = 1..8 emit plain
    greedy's tokens, and test_batching's requests batched equal their outputs alone."""
    engine = _engine(q8_fitted("dense_ckpt"), "triton", "bfloat16")
    assert _spec_equals_plain(engine, list(FIT_PROMPTS[1]), 14, ks=range(1, 9)) > 0
    _alone_equals_batched(engine, range(len(CASES)))


def _alone_equals_batched(engine, cases) -> None:
    alone = {i: _run(engine, [(i, 0)])[i] for i in cases}
    engine.batch_sizes.clear()
    together = _run(engine, [(i, CASES[i][3]) for i in cases])
    assert together == alone
    assert max(engine.batch_sizes) >= 6, engine.batch_sizes


# ---------------------------------------------------------------------------------------------
# bench


def test_bench_random_preset_quantized_to_q8_0(monkeypatch, tmp_path):
    """`nextn bench --random-weights P --quantization q8_0`: the random weights quantized to Q8_0
    (int8, fp16 scales), the roofline counting GGUF's 34 bytes per 32 weights of each, spec == plain,
    `quantization` recorded."""
    from test_fp8 import bench_tiny

    from nextn.bench import offline as bench

    monkeypatch.setitem(bench.PRESETS, "tiny", hf.text_config("dense").to_dict())
    plain = bench.random_model("tiny", "cpu", "float32")
    q8 = bench.random_model("tiny", "cpu", "float32", quantization="q8_0")
    assert q8.model.layers[0].linear_attn.in_proj_qkv.weight.dtype == torch.int8
    quantized = [m.weight for n, m in q8.named_modules() if isinstance(m, QuantLinear) and n.startswith("model.")]
    saved = sum(w.numel() * (4 - 34 / 32) for w in quantized)  # float32 bytes against Q8_0's
    assert quantized and bench.weight_bytes_per_token(q8) == bench.weight_bytes_per_token(plain) - saved
    res = bench_tiny(tmp_path, "q8_0")
    assert res["quantization"] == "q8_0" and res["quantization_config"]["weight_block_size"] == [1, 32]
    assert res["spec_equals_plain"] == {"1": True}
