"""Triton kernels against their PyTorch references, and the row invariance exactness rests on.

On a CPU machine the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here before
triton is imported) on tiny shapes; on a GPU the `gpu` tests run them compiled, in bf16, at the
Qwen3.5-9B shapes. Tolerances: float32 kernels differ from the references only in summation
order (~1e-6 relative); bf16 outputs by at most a couple of bf16 ulps where the reference rounds
intermediate values at different points.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton_interp  # noqa: F401  (before triton: the CPU interpreter, with GPU rounding)
from bit_patterns import bits as _bits

triton = pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from nextn.layers.attention import attend  # noqa: E402
from nextn.layers.gdn import l2norm  # noqa: E402
from nextn.layers.norm import RMSNorm, RMSNormGated  # noqa: E402
from nextn.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402
from nextn.ops import triton_utils  # noqa: E402
from nextn.ops.attention import prefill_attention  # noqa: E402
from nextn.ops.conv import causal_conv1d  # noqa: E402
from nextn.ops.gdn import chunk_gated_delta_rule, recurrent_gated_delta_rule  # noqa: E402
from nextn.ops.moe import routed_experts  # noqa: E402
from nextn.ops.norm import rms_norm as reference_rms_norm  # noqa: E402
from nextn.ops.triton_attention import attend_step, qk_norm_rope  # noqa: E402
from nextn.ops.triton_attention import prefill_attention as fused_prefill_attention  # noqa: E402
from nextn.ops.triton_gdn import gdn_step  # noqa: E402
from nextn.ops.triton_gdn_chunk import chunk_gated_delta_rule as triton_chunk_rule  # noqa: E402
from nextn.ops.triton_gdn_chunk import launch_constexprs as chunk_launch_constexprs  # noqa: E402
from nextn.ops.triton_linear import skinny_linear  # noqa: E402
from nextn.ops.triton_moe import bf16_rounded  # noqa: E402
from nextn.ops.triton_moe_grouped import grouped_experts  # noqa: E402
from nextn.ops.triton_norm import norm_input, rms_norm, rms_norm_rows  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def gpu(fn):
    """Real-shape bf16 tests: marked `gpu` (select with -m gpu), skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason="needs a CUDA device")(fn))


@triton.jit
def _bf16_rounded_kernel(x_ptr, y_ptr, BLOCK: triton.language.constexpr):
    offs = triton.language.program_id(0) * BLOCK + triton.language.arange(0, BLOCK)
    triton.language.store(y_ptr + offs, bf16_rounded(triton.language.load(x_ptr + offs)))


def _rand(*shape, dtype=torch.float32, scale=1.0, seed=None, gen=None):
    return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)


def _close(out, ref, dtype):
    ref = ref.to(out.dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:  # a couple of bf16 ulps at the values' scale
        err = (out.float() - ref.float()).abs().max().item()
        assert err <= 4 * 2**-8 * max(1.0, ref.float().abs().max().item()), err


# ---------------------------------------------------------------------------------------------
# skinny matmul


def _linear_case(M, N, K, dtype, g):
    x = _rand(M, K, dtype=dtype, gen=g)
    w = _rand(N, K, dtype=dtype, scale=K**-0.5, gen=g)
    w2 = _rand(N, K, dtype=dtype, scale=K**-0.5, gen=g)
    res = _rand(M, N, dtype=dtype, gen=g)
    return x, w, w2, res


def _linear_variants(x, w, w2, res):
    return {
        "plain": (dict(), F.linear(x, w)),
        "residual": (dict(residual=res), res + F.linear(x, w)),
        "silu_mul": (dict(up_weight=w2), F.silu(F.linear(x, w)) * F.linear(x, w2)),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K", [(1, 24, 32), (3, 40, 64), (5, 16, 48)])
def test_skinny_linear_matches_reference(M, N, K, dtype):
    g = torch.Generator(device=DEVICE).manual_seed(M * 100 + N)
    args = _linear_case(M, N, K, dtype, g)
    for kw, ref in _linear_variants(*args).values():
        out = skinny_linear(args[0], args[1], **kw)
        _close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skinny_linear_rows_do_not_depend_on_row_count(dtype):
    g = torch.Generator(device=DEVICE).manual_seed(1)
    x, w, w2, res = _linear_case(9, 40, 64, dtype, g)
    for name, (kw, _) in _linear_variants(x, w, w2, res).items():
        full = skinny_linear(x, w, **kw)
        for m in (0, 4, 8):
            one = {k: (v[m : m + 1] if k == "residual" else v) for k, v in kw.items()}
            assert torch.equal(skinny_linear(x[m : m + 1], w, **one)[0], full[m]), (name, m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [(16, 16, 4, 1, 1), (16, 16, 4, 1, 2)])
def test_skinny_linear_reads_a_norm_input_and_writes_the_next(config, dtype):
    """The norm before a projection inside the GEMMs around it: a residual GEMM's `norm_out` gives the
    next norm's input (its output times (1 + w), sums of squares per N block), and the GEMM reading it
    (`rms`) equals the norm then the GEMM; its output bitwise what it was without norm_out; rows
    invariant; the norm kernel's `norm_input` (one sum per row) the same as the GEMM's."""
    g = torch.Generator(device=DEVICE).manual_seed(21)
    x, w, w2, res = _linear_case(9, 64, 64, dtype, g)
    nw = _rand(64, dtype=dtype, scale=0.3, gen=g)
    wa, wb = _rand(40, 64, dtype=dtype, scale=0.125, gen=g), _rand(40, 64, dtype=dtype, scale=0.125, gen=g)
    eps = 1e-6
    y, ni = skinny_linear(x, w, residual=res, norm_out=nw, config=config)
    assert torch.equal(y, skinny_linear(x, w, residual=res, config=config))
    assert ni.ss.shape == (4, 9)  # 64 columns in blocks of 16
    assert torch.equal(ni.x, (y.float() * (1.0 + nw.float())).to(dtype))
    torch.testing.assert_close(ni.ss.sum(0), y.float().pow(2).sum(1), rtol=1e-5, atol=1e-5)
    assert torch.equal(norm_input(y, nw).x, ni.x)
    h = reference_rms_norm(y, nw, eps)
    for made in (ni, norm_input(y, nw)):
        for kw, ref in _linear_variants(h, wa, wb, res[:, :40]).values():
            out = skinny_linear(None, wa, rms=made, eps=eps, config=config, **kw)
            _close(out, ref, dtype)
            for m in (0, 8):
                one = {k: (v[m : m + 1] if k == "residual" else v) for k, v in kw.items()}
                row = type(made)(made.x[m : m + 1], made.ss[:, m : m + 1].contiguous())
                assert torch.equal(skinny_linear(None, wa, rms=row, eps=eps, config=config, **one)[0], out[m])
    # the residual GEMM's partial sums too: each row's, from its own 16-row tile
    _, one = skinny_linear(x[4:5], w, residual=res[4:5], norm_out=nw, config=config)
    assert torch.equal(one.ss[:, 0], ni.ss[:, 4]) and torch.equal(one.x[0], ni.x[4])
    with pytest.raises(ValueError, match="norm_out"):
        skinny_linear(x, w, norm_out=nw)
    with pytest.raises(ValueError, match="rms sums"):  # sums for other rows than x's
        skinny_linear(None, wa, rms=type(ni)(ni.x, ni.ss[:, :3].contiguous()), eps=eps)
    with pytest.raises(ValueError, match="x or rms"):
        skinny_linear(ni.x, wa, rms=ni, eps=eps)


@pytest.mark.parametrize("split", [1, 2])
def test_skinny_linear_run_if(split):
    """run_if 0: the output buffer is left as it was (and split-K's arrival counters stay zero, so
    the next call sums right); run_if 1: the unflagged call's result bitwise."""
    g = torch.Generator(device=DEVICE).manual_seed(3)
    x, w, w2, res = _linear_case(3, 40, 64, torch.bfloat16, g)
    cfg = (16, 16, 4, 1, split)
    for name, (kw, _) in _linear_variants(x, w, w2, res).items():
        want = skinny_linear(x, w, config=cfg, **kw)
        out = torch.full_like(want, 5.0)
        skinny_linear(x, w, out=out, config=cfg, run_if=torch.tensor(False, device=DEVICE), **kw)
        assert (out == 5).all(), name
        skinny_linear(x, w, out=out, config=cfg, run_if=torch.tensor(True, device=DEVICE), **kw)
        assert torch.equal(out, want), name
        assert torch.equal(skinny_linear(x, w, config=cfg, **kw), want), name


@pytest.mark.parametrize("split", [1, 2])
def test_skinny_linear_tensor_descriptor_loads(split):
    """Weight tiles through tensor descriptors (TMA on Hopper): the pointer loads' results bitwise
    (the same tiles, zero past the edges, into the same dots), rows invariant, every fused variant;
    N and K not multiples of the block (the descriptor's zero padding)."""
    g = torch.Generator(device=DEVICE).manual_seed(4)
    x, w, w2, res = _linear_case(9, 40, 96, torch.bfloat16, g)
    for name, (kw, ref) in _linear_variants(x, w, w2, res).items():
        for block_k in (32, 64):
            if split > 1 and 96 % (split * block_k):
                continue
            full = skinny_linear(x, w, config=(16, block_k, 4, 2, split, 1), **kw)
            assert torch.equal(full, skinny_linear(x, w, config=(16, block_k, 4, 2, split), **kw)), name
            _close(full, ref, torch.bfloat16)
            one = {k: (v[4:5] if k == "residual" else v) for k, v in kw.items()}
            assert torch.equal(skinny_linear(x[4:5], w, config=(16, block_k, 4, 2, split, 1), **one)[0], full[4])


@pytest.mark.parametrize("split", [1, 2])
def test_wide_tiles_with_x_through_tensor_descriptors_keep_the_bits(split):
    """Config way 3 (x's tiles through tensor descriptors as well as the weights', wide tiles): the
    pointer loads' bits, every fused variant, rows past M (the last tile's) read as zero; the K splits
    summed in the program in split order. A call the way cannot take (split K in programs) says so."""
    from nextn.ops.linear_configs import WIDE_ROWS

    g = torch.Generator(device=DEVICE).manual_seed(6)
    x, w, w2, res = _linear_case(WIDE_ROWS + 6, 40, 128, torch.bfloat16, g)
    for name, (kw, ref) in _linear_variants(x, w, w2, res).items():
        plain = skinny_linear(x, w, config=(16, 32, 4, 2, split), block_m=64, **kw)
        _close(plain, ref, torch.bfloat16)
        way3 = skinny_linear(x, w, config=(16, 32, 4, 2, split, 3), block_m=64, **kw)
        assert torch.equal(_bits(way3), _bits(plain)), name
    with pytest.raises(ValueError, match="way 3"):
        skinny_linear(x[:40], w, config=(16, 32, 4, 2, 2, 3), block_m=32)


def test_default_wide_tiles_take_x_of_any_alignment():
    """The default wide tile of a wgmma config loads x's tiles through tensor descriptors (WIDE_WAY 3),
    which need rows on 16-byte boundaries: x as a view starting one element in (a column slice) takes
    pointer loads for x, the same bits; asked for way 3 explicitly, such an x is an error."""
    from nextn.ops import linear_configs as cfgs

    g = torch.Generator(device=DEVICE).manual_seed(7)
    # (a wgmma config: the interpreter's for a tiny shape; on a GPU unknown shapes take mma.sync ones, the 9B's
    # q/k/v fused shape a tuned wgmma one)
    N, K = (64, 128) if DEVICE == "cpu" else (10240, 4096)
    M = cfgs.WIDE_ROWS + 4
    x, w, _, _ = _linear_case(M, N, K, torch.bfloat16, g)
    assert cfgs.wide_tile(N, K, False, 2)[1][5:] == (cfgs.WIDE_WAY,) == (3,)
    wide = torch.zeros(M, K + 8, dtype=torch.bfloat16, device=DEVICE)
    wide[:, 1 : K + 1] = x
    shifted = wide[:, 1 : K + 1]  # (rows of 2 bytes past a 16-byte boundary)
    assert torch.equal(_bits(skinny_linear(shifted, w)), _bits(skinny_linear(x, w)))
    block_m, config = cfgs.wide_tile(N, K, False, 2)
    with pytest.raises(ValueError, match="16-byte"):
        skinny_linear(shifted, w, config=config, block_m=block_m)


def test_rms_norm_matches_reference():
    g = torch.Generator(device=DEVICE).manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        x = _rand(5, 48, dtype=dtype, gen=g)
        norm = RMSNorm(48).to(DEVICE)
        norm.weight.data = _rand(48, scale=0.1, gen=g)
        ref = norm.to(dtype)(x)
        _close(rms_norm(x, norm.weight, 1e-6), ref, dtype)
        assert torch.equal(rms_norm(x[2:3], norm.weight, 1e-6)[0], rms_norm(x, norm.weight, 1e-6)[2])


# ---------------------------------------------------------------------------------------------
# the GDN step: causal conv + recurrent delta rule + gated output norm


def _gdn_case(T, H, HV, K, V, W, dtype, g):
    """proj [T, conv | z | b | a] (a column slice of a wider row, as in the engine) and the rest."""
    conv_dim = 2 * H * K + HV * V
    proj = _rand(T, conv_dim + HV * V + 2 * HV + 8, dtype=dtype, gen=g)[:, : conv_dim + HV * V + 2 * HV]
    return dict(
        proj=proj,
        conv_weight=_rand(conv_dim, W, dtype=dtype, scale=0.5, gen=g),
        conv_home=_rand(conv_dim, W - 1, dtype=dtype, gen=g),
        A_log=_rand(HV, dtype=dtype, scale=0.5, gen=g),
        dt_bias=_rand(HV, dtype=dtype, scale=0.5, gen=g),
        state_home=_rand(HV, K, V, scale=0.1, gen=g),
        norm_weight=(1.0 + _rand(V, scale=0.1, gen=g)).to(dtype),
    )


def _gdn_reference(c, H, HV, K, V, norm_eps):
    """The reference modules' composition: conv (+ the window), delta rule (+ states), gated norm."""
    proj = c["proj"]
    T, dtype = proj.shape[0], proj.dtype
    conv_dim = 2 * H * K + HV * V
    mixed, window = causal_conv1d(proj[None, :, :conv_dim], c["conv_weight"], c["conv_home"][None])
    q, k, v = torch.split(mixed[0], [H * K, H * K, HV * V], dim=-1)
    q = l2norm(q.reshape(1, T, H, K).float())
    k = l2norm(k.reshape(1, T, H, K).float())
    v = v.reshape(1, T, HV, V)
    z = proj[:, conv_dim : conv_dim + HV * V]
    b, a = proj[:, conv_dim + HV * V : conv_dim + HV * V + HV], proj[:, conv_dim + HV * V + HV :]
    beta = b.sigmoid()[None]
    gate = (-c["A_log"].float().exp() * F.softplus(a.float() + c["dt_bias"].float()))[None]
    o, states = recurrent_gated_delta_rule(q, k, v, gate, beta, c["state_home"][None])
    norm = RMSNormGated(V, eps=norm_eps).to(DEVICE)
    norm.weight.data = c["norm_weight"]
    out = norm(o[0].reshape(T * HV, V).to(dtype), z.reshape(T * HV, V)).reshape(T, HV * V)
    return out, states[0], window[0]


def _gdn_buffers(c, H, HV, K, V, W, T_max):
    """Window [conv_dim, 2 * (W-1+T_max)], base states [2, HV, K, V] and gates [2 * T_max, 2 * HV],
    both halves as the engine keeps them: the case's carried columns and state in half 0 (read by
    default), the rest NaN-poisoned."""
    conv_dim, dtype = 2 * H * K + HV * V, c["proj"].dtype
    window = torch.full((conv_dim, 2 * (W - 1 + T_max)), float("nan"), device=DEVICE, dtype=dtype)
    states = torch.full((2, HV, K, V), float("nan"), device=DEVICE)
    window[:, : W - 1], states[0] = c["conv_home"], c["state_home"]
    return window, states, torch.full((2 * T_max, 2 * HV), float("nan"), device=DEVICE, dtype=dtype)


def _run_gdn_step(c, H, HV, K, V, W, norm_eps, T_max=8, slots=None, store_all=True, bufs=None, live=None, preconv=None):
    """The step of one sequence (a batch of one, slot 0) into bufs = (window, states, gates) (fresh
    ones by default); slots (state_at, state_write, conv_at, conv_write, pending) as a list, by
    default reading half 0 and writing half 1."""
    bufs = bufs or _gdn_buffers(c, H, HV, K, V, W, T_max)
    window, states, gates = bufs
    slots = torch.tensor([slots or [0, 1, 0, W - 1 + T_max, 0]], device=DEVICE, dtype=torch.int32)
    seqs = torch.tensor([[0], [0], [c["proj"].shape[0]]], device=DEVICE, dtype=torch.int32)
    out = gdn_step(
        c["proj"],
        c["conv_weight"],
        window[None],
        c["A_log"],
        c["dt_bias"],
        states[None],
        gates[None],
        c["norm_weight"],
        num_k_heads=H,
        norm_eps=norm_eps,
        slots=slots,
        seqs=seqs,
        pending_col=4,
        store_all=store_all,
        live=None if live is None else torch.tensor([live], device=DEVICE, dtype=torch.int32),
        preconv=preconv,
    )
    return out, bufs


def _gates(c, H, HV, K, V):
    """The proj rows' gate inputs [T, 2 * HV]: b, then a."""
    col = 2 * H * K + 2 * HV * V
    return c["proj"][:, col : col + 2 * HV]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 2, 5])
