"""Gated full attention for decode / verify steps of a batch of sequences, batch-invariant.

Reference: `nextn.layers.attention.Attention` (per-head zero-centred q/k RMSNorm, partial NEOX
RoPE, causal attention over the layer's K/V cache, output * sigmoid(gate)).

Three launches, all reading each row's sequence slot and position from device tensors
(`row_slot`, `row_pos`), so a CUDA graph captured once serves every position:
- `qk_norm_rope`: normalises and rotates q and k, writes k and v into the row's slot at its position;
- `_attend_chunk_kernel`: flash-decoding over fixed chunks of CHUNK absolute positions: program
  (t, kv head, c) reduces keys [c*CHUNK, (c+1)*CHUNK) of row t into (max, sum, acc) partials of
  each q head the kv head serves (GQA: the K / V tiles loaded once for them, tensor-core dots with
  the heads as the dot's M: one row a program, so its arithmetic never depends on the batch;
  run 182, H100, the 9B's 16 q / 4 kv heads of 256, us, against a program a q head with float32
  reductions: decode of 16 rows at 600 55.8 -> 22.7, a K=3 verify of 16 x 4 rows 177.7 -> 47.9, a
  prefill of 16 x 512 rows 11,916 -> 2,755, one served wave of the 9B 460 -> 408 ms; four rows of
  a slot packed into the dots' 16 M rows, tried beside it, did not finish its tests in 120 s);
- `_combine_kernel`: merges row t's chunk partials in chunk order, applies the gate.
Chunk boundaries are absolute positions, so the row at position p is reduced in the same order
whether it is a decode's only row, a verify's row t or a row of a batch: they agree bitwise.

An fp8 cache (key / value e4m3 with a float32 scale per row [S, cap, Hkv]): `qk_norm_rope`
quantizes each K/V row it writes as nextn.ops.fp8.quantize_rows does (amax / 448, correctly
rounded divisions, round to nearest even: the same bytes), and `_attend_chunk_kernel`
dequantizes after the load (e4m3 * scale in float32, nextn.layers.attention.read_kv).
"""

from __future__ import annotations

import torch

from nextn.config import ATTENTION_CHUNK
from nextn.ops.triton_utils import HAVE_TRITON, interpreting, next_pow2, pdl_supported, row_launch

