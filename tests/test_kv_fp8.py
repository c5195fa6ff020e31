"""The fp8 K/V cache (`kv_cache_dtype="fp8"`): the full-attention layers' K/V stored as e4m3 rows
with a float32 scale each, quantized where they are written and dequantized where they are read,
on the reference path and in the Triton step's kernels (the same bytes); speculation stays exact
(greedy spec == plain, K = 1..4) and a request's output does not depend on its neighbours; the
attention and the logits stay within what e4m3's 3 mantissa bits allow of the exact cache's.

Bounds: e4m3 keeps 3 mantissa bits, so rounding x / scale to nearest moves a value by at most half
an ulp, 2^-4 of it, or 2^-10 * scale among the subnormals (values below 2^-6 * scale).
"""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch
import triton_interp  # noqa: F401  (before triton)
from hf_fixtures import FIT_PROMPTS
from test_batching import CASES, _run, engine_output

import nextn
from nextn.cache import KV
from nextn.cli import main
from nextn.config import FULL, EngineConfig
from nextn.layers.attention import attend_step, read_kv, write_kv
from nextn.layers.rotary import RotaryEmbedding
from nextn.ops.fp8 import E4M3, dequantize_rows, quantize_rows

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
HALF_ULP, SUBNORMAL = 2.0**-4, 2.0**-10  # relative rounding error; absolute, in units of the scale


def _rows_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The most quantize_rows may move each value of x [..., D] (scales [...])."""
    return HALF_ULP * x.abs() + SUBNORMAL * scale[..., None]


def test_quantize_rows_round_trip():
    """Each row's scale is its amax / 448 (1 for a zero row), its largest value lands on 448, every
    value comes back within half an e4m3 ulp, and a row's bytes do not depend on the other rows."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, 64, generator=g) * torch.logspace(-4, 4, 6)[:, None, None]  # [S, H, D]
    x[2, 1] = 0.0
    x[4, 0, 5] = 1e-9  # a subnormal after scaling
    q, scale = quantize_rows(x)
    assert q.dtype == E4M3 and scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    amax = x.abs().amax(-1)
    assert torch.equal(scale, torch.where(amax > 0, amax / 448, torch.ones_like(amax)))
    assert scale[2, 1] == 1 and not q[2, 1].float().any()
    top = q.float().abs().amax(-1)
    assert torch.equal(top[amax > 0], torch.full_like(top[amax > 0], 448.0))
    err = (dequantize_rows(q, scale) - x).abs()
    assert (err <= _rows_bound(x, scale)).all() and err.max() > 0
    for s in range(x.shape[0]):  # alone, a row gives the same bytes
        q1, scale1 = quantize_rows(x[s, 1])
        assert _same(q1, q[s, 1]) and torch.equal(scale1, scale[s, 1])


def _cache(n: int, Hkv: int, D: int, g, fp8: bool) -> KV:
    """One slot's K/V with n random positions written (in fp8 through write_kv)."""
    k, v = torch.randn(2, n, Hkv, D, generator=g, device=DEVICE).unbind(0)
    key, value = torch.zeros(2, 64, Hkv, D, device=DEVICE, dtype=E4M3 if fp8 else torch.float32).unbind(0)
    kv = KV(key, value, *torch.zeros(2, 64, Hkv, device=DEVICE).unbind(0)) if fp8 else KV(key, value)
    write_kv(kv, 0, k, v)
    return kv


