"""FP8 weights: both published layouts load (the publisher's block-wise `quant_method: fp8` and
compressed-tensors FP8 per channel), `quantization="fp8"` quantizes a bf16 checkpoint at load
into the block layout, the reference path computes exactly what the dequantized model computes,
the skinny GEMM reads e4m3 with its scales and keeps rows invariant, speculative output equals
plain output, and what nextn does not load is an error that names it.

Checkpoints are written by tests/hf_fixtures.py's own quantizer from the session's tiny
checkpoints; "dequantized" is the float32 model an FP8 checkpoint stands for (each e4m3 value
times its scale). On CPU the Triton kernels run under Triton's interpreter (triton_interp.py).
"""

from __future__ import annotations

import functools
import json
import shutil

import hf_fixtures as hf
import pytest
import torch
import triton_interp  # noqa: F401  (before triton)
from test_step import PROMPT, _prefilled, _step  # a prompt, a prefilled slot, an uncommitted trunk step

import nextn
from nextn.bench import offline as bench
from nextn.cli import main
from nextn.config import EngineConfig
from nextn.config.model import ConfigError, QuantConfig
from nextn.layers.ffn import QuantExperts
from nextn.layers.linear import Linear, QuantLinear
from nextn.models.loader import CheckpointError, fuse_weights, load_model, quantize_model
from nextn.ops.fp8 import E4M3, QuantWeight, block_scale, channel_scale, compact_scales, dequantize, quantize_blocks
from nextn.ops.norm import rms_norm as rms_norm_reference

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory, request):
    """(source fixture, layout, quantize_mtp) -> that checkpoint in that FP8 layout (made once). A
    "fitted" source's head is fitted again to the FP8 trunk (hf_fixtures.fit_fp8_mtp_head): FP8
    changes the greedy continuations the bf16 fit memorised."""
    made = {}

    def make(src: str, layout: str, quantize_mtp: bool = False):
        key = (src, layout, quantize_mtp)
        if key not in made:
            out = tmp_path_factory.mktemp(f"{src}_{layout}")
            made[key] = hf.fp8_checkpoint(request.getfixturevalue(src), out, layout, quantize_mtp=quantize_mtp)
            if "fitted" in src:
                prompts = [list(p) for p in hf.FIT_PROMPTS]
                hf.fit_fp8_mtp_head(made[key], prompts, tmp_path_factory.mktemp("fit"), quantize_mtp=quantize_mtp)
        return made[key]

    return make


@pytest.fixture(scope="module")
def dequantized(tmp_path_factory):
    made = {}

    def make(ckpt):
        if ckpt not in made:
            made[ckpt] = hf.dequantized_checkpoint(ckpt, tmp_path_factory.mktemp("dequantized"))
        return made[ckpt]

    return make