CHUNK = ATTENTION_CHUNK  # positions per partial: a row at position p reads ceil((p+1)/CHUNK) chunks

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _quantize_row(x):
        """x [D] float32 -> (e4m3 [D], float32 scale): nextn.ops.fp8.quantize_rows."""
        amax = tl.max(tl.abs(x), axis=0)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
        return tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0).to(tl.float8e4nv), scale

    @triton.jit
    def _qk_norm_rope_kernel(
        qkv_ptr,
        stride_qkv,  # [T, Hq*2*D + 2*Hkv*D]: per q head [q | gate], then k heads, then v heads
        q_norm_ptr,
        k_norm_ptr,  # [D] zero-centred norm weights
        cos_ptr,
        sin_ptr,  # [max_pos, R] rotary tables (the reference's values, in the model dtype)
        row_slot_ptr,  # int32 [T]: each row's sequence slot
        row_pos_ptr,  # int32 [T]: each row's cache position; its rope position is that + ROPE_OFFSET
        q_out_ptr,  # [T, Hq, D]
        key_ptr,
        value_ptr,  # [S, cap, Hkv, D] the layer's cache
        key_scale_ptr,
        value_scale_ptr,  # [S, cap, Hkv] float32 (FP8)
        stride_kv_slot,
        flag_ptr,  # run_if (nextn.engine.runner.ModelRunner.when): 0 skips the call
        eps,
        HQ: tl.constexpr,
        HKV: tl.constexpr,
        D: tl.constexpr,
        R: tl.constexpr,
        ROPE_OFFSET: tl.constexpr,
        FP8: tl.constexpr,  # the cache holds e4m3 rows with their scales
        HAS_FLAG: tl.constexpr,
        PDL: tl.constexpr,  # a programmatic dependent launch (nextn.ops.triton_utils.pdl_supported)
    ):
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if HAS_FLAG:
            if tl.load(flag_ptr).to(tl.int32) == 0:
                return
        t = tl.program_id(0)
        head = tl.program_id(1)
        slot = tl.load(row_pos_ptr + t)
        rope_pos = slot + ROPE_OFFSET
        kv_base = tl.load(row_slot_ptr + t).to(tl.int64) * stride_kv_slot
        offs = tl.arange(0, D)
        is_q = head < HQ
        kv_head = head - HQ
        row = qkv_ptr + t * stride_qkv
        base = tl.where(is_q, head * 2 * D, HQ * 2 * D + kv_head * D)
        half = R // 2
        rot = offs < R
        partner = tl.where(offs < half, offs + half, offs - half)
        if is_q:
            w = tl.load(q_norm_ptr + offs).to(tl.float32)
            wp = tl.load(q_norm_ptr + partner, mask=rot, other=0.0).to(tl.float32)
        else:
            w = tl.load(k_norm_ptr + offs).to(tl.float32)
            wp = tl.load(k_norm_ptr + partner, mask=rot, other=0.0).to(tl.float32)
        dtype = q_out_ptr.dtype.element_ty
        x = tl.load(row + base + offs).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        xn = (x * rstd * (1.0 + w)).to(dtype).to(tl.float32)
        # NEOX halves of the first R dims: out = x*cos + [-x2, x1]*sin, each op rounded like the reference
        xp = tl.load(row + base + partner, mask=rot, other=0.0).to(tl.float32)
        xpn = (xp * rstd * (1.0 + wp)).to(dtype).to(tl.float32)
        xpn = tl.where(offs < half, -xpn, xpn)
        cos = tl.load(cos_ptr + rope_pos * R + offs, mask=rot, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + rope_pos * R + offs, mask=rot, other=0.0).to(tl.float32)
        rotated = (xn * cos).to(dtype).to(tl.float32) + (xpn * sin).to(dtype).to(tl.float32)
        out = tl.where(rot, rotated, xn).to(dtype)
        if is_q:
            tl.store(q_out_ptr + (t * HQ + head) * D + offs, out)
        else:
            dst = kv_base + (slot * HKV + kv_head) * D + offs
            v = tl.load(row + HQ * 2 * D + HKV * D + kv_head * D + offs)
            if FP8:
                row_at = kv_base // D + slot * HKV + kv_head  # the row's scale
                k8, k_scale = _quantize_row(out.to(tl.float32))
                v8, v_scale = _quantize_row(v.to(tl.float32))
                tl.store(key_ptr + dst, k8)
                tl.store(value_ptr + dst, v8)
                tl.store(key_scale_ptr + row_at, k_scale)
                tl.store(value_scale_ptr + row_at, v_scale)
            else:
                tl.store(key_ptr + dst, out)
                tl.store(value_ptr + dst, v)

    @triton.jit(do_not_specialize=["NUM_CHUNKS"])
    def _attend_chunk_kernel(
        q_ptr,  # [T, Hq, D]
        key_ptr,
        value_ptr,  # [S, cap, Hkv, D]
        key_scale_ptr,
        value_scale_ptr,  # [S, cap, Hkv] float32 (FP8)
        stride_kv_slot,
        row_slot_ptr,
        row_pos_ptr,  # int32 [T]: each row's slot and position
        part_m_ptr,
        part_l_ptr,
        part_acc_ptr,  # [T, Hq, NUM_CHUNKS] (, D) float32 out
        flag_ptr,  # run_if: 0 skips the call
        scale,
        NUM_CHUNKS,  # partials per row and head (not specialised: an eager prefill's count follows its positions)
        HQ: tl.constexpr,
        HKV: tl.constexpr,
        D: tl.constexpr,
        CHUNK_SIZE: tl.constexpr,
        BLOCK_S: tl.constexpr,
        G_PAD: tl.constexpr,  # the kv head's q heads (HQ / HKV) padded to a tensor-core tile's rows, >= 16
        FP8: tl.constexpr,  # e4m3 K/V: each row times its scale after the load
        DOT_F32: tl.constexpr,  # float32 dots (FP8's dequantized K/V, float32 q, the interpreter)
        HAS_FLAG: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Program (t, kv head, c): the partials of row t's q heads that share the kv head over keys
        [c * CHUNK_SIZE, (c + 1) * CHUNK_SIZE): each K / V tile loaded once for all of them, scores
        and values by tensor-core dots (q heads as the dot's M, the probabilities rounded to the
        cache's dtype for the second, as flash attention does; float32 dots on FP8 or float32)."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if HAS_FLAG:
            if tl.load(flag_ptr).to(tl.int32) == 0:
                return
        t = tl.program_id(0)
        kv_head = tl.program_id(1)
        c = tl.program_id(2)
        length = tl.load(row_pos_ptr + t) + 1  # row t sees positions [0, length) of its slot
        if c * CHUNK_SIZE < length:
            kv_base = tl.load(row_slot_ptr + t).to(tl.int64) * stride_kv_slot
            key_ptr += kv_base
            value_ptr += kv_base
            key_scale_ptr += kv_base // D
            value_scale_ptr += kv_base // D
            G: tl.constexpr = HQ // HKV
            offs_g = tl.arange(0, G_PAD)
            live_g = offs_g < G
            heads = kv_head * G + offs_g
            offs_d = tl.arange(0, D)
            q = tl.load(q_ptr + (t * HQ + heads)[:, None] * D + offs_d[None, :], mask=live_g[:, None], other=0.0)
            if DOT_F32:
                q = q.to(tl.float32)
            m = tl.full((G_PAD,), float("-inf"), tl.float32)
            l = tl.zeros((G_PAD,), tl.float32)
            acc = tl.zeros((G_PAD, D), tl.float32)
            for s0 in range(0, CHUNK_SIZE, BLOCK_S):
                offs_s = c * CHUNK_SIZE + s0 + tl.arange(0, BLOCK_S)
                valid = offs_s < length
                kv_off = (offs_s[:, None] * HKV + kv_head) * D + offs_d[None, :]
                k = tl.load(key_ptr + kv_off, mask=valid[:, None], other=0.0)
                v = tl.load(value_ptr + kv_off, mask=valid[:, None], other=0.0)
                if FP8:
                    at = offs_s * HKV + kv_head
                    k = k.to(tl.float32) * tl.load(key_scale_ptr + at, mask=valid, other=0.0)[:, None]
                    v = v.to(tl.float32) * tl.load(value_scale_ptr + at, mask=valid, other=0.0)[:, None]
                if DOT_F32:
                    s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                s = tl.where(valid[None, :], s * scale, float("-inf"))  # [G_PAD, BLOCK_S]
                m_new = tl.maximum(m, tl.max(s, axis=1))
                alpha = tl.exp(m - m_new)
                p = tl.exp(s - m_new[:, None])
                l = l * alpha + tl.sum(p, axis=1)
                if DOT_F32:
                    pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
                else:
                    pv = tl.dot(p.to(v.dtype), v)
                acc = acc * alpha[:, None] + pv
                m = m_new
            part = (t * HQ + heads) * NUM_CHUNKS + c
            tl.store(part_m_ptr + part, m, mask=live_g)
            tl.store(part_l_ptr + part, l, mask=live_g)
            tl.store(part_acc_ptr + part[:, None] * D + offs_d[None, :], acc, mask=live_g[:, None])

    @triton.jit(do_not_specialize=["NUM_CHUNKS"])
    def _combine_kernel(
        part_m_ptr,
        part_l_ptr,
        part_acc_ptr,
        qkv_ptr,
        stride_qkv,  # the gate: [T, Hq*2*D + ...] columns head*2*D + D ..
        row_pos_ptr,
        o_ptr,  # [T, Hq*D] out: attention * sigmoid(gate)
        flag_ptr,  # run_if: 0 skips the call
        NUM_CHUNKS,  # (not specialised, as the chunk kernel's)
        HQ: tl.constexpr,
        D: tl.constexpr,
        CHUNK_SIZE: tl.constexpr,
        BLOCK_C: tl.constexpr,
        HAS_FLAG: tl.constexpr,
        PDL: tl.constexpr,
        RELEASE: tl.constexpr,  # release the launch after it: 1 at the start, 2 once past the wait
    ):
        if RELEASE == 1:
            tl.extra.cuda.gdc_launch_dependents()
        if PDL:
            tl.extra.cuda.gdc_wait()
            if RELEASE == 2:
                tl.extra.cuda.gdc_launch_dependents()
        if HAS_FLAG:
            if tl.load(flag_ptr).to(tl.int32) == 0:
                return
        t = tl.program_id(0)
        head = tl.program_id(1)
        length = tl.load(row_pos_ptr + t) + 1
        num_chunks = (length + CHUNK_SIZE - 1) // CHUNK_SIZE
        base = (t * HQ + head) * NUM_CHUNKS
        offs_d = tl.arange(0, D)
        m = tl.full((), float("-inf"), tl.float32)
        for c0 in range(0, NUM_CHUNKS, BLOCK_C):
            offs_c = c0 + tl.arange(0, BLOCK_C)
            mc = tl.load(part_m_ptr + base + offs_c, mask=offs_c < num_chunks, other=float("-inf"))
            m = tl.maximum(m, tl.max(mc, axis=0))
        l = tl.zeros((), tl.float32)
        acc = tl.zeros((D,), tl.float32)
        for c0 in range(0, NUM_CHUNKS, BLOCK_C):
            offs_c = c0 + tl.arange(0, BLOCK_C)
            live = offs_c < num_chunks
            mc = tl.load(part_m_ptr + base + offs_c, mask=live, other=float("-inf"))
            w = tl.where(live, tl.exp(mc - m), 0.0)
            lc = tl.load(part_l_ptr + base + offs_c, mask=live, other=0.0)
            ac = tl.load(part_acc_ptr + (base + offs_c[:, None]) * D + offs_d[None, :], mask=live[:, None], other=0.0)
            l += tl.sum(w * lc, axis=0)
            acc += tl.sum(w[:, None] * ac, axis=0)
        dtype = o_ptr.dtype.element_ty
        o = (acc / l).to(dtype).to(tl.float32)
        g = tl.load(qkv_ptr + t * stride_qkv + head * 2 * D + D + offs_d).to(tl.float32)
        gate = (1.0 / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        tl.store(o_ptr + t * HQ * D + head * D + offs_d, (o * gate).to(dtype))


def _scales(key: torch.Tensor, key_scale, value_scale) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' scale arguments: an fp8 cache's (one per row of D, contiguous), else unread placeholders."""
    if key_scale is None:
        return key, key
    if key.dtype != torch.float8_e4m3fn or key_scale.shape != key.shape[:-1] or not key_scale.is_contiguous():
        raise ValueError(f"an fp8 cache is e4m3 [S, cap, Hkv, D] with contiguous scales [S, cap, Hkv], got {key.dtype}")
    return key_scale, value_scale


def qk_norm_rope(
    qkv: torch.Tensor,  # [T, Hq*2*D + 2*Hkv*D]
    q_norm: torch.Tensor,  # [D]
    k_norm: torch.Tensor,  # [D]
    cos: torch.Tensor,  # [max_pos, R]
    sin: torch.Tensor,
    row_slot: torch.Tensor,  # int32 [T] each row's sequence slot
    row_pos: torch.Tensor,  # int32 [T] each row's position (K/V written there)
    key: torch.Tensor,  # [S, cap, Hkv, D]
    value: torch.Tensor,
    num_heads: int,
    eps: float,
    rope_offset: int = 0,
    q_out: torch.Tensor | None = None,  # [T, Hq, D]
    key_scale: torch.Tensor | None = None,  # [S, cap, Hkv] float32: key / value are e4m3
    value_scale: torch.Tensor | None = None,
    run_if: torch.Tensor | None = None,  # [] device flag: 0 skips the call (nothing written)
    pdl: bool = True,  # over one row, a programmatic dependent launch where the GPU has them (the same bits)
) -> torch.Tensor:
    T = qkv.shape[0]
    Hkv, D = key.shape[-2], key.shape[-1]
    if q_out is None:
        q_out = torch.empty(T, num_heads, D, device=qkv.device, dtype=qkv.dtype)
    pdl, _ = row_launch(pdl and pdl_supported(qkv), T)  # (it releases once past its wait)
    _qk_norm_rope_kernel[(T, num_heads + Hkv)](
        qkv,
        qkv.stride(0),
        q_norm,
        k_norm,
        cos,
        sin,
        row_slot,
        row_pos,
        q_out,
        key,
        value,
        *_scales(key, key_scale, value_scale),
        key.stride(0),
        key if run_if is None else run_if,
        eps,
        HQ=num_heads,
        HKV=Hkv,
        D=D,
        R=cos.shape[1],
        ROPE_OFFSET=rope_offset,
        FP8=key_scale is not None,
        HAS_FLAG=run_if is not None,
        PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
    return q_out


def attend_step(
    q: torch.Tensor,  # [T, Hq, D] normed and rotated
    qkv: torch.Tensor,  # [T, ...] the projection output holding the gate
    key: torch.Tensor,  # [S, cap, Hkv, D]
    value: torch.Tensor,
    row_slot: torch.Tensor,  # int32 [T] each row's sequence slot
    row_pos: torch.Tensor,  # int32 [T] each row's position: it sees positions 0..row_pos of its slot
    out: torch.Tensor | None = None,  # [T, Hq*D]
    chunk: int = CHUNK,
    block_s: int = CHUNK,  # keys per inner iteration (fixed: it sets the reduction order)
    num_warps: int | None = None,
    key_scale: torch.Tensor | None = None,  # [S, cap, Hkv] float32: key / value are e4m3
    value_scale: torch.Tensor | None = None,
    run_if: torch.Tensor | None = None,  # [] device flag: 0 skips the call (out is left as it was)
    pdl: bool = True,  # over one row, both launches programmatic dependent ones where the GPU has them
    max_pos: int | None = None,  # a bound on row_pos known on the host (an eager prefill step): fewer chunks
) -> torch.Tensor:
    T, Hq, D = q.shape
    max_len, Hkv = key.shape[1], key.shape[2]
    num_chunks = triton.cdiv(max_len, chunk)
    block_c = min(16, next_pow2(num_chunks))  # the combine's blocks: fixed by the cache, not by max_pos
    if max_pos is not None:  # programs and partials for the chunks rows can reach, in whole combine blocks
        # (a block past a row's chunks adds exact zeros: the row's bits do not depend on it)
        num_chunks = min(num_chunks, max(block_c, next_pow2(triton.cdiv(max_pos + 1, chunk))))
    part_m = torch.empty(T, Hq, num_chunks, device=q.device, dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(T, Hq, num_chunks, D, device=q.device, dtype=torch.float32)
    if out is None:
        out = torch.empty(T, Hq * D, device=q.device, dtype=q.dtype)
    block_s = min(block_s, chunk)
    pdl, release = row_launch(pdl and pdl_supported(q), T)  # (the chunks release once past their wait)
    fp8 = key_scale is not None
    _attend_chunk_kernel[(T, Hkv, num_chunks)](
        q,
        key,
        value,
        *_scales(key, key_scale, value_scale),
        key.stride(0),
        row_slot,
        row_pos,
        part_m,
        part_l,
        part_acc,
        q if run_if is None else run_if,
        D**-0.5,
        HQ=Hq,
        HKV=Hkv,
        D=D,
        NUM_CHUNKS=num_chunks,
        CHUNK_SIZE=chunk,
        BLOCK_S=block_s,
        G_PAD=max(16, next_pow2(Hq // Hkv)),
        FP8=fp8,
        DOT_F32=fp8 or interpreting() or q.dtype == torch.float32,
        HAS_FLAG=run_if is not None,
        PDL=pdl,
        num_warps=num_warps or (8 if fp8 and D > 128 else 4),
        launch_pdl=pdl,
    )
    _combine_kernel[(T, Hq)](
        part_m,
        part_l,
        part_acc,
        qkv,
        qkv.stride(0),
        row_pos,
        out,
        q if run_if is None else run_if,
        HQ=Hq,
        D=D,
        NUM_CHUNKS=num_chunks,
        CHUNK_SIZE=chunk,
        BLOCK_C=block_c,
        HAS_FLAG=run_if is not None,
        PDL=pdl,
        RELEASE=release,
        num_warps=4,
        launch_pdl=pdl,
    )
    return out


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """A prefill's causal attention, nextn.ops.attention.prefill_attention through PyTorch's fused
    attention (flash / memory-efficient kernels, no score matrix): q [1, T, Hq, D] at positions
    start.. over keys / values [1, start+T, Hkv, D]; the causal mask aligned to the last key."""
    from torch.nn.attention.bias import causal_lower_right

    T, Hq, S = q.shape[1], q.shape[2], keys.shape[1]
    groups = Hq // keys.shape[2]
    q = q.transpose(1, 2)
    k = keys.transpose(1, 2).repeat_interleave(groups, dim=1)
    v = values.transpose(1, 2).repeat_interleave(groups, dim=1)
    mask = causal_lower_right(T, S)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