def test_attention_over_an_fp8_cache_is_within_the_rounding_bound():
    """The reference step's attention over an fp8 cache against the same over the exact values it
    was written from. Each key moves by e (|e| <= the rows' bound), so each score by at most
    eps_j = sum_d |q_d| |e_jd| / sqrt(D); softmax weights then change by a factor within e^(+-2 eps)
    (eps = max eps_j), so the output moves by at most max|v e4m3 error| + (e^(2 eps) - 1) max|v|."""
    g = torch.Generator(device=DEVICE).manual_seed(1)
    n, Hq, Hkv, D = 50, 4, 2, 32
    fp8, exact = _cache(n, Hkv, D, g, True), _cache(n, Hkv, D, torch.Generator(device=DEVICE).manual_seed(1), False)
    q = torch.randn(1, 3, Hq, D, generator=g, device=DEVICE)
    out, ref = attend_step(q, fp8, n - 3), attend_step(q, exact, n - 3)  # [1, 3, Hq, D]
    k, v = read_kv(exact, 0, n)
    k_err = _rows_bound(k, fp8.key_scale[:n]).repeat_interleave(Hq // Hkv, dim=1)  # [n, Hq, D]
    eps = torch.einsum("thd,nhd->thn", q[0].abs(), k_err).amax() / math.sqrt(D)
    v_err = _rows_bound(v, fp8.value_scale[:n]).amax(0).repeat_interleave(Hq // Hkv, dim=0)  # [Hq, D]
    v_max = v.abs().amax(0).repeat_interleave(Hq // Hkv, dim=0)
    bound = v_err + torch.expm1(2 * eps) * v_max + 1e-5 * v_max  # (and float32 rounding)
    err = (out - ref).abs()[0]  # [3, Hq, D]
    assert (err <= bound).all(), (err / bound).max()
    assert err.max() > 0  # the cache did hold e4m3


# ---------------------------------------------------------------------------------------------
# the Triton kernels (under the interpreter on the CPU) against the reference

HQ, HKV, D, CAP = 4, 2, 32, 48


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bitwise equal (e4m3 compared as bytes)."""
    return torch.equal(*(t.view(torch.uint8) if t.dtype == E4M3 else t for t in (x, y)))


def _kernel_case(T: int, start: int, dtype, seed: int):
    """Rows qkv [T, ...] of a sequence in slot 1 of a 2-slot fp8 cache whose positions < start hold
    earlier rows (written by write_kv), and the layer's weights (q / k norms, rope tables)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    qkv = torch.randn(T, HQ * 2 * D + 2 * HKV * D, generator=g, device=DEVICE).to(dtype)
    norms = [(0.1 * torch.randn(D, generator=g, device=DEVICE)).to(dtype) for _ in range(2)]
    cos, sin = RotaryEmbedding(D // 4, 10000.0).to(DEVICE).cos_sin(torch.arange(CAP, device=DEVICE), dtype)
    fp8 = torch.zeros(2, 2, CAP, HKV, D, device=DEVICE, dtype=E4M3)
    cache = KV(*fp8.unbind(0), *torch.zeros(2, 2, CAP, HKV, device=DEVICE).unbind(0))  # [S, CAP, ...]
    earlier = torch.randn(2, start, HKV, D, generator=g, device=DEVICE).to(dtype)
    write_kv(KV(*(t[1] for t in cache)), 0, *earlier)
    return qkv, cache, (*norms, cos, sin)


def _kernel_step(qkv: torch.Tensor, cache: KV, start: int, weights) -> tuple[torch.Tensor, torch.Tensor]:
    """qk_norm_rope then attend_step over rows qkv at positions start.. of slot 1: (q, gated output)."""
    from nextn.ops import triton_attention

    T = qkv.shape[0]
    row_slot = torch.ones(T, device=DEVICE, dtype=torch.int32)
    row_pos = torch.arange(start, start + T, device=DEVICE, dtype=torch.int32)
    kv, scales = cache[:2], dict(key_scale=cache.key_scale, value_scale=cache.value_scale)
    q = triton_attention.qk_norm_rope(qkv, *weights, row_slot, row_pos, *kv, HQ, 1e-6, **scales)
    return q, triton_attention.attend_step(q, qkv, *kv, row_slot, row_pos, chunk=16, **scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,start", [(1, 0), (3, 5), (4, 30)])
def test_kernels_on_an_fp8_cache_match_the_reference(T, start, dtype):
    """qk_norm_rope writes the bytes and scales quantize_rows makes of the k / v it writes into a
    cache of the model dtype; attend_step reads them as nextn.layers.attention.attend_step does."""
    pytest.importorskip("triton")
    qkv, cache, weights = _kernel_case(T, start, dtype, seed=T + start)
    plain = KV(*torch.zeros(2, 2, CAP, HKV, D, device=DEVICE, dtype=dtype).unbind(0))
    _kernel_step(qkv, plain, start, weights)  # the k / v the kernel computes, stored as they are
    ref = KV(*(t[1].clone() for t in cache))
    write_kv(ref, start, plain.key[1, start : start + T], plain.value[1, start : start + T])
    q, out = _kernel_step(qkv, cache, start, weights)
    assert all(_same(x[1], y) for x, y in zip(cache, ref, strict=True))
    assert not any(t[0].float().any() for t in cache)  # slot 0 untouched
    gate = qkv[:, : HQ * 2 * D].reshape(T, HQ, 2 * D)[..., D:].reshape(T, -1)
    expected = attend_step(q[None], ref, start)[0].reshape(T, -1) * torch.sigmoid(gate)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:  # a couple of bf16 ulps (the reference rounds the gate product at other points)
        assert (out.float() - expected.float()).abs().max() <= 4 * 2**-8 * max(1.0, expected.float().abs().max())


def test_kernel_rows_on_an_fp8_cache_do_not_depend_on_the_row_count():
    """bf16, rows crossing a chunk boundary: a verify's rows == one-row decodes, bitwise, and they
    write the same bytes."""
    pytest.importorskip("triton")
    T, start = 5, 14
    qkv, cache, weights = _kernel_case(T, start, torch.bfloat16, seed=3)
    solo = KV(*(t.clone() for t in cache))
    _, full = _kernel_step(qkv, cache, start, weights)
    for t in range(T):
        _, row = _kernel_step(qkv[t : t + 1], solo, start + t, weights)
        assert torch.equal(row[0], full[t]), t
    assert all(_same(x, y) for x, y in zip(solo, cache, strict=True))


# ---------------------------------------------------------------------------------------------
# the engine on tiny checkpoints


@functools.lru_cache(maxsize=6)
def _engine(ckpt, kernels: str = "torch", dtype: str = "float32", kv: str = "fp8", k: int = 4):
    size = dict(max_model_len=96, max_num_seqs=8)
    return nextn.LLM(
        ckpt, device=DEVICE, dtype=dtype, num_speculative_tokens=k, kernels=kernels, kv_cache_dtype=kv, **size
    ).engine


def _held_in_fp8(engine) -> bool:
    """The trunk's attention K/V are e4m3 with their scales; the head's draft K/V the model's dtype."""
    cache, cfg = engine.pool.cache, engine.model.cfg
    layers = [i for i, t in enumerate(cfg.layer_types) if t == FULL]
    kv = [cache.kv(i) for i in layers]
    return all(x.key.dtype == x.value.dtype == E4M3 and x.key_scale is not None for x in kv) and (
        cache.draft_kv().key.dtype == engine.runner.dtype
    )


@pytest.mark.parametrize("kernels,dtype", [("torch", "float32"), ("triton", "bfloat16")])
def test_verify_rows_equal_decode_steps_bitwise_under_fp8_kv(kernels, dtype, dense_ckpt):
    """A verify of 4 tokens committing 3 == 3 single-token decodes: logits, and the K/V bytes and
    scales they leave (a row is quantized alone, whatever else its step writes)."""
    if kernels == "triton":
        pytest.importorskip("triton")
    from test_step import _prefilled, _step

    engine = _engine(dense_ckpt, kernels, dtype)
    ids = [5, 77, 300, 12]
    a, b = _prefilled(engine, 0), _prefilled(engine, 1)
    verify_logits, _ = _step(engine, a, ids)
    a.commit(3)
    for t in range(3):
        logits, _ = _step(engine, b, ids[t : t + 1])
        b.commit(1)
        assert torch.equal(logits[0], verify_logits[t]), t
    n, layers = a.seq_len, [i for i, t in enumerate(engine.model.cfg.layer_types) if t == FULL]
    assert _held_in_fp8(engine)
    for i in layers:
        assert all(_same(x[:n], y[:n]) for x, y in zip(a.kv(i), b.kv(i), strict=True)), i


def _spec_equals_plain(engine, prompt, n: int, ks=(1, 2, 3, 4)) -> int:
    """Greedy output with K drafts per round (each of ks) == plain greedy output; the drafts
    accepted."""
    greedy = dict(temperature=0.0)
    plain = engine_output(engine, prompt, greedy, k=0, max_tokens=n, ignore_eos=True)
    accepted = engine.stats.num_accepted
    for k in ks:
        assert engine_output(engine, prompt, greedy, k=k, max_tokens=n, ignore_eos=True) == plain, k
    return engine.stats.num_accepted - accepted


@pytest.mark.parametrize("name,prompt", [("dense_fitted_ckpt", 1), ("moe_fitted_ckpt", 0), ("next_ckpt", 0)])
def test_greedy_spec_equals_plain_under_fp8_kv(name, prompt, request):
    """The reference path (float32): K = 1..4 emit plain greedy's tokens; the fitted heads get
    drafts accepted (several rows of a verify kept)."""
    engine = _engine(request.getfixturevalue(name))
    assert _held_in_fp8(engine)
    accepted = _spec_equals_plain(engine, list(FIT_PROMPTS[prompt]), 14)
    assert accepted > 0 or name == "next_ckpt"  # a random head guesses nothing


def test_triton_greedy_spec_equals_plain_under_fp8_kv(dense_fitted_ckpt):
    """The fused step in bf16 (the interpreter on CPU, about a minute): its kernels write and read
    the fp8 cache; K = 1 and 3 emit plain greedy's tokens (the reference path's test runs 1..4)."""
    pytest.importorskip("triton")
    engine = _engine(dense_fitted_ckpt, "triton", "bfloat16")
    assert _held_in_fp8(engine)
    assert _spec_equals_plain(engine, list(FIT_PROMPTS[1]), 8, ks=(1, 3)) > 0


def test_each_request_equals_itself_alone_under_fp8_kv(dense_fitted_ckpt):
    """test_batching's requests (greedy and seeded sampled, K = 0, 1, 3, arriving at different
    steps) over an fp8 cache: each one's output batched is its output alone."""
    engine = _engine(dense_fitted_ckpt, k=3)
    assert _held_in_fp8(engine)
    alone = {i: _run(engine, [(i, 0)])[i] for i in range(len(CASES))}
    engine.batch_sizes.clear()
    together = _run(engine, [(i, case[3]) for i, case in enumerate(CASES)])
    assert together == alone
    assert max(engine.batch_sizes) >= 6, engine.batch_sizes


def test_logits_with_fp8_kv_are_close_to_the_exact_cache(dense_ckpt):
    """float32, a prefill then a 3-row step: logits over an fp8 cache against those over the exact
    cache, within 2^-4 of the logits' scale. Every value the attention reads is within 2^-4 of its
    own (half an e4m3 ulp), and a softmax-weighted average of such values is too, up to the score
    perturbation (test_attention_over_an_fp8_cache_is_within_the_rounding_bound); the rest of the
    network (one attention layer of four here, behind residuals and norms) does not amplify it."""
    from test_step import _prefilled, _step

    outs = []
    for kv in ("auto", "fp8"):
        engine = _engine(dense_ckpt, kv=kv)
        outs.append(_step(engine, _prefilled(engine, 0), [5, 77, 300])[0])
    exact, fp8 = outs
    err = (fp8 - exact).abs().max()
    assert 0 < err <= HALF_ULP * exact.abs().max(), (err, exact.abs().max())


# ---------------------------------------------------------------------------------------------
# configuration, CLI and bench


def test_a_bad_kv_cache_dtype_is_an_error_naming_it(dense_ckpt, capsys):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig("m", kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .* 'int8'"):
        nextn.LLM(model=dense_ckpt, kv_cache_dtype="int8")
    with pytest.raises(SystemExit):
        main(["generate", str(dense_ckpt), "--prompt", "hi", "--kv-cache-dtype", "e5m2"])
    assert "--kv-cache-dtype: invalid choice: 'e5m2'" in capsys.readouterr().err


def test_bench_on_a_checkpoint_with_fp8_kv(dense_fitted_ckpt, tmp_path):
    """`nextn bench --kv-cache-dtype fp8` on CPU: spec == plain, `kv_cache_dtype` recorded."""
    out = tmp_path / "res.json"
    argv = ["bench", "--model", str(dense_fitted_ckpt), "--kv-cache-dtype", "fp8", "--spec-k", "1", "3"]
    assert main([*argv, "--prompt-len", "8", "--gen-len", "6", "--repeats", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["kv_cache_dtype"] == "fp8" and res["config"]["kv_cache_dtype"] == "fp8"
    assert res["spec_equals_plain"] == {"1": True, "3": True}