def _fp8_weights(model) -> dict[str, torch.Tensor]:
    """Every FP8 weight of the model, dequantized to float32, by module weight name."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            out[f"{name}.weight"] = dequantize(m.weight, m.weight_scale, torch.float32)
        elif isinstance(m, QuantExperts):
            for p in ("gate_up_proj", "down_proj"):
                out[f"{name}.{p}"] = dequantize(getattr(m, p), getattr(m, f"{p}_scale"), torch.float32)
    return out


# ---------------------------------------------------------------------------------------------
# nextn's layout against the published ones


@pytest.mark.parametrize("values, k", [("int8", 256), ("e4m3", 256), ("e4m3", 250)])  # Q8_0 has whole blocks
def test_dequantize_is_each_value_times_its_scale(values, k):
    """dequantize (whole blocks: one pass widening in the multiply; partial: padded) gives each value
    times its column block's scale in float32, rounded to the dtype, for a stack of weights too."""
    g = torch.Generator().manual_seed(1)
    if values == "int8":
        w, block = torch.randint(-127, 128, (3, 40, k), generator=g, dtype=torch.int8), 32
        scale = (torch.rand(3, k // block, 40, generator=g) * 0.02).half()
    else:
        w, block = (torch.randn(3, 40, k, generator=g) * 20).to(E4M3), 128
        scale = torch.rand(3, -(-k // block), 40, generator=g)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        want = (w.float() * scale.float().transpose(-1, -2).repeat_interleave(block, -1)[..., :k]).to(dtype)
        got = dequantize(w, scale, dtype)
        assert got.dtype == dtype and torch.equal(got, want)
        assert torch.equal(dequantize(w[1], scale[1], dtype), want[1])


def test_block_and_channel_scales_dequantize_like_their_layouts():
    """Scales converted to nextn's layout dequantize to exactly what the publisher's formula gives
    (blocks of 32 rows x 128 columns here, partial at both edges), and nextn's block quantizer
    writes the bytes the fixtures' independent one writes."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(80, 300, generator=g) * torch.rand(80, 1, generator=g) * 3
    q, scale_inv = hf._fp8_block(w, (32, 128))
    expanded = scale_inv.repeat_interleave(32, 0).repeat_interleave(128, 1)[:80, :300]
    assert torch.equal(dequantize(q, block_scale(scale_inv, 80, 32), torch.float32), q.float() * expanded)
    ours_q, ours_scale = quantize_blocks(w, 32)
    assert torch.equal(ours_q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(ours_scale, scale_inv)
    # e4m3 keeps 3 mantissa bits: within half an ulp (2^-4 relative), or half the smallest subnormal
    err = (dequantize(q, block_scale(scale_inv, 80, 32), torch.float32) - w).abs()
    assert (err <= 2**-4 * w.abs() + 2**-10 * expanded).all()
    q, scale = hf._fp8_channel(w)
    assert torch.equal(dequantize(q, channel_scale(scale, 80, 300), torch.float32), q.float() * scale.float())


# ---------------------------------------------------------------------------------------------
# the skinny GEMM over e4m3


def _fp8_case(M, N, K, dtype, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w, w2 = (torch.randn(N, K, generator=g, device=DEVICE) * K**-0.5 for _ in range(2))
    fp8 = [QuantWeight(q, block_scale(s, N, 128)) for q, s in (quantize_blocks(w), quantize_blocks(w2))]
    x = torch.randn(M, K, generator=g, device=DEVICE).to(dtype)
    res = torch.randn(M, N, generator=g, device=DEVICE).to(dtype)
    return x, fp8[0], fp8[1], res


def _fp8_variants(x, w8, w28, res):
    """skinny_linear's kwargs and the reference (the weights dequantized, then F.linear) per fusion."""
    F = torch.nn.functional
    w, w2 = (dequantize(p.weight, p.scale, x.dtype) for p in (w8, w28))
    return {
        "plain": (dict(), F.linear(x, w)),
        "residual": (dict(residual=res), res + F.linear(x, w)),
        "silu_mul": (dict(up_weight=w28), F.silu(F.linear(x, w)) * F.linear(x, w2)),
    }


def _close(out, ref, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:  # the reference rounds each dequantized weight to bf16, the kernel scales exact products
        err = (out.float() - ref.float()).abs().max().item()
        assert err <= 4 * 2**-8 * max(1.0, ref.float().abs().max().item()), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K", [(3, 40, 64), (2, 48, 256), (5, 24, 200)])
def test_fp8_skinny_linear_matches_dequantized_reference(M, N, K, dtype):
    """K = 256: two scale blocks per row; K = 200: a partial second block (masked k-tail)."""
    from nextn.ops.triton_linear import skinny_linear

    args = _fp8_case(M, N, K, dtype, seed=M * 100 + K)
    for name, (kw, ref) in _fp8_variants(*args).items():
        out = skinny_linear(args[0], args[1], **kw)
        assert out.dtype == dtype, name
        _close(out, ref, dtype)


@pytest.mark.parametrize("split", [1, 2])
def test_fp8_skinny_linear_rows_do_not_depend_on_the_batch(split):
    """A row of 37 (three 16-row tiles) equals that row alone, bitwise, in every fusion; split-K too."""
    from nextn.ops.triton_linear import skinny_linear

    x, w8, w28, res = _fp8_case(37, 40, 256, torch.bfloat16, seed=split)
    config = None if split == 1 else (16, 64, 4, 2, split)
    for name, (kw, _) in _fp8_variants(x, w8, w28, res).items():
        full = skinny_linear(x, w8, config=config, **kw)
        for m in (0, 5, 17, 36):
            one = {k: (v[m : m + 1] if k == "residual" else v) for k, v in kw.items()}
            assert torch.equal(skinny_linear(x[m : m + 1], w8, config=config, **one)[0], full[m]), (name, m)
    with pytest.raises(ValueError, match="both be FP8"):
        skinny_linear(x, w8, up_weight=dequantize(w28.weight, w28.scale, x.dtype))


def test_fp8_compact_scales_compute_the_same_bits():
    """One scale per 128 rows (what the step reads for 128-row blocks) gives the per-row layout's
    results bitwise, in every fusion; per-channel scales do not compact."""
    from nextn.ops.triton_linear import skinny_linear

    x, w8, w28, res = _fp8_case(5, 256, 200, torch.bfloat16, seed=3)
    compact, compact2 = compact_scales(w8), compact_scales(w28)
    assert compact.rows == 128 and compact.scale.shape == (2, 2)
    for name, (kw, _) in _fp8_variants(x, w8, w28, res).items():
        kw_compact = dict(kw, up_weight=compact2) if "up_weight" in kw else kw
        assert torch.equal(skinny_linear(x, compact, **kw_compact), skinny_linear(x, w8, **kw)), name
    q, scale = hf._fp8_channel(torch.randn(256, 64))
    assert compact_scales(QuantWeight(q, channel_scale(scale, 256, 64))).rows == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "config", [(128, 128, 4, 2, 1), (64, 64, 4, 2, 2), (128, 128, 4, 2, 1, 2), (64, 64, 4, 2, 2, 2)]
)
def test_fp8_chained_blocks_match_the_reference_and_keep_rows_invariant(config, dtype):
    """One scale per 128x128 block and BLOCK_N dividing 128: the block's scale goes onto x's tile and
    the dots chain (weights as the dot's M, or x-major: way 2). Every fusion matches the dequantized
    reference, e4m3 subnormals and zeros included, and a row of 21 equals that row alone, bitwise."""
    from nextn.ops.triton_linear import skinny_linear

    x, w8, w28, res = _fp8_case(21, 256, 256, dtype, seed=config[0] + config[4])
    tiny = torch.tensor([0.0, 2.0**-9, -(2.0**-7), 2.0**-6, 448.0, -448.0]).to(torch.float8_e4m3fn)
    w8 = QuantWeight(
        torch.cat([tiny.to(DEVICE).repeat(256 * 256 // 6 + 1)[: 256 * 128].view(256, 128), w8.weight[:, 128:]], 1),
        w8.scale,
    )
    compact, compact2 = compact_scales(w8), compact_scales(w28)
    assert compact.rows == 128
    per_tile = skinny_linear(x, w8, config=config, out_dtype=torch.float32)  # per-row scales: not chained
    assert not torch.equal(skinny_linear(x, compact, config=config, out_dtype=torch.float32), per_tile)
    for name, (kw, ref) in _fp8_variants(x, w8, w28, res).items():
        kw = dict(kw, up_weight=compact2) if "up_weight" in kw else kw
        full = skinny_linear(x, compact, config=config, **kw)
        _close(full, ref, dtype)
        for m in (0, 17, 20):
            one = {k: (v[m : m + 1] if k == "residual" else v) for k, v in kw.items()}
            assert torch.equal(skinny_linear(x[m : m + 1], compact, config=config, **one)[0], full[m]), (name, m)


@pytest.mark.parametrize("way", [0, 2])
@pytest.mark.parametrize("split", [1, 2])
def test_fp8_chained_blocks_read_a_norm_input(split, way):
    """The chained dots reading a norm's input (skinny_linear's `rms`) scale x's tiles by each row's
    rstd with the block scale, so rows whose values before the norm are far past fp16's range match
    the norm then the dequantized GEMM, in every fusion; rows invariant."""
    from nextn.ops.triton_linear import skinny_linear
    from nextn.ops.triton_norm import NormInput, norm_input

    x, w8, w28, res = _fp8_case(5, 256, 256, torch.bfloat16, seed=13)
    x = x * 3e5  # the residual stream's scale is the norm's to remove: x * scale alone passes fp16's range
    g = torch.Generator(device=DEVICE).manual_seed(14)  # (unseeded, it followed the tests run before it)
    nw = (torch.randn(256, generator=g, device=DEVICE) * 0.3).to(torch.bfloat16)
    h = rms_norm_reference(x, nw, 1e-6)
    compact, compact2 = compact_scales(w8), compact_scales(w28)
    config = (64, 128, 4, 2, split, way)
    ni = norm_input(x, nw)
    for kw, ref in _fp8_variants(h, w8, w28, res).values():
        kw = dict(kw, up_weight=compact2) if "up_weight" in kw else kw
        out = skinny_linear(None, compact, rms=ni, eps=1e-6, config=config, **kw)
        _close(out, ref, torch.bfloat16)
        for m in (0, 4):
            one = {k: (v[m : m + 1] if k == "residual" else v) for k, v in kw.items()}
            row = NormInput(ni.x[m : m + 1], ni.ss[:, m : m + 1].contiguous())
            assert torch.equal(skinny_linear(None, compact, rms=row, eps=1e-6, config=config, **one)[0], out[m])


@pytest.mark.parametrize("way", [0, 2])
@pytest.mark.parametrize("split", [1, 2])
def test_fp8_chained_rows_past_fp16_range_are_computed_again(split, way):
    """A row whose scaled values pass fp16's range (the chained dots' operands) is computed again tile
    by tile: finite and the reference's, in every fusion; the other rows keep the chained bits."""
    from nextn.ops.triton_linear import skinny_linear

    x, w8, w28, res = _fp8_case(5, 256, 256, torch.bfloat16, seed=11)
    x[2] = x[2] * 3e5  # past 65504 times the largest block scale (in [1, 2) after the shift)
    x[4, 7] = 1e6
    compact, compact2 = compact_scales(w8), compact_scales(w28)
    config = (64, 128, 4, 2, split, way)
    for name, (kw, ref) in _fp8_variants(x, w8, w28, res).items():
        kw = dict(kw, up_weight=compact2) if "up_weight" in kw else kw
        out = skinny_linear(x, compact, config=config, **kw)
        assert torch.isfinite(out).all(), name
        for m in range(5):
            torch.testing.assert_close(out[m].float(), ref[m].float(), rtol=2e-2, atol=2e-2 * ref[m].abs().max().item())
            one = {k: (v[m : m + 1] if k == "residual" else v) for k, v in kw.items()}
            assert torch.equal(skinny_linear(x[m : m + 1], compact, config=config, **one)[0], out[m]), (name, m)
    calm = skinny_linear(x[[0, 1, 3]], compact, config=config)
    assert torch.equal(skinny_linear(x, compact, config=config)[[0, 1, 3]], calm)


def test_skinny_linear_config_ways_name_the_weights_they_take():
    """A config's sixth field picks how the tiles are read: TMA descriptors take bf16 weights, the
    x-major chained dots FP8 ones; the wrong kind, or an unknown way, is an error naming the way."""
    from nextn.ops.triton_linear import skinny_linear

    x, w8, _, _ = _fp8_case(2, 128, 256, torch.bfloat16, seed=3)
    bf16 = dequantize(w8.weight, w8.scale, torch.bfloat16)
    for weight, way in ((bf16, 2), (compact_scales(w8), 1), (compact_scales(w8), 3), (bf16, 4)):
        with pytest.raises(ValueError, match=f"config way {way}"):
            skinny_linear(x, weight, config=(64, 128, 4, 2, 1, way))


@pytest.mark.parametrize("magnitude", [1e-7, 1e5])
def test_fp8_chained_blocks_shift_the_scales_into_fp16_range(magnitude):
    """compact_scales puts a weight's largest block scale in [1, 2) with a power of two, so weights far
    from 1 in magnitude keep x * scale inside fp16's normal range: tiny ones keep their precision."""
    from nextn.ops.triton_linear import skinny_linear

    x, w8, _, _ = _fp8_case(3, 128, 256, torch.bfloat16, seed=5)
    w = QuantWeight(w8.weight, w8.scale * magnitude)
    compact = compact_scales(w)
    assert 1 <= compact.scale.max().item() * 2.0**compact.exponent < 2
    ref = x.float() @ dequantize(w.weight, w.scale, torch.float32).T
    out = skinny_linear(x, compact, config=(64, 128, 4, 2, 1), out_dtype=torch.float32)
    assert (out - ref).abs().max().item() <= 2**-9 * ref.abs().max().item()


@pytest.mark.parametrize("way", [0, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_chained_blocks_are_exact_on_every_e4m3_value(dtype, way):
    """Every finite e4m3 value (subnormals and zeros included) read by one-hot rows with a power-of-two
    block scale: the chained path gives value * scale exactly (no flush of the moved subnormals)."""
    from nextn.ops.triton_linear import skinny_linear

    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)  # all but e4m3fn's two NaNs
    cols = torch.arange(16, device=DEVICE) * 16 + 3  # the columns the one-hot rows read
    q = torch.randint(0, 0x7F, (128, 256), dtype=torch.uint8)
    q[:, cols.cpu()] = codes.repeat(9)[: 128 * 16].view(128, 16)
    q = q.view(torch.float8_e4m3fn).to(DEVICE)
    w = QuantWeight(q, torch.full((2, 1), 2.0**-3, device=DEVICE), 128)
    x = torch.zeros(16, 256, device=DEVICE, dtype=dtype)
    x[torch.arange(16, device=DEVICE), cols] = 1.0
    out = skinny_linear(x, w, config=(64, 128, 4, 2, 1, way), out_dtype=torch.float32)
    assert torch.equal(out, (q.float() * 2.0**-3)[:, cols].T)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize(
    "N,K,kind",
    [
        (12288, 4096, "plain"),
        (10240, 4096, "plain"),
        (12288, 4096, "silu_mul"),
        (4096, 4096, "residual"),
        (4096, 12288, "residual"),
    ],
)
@pytest.mark.parametrize("config", [None, (128, 128, 4, 4, 2, 2), (64, 128, 4, 4, 1, 2)])
def test_fp8_skinny_linear_9b_shapes_gpu(N, K, kind, config):
    """Qwen3.5-9B's FP8 projections (GDN qkv|z, attention q|k|v, gate|up, o/out, down) with the scales
    the step reads (one per 128x128 block), compiled (the picked config, and x-major ones): the
    reference, and 9 rows == each row alone."""
    from nextn.ops.triton_linear import skinny_linear

    x, w8, w28, res = _fp8_case(9, N, K, torch.bfloat16, seed=N + K)
    kw, ref = _fp8_variants(x, w8, w28, res)[kind]
    w8 = compact_scales(w8)
    kw = dict(kw, up_weight=compact_scales(w28)) if "up_weight" in kw else kw
    assert w8.rows == 128
    out = skinny_linear(x, w8, config=config, **kw)
    _close(out, ref, torch.bfloat16)
    for m in (0, 3, 8):
        one = {k: (v[m : m + 1] if k == "residual" else v) for k, v in kw.items()}
        assert torch.equal(skinny_linear(x[m : m + 1], w8, config=config, **one)[0], out[m]), m


# ---------------------------------------------------------------------------------------------
# loading


CASES = [
    ("dense_fitted_ckpt", "block", True),
    ("dense_fitted_ckpt", "channel", False),
    ("moe_ckpt", "block", False),
    ("moe_ckpt", "channel", False),
    ("next_ckpt", "block", True),
]


@pytest.mark.parametrize("src,layout,quantize_mtp", CASES)
def test_fp8_checkpoints_load(src, layout, quantize_mtp, fp8_ckpt, dequantized):
    """The checkpoint's e4m3 weights load as FP8 modules whose dequantized weights are exactly the
    dequantized checkpoint's (experts packed, Qwen3-Next rows regrouped, scales converted); what
    it keeps unquantized stays in the model's dtype, equal too."""
    ckpt = fp8_ckpt(src, layout, quantize_mtp)
    model, ref = load_model(ckpt), load_model(dequantized(ckpt))
    assert model.cfg.quantization.method == {"block": "fp8", "channel": "compressed-tensors"}[layout]
    fp8 = _fp8_weights(model)
    ref_state = ref.state_dict()
    for name, w in fp8.items():
        assert torch.equal(w, ref_state[name]), name
    kept = {k: v for k, v in model.state_dict().items() if k not in fp8 and not k.endswith("_scale")}
    assert kept.keys() == ref_state.keys() - fp8.keys()
    for name, t in kept.items():
        assert t.dtype == torch.float32 and torch.equal(t, ref_state[name]), name
    layer0 = model.model.layers[0]
    assert isinstance(
        layer0.mlp.experts if src != "dense_fitted_ckpt" else layer0.mlp.gate_proj, QuantLinear | QuantExperts
    )
    gdn = layer0.linear_attn
    assert isinstance(gdn.in_proj_qkvz if src == "next_ckpt" else gdn.in_proj_qkv, QuantLinear)
    assert type(gdn.in_proj_ba if src == "next_ckpt" else gdn.in_proj_a) is Linear
    assert isinstance(model.mtp.fc, QuantLinear) == quantize_mtp and type(model.lm_head_weight) is torch.nn.Parameter
    assert model.lm_head_weight.dtype == torch.float32


def _llm(ckpt, kernels="torch", dtype="float32", k=0, **kw):
    return nextn.LLM(
        model=ckpt, device=DEVICE, dtype=dtype, kernels=kernels, num_speculative_tokens=k, max_model_len=64, **kw
    )


def _greedy(llm, prompt=PROMPT, n=12):
    params = nextn.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return llm.generate(prompt_token_ids=list(prompt), params=params)


@pytest.mark.parametrize(
    "src,layout,quantize_mtp",
    [("dense_fitted_ckpt", "block", True), ("moe_ckpt", "channel", False), ("next_ckpt", "block", True)],
)
def test_greedy_equals_the_dequantized_model(src, layout, quantize_mtp, fp8_ckpt, dequantized):
    """The reference path dequantizes: logits bitwise the float32 dequantized model's, greedy too."""
    ckpt = fp8_ckpt(src, layout, quantize_mtp)
    fp8, ref = _llm(ckpt), _llm(dequantized(ckpt))
    ids = torch.tensor([PROMPT], device=DEVICE)
    with torch.no_grad():
        logits = [m.logits(m.final_norm(m(ids))) for m in (fp8.model, ref.model)]
    assert torch.equal(*logits)
    assert _greedy(fp8).token_ids == _greedy(ref).token_ids


@pytest.mark.parametrize(
    "src,layout,quantize_mtp",
    [("dense_fitted_ckpt", "block", True), ("dense_fitted_ckpt", "channel", False), ("moe_fitted_ckpt", "block", True)],
)
def test_greedy_spec_equals_plain_under_fp8(src, layout, quantize_mtp, fp8_ckpt):
    """Reference path: K = 3 drafts (an FP8 or bf16 head) verified by the FP8 trunk emit plain greedy's
    tokens; the fitted heads still get drafts accepted."""
    ckpt = fp8_ckpt(src, layout, quantize_mtp)
    plain = _greedy(_llm(ckpt, k=0), hf.FIT_PROMPTS[1])
    spec = _greedy(_llm(ckpt, k=3), hf.FIT_PROMPTS[1])
    assert spec.token_ids == plain.token_ids
    assert spec.spec.num_drafted > 0 and spec.spec.num_accepted > 0


@pytest.mark.parametrize("src", ["dense_ckpt", "moe_ckpt"])
def test_quantization_fp8_at_load_is_the_block_layout(src, fp8_ckpt, request):
    """quantization="fp8" on a bf16 checkpoint gives, bit for bit, the model of its 128x128 block
    checkpoint (what the published FP8 checkpoints quantize: not lm_head, embeddings, norms, GDN
    a/b, routers, shared-expert gates; mtp.* kept); quantize_model (the bench's random weights)
    gives the same. An FP8 checkpoint loads as it is with or without the flag."""
    at_load = load_model(request.getfixturevalue(src), quantization="fp8")
    assert at_load.cfg.quantization == QuantConfig("fp8", (128, 128), at_load=True)
    published = load_model(fp8_ckpt(src, "block")).state_dict()
    in_memory = fuse_weights(quantize_model(load_model(request.getfixturevalue(src)))).state_dict()
    state = at_load.state_dict()
    assert state.keys() == published.keys() == in_memory.keys()
    assert any(t.dtype == torch.float8_e4m3fn for t in state.values())
    for name, t in state.items():
        for other in (published, in_memory):
            assert t.dtype == other[name].dtype and torch.equal(t.view(torch.uint8), other[name].view(torch.uint8)), (
                name
            )
    channel = load_model(fp8_ckpt(src, "channel"), quantization="fp8")
    assert channel.cfg.quantization.method == "compressed-tensors"


# ---------------------------------------------------------------------------------------------
# what nextn does not load


@pytest.mark.parametrize(
    "config,match",
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "'gptq'"),
        ({"quant_method": "awq", "bits": 4}, "'awq'"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
        ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "static"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "e5m2"),
        ({"quant_method": "fp8", "weight_block_size": [64, 64]}, r"\[64, 64\]"),
        ({"quant_method": "fp8"}, "weight_block_size"),
    ],
)
def test_unsupported_quantization_is_an_error_naming_it(config, match, dense_ckpt, tmp_path):
    ckpt = tmp_path / "q"
    shutil.copytree(dense_ckpt, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(dict(cfg, quantization_config=config)))
    with pytest.raises(ConfigError, match=match):
        load_model(ckpt)


def test_unsupported_compressed_tensors_schemes_are_named():
    base = hf._fp8_config("channel", (128, 128))
    assert QuantConfig.from_hf(base) == QuantConfig("compressed-tensors")
    group = base["config_groups"]["group_0"]
    int4 = dict(group, weights=dict(group["weights"], num_bits=4, type="int"))
    static = dict(group, input_activations=dict(group["input_activations"], dynamic=False))
    for groups, match in ((int4, "4-bit int"), (static, "static input activation")):
        with pytest.raises(ConfigError, match=match):
            QuantConfig.from_hf(dict(base, config_groups={"group_0": groups}))
    with pytest.raises(ConfigError, match="pack-quantized"):
        QuantConfig.from_hf(dict(base, format="pack-quantized"))


def test_unsupported_quantization_flag_is_named(dense_ckpt):
    with pytest.raises(ValueError, match="'awq'"):
        load_model(dense_ckpt, quantization="awq")
    with pytest.raises(ValueError, match="'gptq'"):
        nextn.LLM(model=dense_ckpt, device="cpu", quantization="gptq")
    with pytest.raises(ValueError, match="'int8'"):
        EngineConfig("m", quantization="int8")
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "x", "--quantization", "awq"])


def _rewrite(src, dst, edit):
    """A copy of checkpoint src with its tensors edited (edit(tensors) in place)."""
    shutil.copytree(src, dst)
    tensors = hf.read_tensors(dst)
    edit(tensors)
    hf.write_tensors(tensors, dst, None)
    return dst


def test_missing_or_misshaped_scales_are_errors_naming_them(fp8_ckpt, tmp_path):
    ckpt = fp8_ckpt("dense_fitted_ckpt", "block", True)
    key = "model.layers.0.linear_attn.in_proj_qkv.weight_scale_inv"
    missing = _rewrite(ckpt, tmp_path / "missing", lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=f"missing tensor {key}"):
        load_model(missing)
    shape = lambda t: t.update({key: torch.ones(3, 1)})  # noqa: E731
    with pytest.raises(CheckpointError, match=rf"{key} has shape \[3, 1\], expected \[1, 1\]"):
        load_model(_rewrite(ckpt, tmp_path / "shape", shape))
    orphan = lambda t: t.update({"model.layers.0.input_layernorm.weight_scale_inv": torch.ones(1, 1)})  # noqa: E731
    with pytest.raises(CheckpointError, match="is BF16|is F32"):
        load_model(_rewrite(ckpt, tmp_path / "orphan", orphan))
    head = fp8_ckpt("moe_ckpt", "block")  # an untied lm_head

    def lm_head(t):
        t["lm_head.weight"], t["lm_head.weight_scale_inv"] = hf._fp8_block(t["lm_head.weight"], (128, 128))

    with pytest.raises(CheckpointError, match="quantizes lm_head"):
        load_model(_rewrite(head, tmp_path / "head", lm_head))
    no_config = tmp_path / "no_config"
    shutil.copytree(ckpt, no_config)
    cfg = json.loads((no_config / "config.json").read_text())
    cfg.pop("quantization_config")
    (no_config / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="no quantization_config"):
        load_model(no_config)


# ---------------------------------------------------------------------------------------------
# the fused Triton step over FP8 weights


@functools.lru_cache(maxsize=4)
def _engine(ckpt, dtype, kernels="triton", k=3):
    return _llm(ckpt, kernels=kernels, dtype=dtype, k=k, max_num_seqs=2).engine


def test_triton_step_reads_fp8_and_matches_the_reference_step(fp8_ckpt):
    ckpt = fp8_ckpt("dense_fitted_ckpt", "block", True)
    ref, fast = _engine(ckpt, "float32", "torch"), _engine(ckpt, "float32")
    gdn = fast.runner.step.layers[0]
    assert [type(p) for p in gdn.in_proj] == [QuantWeight, torch.Tensor]  # FP8 qkv | z, bf16 b | a
    assert isinstance(gdn.out_proj, QuantWeight) and isinstance(fast.runner.step.head_weights[2], QuantWeight)
    assert gdn.mlp.gate.rows == 128 and gdn.in_proj[0].rows == 1  # 128-row blocks compact, 192 rows do not
    outs = [_step(e, _prefilled(e, 0), [5, 77, 300]) for e in (ref, fast)]
    for x, y in zip(*outs, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


def test_triton_step_fp8_verify_rows_equal_decode_rows_bitwise(fp8_ckpt):
    """bf16: a verify of 4 tokens committing 3 == 3 single-token decodes (logits and hiddens)."""
    verify_rows_equal_decode_rows(_engine(fp8_ckpt("dense_fitted_ckpt", "block", True), "bfloat16"))


def verify_rows_equal_decode_rows(engine) -> None:
    """A verify of 4 tokens committing 3 == 3 single-token decodes, bitwise (logits and hiddens)."""
    ids = [5, 77, 300, 12]
    a, b = _prefilled(engine, 0), _prefilled(engine, 1)
    verify_logits, verify_hidden = _step(engine, a, ids)
    a.commit(3)
    for t in range(3):
        logits, hidden = _step(engine, b, ids[t : t + 1])
        b.commit(1)
        assert torch.equal(logits[0], verify_logits[t]) and torch.equal(hidden[0], verify_hidden[t]), t


def test_triton_greedy_spec_equals_plain_under_fp8_bf16(fp8_ckpt):
    """The fused step in bf16 with an FP8 trunk and head: K = 3 emits plain greedy's tokens."""
    ckpt = fp8_ckpt("dense_fitted_ckpt", "block", True)
    plain = _greedy(_llm(ckpt, "triton", "bfloat16", k=0), hf.FIT_PROMPTS[1], n=8)
    spec = _greedy(_llm(ckpt, "triton", "bfloat16", k=3), hf.FIT_PROMPTS[1], n=8)
    assert spec.token_ids == plain.token_ids and spec.spec.num_accepted > 0  # a partial accept among them


def _same_sums(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    """Equal up to a reordered float32 sum: float32 outputs to 1e-5, bf16 ones to a couple of ulps."""
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    return a.shape == b.shape and bool(((a.float() - b.float()).abs() <= tol * (1 + b.float().abs())).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_moe_step_computes_its_dequantized_weights(dtype):
    """The MoE decode kernels over FP8 experts and shared expert dequantize each tile as the
    reference's `dequantize` does: the block equals the same kernels on the dequantized copies (H
    and I with partial 128-column blocks, I over two of them). Bit for bit on the interpreter; on a
    GPU Triton lays a loaded tile out by its element size (e4m3 against the copies' dtype), so the
    in-tile sums may add in another order: there the outputs agree to the sums' rounding."""
    from nextn.ops.fp8 import quantize
    from nextn.ops.triton_moe import moe_step

    g = torch.Generator(device=DEVICE).manual_seed(9)
    E, k, H, I, Is, T = 4, 2, 200, 136, 72, 2

    def weight(*shape):  # e4m3 in nextn's layout (a scale per row and 128 columns), and its dequantized copy
        w = torch.randn(*shape, generator=g, device=DEVICE) * shape[-1] ** -0.5
        parts = [quantize(m) for m in w.reshape(-1, *shape[-2:])]
        scale = torch.stack([p.scale for p in parts]).view(*shape[:-2], *parts[0].scale.shape)
        q = QuantWeight(torch.stack([p.weight for p in parts]).view(*shape), scale)
        return q, dequantize(q.weight, q.scale, dtype).contiguous()  # (a partial block's slice is a view)

    (gu8, gu), (dn8, dn) = weight(E, 2 * I, H), weight(E, H, I)
    (sg8, sg), (su8, su), (sd8, sd) = weight(Is, H), weight(Is, H), weight(H, Is)
    gates = (torch.randn(E + 1, H, generator=g, device=DEVICE) * H**-0.5).to(dtype)
    x, norm = torch.randn(T, H, generator=g, device=DEVICE).to(dtype), torch.zeros(H, device=DEVICE, dtype=dtype)
    same = torch.equal if not CUDA else functools.partial(_same_sums, dtype=dtype)

    def run(*ws, residual=True):
        return moe_step(x, norm, 1e-6, gates, *ws, k, True, residual=residual)

    for residual in (True, False):
        out = run(gu8, dn8, sg8, su8, sd8, residual=residual)
        assert same(out, run(gu, dn, sg, su, sd, residual=residual))
    mixed = run(gu8, dn8, sg, su, sd)  # FP8 experts, bf16 shared expert
    assert same(mixed, run(gu, dn, sg, su, sd))
    with pytest.raises(ValueError, match="all be FP8 or none"):
        run(gu8, dn, sg, su, sd)
    with pytest.raises(ValueError, match="contiguous"):
        run(gu, dn, sg, su, sd.T.contiguous().T)


def test_triton_step_runs_fp8_moe_like_the_reference_step(fp8_ckpt):
    """An FP8 MoE checkpoint (experts, shared expert) on the fused step: the reference step's logits
    and hiddens. (Its rows are invariant by construction: the MoE kernels give each row its own
    programs; test_kernels checks that for the bf16 block.)"""
    ckpt = fp8_ckpt("moe_ckpt", "block")
    ref, fast = _engine(ckpt, "float32", "torch"), _engine(ckpt, "float32")
    moe = next(w.mlp for w in fast.runner.step.layers if hasattr(w.mlp, "gate_up"))
    assert isinstance(moe.gate_up, QuantWeight) and isinstance(moe.shared_down, QuantWeight)
    outs = [_step(e, _prefilled(e, 0), [5, 77, 300]) for e in (ref, fast)]
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# bench


def test_bench_random_preset_quantized_at_load(monkeypatch, tmp_path):
    """`nextn bench --random-weights P --quantization fp8`: the random bf16 weights quantized into
    the block layout, fewer weight bytes per token, spec == plain, `quantization` recorded."""
    monkeypatch.setitem(bench.PRESETS, "tiny", hf.text_config("dense").to_dict())
    plain, fp8 = (
        bench.random_model("tiny", "cpu", "float32"),
        bench.random_model("tiny", "cpu", "float32", quantization="fp8"),
    )
    assert isinstance(fp8.model.layers[0].linear_attn.in_proj_qkv, QuantLinear)
    assert bench.weight_bytes_per_token(fp8) < 0.5 * bench.weight_bytes_per_token(plain)
    res = bench_tiny(tmp_path, "fp8")
    assert res["quantization"] == "fp8" and res["quantization_config"]["weight_block_size"] == [128, 128]
    assert res["spec_equals_plain"] == {"1": True}


def bench_tiny(tmp_path, quantization: str) -> dict:
    """`nextn bench --random-weights tiny --quantization Q` at K = 1, a few tokens: its JSON report."""
    out = tmp_path / "res.json"
    argv = ["bench", "--random-weights", "tiny", "--quantization", quantization, "--spec-k", "1", "--prompt-len", "8"]
    assert main([*argv, "--gen-len", "6", "--repeats", "1", "--json", str(out)]) == 0
    return json.loads(out.read_text())
