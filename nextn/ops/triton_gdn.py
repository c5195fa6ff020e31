"""A Gated DeltaNet layer's step between its two projections, in one kernel: causal conv + SiLU,
the recurrent gated delta rule, and the gated output RMSNorm.

References, op by op: `nextn.ops.conv.causal_conv1d` (taps summed in order, each product and sum
rounded to the input dtype: bitwise), `nextn.layers.gdn` (l2norm of q and k, `beta = sigmoid(b)`,
`g = -exp(A_log) * softplus(a + dt_bias)`) with `nextn.ops.gdn.recurrent_gated_delta_rule`, then
`nextn.layers.norm.RMSNormGated` on o rounded to the input dtype; the fold of pending rows:
`nextn.layers.gdn.GatedDeltaNet.committed`.

Program (value head, block of BLOCK_V value columns) keeps its [K, BLOCK_V] slice of the float32
state in registers and walks, in one loop, the rows the last verify kept (pending: their conv
columns from the window that verify stored, their gates from its gate buffer) and then the step's T
rows: for each it convolves its k (its key head's) and v channels and updates the state, and for a
step row also its q, storing o rounded to the input dtype and o's partial sum of squares. One loop
body for both, so a kept row's state has the same bits either time (two copies of the update can
compile to different contractions on a GPU). A verify stores the folded base and its rows' gates
(the rollback point of a partial accept: the kept rows become pending), a prefill step the state
after its last row. The last of a head's programs to finish (an arrival counter) sums the partials
in block order and applies the gated norm to the head's rows. Per token, in a fixed order, so row
t's result does not depend on T. The carried conv window (the step's inputs after the committed
columns) is written too: v channels by their program, q/k channels by block 0 of the first value
head of each key head.

A prefill step (`preconv`, store_all=False) may compute its rows' conv first: `_gdn_conv_kernel`
runs `_conv_silu` over every step row and channel in parallel (rows in blocks, the same function on
the same columns) and stores the bf16 values; the row loop then loads q, k and v for its step rows
and keeps only the norms and the state update serial (the pending rows' conv stays in the loop),
each step row's inputs (its gates and conv outputs) loaded while the row before runs (run 179, H100,
the 9B's heads: a 512-row prefill 1,021 -> 885 us a layer alone, 5,535 -> 4,866 for 16 of them;
outputs, states and windows bitwise the loop's before).
The conv is about half of a row's instructions in the loop (bench/NOTES.md, fifteenth session).
Both compute the same `_conv_silu`, whose products are rounded by integer ops (`_rounded`): with a
plain cast, the pre-pass compiled to bf16 fmas (the product not rounded before the sum) where the
loop did not, and run 158 found every prefill row's output differing (bench/sm90_compile.py now
fails on an fma.rn.bf16 in either kernel). With it, run 160 found the pre-pass's bits equal to the
loop's on an H100 (every prefill case of bench/gdn_sweep.py --check --preconv, the 9B's and the
bundled model's heads; tests/test_prefill.py's bitwise tests there too), the 9B's prefill of 512
rows 1.26x (B = 1) / 1.35x (B = 6) faster a layer and the bundled model's 1.74x / 1.69x; the
integer rounding costs the decode 0.6 us a layer on the 9B's heads (6.2 -> 6.8) and 1.6 on the
bundled model's (5.9 -> 7.5), and changed the loop's bits against the module before it (run 159:
decode rows too, so that loop's conv had not rounded each product on that GPU). The model's step
uses the pre-pass in bfloat16 only, and gdn_step refuses it in another dtype.

A step runs a batch of sequences (program axis 2), each over its own rows of `proj` and its own
cache slot. Where a sequence's step reads and writes is five int32 device values of its slot
(`gdn_step`'s `slots`), read by the kernel itself (no host read: one CUDA graph serves every
round).
"""

from __future__ import annotations

import torch

from nextn.ops.triton_utils import HAVE_TRITON, arrival_counters, next_pow2, pdl_supported, row_launch