def test_gdn_step_matches_reference(T, dtype):
    """A step against the reference modules, writing half 1 only; a verify stores its base, its
    rows' gates and its window there; the next step, after keeping t of its rows, folds them from
    those (half 0 poisoned) and gives row t on, and the last state, bitwise."""
    H, HV, K, V, W, eps, T_max = 2, 4, 16, 32, 4, 1e-6, 8
    half = W - 1 + T_max
    g = torch.Generator(device=DEVICE).manual_seed(10 + T)
    c = _gdn_case(T, H, HV, K, V, W, dtype, g)
    out, (window, states, gates) = _run_gdn_step(c, H, HV, K, V, W, eps, store_all=False)
    ref_out, ref_states, ref_window = _gdn_reference(c, H, HV, K, V, eps)
    assert torch.equal(window[:, half : half + W - 1], ref_window[:, T:])  # the next carried columns, bitwise
    assert window[:, W - 1 : half].isnan().all() and window[:, half + W - 1 :].isnan().all() and gates.isnan().all()
    assert torch.equal(window[:, : W - 1], c["conv_home"]) and torch.equal(states[0], c["state_home"])  # read, kept
    assert not triton_utils._COUNTERS[out.device].any()  # the heads' last programs re-armed them
    verify_out, (vwin, vstates, vgates) = _run_gdn_step(c, H, HV, K, V, W, eps)  # store_all
    assert torch.equal(verify_out, out)
    assert torch.equal(vstates[1], c["state_home"])  # the base: nothing was pending
    assert torch.equal(vgates[T_max : T_max + T], _gates(c, H, HV, K, V)) and vgates[:T_max].isnan().all()
    assert torch.equal(vwin[:, half : half + W - 1 + T], ref_window) and vwin[:, half + W - 1 + T :].isnan().all()
    for t in range(T):  # t rows kept (pending), then rows t.. as the next step, into half 0
        win, st, gt = vwin.clone(), vstates.clone(), vgates.clone()
        win[:, :half], st[0] = float("nan"), float("nan")
        rest = dict(c, proj=c["proj"][t:])
        rest_out, _ = _run_gdn_step(
            rest, H, HV, K, V, W, eps, slots=[1, 0, half + t, 0, t], store_all=False, bufs=(win, st, gt)
        )
        assert torch.equal(rest_out, out[t:]) and torch.equal(st[0], states[1]), t
        assert torch.equal(st[1], vstates[1]) and torch.equal(_bits(gt), _bits(vgates))
    # against the reference modules: o, its norm and its gate are rounded to bf16 in the kernel's own
    # order, a few ulps at the values' scale (on an H200, 3 at most seen)
    if dtype == torch.float32:
        _close(out, ref_out, dtype)
        torch.testing.assert_close(states[1], ref_states[-1], rtol=1e-4, atol=1e-5)
    else:  # (the state integrates bf16 conv outputs: test_gdn_step_9b_shapes_gpu)
        assert (out.float() - ref_out.float()).abs().max() <= 8 * 2**-8 * max(1.0, ref_out.float().abs().max().item())
        torch.testing.assert_close(states[1], ref_states[-1], rtol=2**-6, atol=2**-5)


@pytest.mark.parametrize("live", [1, 3, 5])
def test_gdn_step_live_rows(live):
    """live rows (a verify whose gate cut drafts): the recurrence stops after them; their outputs are
    the full step's bitwise, later rows' outputs are 0; the base, gates and window as the full step's."""
    H, HV, K, V, W, eps, T, dtype = 2, 4, 16, 32, 4, 1e-6, 5, torch.bfloat16
    c = _gdn_case(T, H, HV, K, V, W, dtype, torch.Generator(device=DEVICE).manual_seed(30))
    out, bufs = _run_gdn_step(c, H, HV, K, V, W, eps)
    out_l, bufs_l = _run_gdn_step(c, H, HV, K, V, W, eps, live=live)
    assert torch.equal(out_l[:live], out[:live]) and (out_l[live:] == 0).all()
    for x, y in zip(bufs_l, bufs, strict=True):
        assert torch.equal(_bits(x), _bits(y))
    assert not triton_utils._COUNTERS[out.device].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 4])
def test_gdn_step_slots(T, dtype):
    """slots = (state_at, state_write, conv_at, conv_write, pending) in the device tensor: a verify of
    P rows written to half 1, then a step from there with its P rows pending (half 0 poisoned)
    equals the whole run bitwise; each step writes its half at the offsets and nothing else."""
    H, HV, K, V, W, eps, T_max, P = 2, 4, 16, 32, 4, 1e-6, 8, 3
    half = W - 1 + T_max
    g = torch.Generator(device=DEVICE).manual_seed(20 + T)
    c = _gdn_case(P + T, H, HV, K, V, W, dtype, g)
    whole_out, (_, whole_states, _) = _run_gdn_step(c, H, HV, K, V, W, eps, store_all=False)  # the baseline
    first = dict(c, proj=c["proj"][:P])
    _, (window, states, gates) = _run_gdn_step(first, H, HV, K, V, W, eps)
    assert torch.equal(states[1], c["state_home"]) and torch.equal(gates[T_max : T_max + P], _gates(first, H, HV, K, V))
    window[:, :half], states[0] = float("nan"), float("nan")
    rest = dict(c, proj=c["proj"][P:])
    for store_all in (True, False):
        bufs = tuple(b.clone() for b in (window, states, gates))
        out, (win, st, gt) = _run_gdn_step(
            rest, H, HV, K, V, W, eps, slots=[1, 0, half + P, 0, P], store_all=store_all, bufs=bufs
        )
        assert torch.equal(out, whole_out[P:]), store_all
        # the read half is kept; the written half holds the folded base (a verify) or the last state
        assert torch.equal(_bits(win[:, half:]), _bits(window[:, half:])) and torch.equal(st[1], states[1])
        assert torch.equal(_bits(gt[T_max:]), _bits(gates[T_max:]))
        width = W - 1 + T if store_all else W - 1  # the whole window, or its last W-1 columns
        assert not win[:, :width].isnan().any() and win[:, width:half].isnan().all()
        if store_all:
            assert torch.equal(gt[:T], _gates(rest, H, HV, K, V)) and gt[T:T_max].isnan().all()
            # the stored base is the state after the P rows: a step of the rest from it, nothing pending
            again, (_, st2, _) = _run_gdn_step(
                rest, H, HV, K, V, W, eps, slots=[0, 1, 0, half, 0], store_all=False, bufs=(win.clone(), st.clone(), gt)
            )
            assert torch.equal(again, out) and torch.equal(st2[1], whole_states[1])
        else:
            assert torch.equal(st[0], whole_states[1]) and gt[:T_max].isnan().all()


@pytest.mark.parametrize("P", [0, 3])
def test_gdn_step_conv_prepass_is_bitwise(P, dtype=torch.bfloat16):
    """A prefill step's conv pre-pass (preconv: the step rows' conv outputs computed first, in
    parallel, then loaded by the row loop) gives the in-loop conv's bits: outputs, states, window and
    gates, with P pending rows folded first (their conv stays in the loop). bfloat16 only: gdn_step
    refuses the pre-pass in float32 (run 162: its bits were off the loop's with P = 3 on an H100)."""
    H, HV, K, V, W, eps, T_max, T = 2, 4, 16, 32, 4, 1e-6, 8, 6
    half = W - 1 + T_max
    g = torch.Generator(device=DEVICE).manual_seed(40 + P)
    c = _gdn_case(P + T, H, HV, K, V, W, dtype, g)
    slots = None
    bufs = _gdn_buffers(c, H, HV, K, V, W, T_max)
    if P:  # a verify of P rows into half 1, then the prefill step from there with them pending
        _, bufs = _run_gdn_step(dict(c, proj=c["proj"][:P]), H, HV, K, V, W, eps, bufs=bufs)
        slots = [1, 0, half + P, 0, P]
    rest = dict(c, proj=c["proj"][P:])
    got = [
        _run_gdn_step(
            rest, H, HV, K, V, W, eps, slots=slots, store_all=False, bufs=tuple(b.clone() for b in bufs), preconv=pre
        )  # fmt: skip
        for pre in (None, T)
    ]
    (out, bufs_loop), (out_pre, bufs_pre) = got
    assert torch.equal(out_pre, out)
    for x, y in zip(bufs_pre, bufs_loop, strict=True):
        assert torch.equal(_bits(x), _bits(y))


def test_gdn_step_conv_prepass_refuses_float32():
    """The pre-pass's float32 bits are not the loop's on a GPU (a product and its sum contracted in
    one kernel only): gdn_step refuses it there rather than give other bits."""
    H, HV, K, V, W, T_max, T = 2, 4, 16, 32, 4, 8, 6
    c = _gdn_case(T, H, HV, K, V, W, torch.float32, torch.Generator(device=DEVICE).manual_seed(3))
    with pytest.raises(ValueError, match="bfloat16 only"):
        _run_gdn_step(c, H, HV, K, V, W, 1e-6, store_all=False, bufs=_gdn_buffers(c, H, HV, K, V, W, T_max), preconv=T)


# ---------------------------------------------------------------------------------------------
# chunked delta rule (prefill)


def _chunk_case(B, T, H, HV, K, V, dtype, g, decay=0.5, with_state=True, repeat_keys=False):
    q = l2norm(_rand(B, T, H, K, gen=g))
    k = l2norm(_rand(B, T, H, K, gen=g))
    if repeat_keys:  # one key throughout: A is dense, its power series explodes; the inverse must not
        k = k[:, :1].expand(B, T, H, K).contiguous()
    v = _rand(B, T, HV, V, dtype=dtype, gen=g)
    gate = -torch.rand(B, T, HV, generator=g, device=DEVICE) * decay
    beta = torch.rand(B, T, HV, generator=g, device=DEVICE)
    state = _rand(B, HV, K, V, gen=g) if with_state else None
    return q, k, v, gate, beta, state


@pytest.mark.parametrize(
    "B,T,H,HV,K,V,decay,with_state,repeat_keys",
    [
        (1, 1, 1, 2, 16, 16, 0.5, True, False),  # one token
        (1, 2, 1, 1, 16, 16, 0.5, True, False),
        (1, 63, 1, 2, 16, 16, 0.5, True, False),  # around the chunk boundary (64)
        (1, 65, 1, 2, 16, 16, 0.5, False, False),
        (1, 1000, 1, 1, 16, 16, 0.1, True, False),  # 16 chunks: errors must not grow along the scan
        (1, 70, 2, 4, 16, 32, 0.5, True, False),  # a partial second chunk, grouped heads
        (2, 130, 1, 1, 32, 16, 0.5, False, False),  # batch, three chunks, no initial state
        (1, 64, 1, 1, 8, 24, 8.0, True, False),  # head dims below a tile (masked), strong decay (exp underflow)
        (1, 100, 1, 1, 16, 16, 0.01, True, True),  # the same key at every token, barely decaying
    ],
)
def test_chunk_rule_matches_reference(B, T, H, HV, K, V, decay, with_state, repeat_keys):
    g = torch.Generator(device=DEVICE).manual_seed(T + K)
    q, k, v, gate, beta, state = _chunk_case(B, T, H, HV, K, V, torch.float32, g, decay, with_state, repeat_keys)
    o, final = triton_chunk_rule(q, k, v, gate, beta, state)
    ref_o, ref_final = chunk_gated_delta_rule(q, k, v, gate, beta, state)
    # the output's products in one tf32 pass on a GPU where the heads allow it (triton_gdn_chunk.PRECISIONS)
    one_pass = DEVICE == "cuda" and chunk_launch_constexprs(H, HV, K, V, with_state)[2]["P_O"] == "tf32"
    o_tol = 2e-3 if one_pass else 1e-5
    torch.testing.assert_close(o, ref_o, rtol=o_tol, atol=o_tol)
    torch.testing.assert_close(final, ref_final, rtol=1e-5, atol=1e-5)
    # and the recurrence it stands for, token by token
    rec_o, rec_states = recurrent_gated_delta_rule(q, k, v, gate, beta, state)
    torch.testing.assert_close(o, rec_o, rtol=max(o_tol, 1e-4), atol=max(o_tol, 1e-4))
    torch.testing.assert_close(final, rec_states[:, -1], rtol=1e-4, atol=1e-4)


def test_chunk_rule_reads_and_writes_a_caches_states_in_place():
    """slot_states: the rule's initial states read from and final states written to a cache's halves
    ([S, 2, HV, K, V] at per-sequence element offsets) give what initial_state and the returned
    final state give, bit for bit, and touch nothing else of the cache."""
    g = torch.Generator(device=DEVICE).manual_seed(47)
    q, k, v, gate, beta, _ = _chunk_case(2, 70, 1, 2, 16, 16, torch.float32, g, 0.5, False, False)
    states = _rand(3, 2, 2, 16, 16, gen=g)
    o, final = triton_chunk_rule(q, k, v, gate, beta, torch.stack([states[2, 1], states[0, 0]]))
    slot, half = states.stride(0), states.stride(1)
    read = torch.tensor([2 * slot + half, 0], device=DEVICE)
    write = torch.tensor([2 * slot, half], device=DEVICE)
    before = states.clone()
    o2, none = triton_chunk_rule(q, k, v, gate, beta, slot_states=(states, read, write))
    assert none is None and torch.equal(o2, o)
    assert torch.equal(states[2, 0], final[0]) and torch.equal(states[0, 1], final[1])
    kept = torch.ones(3, 2, dtype=torch.bool)
    kept[2, 0] = kept[0, 1] = False
    assert torch.equal(states[kept], before[kept])
    with pytest.raises(ValueError, match="slot_states"):
        triton_chunk_rule(q, k, v, gate, beta, states[:2, 0], slot_states=(states, read, write))