T_CHUNK = 4  # rows of a step's inputs copied to the conv window per round trip (a decode's 1, a K=3 verify's 4)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rounded(x, dtype: tl.constexpr):
        """x (float32) rounded to dtype, as float32; bfloat16 by integer ops on the bits (round to
        nearest even, as `.to(dtype)`). Through a cast, LLVM narrows a float32 product of two
        bfloat16 values to a bf16 multiply and may contract it with the add after it into one fma,
        a single rounding where the reference rounds twice, in one compilation and not another:
        run 158's conv pre-pass compiled to fma.rn.bf16 where the step's loop kept mul.bf16 and
        add.bf16 (bench/NOTES.md; bench/sm90_compile.py checks it). No compiler contracts across
        integer ops."""
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        else:
            return x.to(dtype).to(tl.float32)

    @triton.jit
    def _sequence(seqs_ptr, stride_seqs, seq):
        """Sequence seq's (slot, first row, rows) from `gdn_step`'s seqs [3, B] (a step's batch)."""
        slot = tl.load(seqs_ptr + seq).to(tl.int64)
        return slot, tl.load(seqs_ptr + stride_seqs + seq), tl.load(seqs_ptr + 2 * stride_seqs + seq)

    @triton.jit
    def _conv_silu(proj_ptr, stride_p, w_ptr, carried_ptr, stride_c, ch, t, n_carried, W: tl.constexpr,
                   dtype: tl.constexpr):  # fmt: skip
        """silu(causal conv) of channels ch at row t, rounded like the reference, as float32. Columns
        before n_carried come from carried_ptr (the window: the pending rows' columns, then the
        step's carried ones), the others from the step's inputs."""
        y = tl.zeros(ch.shape, tl.float32)
        for j in tl.static_range(W):
            # column of tap j: a window column (c < n_carried) or the step's input c - n_carried
            c = tl.zeros(ch.shape, tl.int32) + t + j
            carried = c < n_carried
            from_state = tl.load(carried_ptr + ch * stride_c + c, mask=carried, other=0.0)
            from_x = tl.load(proj_ptr + (c - n_carried) * stride_p + ch, mask=c >= n_carried, other=0.0)
            v = tl.where(carried, from_state.to(dtype), from_x).to(tl.float32)
            tap = tl.load(w_ptr + ch * W + j).to(dtype).to(tl.float32)
            prod = _rounded(v * tap, dtype)  # (never contracted with the sum below)
            if j == 0:
                y = prod
            else:
                y = (y + prod).to(dtype).to(tl.float32)
        return (y / (1.0 + tl.exp(-y))).to(dtype).to(tl.float32)

    @triton.jit
    def _advance(S, proj_ptr, stride_p, conv_w_ptr, carried_ptr, stride_c, k_ch, v_ch, t, n_carried, b, a,
                 decay_rate, dt_bias, eps, W: tl.constexpr, dtype: tl.constexpr):  # fmt: skip
        """The state S [K, BLOCK_V] after row t (its gate inputs b, a)."""
        k = _conv_silu(proj_ptr, stride_p, conv_w_ptr, carried_ptr, stride_c, k_ch, t, n_carried, W, dtype)
        v = _conv_silu(proj_ptr, stride_p, conv_w_ptr, carried_ptr, stride_c, v_ch, t, n_carried, W, dtype)
        return _update(S, k, v, b, a, decay_rate, dt_bias, eps, dtype)

    @triton.jit
    def _update(S, k, v, b, a, decay_rate, dt_bias, eps, dtype: tl.constexpr):
        """The state S [K, BLOCK_V] after a row whose conv outputs are k [K], v [BLOCK_V] (float32 of
        bf16 values) and gate inputs b, a."""
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps)
        beta = (1.0 / (1.0 + tl.exp(-b))).to(dtype).to(tl.float32)
        a = a + dt_bias
        softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
        S = S * tl.exp(-decay_rate * softplus)
        kv_mem = tl.sum(S * k[:, None], axis=0)  # [BLOCK_V]
        delta = (v - kv_mem) * beta
        return S + k[:, None] * delta[None, :]

    @triton.jit
    def _preconv_row(proj_ptr, stride_p, conv_ptr, stride_c, gate_col, hv, HV: tl.constexpr, q_ch, k_ch, v_ch, r, TL):
        """Step row r's gate inputs b, a and its pre-pass conv outputs q, k, v (float32); zeros past
        the live rows TL (a row loaded ahead that does not run)."""
        gate = proj_ptr + r * stride_p + gate_col
        b = tl.load(gate + hv, mask=r < TL, other=0.0).to(tl.float32)
        a = tl.load(gate + HV + hv, mask=r < TL, other=0.0).to(tl.float32)
        row = conv_ptr + r * stride_c  # (block masks: the interpreter refuses a scalar mask on a block load)
        q = tl.load(row + q_ch, mask=(tl.zeros_like(q_ch) + r) < TL, other=0.0).to(tl.float32)
        k = tl.load(row + k_ch, mask=(tl.zeros_like(k_ch) + r) < TL, other=0.0).to(tl.float32)
        v = tl.load(row + v_ch, mask=(tl.zeros_like(v_ch) + r) < TL, other=0.0).to(tl.float32)
        return b, a, k, v, q

    @triton.jit
    def _carried_cols(carried_ptr, stride_c, ch, mask, W: tl.constexpr, W_BLOCK: tl.constexpr, dtype: tl.constexpr):
        """The W-1 carried window columns of channels ch, a [W_BLOCK, n] tile (rows past W-1: 0)."""
        j = tl.arange(0, W_BLOCK)
        m = (j[:, None] < W - 1) & mask[None, :]
        return tl.load(carried_ptr + ch[None, :] * stride_c + j[:, None], mask=m, other=0.0).to(dtype)

    @triton.jit
    def _last_cols(carried_ptr, stride_c, proj_ptr, stride_p, ch, mask, T, W: tl.constexpr, W_BLOCK: tl.constexpr,
                   dtype: tl.constexpr):  # fmt: skip
        """The last W-1 columns of [carried | the step's T inputs] of channels ch, a [W_BLOCK, n] tile
        (rows past W-1: 0): column T + j of the concatenation is row j."""
        j = tl.arange(0, W_BLOCK)
        c = T + j
        live = (j[:, None] < W - 1) & mask[None, :]
        early = c[:, None] < W - 1
        carried = tl.load(carried_ptr + ch[None, :] * stride_c + c[:, None], mask=live & early, other=0.0)
        inputs = tl.load(proj_ptr + (c[:, None] - (W - 1)) * stride_p + ch[None, :], mask=live & ~early, other=0.0)
        return tl.where(early, carried.to(dtype), inputs)

    @triton.jit
    def _input_cols(proj_ptr, stride_p, ch, mask, t0, T, T_CHUNK: tl.constexpr):
        """The step's inputs t0.. t0+T_CHUNK-1 (those before T) of channels ch, a [T_CHUNK, n] tile."""
        t = t0 + tl.arange(0, T_CHUNK)
        return tl.load(proj_ptr + t[:, None] * stride_p + ch[None, :], mask=(t[:, None] < T) & mask[None, :], other=0.0)

    @triton.jit
    def _store_cols(window_ptr, stride_win, ch, mask, col0, cols, count):
        """The first `count` rows of cols [c, n] into window columns col0.. of channels ch."""
        j = tl.arange(0, cols.shape[0])
        m = (j[:, None] < count) & mask[None, :]
        tl.store(window_ptr + ch[None, :] * stride_win + col0 + j[:, None], cols, mask=m)

    @triton.jit(do_not_specialize=["stride_seqs", "stride_out"])
    def _gdn_conv_kernel(
        proj_ptr,
        stride_p,
        conv_w_ptr,
        window_ptr,
        stride_win_slot,
        stride_win,
        slots_ptr,
        stride_slots,
        seqs_ptr,
        stride_seqs,
        out_ptr,  # [M, conv_dim]: silu(causal conv) of every step row's q | k | v channels
        stride_out,
        W: tl.constexpr,
        BLOCK_C: tl.constexpr,
        ROWS: tl.constexpr,
        PEND: tl.constexpr,
        WINDOW: tl.constexpr,  # also the window's next carried columns (`conv_prepass(window_out=True)`)
        W_BLOCK: tl.constexpr,
    ):
        """A prefill step's conv pre-pass (`gdn_step(preconv=True)`): program (sequence, block of ROWS
        rows, block of BLOCK_C channels) computes `_conv_silu` of its rows exactly as the step's row
        loop would (the same function on the same columns: the pending rows' and carried columns of
        the window, then the step's inputs), so the loop only loads them. WINDOW (chunked prompt
        pieces, which run no step loop): the first row block's programs also write the last W-1
        columns of [carried | inputs] at the slot's conv_write, as a prefill step's loop does."""
        seq = tl.program_id(0)
        slot, row0, T = _sequence(seqs_ptr, stride_seqs, seq)
        proj_ptr += row0 * stride_p
        out_ptr += row0 * stride_out
        window_ptr += slot * stride_win_slot
        slots_ptr += slot * stride_slots
        dtype = proj_ptr.dtype.element_ty
        conv_at = tl.load(slots_ptr + 2)
        pending = tl.load(slots_ptr + PEND)
        fold_ptr = window_ptr + conv_at - pending
        n_carried = pending + W - 1
        ch = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        if WINDOW:
            if tl.program_id(1) == 0:
                every = ch >= 0  # (BLOCK_C divides the channels)
                cols = _last_cols(window_ptr + conv_at, stride_win, proj_ptr, stride_p, ch, every, T, W, W_BLOCK, dtype)
                _store_cols(window_ptr + tl.load(slots_ptr + 3), stride_win, ch, every, 0, cols, W - 1)
        for i in range(ROWS):
            r = tl.program_id(1) * ROWS + i
            if r < T:
                y = _conv_silu(
                    proj_ptr, stride_p, conv_w_ptr, fold_ptr, stride_win, ch, pending + r, n_carried, W, dtype
                )
                tl.store(out_ptr + r * stride_out + ch, y.to(dtype))

    @triton.jit(do_not_specialize=["stride_seqs"])
    def _gdn_step_kernel(
        proj_ptr,
        stride_p,  # [T, conv_dim | z (HV*V) | b (HV) | a (HV)]: the in_proj output
        conv_w_ptr,  # [conv_dim, W] taps
        window_ptr,  # [S, conv_dim, NW]: carried columns at slots[2]; written at slots[3]
        stride_win_slot,
        stride_win,
        a_log_ptr,
        dt_bias_ptr,  # [HV]
        states_ptr,  # [S, 2, HV, K, V] float32: the base states[slots[0]]; states[slots[1]] written
        stride_states_slot,
        stride_states,
        gates_ptr,  # [S, 2 * R, 2 * HV]: rows' (b, a), half slots[0] read (pending rows), half slots[1] written
        stride_gates_slot,
        R,  # rows a half of gates holds
        slots_ptr,  # int32 [S, > PEND] (row stride stride_slots): (state_at, state_write, conv_at, conv_write), pending
        stride_slots,
        seqs_ptr,  # int32 [3, B] (row stride stride_seqs): each sequence's slot, first row and number of rows
        stride_seqs,  # (not specialised: a batch's size never picks another compiled variant)
        live_ptr,  # int32 [B]: the rows that count (LIVE): the recurrence stops there, o is 0 past it
        conv_ptr,  # PRECONV: [M, conv_dim] the step rows' conv outputs (`_gdn_conv_kernel`)
        stride_c,
        norm_w_ptr,  # [V] RMSNormGated weight
        o_ptr,
        stride_o,  # [M, HV*V] out: RMSNormGated(o) * silu(z)
        sumsq_ptr,  # [M, HV, V // BLOCK_V] float32 scratch: o's partial sums of squares
        count_ptr,  # [>= B*HV] int32 arrival counters, zero
        scale,
        eps,
        norm_eps,
        H: tl.constexpr,
        HV: tl.constexpr,
        K: tl.constexpr,
        V: tl.constexpr,
        W: tl.constexpr,
        W_BLOCK: tl.constexpr,  # next_pow2(W - 1): the carried columns' tile
        T_CHUNK: tl.constexpr,  # the step's inputs copied to the window this many rows at a time
        BLOCK_V: tl.constexpr,
        PEND: tl.constexpr,  # column of slots holding the pending rows' count
        STORE_ALL: tl.constexpr,  # else only the last token's state, at slots[1]
        PRECONV: tl.constexpr,  # the step rows' q / k / v conv outputs come from conv_ptr (not STORE_ALL)
        LIVE: tl.constexpr,
        PDL: tl.constexpr,  # a programmatic dependent launch: the state loaded before the wait
        RELEASE: tl.constexpr,  # release the launch after it: 1 at the start, 2 once past the wait
    ):
        if RELEASE == 1:
            tl.extra.cuda.gdc_launch_dependents()
        hv = tl.program_id(0)
        vb = tl.program_id(1)
        seq = tl.program_id(2)
        NB: tl.constexpr = V // BLOCK_V
        slot, row0, T = _sequence(seqs_ptr, stride_seqs, seq)
        proj_ptr += row0 * stride_p
        o_ptr += row0 * stride_o
        conv_ptr += row0 * stride_c
        sumsq_ptr += row0 * HV * NB
        count_ptr += seq * HV
        window_ptr += slot * stride_win_slot
        states_ptr += slot * stride_states_slot
        gates_ptr += slot * stride_gates_slot
        slots_ptr += slot * stride_slots
        h = hv // (HV // H)
        dtype = proj_ptr.dtype.element_ty
        conv_dim = 2 * H * K + HV * V
        offs_k = tl.arange(0, K)
        offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        q_ch = h * K + offs_k
        k_ch = H * K + h * K + offs_k
        v_ch = 2 * H * K + hv * V + offs_v
        state_at = tl.load(slots_ptr)
        state_write = tl.load(slots_ptr + 1)
        conv_at = tl.load(slots_ptr + 2)
        conv_write = tl.load(slots_ptr + 3)
        pending = tl.load(slots_ptr + PEND)
        carried_ptr = window_ptr + conv_at  # the committed conv columns (row stride stride_win)
        win = window_ptr + conv_write
        tile = hv * K * V + offs_k[:, None] * V + offs_v[None, :]
        S = tl.load(states_ptr + state_at * stride_states + tile)
        decay_rate = tl.exp(tl.load(a_log_ptr + hv).to(tl.float32))
        dt_bias = tl.load(dt_bias_ptr + hv).to(tl.float32)
        # the window written (the carried columns, then the inputs): every load issued before any
        # store (a store waits for its load, and a load after a store to the same buffer is not
        # moved above it), so the copy costs one memory round trip, beside the state's
        writes_qk = (tl.zeros((K,), tl.int32) + (hv % (HV // H)) + vb) == 0
        writes_v = offs_v < V
        qc = _carried_cols(carried_ptr, stride_win, q_ch, writes_qk, W, W_BLOCK, dtype)
        kc = _carried_cols(carried_ptr, stride_win, k_ch, writes_qk, W, W_BLOCK, dtype)
        vc = _carried_cols(carried_ptr, stride_win, v_ch, writes_v, W, W_BLOCK, dtype)
        if PDL:  # the launch right before writes none of the above (the rule: nextn.ops.triton_utils)
            tl.extra.cuda.gdc_wait()
            if RELEASE == 2:
                tl.extra.cuda.gdc_launch_dependents()
        TL = T
        if LIVE:
            TL = tl.minimum(tl.load(live_ptr + seq), T)
        if STORE_ALL:  # the whole window: a verify keeps any prefix of its rows
            qi = _input_cols(proj_ptr, stride_p, q_ch, writes_qk, 0, T, T_CHUNK)
            ki = _input_cols(proj_ptr, stride_p, k_ch, writes_qk, 0, T, T_CHUNK)
            vi = _input_cols(proj_ptr, stride_p, v_ch, writes_v, 0, T, T_CHUNK)
            _store_cols(win, stride_win, q_ch, writes_qk, 0, qc, W - 1)
            _store_cols(win, stride_win, k_ch, writes_qk, 0, kc, W - 1)
            _store_cols(win, stride_win, v_ch, writes_v, 0, vc, W - 1)
            _store_cols(win, stride_win, q_ch, writes_qk, W - 1, qi, T)
            _store_cols(win, stride_win, k_ch, writes_qk, W - 1, ki, T)
            _store_cols(win, stride_win, v_ch, writes_v, W - 1, vi, T)
            for t0 in range(T_CHUNK, T, T_CHUNK):  # a verify longer than one chunk
                qi = _input_cols(proj_ptr, stride_p, q_ch, writes_qk, t0, T, T_CHUNK)
                ki = _input_cols(proj_ptr, stride_p, k_ch, writes_qk, t0, T, T_CHUNK)
                vi = _input_cols(proj_ptr, stride_p, v_ch, writes_v, t0, T, T_CHUNK)
                _store_cols(win, stride_win, q_ch, writes_qk, W - 1 + t0, qi, T - t0)
                _store_cols(win, stride_win, k_ch, writes_qk, W - 1 + t0, ki, T - t0)
                _store_cols(win, stride_win, v_ch, writes_v, W - 1 + t0, vi, T - t0)
        else:  # a prefill step (any number of rows) keeps all of them: only the last W-1 columns
            qt = _last_cols(carried_ptr, stride_win, proj_ptr, stride_p, q_ch, writes_qk, T, W, W_BLOCK, dtype)
            kt = _last_cols(carried_ptr, stride_win, proj_ptr, stride_p, k_ch, writes_qk, T, W, W_BLOCK, dtype)
            vt = _last_cols(carried_ptr, stride_win, proj_ptr, stride_p, v_ch, writes_v, T, W, W_BLOCK, dtype)
            _store_cols(win, stride_win, q_ch, writes_qk, 0, qt, W - 1)
            _store_cols(win, stride_win, k_ch, writes_qk, 0, kt, W - 1)
            _store_cols(win, stride_win, v_ch, writes_v, 0, vt, W - 1)
        states_ptr += state_write * stride_states
        if STORE_ALL and vb == 0:  # a verify's rows' gates (by the head's first program)
            gate_rows = gates_ptr + state_write * R * 2 * HV
            for t in range(T):
                row = proj_ptr + t * stride_p + conv_dim + HV * V
                tl.store(gate_rows + t * 2 * HV + hv, tl.load(row + hv))
                tl.store(gate_rows + t * 2 * HV + HV + hv, tl.load(row + HV + hv))
        # the pending rows (the base's half: their gates; the window from column conv_at - pending: their
        # columns, then the step's carried ones), then the step's rows, in one loop: a row's state is
        # the same code either time, so the same bits
        fold_ptr = window_ptr + conv_at - pending
        fold_gates = gates_ptr + state_at * R * 2 * HV
        n_carried = pending + W - 1
        if PRECONV:  # the first step row's inputs, loaded ahead (each step row loads its successor's)
            nb, na, nk, nv, nq = _preconv_row(proj_ptr, stride_p, conv_ptr, stride_c, conv_dim + HV * V, hv, HV,
                                              q_ch, k_ch, v_ch, 0, TL)  # fmt: skip
        for t in range(pending + TL):
            r = t - pending  # the step's row (< 0: a pending row)
            if STORE_ALL:
                if r == 0:  # a verify: the base its kept rows will be pending on
                    tl.store(states_ptr + tile, S)
            if PRECONV:
                if r >= 0:  # a step row: its conv outputs from the pre-pass, loaded one row ahead, so
                    # that the loads' latency hides behind the row before (the arithmetic is the same)
                    b, a, k, v, q = nb, na, nk, nv, nq
                    nb, na, nk, nv, nq = _preconv_row(proj_ptr, stride_p, conv_ptr, stride_c, conv_dim + HV * V, hv,
                                                      HV, q_ch, k_ch, v_ch, r + 1, TL)  # fmt: skip
                else:
                    b = tl.load(fold_gates + t * 2 * HV + hv).to(tl.float32)
                    a = tl.load(fold_gates + t * 2 * HV + HV + hv).to(tl.float32)
                    k = _conv_silu(proj_ptr, stride_p, conv_w_ptr, fold_ptr, stride_win, k_ch, t, n_carried, W, dtype)
                    v = _conv_silu(proj_ptr, stride_p, conv_w_ptr, fold_ptr, stride_win, v_ch, t, n_carried, W, dtype)
                    q = nq  # (unused: a pending row has no output)
                S = _update(S, k, v, b, a, decay_rate, dt_bias, eps, dtype)
            else:
                gate = tl.where(r < 0, fold_gates + t * 2 * HV, proj_ptr + r * stride_p + conv_dim + HV * V)
                b = tl.load(gate + hv).to(tl.float32)
                a = tl.load(gate + HV + hv).to(tl.float32)
                S = _advance(S, proj_ptr, stride_p, conv_w_ptr, fold_ptr, stride_win, k_ch, v_ch, t, n_carried, b, a,
                             decay_rate, dt_bias, eps, W, dtype)  # fmt: skip
            if r >= 0:
                if not PRECONV:
                    q = _conv_silu(proj_ptr, stride_p, conv_w_ptr, fold_ptr, stride_win, q_ch, t, n_carried, W, dtype)
                q = q / tl.sqrt(tl.sum(q * q, axis=0) + eps) * scale
                o = tl.sum(S * q[:, None], axis=0).to(dtype)
                tl.store(o_ptr + r * stride_o + hv * V + offs_v, o)
                of = o.to(tl.float32)
                tl.store(sumsq_ptr + (r * HV + hv) * NB + vb, tl.sum(of * of, axis=0))
        if STORE_ALL:
            if TL == 0:  # (no live row: the folded base all the same)
                tl.store(states_ptr + tile, S)
        else:  # a prefill step keeps all its rows: the state after the last one
            tl.store(states_ptr + tile, S)

        # the head's last program: RMSNormGated over the head's V columns, each op rounded like
        # the module, from the partial sums in block order
        tl.debug_barrier()  # every thread's o and partial are written before the counter moves
        arrived = tl.atomic_add(count_ptr + hv, 1, sem="acq_rel")
        if arrived == NB - 1:
            tl.store(count_ptr + hv, 0)  # re-armed for the next launch
            offs = tl.arange(0, V)
            norm_w = tl.load(norm_w_ptr + offs).to(tl.float32)
            for t in range(TL, T):  # rows past the live ones: zeros (finite, whatever the buffer held)
                tl.store(o_ptr + t * stride_o + hv * V + offs, tl.zeros((V,), dtype))
            for t in range(TL):
                total = tl.load(sumsq_ptr + (t * HV + hv) * NB, cache_modifier=".cg")
                for j in tl.static_range(1, NB):
                    total += tl.load(sumsq_ptr + (t * HV + hv) * NB + j, cache_modifier=".cg")
                rstd = 1.0 / tl.sqrt(total / V + norm_eps)
                o = tl.load(o_ptr + t * stride_o + hv * V + offs, cache_modifier=".cg").to(tl.float32)
                normed = (o * rstd).to(dtype).to(tl.float32)
                gated = (norm_w * normed).to(dtype).to(tl.float32)
                z = tl.load(proj_ptr + t * stride_p + conv_dim + hv * V + offs).to(tl.float32)
                tl.store(o_ptr + t * stride_o + hv * V + offs, (gated * (z / (1.0 + tl.exp(-z)))).to(dtype))


def launch_config(K: int, V: int) -> tuple[int, int]:
    """(block_v, num_warps) of the step kernel for heads of dims K, V: a model's one choice, since
    block_v orders the norm's sums and the warps lay out the state's reductions, so every call
    (decode, verify, prefill, any batch) must use the same for a row to keep its bits.

    Heads of 128 x 128 (Qwen3.5-9B, 35B-A3B, Qwen3-Next): 32 columns at 2 warps. Run 179 (H100,
    `bench/gdn_sweep.py`, us a layer, 32 x 4 -> 32 x 2): decode at B = 16 58.1 -> 43.2, a K = 3 verify
    at B = 16 126.3 -> 79.4, a prefill of 16 x 512 rows 4,866 -> 3,547; one sequence alone pays
    6.8 -> 7.2 (decode) and 16.5 -> 16.9 (verify), its 512-row prefill 885 -> 876. (1 warp: 2,448
    for the 16-prompt prefill, but 8.3 / 19.4 for one sequence's decode / verify.) Smaller heads (the
    bundled model's 64 x 64, swept at 4 warps in runs 42 / 74): 32 columns at 4 warps."""
    return min(32, V), (2 if K * V >= 128 * 128 else 4)


def gdn_step(
    proj: torch.Tensor,  # [M, conv_dim + HV*V + 2*HV] (last dim contiguous): every sequence's rows
    conv_weight: torch.Tensor,  # [conv_dim, W]
    window: torch.Tensor,  # [S, conv_dim, NW] (last dim contiguous): read at slots[2], written at slots[3]
    A_log: torch.Tensor,  # [HV]
    dt_bias: torch.Tensor,  # [HV]
    states: torch.Tensor,  # [S, 2, HV, K, V] float32 (contiguous per half): base states, see `slots`
    gates: torch.Tensor,  # [S, 2 * R, 2 * HV] (last dim contiguous): rows' b then a, R a half
    norm_weight: torch.Tensor,  # [V]
    num_k_heads: int,
    norm_eps: float,
    slots: torch.Tensor,  # int32 [S, > pending_col] on the device (a view of the cache's ctl), read by the kernel
    seqs: torch.Tensor,  # int32 [3, B]: each sequence's slot, first row in proj and number of rows (<= R)
    pending_col: int,  # the column of slots holding the pending rows' count
    eps: float = 1e-6,  # of the q / k l2norm
    out: torch.Tensor | None = None,  # [M, HV*V]
    store_all: bool = True,
    live: torch.Tensor | None = None,  # int32 [B] on the device: the rows that count (default: all)
    block_v: int | None = None,  # value columns per program (default: `launch_config`)
    num_warps: int | None = None,  # (default: `launch_config`)
    pdl: bool = True,  # PDL where the GPU has it (the same bits): below
    preconv: int | None = None,  # a prefill step (not store_all): its longest sequence's rows, conv pre-pass
) -> torch.Tensor:
    """One GDN decode / verify step of B sequences; returns `out` [M, HV*V].

    live: sequence b's recurrence runs over its first min(live[b], rows) rows only (a verify whose
    gate cut drafts: rows past them are never accepted); their states are not written and their
    output rows are 0. The rows before are the same bits either way (row t never depends on later
    rows). The conv window is written for every row.

    Per sequence, with slots[slot] = (state_at, state_write, conv_at, conv_write) and P =
    slots[slot, pending_col] (an empty sequence: (0, 1, 0, NW // 2), P = 0, zeros in half 0):
    - the base state is states[state_at]; the state before the
      step is the base advanced by the P pending rows: row t's window is window[:, conv_at - P + t:]
      (its W taps), its gates gates[state_at * R + t] (b then a);
    - store_all: the state before the step goes to states[state_write] and row t's gates to
      gates[state_write * R + t] (the step's kept rows are pending after the commit); else the state
      after the last row goes to states[state_write];
    - carried conv column j (< W-1) is window[:, conv_at + j];
    - window[:, conv_write + j] gets carried column j, window[:, conv_write + W-1 + t] input t; with
      store_all=False (a prefill step, T rows however many) only the last W-1 columns of those,
      window[:, conv_write + j] = column T + j (the window's next carried columns, the same values).
    The caller keeps the regions read (window[:, conv_at-P:conv_at+W-1], states[state_at] and its
    gates) apart from those written (window[:, conv_write:conv_write+W-1+T], half state_write).

    pdl: launched as `triton_utils.row_launch` arranges it: a decode's one row is a programmatic
    dependent launch that loads the state and the carried columns before it waits for the
    projection ahead of it.
    """
    M = proj.shape[0]
    HV, K, V = states.shape[2:]
    W = conv_weight.shape[1]
    B = seqs.shape[1]
    if conv_weight.shape[0] != 2 * num_k_heads * K + HV * V:
        raise ValueError(
            f"gdn_step: conv weight {tuple(conv_weight.shape)} does not fit H={num_k_heads}, HV={HV}, K={K}, V={V}"
        )
    if out is None:
        out = torch.empty(M, HV * V, device=proj.device, dtype=proj.dtype)
    if out.dtype != proj.dtype:
        raise ValueError("gdn_step: out must have the input dtype (it holds o before the norm)")
    if slots.dtype != torch.int32 or slots.dim() != 2 or slots.shape[1] <= max(pending_col, 3) or slots.stride(1) != 1:
        raise ValueError(
            f"gdn_step: slots must be int32 [S, > {max(pending_col, 3)}] (state_at, state_write, conv_at, "
            f"conv_write, ..., pending per slot), not {slots.dtype} {tuple(slots.shape)}"
        )
    if states.shape[1] != 2 or gates.shape[-1] != 2 * HV or gates.shape[1] % 2 or gates.stride(-1) != 1:
        raise ValueError(
            f"gdn_step: states [S, 2, HV, K, V] and gates [S, 2 * R, 2 * HV={2 * HV}], not "
            f"{tuple(states.shape)} and {tuple(gates.shape)}"
        )
    if seqs.dtype != torch.int32 or seqs.shape[0] != 3 or seqs.stride(1) != 1:
        raise ValueError(f"gdn_step: seqs must be int32 [3, B] (slot, first row, rows), not {tuple(seqs.shape)}")
    if live is not None and (live.dtype != torch.int32 or live.shape != (B,)):
        raise ValueError(f"gdn_step: live must be int32 [B={B}], not {live.dtype} {tuple(live.shape)}")
    chosen = launch_config(K, V)
    block_v = min(chosen[0] if block_v is None else block_v, V)
    num_warps = chosen[1] if num_warps is None else num_warps
    sumsq = torch.empty(M, HV, V // block_v, device=proj.device, dtype=torch.float32)
    conv = proj  # (PRECONV off: not read)
    if preconv is not None:
        conv = conv_prepass(proj, conv_weight, window, slots, seqs, pending_col, preconv, store_all)
    dependent, release = row_launch(pdl and pdl_supported(proj), M)
    _gdn_step_kernel[(HV, V // block_v, B)](
        proj,
        proj.stride(0),
        conv_weight,
        window,
        window.stride(0),
        window.stride(1),
        A_log,
        dt_bias,
        states,
        states.stride(0),
        states.stride(1),
        gates,
        gates.stride(0),
        gates.shape[1] // 2,
        slots,
        slots.stride(0),
        seqs,  # (one base pointer: views of its rows would be 16-byte aligned or not by B, a variant each)
        seqs.stride(0),
        live if live is not None else seqs,
        conv,
        conv.stride(0),
        norm_weight,
        out,
        out.stride(0),
        sumsq,
        arrival_counters(proj.device, B * HV),
        K**-0.5,
        eps,
        norm_eps,
        H=num_k_heads,
        HV=HV,
        K=K,
        V=V,
        W=W,
        W_BLOCK=next_pow2(W - 1),
        T_CHUNK=T_CHUNK,
        BLOCK_V=block_v,
        PEND=pending_col,
        STORE_ALL=bool(store_all),
        PRECONV=preconv is not None,
        LIVE=live is not None,
        PDL=dependent,
        RELEASE=release,
        num_warps=num_warps,
        launch_pdl=dependent,
    )
    return out


CONV_ROWS = 8  # rows a pre-pass program computes


def conv_prepass(
    proj, conv_weight, window, slots, seqs, pending_col: int, max_rows: int, store_all: bool, window_out: bool = False
):
    """silu(causal conv) of every step row's q | k | v channels [M, conv_dim] (`_gdn_conv_kernel`);
    window_out: also each sequence's next carried columns into its window at conv_write (slots[3])."""
    if store_all:
        raise ValueError("gdn_step: the conv pre-pass serves a prefill step (store_all=False)")
    if proj.dtype != torch.bfloat16 and not window_out:  # float32: a product and the sum after it may
        # compile to one fma in one kernel and not the other (`_rounded` rounds bfloat16 products only);
        # run 162's H100 found the pre-pass's float32 bits off the loop's with pending rows. (Chunked
        # prompt pieces, window_out, run no loop whose bits the pre-pass must give: any dtype.)
        raise ValueError(f"gdn_step: the conv pre-pass is exact in bfloat16 only, not {proj.dtype}")
    conv_dim, W = conv_weight.shape
    out = torch.empty(proj.shape[0], conv_dim, device=proj.device, dtype=proj.dtype)
    block_c = min(256, conv_dim & -conv_dim)  # a power of two dividing conv_dim: no channel mask
    if max_rows > 0:
        _gdn_conv_kernel[(seqs.shape[1], -(-max_rows // CONV_ROWS), conv_dim // block_c)](
            proj,
            proj.stride(0),
            conv_weight,
            window,
            window.stride(0),
            window.stride(1),
            slots,
            slots.stride(0),
            seqs,
            seqs.stride(0),
            out,
            out.stride(0),
            W=W,
            BLOCK_C=block_c,
            ROWS=CONV_ROWS,
            PEND=pending_col,
            WINDOW=window_out,
            W_BLOCK=next_pow2(W - 1),
        )
    return out