def test_chunk_rule_runs_pieces_one_after_another_as_padded_sequences():
    """chunk_starts: pieces laid one after another in whole chunks (each padded to its last chunk's
    end with zero rows) give each piece's rows and final state bit for bit what the pieces padded
    to the longest give as a batch (the layout the engine's mixed steps used before: the same
    chunks, none past a piece's end), from and into the slots' states; a launch of the same sizes
    serves another split of the same rows (a CUDA graph keyed by them)."""
    g = torch.Generator(device=DEVICE).manual_seed(53)
    H, HV, K, V, C = 1, 2, 16, 16, 64
    T = 200
    q, k, v, gate, beta, _ = _chunk_case(1, T, H, HV, K, V, torch.float32, g, 0.5, False, False)
    states = _rand(4, 2, HV, K, V, gen=g)
    slot, half = states.stride(0), states.stride(1)
    for rows in ([70, 125, 5], [64, 1, 135], [199, 1]):
        P, chunks = len(rows), [-(-n // C) for n in rows]
        first = [0, *itertools.accumulate(rows)][:-1]
        # padded: [P, longest] with zeros past each piece
        Tmax = max(rows)
        padded = [x.new_zeros(P, Tmax, *x.shape[2:]) for x in (q, k, v, gate, beta)]
        # one after another: piece p's rows at chunk starts[p], zeros to its last chunk's end
        starts = [0, *itertools.accumulate(chunks)]
        flat = [x.new_zeros(1, starts[-1] * C, *x.shape[2:]) for x in (q, k, v, gate, beta)]
        for p, (o0, n) in enumerate(zip(first, rows, strict=True)):
            for x, pad, fl in zip((q, k, v, gate, beta), padded, flat, strict=True):
                pad[p, :n] = x[0, o0 : o0 + n]
                fl[0, starts[p] * C : starts[p] * C + n] = x[0, o0 : o0 + n]
        read = torch.tensor([s * slot for s in range(P)], device=DEVICE)
        write = torch.tensor([s * slot + half for s in range(P)], device=DEVICE)
        ours = states.clone()
        o_pad, _ = triton_chunk_rule(*padded, slot_states=(ours, read, write))
        want = ours[:P, 1].clone()
        ours = states.clone()
        at = torch.tensor(starts, device=DEVICE, dtype=torch.int32)
        o_flat, none = triton_chunk_rule(*flat, slot_states=(ours, read, write), chunk_starts=at)
        assert none is None
        for p, n in enumerate(rows):
            assert torch.equal(o_flat[0, starts[p] * C : starts[p] * C + n], o_pad[p, :n]), (rows, p)
        assert torch.equal(ours[:P, 1], want), rows
        assert torch.equal(ours[:P, 0], states[:P, 0]) and torch.equal(ours[P:], states[P:])
    with pytest.raises(ValueError, match="chunk_starts"):
        triton_chunk_rule(q, k, v, gate, beta, slot_states=(states, read, write), chunk_starts=at)


def test_chunk_inputs_are_the_modules_and_zero_past_a_piece():
    """The chunked pieces' input kernel (triton_gdn_chunk.chunk_inputs: step rows laid out as pieces
    padded to T rows) gives the module's inputs (nextn.layers.gdn: l2norm of q and k in float32,
    GatedDeltaNet.gates) row for row, and zeros, gates included, for the padded rows."""
    from nextn.layers.gdn import l2norm
    from nextn.ops.triton_gdn_chunk import chunk_inputs

    g = torch.Generator(device=DEVICE).manual_seed(41)
    H, K, HV, V, M = 2, 16, 4, 8, 11
    conv = _rand(M, 2 * H * K + HV * V, dtype=torch.bfloat16, gen=g)
    proj = _rand(M, 40 + 2 * HV, dtype=torch.bfloat16, scale=3.0, gen=g)  # (b | a from column 40)
    A_log, dt_bias = _rand(HV, gen=g), _rand(HV, gen=g)
    index = torch.tensor([[0, 1, 2, M, M], [3, 4, 5, 6, 7]], device=DEVICE)  # a piece of 3 rows, one of 5
    q, k, v, gate, beta = chunk_inputs(conv, proj, 40, index, A_log, dt_bias, (H, K, HV, V))
    live = index < M
    rows = index[live]
    ref_q = l2norm(conv[rows, : H * K].unflatten(-1, (H, K)).float())
    ref_k = l2norm(conv[rows, H * K : 2 * H * K].unflatten(-1, (H, K)).float())
    b, a = proj[rows, 40 : 40 + HV], proj[rows, 40 + HV :]
    ref_beta = b.sigmoid().float()
    ref_g = -A_log.exp() * F.softplus(a.float() + dt_bias)
    torch.testing.assert_close(q[live], ref_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k[live], ref_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(v[live], conv[rows, 2 * H * K :].unflatten(-1, (HV, V)))
    torch.testing.assert_close(beta[live], ref_beta, rtol=0, atol=2**-8)  # (sigmoid rounded to bf16 either way)
    torch.testing.assert_close(gate[live], ref_g, rtol=1e-5, atol=1e-6)
    for x in (q, k, v, gate, beta):
        assert not x[~live].any()


def test_gated_norm_rows_is_the_modules_norm():
    """The chunked pieces' output norm (triton_gdn_chunk.gated_norm_rows: rows of o picked by index,
    each value head RMSNormGated * silu(z)) is nextn.layers.norm.RMSNormGated, op for op."""
    from nextn.layers.norm import RMSNormGated
    from nextn.ops.triton_gdn_chunk import gated_norm_rows

    g = torch.Generator(device=DEVICE).manual_seed(43)
    HV, V, R = 3, 16, 5
    o = _rand(9, HV * V, dtype=torch.bfloat16, gen=g)
    rows = torch.tensor([4, 0, 8, 2, 3], device=DEVICE)
    z = _rand(R, HV * V, dtype=torch.bfloat16, gen=g)
    norm = RMSNormGated(V, 1e-6).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1.0 + _rand(V, scale=0.1, gen=g))
    out = gated_norm_rows(o, rows, z, norm.weight.detach(), 1e-6, torch.empty_like(z))
    ref = norm(o[rows].reshape(-1, V), z.reshape(-1, V)).reshape(R, HV * V)
    _close(out, ref, torch.bfloat16)


def test_chunk_rule_splits_like_one_call():
    """A prompt prefilled in two requests ends in the state one request would reach."""
    g = torch.Generator(device=DEVICE).manual_seed(9)
    q, k, v, gate, beta, state = _chunk_case(1, 100, 1, 2, 16, 16, torch.float32, g)
    o, whole = triton_chunk_rule(q, k, v, gate, beta, state)
    o1, mid = triton_chunk_rule(q[:, :37], k[:, :37], v[:, :37], gate[:, :37], beta[:, :37], state)
    o2, end = triton_chunk_rule(q[:, 37:], k[:, 37:], v[:, 37:], gate[:, 37:], beta[:, 37:], mid)
    torch.testing.assert_close(end, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([o1, o2], dim=1), o, rtol=1e-5, atol=1e-5)
    o0, same = triton_chunk_rule(q[:, :0], k[:, :0], v[:, :0], gate[:, :0], beta[:, :0], state)
    assert o0.shape == (1, 0, 2, 16) and torch.equal(same, state)
    with pytest.raises(ValueError, match="not a multiple"):
        triton_chunk_rule(
            q.expand(1, 100, 2, 16),
            k.expand(1, 100, 2, 16),
            v[:, :, :1].expand(1, 100, 3, 16),
            gate[:, :, :1].expand(1, 100, 3),
            beta[:, :, :1].expand(1, 100, 3),
        )


def test_chunk_rule_scratch_is_what_the_memory_plan_counts(monkeypatch):
    """The float32 scratch chunk_gated_delta_rule allocates (u, w, the intra-chunk scores, gc, each chunk's
    first state) is scratch_floats_per_row a padded row, the figure nextn.engine.memory's activation
    estimate counts for a prefill's GDN layer (a scratch tensor it misses is memory the cache fit spends)."""
    from nextn.engine.memory import activation_bytes_per_row
    from nextn.ops import triton_gdn_chunk as rule

    B, T, H, HV, K, V = 2, 70, 1, 2, 32, 16
    g = torch.Generator(device=DEVICE).manual_seed(10)
    q, k, v, gate, beta, state = _chunk_case(B, T, H, HV, K, V, torch.float32, g)
    floats, empty = [], torch.empty

    def spy(*shape, dtype=None, **kw):
        out = empty(*shape, dtype=dtype, **kw)
        if dtype == torch.float32:
            floats.append(out.numel())
        return out

    monkeypatch.setattr(rule.torch, "empty", spy)
    rule.chunk_gated_delta_rule(q, k, v, gate, beta, state)
    monkeypatch.undo()
    outputs = B * T * HV * V + B * HV * K * V  # (o in v's dtype, float32 here, and the final state)
    padded_rows = B * -(-T // rule.CHUNK) * rule.CHUNK
    assert sum(floats) - outputs == padded_rows * rule.scratch_floats_per_row(HV, K, V)
    from nextn.models.random_weights import preset_config

    cfg = preset_config("qwen3.5-9b")  # (its GDN layer the widest a row: the estimate's maximum)
    heads = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    counted = activation_bytes_per_row(cfg, torch.bfloat16)
    monkeypatch.setattr("nextn.engine.memory.scratch_floats_per_row", lambda *a: 0)
    assert counted - activation_bytes_per_row(cfg, torch.bfloat16) == 4 * rule.scratch_floats_per_row(*heads)


def _sm90_unavailable() -> str | None:
    """Why the installed triton cannot compile for sm90 on this machine, or None if it can."""
    from triton.backends import backends

    if "nvidia" not in backends:
        return f"the installed triton has no nvidia backend (backends: {sorted(backends)})"
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        get_ptxas(90)  # the ptxas triton would run for sm90 (bundled, or TRITON_PTXAS_*_PATH)
    except RuntimeError as e:  # "Cannot find ptxas..."
        return f"the installed triton finds no ptxas for sm90: {e}"
    return None


def test_prefill_kernels_fit_sm90_shared_memory():
    """The prefill kernels (chunked delta rule, grouped experts) compile for sm90 at the real shapes
    with their wrappers' launch options, within an H200 block's shared memory: a config that would
    raise OutOfResources on the GPU fails here, on the CPU. bench/sm90_compile.py does it, in a
    process without TRITON_INTERPRET (this one interprets: its kernels cannot be compiled)."""
    reason = _sm90_unavailable()
    if reason is not None:
        pytest.skip(reason)
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.run(
        [sys.executable, str(root / "bench" / "sm90_compile.py")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"bench/sm90_compile.py exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"


# ---------------------------------------------------------------------------------------------
# routed experts over many rows (prefill)


def _experts_case(N, H, E, I, k, dtype, g, skew=False):
    x = _rand(N, H, dtype=dtype, gen=g)
    gate_up = _rand(E, 2 * I, H, dtype=dtype, scale=H**-0.5, gen=g)
    down = _rand(E, H, I, dtype=dtype, scale=I**-0.5, gen=g)
    logits = _rand(N, E, gen=g) + (torch.arange(E, device=DEVICE) == 1) * (20.0 if skew else 0.0)
    top_w, top_idx = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return x, top_idx, (top_w / top_w.sum(-1, keepdim=True)).to(dtype), gate_up, down


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "N,H,E,I,k,skew",
    [
        (1, 32, 4, 16, 2, False),  # one token
        (37, 48, 8, 24, 3, False),  # dims off the tiles, several groups per block size
        (150, 32, 6, 16, 2, True),  # one expert takes every token: its group spans three blocks
    ],
)
def test_grouped_experts_match_reference(N, H, E, I, k, skew, dtype):
    g = torch.Generator(device=DEVICE).manual_seed(N + E)
    x, top_idx, top_w, gate_up, down = _experts_case(N, H, E, I, k, dtype, g, skew)
    out = grouped_experts(x, top_idx, top_w, gate_up, down)
    ref = routed_experts(x, top_idx, top_w, gate_up, down)
    _close(out, ref, dtype)


# ---------------------------------------------------------------------------------------------
# attention


def _attn_case(T, start, Hq, Hkv, D, max_len, dtype, g):
    qkv = _rand(T, Hq * 2 * D + 2 * Hkv * D, dtype=dtype, gen=g)
    key = _rand(max_len, Hkv, D, dtype=dtype, gen=g)  # slots >= start are stale: overwritten or unread
    value = _rand(max_len, Hkv, D, dtype=dtype, gen=g)
    q_norm = _rand(D, scale=0.1, dtype=dtype, gen=g)
    k_norm = _rand(D, scale=0.1, dtype=dtype, gen=g)
    return qkv, key, value, q_norm, k_norm


def _attn_reference(qkv, key, value, q_norm, k_norm, start, Hq, Hkv, D, rotary, dtype):
    T = qkv.shape[0]
    qn, kn = RMSNorm(D).to(DEVICE), RMSNorm(D).to(DEVICE)
    qn.weight.data, kn.weight.data = q_norm.float(), k_norm.float()
    qn, kn = qn.to(dtype), kn.to(dtype)
    qg = qkv[:, : Hq * 2 * D].reshape(1, T, Hq, 2 * D)
    q, gate = qg[..., :D], qg[..., D:]
    k = qkv[:, Hq * 2 * D : Hq * 2 * D + Hkv * D].reshape(1, T, Hkv, D)
    v = qkv[:, Hq * 2 * D + Hkv * D :].reshape(1, T, Hkv, D)
    cos, sin = rotary.cos_sin(torch.arange(start, start + T, device=DEVICE), dtype)
    q = apply_rotary(qn(q), cos, sin)
    k = apply_rotary(kn(k), cos, sin)
    keys, values = key.clone()[None], value.clone()[None]
    keys[:, start : start + T], values[:, start : start + T] = k, v
    rows = torch.arange(T, device=DEVICE)[:, None] + start
    mask = torch.arange(start + T, device=DEVICE)[None, :] <= rows
    o = attend(q, keys[:, : start + T], values[:, : start + T], mask, False)
    return (o.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1)))[None], keys[0], values[0]


def _attn_run(qkv, key, value, q_norm, k_norm, start, Hq, cos, sin, chunk, slot=None):
    """One sequence's rows at positions start..: key / value [cap, Hkv, D] (a cache of one slot), or
    [S, cap, Hkv, D] with the rows in `slot`."""
    T = qkv.shape[0]
    if slot is None:
        key, value, slot = key[None], value[None], 0
    row_slot = torch.full((T,), slot, device=DEVICE, dtype=torch.int32)
    row_pos = torch.arange(start, start + T, device=DEVICE, dtype=torch.int32)
    q = qk_norm_rope(qkv, q_norm, k_norm, cos, sin, row_slot, row_pos, key, value, Hq, 1e-6)
    return attend_step(q, qkv, key, value, row_slot, row_pos, chunk=chunk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,start", [(1, 0), (3, 5), (4, 30)])
def test_step_attention_matches_reference(T, start, dtype):
    Hq, Hkv, D, max_len = 4, 2, 32, 40
    g = torch.Generator(device=DEVICE).manual_seed(20 + T)
    qkv, key, value, q_norm, k_norm = _attn_case(T, start, Hq, Hkv, D, max_len, dtype, g)
    rotary = RotaryEmbedding(D // 4, 10000.0).to(DEVICE)
    cos, sin = rotary.cos_sin(torch.arange(max_len, device=DEVICE), dtype)
    ref, ref_key, ref_value = _attn_reference(qkv, key, value, q_norm, k_norm, start, Hq, Hkv, D, rotary, dtype)
    out = _attn_run(qkv, key, value, q_norm, k_norm, start, Hq, cos, sin, chunk=16)
    _close(out, ref[0], dtype)
    _close(key[: start + T], ref_key[: start + T], dtype)
    assert torch.equal(value[: start + T], ref_value[: start + T])


def test_step_attention_rows_do_not_depend_on_row_count():
    Hq, Hkv, D, max_len, T, start = 4, 2, 32, 40, 5, 14  # rows cross a chunk boundary (16)
    g = torch.Generator(device=DEVICE).manual_seed(3)
    dtype = torch.bfloat16
    qkv, key, value, q_norm, k_norm = _attn_case(T, start, Hq, Hkv, D, max_len, dtype, g)
    rotary = RotaryEmbedding(D // 4, 10000.0).to(DEVICE)
    cos, sin = rotary.cos_sin(torch.arange(max_len, device=DEVICE), dtype)
    key1, value1 = key.clone(), value.clone()
    full = _attn_run(qkv, key, value, q_norm, k_norm, start, Hq, cos, sin, chunk=16)
    for t in range(T):  # one row at a time, as plain decoding would run them
        one = _attn_run(qkv[t : t + 1], key1, value1, q_norm, k_norm, start + t, Hq, cos, sin, chunk=16)
        assert torch.equal(one[0], full[t]), t
    assert torch.equal(key1[: start + T], key[: start + T])


@pytest.mark.parametrize("start", [0, 37])
def test_prefill_attention_matches_reference(start):
    """The prefill's fused attention (PyTorch's flash / memory-efficient kernels, the causal mask
    aligned to the last key, GQA) against the materialised reference, a first chunk and a later one."""
    g = torch.Generator(device=DEVICE).manual_seed(start)
    T, Hq, Hkv, D = 50, 8, 2, 64
    q = _rand(1, T, Hq, D, dtype=torch.bfloat16, gen=g)
    keys = _rand(1, start + T, Hkv, D, dtype=torch.bfloat16, gen=g)
    values = _rand(1, start + T, Hkv, D, dtype=torch.bfloat16, gen=g)
    _close(fused_prefill_attention(q, keys, values, start), prefill_attention(q, keys, values, start), torch.bfloat16)


def test_prefill_rms_norm_matches_reference():
    g = torch.Generator(device=DEVICE).manual_seed(4)
    x = _rand(3, 7, 5, 96, dtype=torch.bfloat16, gen=g)[:, :, 1:]  # a strided view, as q heads are
    w = _rand(96, scale=0.1, dtype=torch.bfloat16, gen=g)
    _close(rms_norm_rows(x, w, 1e-6), reference_rms_norm(x, w, 1e-6), torch.bfloat16)


def test_step_attention_batch_equals_each_sequence_alone():
    """Three sequences' rows in one launch, each in its own slot at its own position (rows packed),
    give bitwise what each sequence's rows give alone, and write K/V only into their own slots."""
    Hq, Hkv, D, max_len, dtype = 4, 2, 32, 48, torch.bfloat16
    g = torch.Generator(device=DEVICE).manual_seed(7)
    rotary = RotaryEmbedding(D // 4, 10000.0).to(DEVICE)
    cos, sin = rotary.cos_sin(torch.arange(max_len, device=DEVICE), dtype)
    seqs = [(3, 14, 2), (1, 0, 0), (4, 30, 1)]  # (rows, start, slot)
    cases = [_attn_case(T, start, Hq, Hkv, D, max_len, dtype, g) for T, start, _ in seqs]
    keys = torch.full((3, max_len, Hkv, D), float("nan"), device=DEVICE, dtype=dtype)
    values = keys.clone()
    for (_, _, slot), case in zip(seqs, cases, strict=True):
        keys[slot], values[slot] = case[1], case[2]
    qkv = torch.cat([case[0] for case in cases])
    row_slot = torch.tensor([s for T, _, s in seqs for _ in range(T)], device=DEVICE, dtype=torch.int32)
    row_pos = torch.tensor([p + t for T, p, _ in seqs for t in range(T)], device=DEVICE, dtype=torch.int32)
    q = qk_norm_rope(qkv, cases[0][3], cases[0][4], cos, sin, row_slot, row_pos, keys, values, Hq, 1e-6)
    batched = attend_step(q, qkv, keys, values, row_slot, row_pos, chunk=16)
    row = 0
    for (T, start, slot), (qkv1, key1, value1, _, _) in zip(seqs, cases, strict=True):
        alone = _attn_run(qkv1, key1, value1, cases[0][3], cases[0][4], start, Hq, cos, sin, chunk=16)
        assert torch.equal(alone, batched[row : row + T]), slot
        assert torch.equal(_bits(keys[slot]), _bits(key1)) and torch.equal(_bits(values[slot]), _bits(value1))
        row += T


def test_gdn_step_batch_equals_each_sequence_alone():
    """Three sequences in one launch (rows packed, each from its own slot's state and window,
    different states locations) give bitwise each one's step alone: outputs, states, windows."""
    H, HV, K, V, W, eps, T_max = 2, 4, 16, 32, 4, 1e-6, 8
    dtype = torch.bfloat16
    g = torch.Generator(device=DEVICE).manual_seed(31)
    rows = [2, 1, 5]
    cases = [_gdn_case(T, H, HV, K, V, W, dtype, g) for T in rows]
    weights = ("conv_weight", "A_log", "dt_bias", "norm_weight")  # one layer's: the first case's
    cases = [dict(c, **{k: cases[0][k] for k in weights}) for c in cases]
    alone = [_run_gdn_step(c, H, HV, K, V, W, eps, T_max) for c in cases]
    S = 4  # slot 3 holds the first sequence, slot 0 the second, slot 1 the third
    slot_of = [3, 0, 1]
    bufs = [_gdn_buffers(cases[0], H, HV, K, V, W, T_max) for _ in range(S)]
    window, states, gates = (torch.stack([b[i] for b in bufs]) for i in range(3))
    for c, s in zip(cases, slot_of, strict=True):  # each sequence's carried columns and state in its half 0
        window[s, :, : W - 1], states[s, 0] = c["conv_home"], c["state_home"]
    window[2, :, : W - 1], states[2, 0] = float("nan"), float("nan")
    slots = torch.tensor([[0, 1, 0, W - 1 + T_max, 0]] * S, device=DEVICE, dtype=torch.int32)
    seqs = torch.tensor([slot_of, [0, 2, 3], rows], device=DEVICE, dtype=torch.int32)
    out = gdn_step(
        torch.cat([c["proj"] for c in cases]),
        cases[0]["conv_weight"],
        window,
        cases[0]["A_log"],
        cases[0]["dt_bias"],
        states,
        gates,
        cases[0]["norm_weight"],
        num_k_heads=H,
        norm_eps=eps,
        slots=slots,
        seqs=seqs,
        pending_col=4,
    )
    row = 0
    for T, s, (one_out, one_bufs) in zip(rows, slot_of, alone, strict=True):
        assert torch.equal(out[row : row + T], one_out), s
        for x, y in zip((window[s], states[s], gates[s]), one_bufs, strict=True):
            assert torch.equal(_bits(x), _bits(y))
        row += T
    assert window[2].isnan().all() and states[2].isnan().all() and gates[2].isnan().all()  # outside the batch
    assert not triton_utils._COUNTERS[out.device].any()


def test_skinny_linear_rows_past_one_tile():
    """More than 16 rows (a batch's) run in a mid tile: each row bitwise what it gives alone."""
    g = torch.Generator(device=DEVICE).manual_seed(12)
    x, w, w2, res = _linear_case(37, 48, 64, torch.bfloat16, g)
    for name, (kw, ref) in _linear_variants(x, w, w2, res).items():
        out = skinny_linear(x, w, **kw)
        _close(out, ref, torch.bfloat16)
        for m in (0, 17, 36):
            one = {k: (v[m : m + 1] if k == "residual" else v) for k, v in kw.items()}
            assert torch.equal(skinny_linear(x[m : m + 1], w, **one)[0], out[m]), (name, m)
    # the norm between two GEMMs (norm_out, rms): each row's partial sums at its own column
    nw, w3 = _rand(48, dtype=torch.bfloat16, scale=0.3, gen=g), w2[:, :48].contiguous()
    y, ni = skinny_linear(x, w, residual=res, norm_out=nw)
    out = skinny_linear(None, w3, rms=ni, eps=1e-6)
    _close(out, F.linear(reference_rms_norm(y, nw, 1e-6), w3), torch.bfloat16)
    for m in (0, 17, 36):
        _, one = skinny_linear(x[m : m + 1], w, residual=res[m : m + 1], norm_out=nw)
        assert torch.equal(one.ss[:, 0], ni.ss[:, m]) and torch.equal(one.x[0], ni.x[m]), m
        assert torch.equal(skinny_linear(None, w3, rms=one, eps=1e-6)[0], out[m]), m


@pytest.mark.gpu  # (also on the CPU: the mark puts it in the GPU runs' `-m gpu`, which had left it out)
@pytest.mark.parametrize("config", [(16, 16, 4, 1, 1), (16, 16, 4, 1, 2), (32, 32, 4, 1, 2)])
@pytest.mark.parametrize("block_m", [32, 64])
@pytest.mark.parametrize("M", [70, 262])  # a mid tile's call (splits in programs of their own), a wide tile's
def test_skinny_linear_wide_tiles_keep_the_bits(config, block_m, M):
    """Rows in tiles of block_m (below WIDE_ROWS rows the K splits programs of their own, their
    partials added by the last to arrive; from it summed in the program, in split order) give the
    16-row tiles' bits, row for row: the plain GEMM, both epilogues and the norm between two GEMMs.
    A tile reducing its splits in another order, or rows whose arithmetic followed the tile, would differ."""
    g = torch.Generator(device=DEVICE).manual_seed(21)
    x, w, w2, res = _linear_case(M, 48, 64, torch.bfloat16, g)
    for name, (kw, ref) in _linear_variants(x, w, w2, res).items():
        narrow = skinny_linear(x, w, config=config, **kw)
        _close(narrow, ref, torch.bfloat16)
        wide = skinny_linear(x, w, config=config, block_m=block_m, **kw)
        assert torch.equal(_bits(wide), _bits(narrow)), name
    nw, w3 = _rand(48, dtype=torch.bfloat16, scale=0.3, gen=g), w2[:, :48].contiguous()
    y, ni = skinny_linear(x, w, residual=res, norm_out=nw, config=config)
    y_w, ni_w = skinny_linear(x, w, residual=res, norm_out=nw, config=config, block_m=block_m)
    assert torch.equal(_bits(y_w), _bits(y)) and torch.equal(_bits(ni_w.x), _bits(ni.x))
    assert torch.equal(_bits(ni_w.ss), _bits(ni.ss))
    cfg3 = config[:4] + (1,)  # (K = 48: one split)
    out = skinny_linear(None, w3, rms=ni, eps=1e-6, config=cfg3)
    assert torch.equal(_bits(skinny_linear(None, w3, rms=ni, eps=1e-6, config=cfg3, block_m=block_m)), _bits(out))
    with pytest.raises(ValueError, match="block_m"):
        skinny_linear(x, w, block_m=24)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("config", [(16, 256, 4, 3, 1), (32, 256, 4, 4, 4)])
@pytest.mark.parametrize("N,K", [(1024, 384), (4096, 4096)])
def test_skinny_linear_narrow_wide_tiles_keep_the_bits_gpu(N, K, config):
    """Compiled, 16- and 32-row configs (mma.sync on Hopper) at the bundled model's and the 9B's
    sizes: wide tiles of the same BLOCK_N (block_m x rows as the dot's N, an mma.sync too) give the
    16-row tiles' bits (what wide_tile takes below WGMMA_ROWS; passed on an H100, run 173)."""
    from nextn.ops.linear_configs import WIDE_SMEM

    if K % (config[1] * config[4]):
        pytest.skip("split does not fit K")
    g = torch.Generator(device=DEVICE).manual_seed(N + K)
    x, w, w2, res = _linear_case(300, N, K, torch.bfloat16, g)
    for name, (kw, _) in _linear_variants(x, w, w2, res).items():
        narrow = skinny_linear(x, w, config=config, **kw)
        for block_m in (64, 128):  # pipeline stages within the wide tiles' shared memory (no bits depend on them)
            stages = min(3, WIDE_SMEM // ((2 if "silu" in name else 1) * 2 * config[0] + 2 * block_m) // config[1])
            wide = skinny_linear(x, w, config=config[:3] + (stages,) + config[4:], block_m=block_m, **kw)
            assert torch.equal(_bits(wide), _bits(narrow)), (name, block_m)


@pytest.mark.parametrize("block_m", [16, 64])
def test_skinny_linear_norm_sums_in_halves_of_a_block(block_m):
    """A residual GEMM writing the next norm's input at twice a config's BLOCK_N stores two sums of
    squares a program, one per half (norm_block): the same partials, bit for bit, as programs of
    BLOCK_N / 2 columns (what a wide tile of 128 columns keeps of the 16-row tiles' 64), so the
    projection reading them gives the same rows. Summing a whole block once would group them anew."""
    g = torch.Generator(device=DEVICE).manual_seed(23)
    x, w, _, res = _linear_case(40, 64, 64, torch.bfloat16, g)
    nw = _rand(64, dtype=torch.bfloat16, scale=0.3, gen=g)
    w3 = _rand(24, 64, dtype=torch.bfloat16, scale=0.125, gen=g)
    narrow, wide = (16, 32, 4, 1, 1), (32, 32, 4, 1, 1)
    y, ni = skinny_linear(x, w, residual=res, norm_out=nw, config=narrow)
    y2, ni2 = skinny_linear(x, w, residual=res, norm_out=nw, config=wide, block_m=block_m, norm_block=16)
    assert torch.equal(_bits(y2), _bits(y)) and torch.equal(_bits(ni2.x), _bits(ni.x))
    assert ni2.ss.shape == ni.ss.shape == (4, 40) and torch.equal(_bits(ni2.ss), _bits(ni.ss))
    out = skinny_linear(None, w3, rms=ni, eps=1e-6, config=(16, 32, 4, 1, 1))
    assert torch.equal(_bits(skinny_linear(None, w3, rms=ni2, eps=1e-6, config=(16, 32, 4, 1, 1))), _bits(out))
    _close(out, F.linear(reference_rms_norm(y, nw, 1e-6), w3), torch.bfloat16)
    _, whole = skinny_linear(x, w, residual=res, norm_out=nw, config=wide, block_m=block_m)
    assert whole.ss.shape == (2, 40)  # (one sum a block: another grouping of the same squares)
    for bad in (8, 24):
        with pytest.raises(ValueError, match="norm_block"):
            skinny_linear(x, w, residual=res, norm_out=nw, config=wide, norm_block=bad)


def test_wide_tiles_only_where_the_16_row_tiles_are_wgmma(monkeypatch):
    """A shape whose 16-row config is narrower than WGMMA_ROWS (its dot an mma.sync on Hopper, which
    sums a k-step otherwise than a wide tile's wgmma: run 171) takes wide tiles of its own BLOCK_N and
    warps (an mma.sync again), over bf16 and Q8_0 weights; from WGMMA_ROWS, wide tiles of 64-128
    weight rows (a wgmma). Every wide tile keeps the shape's split, and its BLOCK_K, but for bf16
    weights of a wgmma config (writing a norm input too, where 128 columns keep its sums' grouping):
    k-tiles of WIDE_K (the same k16 steps, in order), loaded WIDE_WAY's way."""
    from nextn.ops import linear_configs as cfgs

    narrow_cfg, wgmma_cfg = (32, 256, 2, 4, 4), (cfgs.WGMMA_ROWS, 256, 4, 3, 4)
    for narrow in (narrow_cfg, wgmma_cfg):
        monkeypatch.setitem(cfgs.CONFIGS, (4096, 4096), narrow)
        monkeypatch.setitem(cfgs.Q8_0_CONFIGS, (4096, 4096), narrow)
        for quant, w_bytes in (("", 2), ("q8_0", 1)):
            for dual, norm_out in ((False, False), (True, False), (False, True)):
                block_m, config = cfgs.wide_tile(4096, 4096, dual, 2, norm_out, quant=quant, w_bytes=w_bytes)
                wide_k = narrow == wgmma_cfg and not quant  # (norm_out: BLOCK_N 128 is twice the 16-row tiles')
                block_k = cfgs.WIDE_K if wide_k else 256
                assert block_m > cfgs.TILE_ROWS and config[1::3] == (block_k, 4), (narrow, quant, dual, norm_out)
                if wide_k:  # 128 x 128, WIDE_STAGES deep: two weights' tiles too (run 183)
                    assert (block_m, *config[:4]) == (128, 128, cfgs.WIDE_K, 8, cfgs.WIDE_STAGES), dual
                    assert config[5:] == ((cfgs.WIDE_WAY,) if cfgs.WIDE_WAY else ()), (dual, norm_out)
                else:
                    assert config[5:] == (), (narrow, quant, dual, norm_out)
                if narrow == narrow_cfg:  # the mma.sync's BLOCK_N and warps
                    assert config[:3] == narrow[:3], (quant, dual, norm_out)
                else:  # a wgmma's 64-128 weight rows
                    assert config[0] >= cfgs.WGMMA_ROWS, (quant, dual, norm_out)


@gpu
@pytest.mark.parametrize("N,K", [(1024, 384), (384, 1024), (384, 384), (8192, 384)])
def test_default_narrow_wide_tiles_keep_each_rows_bits_gpu(N, K):
    """The bundled model's shapes compiled (16- and 32-row defaults, mma.sync): a default call of
    WIDE_ROWS + 4 rows runs in wide tiles of the 16-row config's BLOCK_N, and each of its rows equals
    the row alone (a 16-row tile), bit for bit, in every fusion and in the norm between two GEMMs
    (norm_out's sums of squares, then a projection reading them)."""
    from nextn.ops.linear_configs import TILE_ROWS, WIDE_ROWS, pick_config, wide_tile

    assert pick_config(N, K)[0] < 64 and wide_tile(N, K, False, 2)[0] > TILE_ROWS
    g = torch.Generator(device=DEVICE).manual_seed(N + 7 * K)
    rows = (0, 17, 130, WIDE_ROWS + 3)
    x, w, w2, res = _linear_case(WIDE_ROWS + 4, N, K, torch.bfloat16, g)
    for name, (kw, ref) in _linear_variants(x, w, w2, res).items():
        out = skinny_linear(x, w, **kw)
        _close(out, ref, torch.bfloat16)
        for m in rows:
            one = {k: (v[m : m + 1] if k == "residual" else v) for k, v in kw.items()}
            assert torch.equal(_bits(skinny_linear(x[m : m + 1], w, **one)[0]), _bits(out[m])), (name, m)
    nw = _rand(N, dtype=torch.bfloat16, scale=0.3, gen=g)
    w3 = _rand(96, N, dtype=torch.bfloat16, scale=N**-0.5, gen=g)
    y, ni = skinny_linear(x, w, residual=res, norm_out=nw)
    out = skinny_linear(None, w3, rms=ni, eps=1e-6)
    _close(out, F.linear(reference_rms_norm(y, nw, 1e-6), w3), torch.bfloat16)
    for m in rows:
        y1, n1 = skinny_linear(x[m : m + 1], w, residual=res[m : m + 1], norm_out=nw)
        assert torch.equal(_bits(y1[0]), _bits(y[m])) and torch.equal(_bits(n1.ss[:, 0]), _bits(ni.ss[:, m])), m
        assert torch.equal(_bits(skinny_linear(None, w3, rms=n1, eps=1e-6)[0]), _bits(out[m])), m


@pytest.mark.skipif(
    CUDA, reason="the interpreter's configs (a GPU's are narrow): test_mid_tiles_keep_each_rows_bits_gpu"
)
def test_calls_between_16_and_wide_rows_take_mid_tiles(monkeypatch):
    """A default call of 17 to WIDE_ROWS - 1 rows (a verify's, a batch's decode, a prompt's tail) over
    bf16 weights of a wgmma config runs in mid tiles: the 16-row config (BLOCK_N, BLOCK_K, warps, split)
    with up to MID_ROWS rows a program, fewer where the accumulators pass MID_ACC_REGS a thread, no two
    stages fit WIDE_SMEM or the launch falls below NUM_SMS programs; each row, and the next norm's sums,
    what the 16-row tiles give, in every fusion."""
    from nextn.ops import linear_configs as cfgs
    from nextn.ops import triton_linear

    assert cfgs.mid_tile(4096, 4096, 17, False, 2)[0] == 32
    assert cfgs.mid_tile(4096, 4096, 200, False, 2) == (cfgs.MID_ROWS, cfgs.CONFIGS[(4096, 4096)])
    assert cfgs.mid_tile(248320, 4096, 200, False, 2)[0] == 64  # (128 x 128 accumulators over 4 warps: 128 a thread)
    assert cfgs.mid_tile(4096, 4096, 100, False, 2, "q8_0") == (16, cfgs.Q8_0_CONFIGS[(4096, 4096)])  # (no GPU run)
    assert cfgs.mid_tile(1024, 384, 200, False, 2)[0] == 16  # (an mma.sync config: the bundled model's)
    taken = []

    def spy(*args, **kwargs):
        taken.append(cfgs.mid_tile(*args, **kwargs))
        return taken[-1]

    monkeypatch.setattr(triton_linear, "mid_tile", spy)
    g = torch.Generator(device=DEVICE).manual_seed(31)
    M, N, K = 100, 96, 128
    x, w, w2, res = _linear_case(M, N, K, torch.bfloat16, g)
    cfg = cfgs.pick_config(N, K)
    assert cfg[0] >= cfgs.WGMMA_ROWS and cfgs.mid_tile(N, K, M, False, 2)[0] == cfgs.TILE_ROWS  # (too few programs)
    monkeypatch.setattr(cfgs, "NUM_SMS", 1)  # (the interpreter's shapes: a launch of a few programs)
    for name, (kw, ref) in _linear_variants(x, w, w2, res).items():
        taken.clear()
        out = skinny_linear(x, w, **kw)
        assert taken and taken[0][0] > cfgs.TILE_ROWS and taken[0][1][:3] == cfg[:3], name
        _close(out, ref, torch.bfloat16)
        assert torch.equal(_bits(out), _bits(skinny_linear(x, w, block_m=16, **kw))), name
    nw = _rand(N, dtype=torch.bfloat16, scale=0.3, gen=g)
    y, ni = skinny_linear(x, w, residual=res, norm_out=nw)
    y16, ni16 = skinny_linear(x, w, residual=res, norm_out=nw, block_m=16)
    assert torch.equal(_bits(y), _bits(y16)) and torch.equal(_bits(ni.ss), _bits(ni16.ss))
    taken.clear()
    skinny_linear(x[:16], w)
    assert not taken  # (16 rows: one 16-row tile)


@gpu
@pytest.mark.parametrize("M", [24, 64, 130, 260])
@pytest.mark.parametrize("N,K", [(4096, 4096), (12352, 4096), (4096, 12288), (1024, 384)])
def test_mid_tiles_keep_each_rows_bits_gpu(N, K, M):
    """Compiled at the 9B's shapes (wgmma 16-row configs) and the bundled model's (mma.sync): a default
    call of M rows (mid tiles, linear_configs.mid_tile; from WIDE_ROWS wide tiles, in k-tiles of WIDE_K
    where no norm input is written) gives the 16-row tiles' bits in every fusion and in the norm between
    two GEMMs (x rows as the dot's N: 32-128 where the 16-row tiles have 16)."""
    g = torch.Generator(device=DEVICE).manual_seed(N + 3 * K + M)
    x, w, w2, res = _linear_case(M, N, K, torch.bfloat16, g)
    for name, (kw, ref) in _linear_variants(x, w, w2, res).items():
        out = skinny_linear(x, w, **kw)
        _close(out, ref, torch.bfloat16)
        assert torch.equal(_bits(out), _bits(skinny_linear(x, w, block_m=16, **kw))), name
    nw = _rand(N, dtype=torch.bfloat16, scale=0.3, gen=g)
    w3 = _rand(96, N, dtype=torch.bfloat16, scale=N**-0.5, gen=g)
    y, ni = skinny_linear(x, w, residual=res, norm_out=nw)
    y16, ni16 = skinny_linear(x, w, residual=res, norm_out=nw, block_m=16)
    assert torch.equal(_bits(y), _bits(y16)) and torch.equal(_bits(ni.ss), _bits(ni16.ss))
    out = skinny_linear(None, w3, rms=ni, eps=1e-6)
    assert torch.equal(_bits(out), _bits(skinny_linear(None, w3, rms=ni16, eps=1e-6, block_m=16)))


def test_skinny_linear_default_wide_tiles_keep_each_rows_bits():
    """With the default configs a call of WIDE_ROWS rows runs in wide tiles (wide_tile): each row of
    a residual GEMM writing the next norm's input, and of the projection reading it, equals the row
    computed alone (16-row tiles). The next norm's sums of squares are partials per BLOCK_N columns,
    so a wide tile of another BLOCK_N would regroup them (another rstd): wide_tile keeps it there."""
    from nextn.ops.linear_configs import WIDE_ROWS

    g = torch.Generator(device=DEVICE).manual_seed(5)
    M, N, K = WIDE_ROWS + 4, 384, 64
    x, w, w2, res = _linear_case(M, N, K, torch.bfloat16, g)
    nw = _rand(N, dtype=torch.bfloat16, scale=0.3, gen=g)
    w3 = _rand(96, N, dtype=torch.bfloat16, scale=N**-0.5, gen=g)
    y, ni = skinny_linear(x, w, residual=res, norm_out=nw)
    out = skinny_linear(None, w3, rms=ni, eps=1e-6)
    _close(out, F.linear(reference_rms_norm(y, nw, 1e-6), w3), torch.bfloat16)
    for m in (0, 130, M - 1):
        y1, n1 = skinny_linear(x[m : m + 1], w, residual=res[m : m + 1], norm_out=nw)
        assert torch.equal(_bits(y1[0]), _bits(y[m])) and torch.equal(_bits(n1.ss[:, 0]), _bits(ni.ss[:, m])), m
        assert torch.equal(_bits(skinny_linear(None, w3, rms=n1, eps=1e-6)[0]), _bits(out[m])), m


# ---------------------------------------------------------------------------------------------
# the H200: Qwen3.5-9B shapes in bf16


@gpu
@pytest.mark.parametrize(
    "N,K,kind",
    [
        (12352, 4096, "plain"),
        (4096, 4096, "residual"),
        (12288, 4096, "silu_mul"),
        (4096, 12288, "residual"),
        (10240, 4096, "plain"),
        (248320, 4096, "plain"),
    ],
)
@pytest.mark.parametrize("config", [None, (64, 128, 4, 4, 1, 1), (128, 128, 8, 3, 2, 1)])
def test_skinny_linear_9b_shapes_gpu(N, K, kind, config):
    g = torch.Generator(device=DEVICE).manual_seed(N + K)
    x, w, w2, res = _linear_case(9, N, K, torch.bfloat16, g)
    kw, ref = _linear_variants(x, w, w2, res)[kind]
    out = skinny_linear(x, w, config=config, **kw)
    _close(out, ref, torch.bfloat16)
    for m in (0, 3, 8):
        one = {k: (v[m : m + 1] if k == "residual" else v) for k, v in kw.items()}
        assert torch.equal(skinny_linear(x[m : m + 1], w, config=config, **one)[0], out[m]), m


@gpu
@pytest.mark.parametrize("producer,consumer", [((4096, 4096), (12288, 4096)), ((4096, 12288), (12352, 4096))])
def test_skinny_linear_norm_between_9b_shapes_gpu(producer, consumer):
    """The norm between a residual GEMM and the next projection (norm_out, then rms), at the tuned or
    default configs of the 9B's shapes: the norm then F.linear, rows invariant, on the GPU's dots."""
    g = torch.Generator(device=DEVICE).manual_seed(producer[1])
    x, w, _, res = _linear_case(9, *producer, torch.bfloat16, g)
    nw = _rand(producer[0], dtype=torch.bfloat16, scale=0.3, gen=g)
    wa, wb = (_rand(*consumer, dtype=torch.bfloat16, scale=consumer[1] ** -0.5, gen=g) for _ in range(2))
    y, ni = skinny_linear(x, w, residual=res, norm_out=nw)
    assert torch.equal(y, skinny_linear(x, w, residual=res))
    h = reference_rms_norm(y, nw, 1e-6)
    kw, ref = (
        (dict(up_weight=wb), F.silu(F.linear(h, wa)) * F.linear(h, wb)) if consumer[0] == 12288 else ({}, h @ wa.T)
    )
    out = skinny_linear(None, wa, rms=ni, eps=1e-6, **kw)
    _close(out, ref, torch.bfloat16)
    for m in (0, 3, 8):
        y1, n1 = skinny_linear(x[m : m + 1], w, residual=res[m : m + 1], norm_out=nw)
        assert torch.equal(n1.x[0], ni.x[m]) and torch.equal(n1.ss[:, 0], ni.ss[:, m])
        assert torch.equal(skinny_linear(None, wa, rms=n1, eps=1e-6, **kw)[0], out[m]), m


@gpu
def test_skinny_linear_programmatic_dependent_launches_gpu():
    """pdl=True (the default on Hopper: each call starts before the kernel ahead has finished and waits
    in-kernel) gives plain launches' bits through a chain where every call reads
    the output of the one before: residual GEMMs writing the next norm's input, split-K sums, the
    SwiGLU over the norm, a call behind a run_if flag and torch ops between; eagerly and replayed in a
    CUDA graph. A call that read its input before the kernel ahead wrote it would differ."""
    if not triton_utils.pdl_supported(torch.empty(1, device=DEVICE)):
        pytest.skip("programmatic dependent launches need compute capability 9 or later")
    H, I, layers = 4096, 12288, 3
    g = torch.Generator(device=DEVICE).manual_seed(11)
    x = _rand(4, H, dtype=torch.bfloat16, gen=g)
    nw = _rand(H, dtype=torch.bfloat16, scale=0.3, gen=g)
    flag = torch.ones((), device=DEVICE, dtype=torch.int32)
    w = [
        [
            _rand(*shape, dtype=torch.bfloat16, scale=shape[1] ** -0.5, gen=g)
            for shape in ((H, H), (I, H), (I, H), (H, I))
        ]
        for _ in range(layers)
    ]

    def chain(h, pdl):
        for wo, wg, wu, wd in w:
            y, ni = skinny_linear(h, wo, residual=h, norm_out=nw, pdl=pdl)
            a = skinny_linear(None, wg, up_weight=wu, rms=ni, eps=1e-6, pdl=pdl)
            h = skinny_linear(a, wd, residual=y, pdl=pdl)
            h = skinny_linear(h, wo, run_if=flag, out=torch.zeros_like(h), pdl=pdl) * 0.5
        return h

    plain = chain(x, False)
    assert torch.isfinite(plain).all() and plain.abs().max() > 0
    assert torch.equal(chain(x, True), plain)
    static_x = x.clone()
    chain(static_x, True)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(static_x, True)
    for _ in range(3):
        out.zero_()
        graph.replay()
        assert torch.equal(out, plain)


@gpu
@pytest.mark.parametrize("preconv", [False, True])
def test_gdn_step_9b_shapes_gpu(preconv):
    """Qwen3.5-9B's GDN heads at the model's launch config (`triton_gdn.launch_config`, one for every
    call): a prefill step (its conv in the row loop, or from the pre-pass with each row's inputs
    loaded a row ahead, f12daf8) against the reference; a verify of the same rows gives the same
    outputs, and after keeping 4 of them the next step (their states folded from the verify's window
    and gates) gives rows 4.. and the last state bitwise."""
    H, HV, K, V, W, T, eps, T_max = 16, 32, 128, 128, 4, 9, 1e-6, 16
    half = W - 1 + T_max
    g = torch.Generator(device=DEVICE).manual_seed(5)
    c = _gdn_case(T, H, HV, K, V, W, torch.bfloat16, g)
    out, (window, states, _) = _run_gdn_step(
        c, H, HV, K, V, W, eps, T_max=T_max, store_all=False, preconv=T if preconv else None
    )
    ref_out, ref_states, ref_window = _gdn_reference(c, H, HV, K, V, eps)
    _close(out, ref_out, torch.bfloat16)
    # the kernel's SiLU (tl.exp) can round a bf16 conv output one ulp off torch's, and the state
    # integrates v, k over the tokens: 0.0159 was the largest difference seen on an H200
    torch.testing.assert_close(states[1], ref_states[-1], rtol=2**-6, atol=2**-5)
    assert torch.equal(window[:, half : half + W - 1], ref_window[:, T:])
    verify_out, (vwin, vstates, vgates) = _run_gdn_step(c, H, HV, K, V, W, eps, T_max=T_max)
    assert torch.equal(verify_out, out)
    rest = dict(c, proj=c["proj"][4:])
    bufs = (vwin.clone(), vstates.clone(), vgates.clone())
    rest_out, (_, st, _) = _run_gdn_step(
        rest, H, HV, K, V, W, eps, T_max=T_max, slots=[1, 0, half + 4, 0, 4], store_all=False, bufs=bufs,
        preconv=T - 4 if preconv else None,
    )  # fmt: skip
    assert torch.equal(rest_out, out[4:]) and torch.equal(st[0], states[1])


@gpu
def test_chunk_rule_9b_shapes_gpu():
    """Qwen3.5-9B's GDN heads over a 512-token prompt, v in bf16, as prefill runs it."""
    g = torch.Generator(device=DEVICE).manual_seed(8)
    q, k, v, gate, beta, state = _chunk_case(1, 517, 16, 32, 128, 128, torch.bfloat16, g)
    o, final = triton_chunk_rule(q, k, v, gate, beta, state)
    ref_o, ref_final = chunk_gated_delta_rule(q, k, v, gate, beta, state)
    _close(o, ref_o, torch.bfloat16)
    torch.testing.assert_close(final, ref_final, rtol=1e-4, atol=1e-4)


@gpu
def test_grouped_experts_35b_shapes_gpu():
    """Qwen3.5-35B-A3B's experts over a 517-token prompt in bf16, as prefill runs them."""
    g = torch.Generator(device=DEVICE).manual_seed(11)
    x, top_idx, top_w, gate_up, down = _experts_case(517, 2048, 256, 512, 8, torch.bfloat16, g)
    out = grouped_experts(x, top_idx, top_w, gate_up, down)
    ref = routed_experts(x, top_idx, top_w, gate_up, down)
    _close(out, ref, torch.bfloat16)


@gpu
def test_step_attention_9b_shapes_gpu():
    Hq, Hkv, D, max_len, T, start = 16, 4, 256, 1024, 9, 700
    g = torch.Generator(device=DEVICE).manual_seed(6)
    dtype = torch.bfloat16
    qkv, key, value, q_norm, k_norm = _attn_case(T, start, Hq, Hkv, D, max_len, dtype, g)
    rotary = RotaryEmbedding(64, 1e7).to(DEVICE)
    cos, sin = rotary.cos_sin(torch.arange(max_len, device=DEVICE), dtype)
    ref, _, _ = _attn_reference(qkv, key, value, q_norm, k_norm, start, Hq, Hkv, D, rotary, dtype)
    key1, value1 = key.clone(), value.clone()
    out = _attn_run(qkv, key, value, q_norm, k_norm, start, Hq, cos, sin, chunk=128)
    _close(out, ref[0], dtype)
    for t in range(T):  # row by row, as plain decoding runs them
        one = _attn_run(qkv[t : t + 1], key1, value1, q_norm, k_norm, start + t, Hq, cos, sin, chunk=128)
        assert torch.equal(one[0], out[t]), t


# ---------------------------------------------------------------------------------------------
# sparse MoE block


def _moe_block(E, k, H, I, Is, dtype, seed):
    from nextn.config.model import ModelConfig
    from nextn.layers.ffn import SparseMoeBlock

    cfg = ModelConfig(
        family="qwen3_5_moe",
        vocab_size=16,
        hidden_size=H,
        num_hidden_layers=1,
        layer_types=("full_attention",),
        rms_norm_eps=1e-6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        rope_theta=1e4,
        partial_rotary_factor=0.25,
        attention_bias=False,
        max_position_embeddings=64,
        linear_num_key_heads=1,
        linear_num_value_heads=1,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        intermediate_size=0,
        num_experts=E,
        num_experts_per_tok=k,
        moe_intermediate_size=I,
        shared_expert_intermediate_size=Is,
    )
    block = SparseMoeBlock(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return block.to(device=DEVICE, dtype=dtype)


EPS = 1e-6


def _moe_run(block, x, norm, residual=True, **blocks):
    from nextn.ops.triton_moe import moe_step

    se = block.shared_expert
    return moe_step(
        x,
        norm,
        EPS,
        torch.cat([block.gate.weight, block.shared_expert_gate.weight]),  # as TritonStep concatenates them
        block.experts.gate_up_proj,
        block.experts.down_proj,
        se.gate_proj.weight,
        se.up_proj.weight,
        se.down_proj.weight,
        block.gate.top_k,
        block.gate.norm_topk_prob,
        residual=residual,
        **blocks,
    )


def _untied_rows(block, norm, T, H, dtype, g):
    """Rows whose normalised router logits have no tie at the top-k boundary (ties may pick either
    expert)."""
    rows = []
    while len(rows) < T:
        x = _rand(1, H, dtype=dtype, gen=g)
        logits = F.linear(reference_rms_norm(x, norm, EPS), block.gate.weight)[0].float().sort(descending=True).values
        if logits[block.gate.top_k - 1] != logits[block.gate.top_k]:
            rows.append(x)
    return torch.cat(rows)


@pytest.mark.parametrize(
    ("dtype", "I", "Is"), [(torch.float32, 16, 24), (torch.bfloat16, 16, 24), (torch.bfloat16, 40, 8)]
)
def test_moe_step_matches_reference_and_rows_are_invariant(dtype, I, Is):
    # the shared expert's intermediate size below and above the routed experts' (40: a partial block)
    block = _moe_block(E=8, k=3, H=32, I=I, Is=Is, dtype=dtype, seed=0)
    g = torch.Generator(device=DEVICE).manual_seed(4)
    norm = _rand(32, dtype=dtype, scale=0.5, gen=g)
    x = _untied_rows(block, norm, 5, 32, dtype, g)
    ref = block(reference_rms_norm(x, norm, EPS))
    for residual in (True, False):  # False: tensor parallelism's partial sum, no residual
        out = _moe_run(block, x, norm, residual)
        _close(out, x + ref if residual else ref, dtype)
        # the down kernel's last program per (row, block of H) re-armed its counter; other block
        # sizes give the same bits
        assert not triton_utils._COUNTERS[out.device].any()
        assert torch.equal(_moe_run(block, x, norm, residual, gate_up_blocks=(8, 2), down_blocks=(32, 8)), out)
        for t in range(5):  # each row as a decode step computes it alone
            assert torch.equal(_moe_run(block, x[t : t + 1], norm, residual)[0], out[t]), t


def test_moe_step_writes_the_next_norms_input():
    """norm_out: the block's output bitwise as without it, and the next norm's NormInput as a residual
    skinny GEMM writes it (output times (1 + w), sums of squares per block of H), each row's alone;
    the GEMM reading it equals the norm then the GEMM."""
    dtype = torch.bfloat16
    block = _moe_block(E=8, k=3, H=64, I=32, Is=40, dtype=dtype, seed=1)
    g = torch.Generator(device=DEVICE).manual_seed(6)
    norm, nw = _rand(64, dtype=dtype, scale=0.5, gen=g), _rand(64, dtype=dtype, scale=0.3, gen=g)
    x = _untied_rows(block, norm, 4, 64, dtype, g)
    plain = _moe_run(block, x, norm)
    out, ni = _moe_run(block, x, norm, norm_out=nw, down_blocks=(16, 4))
    assert torch.equal(out, plain) and ni.ss.shape == (4, 4)  # 64 columns in blocks of 16
    assert torch.equal(ni.x, (out.float() * (1.0 + nw.float())).to(dtype))
    torch.testing.assert_close(ni.ss.sum(0), out.float().pow(2).sum(1), rtol=1e-5, atol=1e-5)
    for t in range(4):
        _, one = _moe_run(block, x[t : t + 1], norm, norm_out=nw, down_blocks=(16, 4))
        assert torch.equal(one.x[0], ni.x[t]) and torch.equal(one.ss[:, 0], ni.ss[:, t]), t
    w = _rand(24, 64, dtype=dtype, scale=0.125, gen=g)
    _close(skinny_linear(None, w, rms=ni, eps=EPS), F.linear(reference_rms_norm(out, nw, EPS), w), dtype)
    with pytest.raises(ValueError, match="norm_out"):
        _moe_run(block, x, norm, residual=False, norm_out=nw)


def test_moe_norm_router_kernel_matches_reference_and_rows_are_invariant():
    """The block's first kernel at the 35B-A3B router's shape (257 rows over ROUTER_BLOCKS'
    programs, a partial last one): the post-attention norm, the router and shared gate logits, and
    the routing the row's last program computes. Every program normalises the row itself: h and
    the logits agree with the reference's norm and linear, the routing is the reference router's
    (rows without a tie at the top-k boundary), and a row's results do not depend on the rows
    beside it."""
    from nextn.ops import triton_moe

    dtype, T, H, E, k, stride = torch.bfloat16, 3, 2048, 256, 8, 272
    block = _moe_block(E=E, k=k, H=H, I=16, Is=16, dtype=dtype, seed=2)
    g = torch.Generator(device=DEVICE).manual_seed(5)
    norm = _rand(H, dtype=dtype, scale=0.5, gen=g)
    x = _untied_rows(block, norm, 2 * T, H, dtype, g)
    gates = torch.cat([block.gate.weight, block.shared_expert_gate.weight])

    def run(rows):
        n = rows.shape[0]
        h, logits = torch.empty_like(rows), torch.full((n, stride), float("nan"), device=DEVICE, dtype=dtype)
        idx, rw = torch.empty(n, k, device=DEVICE, dtype=torch.int32), torch.empty(n, k + 1, device=DEVICE, dtype=dtype)
        counters = triton_utils.arrival_counters(rows.device, n)
        per_program, warps = triton_moe.ROUTER_BLOCKS
        triton_moe._norm_router_kernel[(n, -(-(E + 1) // per_program))](
            rows, norm, gates, h, logits, counters, idx, rw, EPS, H=H, E=E, LOGIT_STRIDE=stride, TOP_K=k,
            RENORM=True, BLOCK_R=per_program, BLOCK_H=H, BLOCK_E=E, WARPS=warps, PDL=False, RELEASE=0, num_warps=warps,
        )  # fmt: skip
        assert logits[:, E + 1 :].isnan().all()  # nothing written past the E + 1 logits
        assert not counters.any()  # the last program re-armed its row's counter
        return h, logits[:, : E + 1], idx, rw

    top = run(x)[1][:, :E].float().sort(dim=-1, descending=True).values
    x = x[top[:, k - 1] != top[:, k]][:T]  # no tie at the boundary in the kernel's logits either
    h, logits, idx, rw = run(x)
    want = reference_rms_norm(x, norm, EPS)
    _close(h, want, dtype)
    _close(logits, F.linear(want.float(), gates.float()).to(dtype), dtype)
    probs = torch.softmax(logits[:, :E].float(), dim=-1)  # the reference router's law on these logits
    top_w, top_idx = torch.topk(probs, k, dim=-1)
    order = top_idx.sort(dim=-1)
    assert torch.equal(idx.long(), order.values)  # ascending expert ids
    _close(rw[:, :k], (top_w / top_w.sum(-1, keepdim=True)).gather(-1, order.indices).to(dtype), dtype)
    _close(rw[:, k], torch.sigmoid(logits[:, E].float()).to(dtype), dtype)
    assert len(x) == T
    for t in range(T):
        one = run(x[t : t + 1])
        for a, b in zip(one, (h, logits, idx, rw), strict=True):
            assert torch.equal(a[0], b[t]), t


@gpu
def test_bf16_rounded_is_the_convert_bit_for_bit_gpu():
    """triton_moe.bf16_rounded (a packed cvt.rn.bf16x2.f32 a pair) equals torch's float32 -> bf16 ->
    float32 on every value: random magnitudes, exact ties at bf16's last bit (to even), subnormals,
    signed zeros, the largest finite floats (to inf) and infinities."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 16,), generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    x = torch.where(x.isnan(), torch.zeros_like(x), x)
    ties = (torch.randn(4096, generator=g).bfloat16().float().view(torch.int32) | 0x8000).view(torch.float32)
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3.4e38, -3.4e38, float("inf"), float("-inf")])
    x = torch.cat([x, ties, special, torch.randn(4096 - special.numel(), generator=g)]).to(DEVICE)
    y = torch.empty_like(x)
    _bf16_rounded_kernel[(x.numel() // 1024,)](x, y, BLOCK=1024)
    assert torch.equal(y.view(torch.int32), x.bfloat16().float().view(torch.int32))


@pytest.mark.parametrize("E,k", [(16, 4), (40, 10)])
def test_moe_routing_breaks_ties_by_the_lowest_id(E, k):
    """The routing's rule at ties (the reference router's torch.topk leaves their order open): the
    k largest probabilities, a tie at the boundary and above it going to the lowest ids. Router rows
    that are multiples of the row's own normalised input give logits equal wherever the multiples
    are (the same row computed the same way), on a coarse grid with many repeats."""
    from nextn.ops import triton_moe

    dtype, H = torch.bfloat16, 64
    g = torch.Generator(device=DEVICE).manual_seed(E)
    x = _rand(1, H, dtype=dtype, gen=g)
    norm = torch.zeros(H, device=DEVICE, dtype=dtype)
    h = reference_rms_norm(x, norm, EPS)[0]
    grid = torch.tensor([3, 1, 2, 3, 0, 2, 3, 1, 2, 0, 3, 2, 1, 3, 2, 2], device=DEVICE)  # repeats of 4 levels
    scale = grid.repeat(-(-E // grid.numel()))[:E].to(dtype) / 4
    gates = torch.cat([scale[:, None] * h[None], h[None]]).to(dtype)
    stride = -(-(E + 1) // 16) * 16
    out_h, logits = torch.empty_like(x), torch.empty(1, stride, device=DEVICE, dtype=dtype)
    idx, rw = torch.empty(1, k, device=DEVICE, dtype=torch.int32), torch.empty(1, k + 1, device=DEVICE, dtype=dtype)
    per_program, warps = triton_moe.ROUTER_BLOCKS
    triton_moe._norm_router_kernel[(1, -(-(E + 1) // per_program))](
        x, norm, gates, out_h, logits, triton_utils.arrival_counters(x.device, 1), idx, rw, EPS, H=H, E=E,
        LOGIT_STRIDE=stride, TOP_K=k, RENORM=True, BLOCK_R=per_program, BLOCK_H=H,
        BLOCK_E=triton.next_power_of_2(E), WARPS=warps, PDL=False, RELEASE=0, num_warps=warps,
    )  # fmt: skip
    values = logits[0, :E].float()
    levels = values.unique()
    assert levels.numel() == 4  # four levels, each logit repeated (the same products, the same sums)
    ranked = sorted(range(E), key=lambda e: (-values[e].item(), e))  # largest first, then the lowest id
    assert values[ranked[k - 1]] == values[ranked[k]]  # a tie at the boundary: the rule decides
    assert idx[0].tolist() == sorted(ranked[:k])


@gpu
def test_moe_step_35b_shapes_gpu():
    block = _moe_block(E=256, k=8, H=2048, I=512, Is=512, dtype=torch.bfloat16, seed=1)
    g = torch.Generator(device=DEVICE).manual_seed(7)
    norm = _rand(2048, dtype=torch.bfloat16, scale=0.5, gen=g)
    x = _untied_rows(block, norm, 9, 2048, torch.bfloat16, g)
    out = _moe_run(block, x, norm)
    _close(out, x + block(reference_rms_norm(x, norm, EPS)), torch.bfloat16)
    for t in (0, 8):
        assert torch.equal(_moe_run(block, x[t : t + 1], norm)[0], out[t]), t
    # block sizes with BLOCK >= 2 * num_warps keep the tiles' register layout: the same bits
    for blocks in ((2, 1), (8, 4), (32, 8)):
        assert torch.equal(_moe_run(block, x, norm, gate_up_blocks=blocks, down_blocks=blocks), out), blocks
    # the down kernel as a plain launch, and the block replayed in a CUDA graph (the down kernel's
    # dependency on the gate/up kernel a programmatic edge there): the same bits
    assert torch.equal(_moe_run(block, x, norm, pdl=False), out)
    graph, static_x = torch.cuda.CUDAGraph(), x.clone()
    with torch.cuda.graph(graph):
        static_out = _moe_run(block, static_x, norm)
    for _ in range(3):
        static_out.zero_()
        graph.replay()
        assert torch.equal(static_out, out)


@pytest.mark.parametrize("split", [2, 4])
def test_split_k_matches_reference_and_rows_are_invariant(split):
    dtype = torch.bfloat16
    g = torch.Generator(device=DEVICE).manual_seed(split)
    x, w, w2, res = _linear_case(6, 40, 128, dtype, g)
    cfg = (16, 32, 4, 2, split)
    for name, (kw, ref) in _linear_variants(x, w, w2, res).items():
        out = skinny_linear(x, w, config=cfg, **kw)
        _close(out, ref, dtype)
        for m in (0, 5):
            one = {k: (v[m : m + 1] if k == "residual" else v) for k, v in kw.items()}
            assert torch.equal(skinny_linear(x[m : m + 1], w, config=cfg, **one)[0], out[m]), (name, m)
        # the last split to arrive reduces and re-arms its N block's counter for the next launch
        assert not triton_utils._COUNTERS[x.device].any(), name
        assert torch.equal(skinny_linear(x, w, config=cfg, **kw), out), name


@gpu
def test_tune_refuses_a_config_that_computes_something_else(monkeypatch):
    """A candidate config whose output is off the default config's is not chosen, however fast: here
    one that does no work (zeros), the fastest of all."""
    from nextn.ops import linear_configs, linear_tune

    real, bad = linear_tune.skinny_linear, (16, 64, 4, 2, 1)

    def patched(x, w, up_weight=None, config=None, **kw):
        if config == bad:
            return torch.zeros(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
        return real(x, w, up_weight=up_weight, config=config, **kw)

    monkeypatch.setattr(linear_tune, "skinny_linear", patched)
    saved, logs = dict(linear_configs.CONFIGS), []
    try:
        candidates = [bad, (32, 128, 4, 3, 1)]
        chosen = linear_tune.tune([(256, 512, False, "")], "cuda", candidates=candidates, log=logs.append)
    finally:
        linear_configs.CONFIGS.clear()
        linear_configs.CONFIGS.update(saved)
    assert chosen["256x512"]["config"] != list(bad)
    assert any(f"{bad}: its output is off the default config's" in line for line in logs)
