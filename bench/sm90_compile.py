"""Compile the prefill Triton kernels for Hopper (sm90) on the CPU and check their shared memory
(and which tensor-core instructions the FP8 skinny GEMM's two ways compile to).

A kernel whose tiles and pipeline stages need more shared memory than an H200 block may have
(232448 bytes) compiles anywhere but fails on the GPU at its first launch ("OutOfResources: shared
memory"). This script catches that without a GPU: it compiles `triton_gdn_chunk`'s and
`triton_moe_grouped`'s kernels (and the decode MoE block's quantized kernels and router, and a
greedy round's own kernels: round_cases) with Triton's nvidia backend (the ptxas bundled with
triton) at the real model shapes (Qwen3.5-9B's GDN heads, Qwen3.5-35B-A3B's experts), with the
constexprs and launch options their wrappers use (imported from the kernel modules), and with the
argument specialisations (16-divisible ints and pointers) a launch at those shapes gets. It prints
one line per kernel and exits 1 if one fails to compile or does not fit. The FP8 skinny GEMM's
chained dots (nextn.ops.triton_linear) compile to wgmma with the weights as the dot's M and to
mma.sync x-major (config way 2); a build that lost either way fails here too.

    python bench/sm90_compile.py      # TRITON_INTERPRET unset (or 0): interpreted kernels do not compile

tests/test_kernels.py runs it (test_prefill_kernels_fit_sm90_shared_memory).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo's nextn, run from anywhere

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from nextn.ops import linear_configs as cfgs  # noqa: E402
from nextn.ops import triton_draft as draft  # noqa: E402
from nextn.ops import triton_gdn as gdn_step  # noqa: E402
from nextn.ops import triton_gdn_chunk as gdn  # noqa: E402
from nextn.ops import triton_linear as linear  # noqa: E402
from nextn.ops import triton_moe as moe_step  # noqa: E402
from nextn.ops import triton_moe_grouped as moe  # noqa: E402
from nextn.sample import triton_sample as sample  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
SHARED_LIMIT = 232448  # bytes of shared memory per block on an H200 (sm90, opt-in maximum)


def _strides(*shape: int) -> tuple[int, ...]:
    """A contiguous tensor's strides."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def gdn_cases(B=1, T=517, H=16, HV=32, K=128, V=128):
    """`chunk_gated_delta_rule` over a T-token prompt with Qwen3.5-9B's GDN heads: q, k float32
    (l2-normalised upstream), v and o bfloat16, the scratch and states float32, an initial state."""
    sq, sv, sg = _strides(B, T, H, K), _strides(B, T, HV, V), _strides(B, T, HV)
    args = dict(
        q_ptr="*fp32",
        k_ptr="*fp32",
        v_ptr="*bf16",
        o_ptr="*bf16",
        g_ptr="*fp32",
        beta_ptr="*fp32",
        u_ptr="*fp32",
        w_ptr="*fp32",
        a_ptr="*fp32",
        gc_ptr="*fp32",
        h0_ptr="*fp32",
        ht_ptr="*fp32",
        hs_ptr="*fp32",
        h0_at_ptr="*i64",
        ht_at_ptr="*i64",
        starts_ptr="*i32",
        sq_b=sq[0],
        sq_t=sq[1],
        sq_h=sq[2],
        sk_b=sq[0],
        sk_t=sq[1],
        sk_h=sq[2],
        sv_b=sv[0],
        sv_t=sv[1],
        sv_h=sv[2],
        so_b=sv[0],
        so_t=sv[1],
        so_h=sv[2],
        sg_b=sg[0],
        sg_t=sg[1],
        sb_b=sg[0],
        sb_t=sg[1],
        T=T,
        Tp=triton.cdiv(T, gdn.CHUNK) * gdn.CHUNK,
        scale=K**-0.5,
    )
    prep, states, output = gdn.launch_constexprs(H, HV, K, V, has_h0=True)
    slots = gdn.launch_constexprs(H, HV, K, V, has_h0=True, slots=True)[1]  # (a cache's states: prompt pieces)
    varlen = gdn.launch_constexprs(H, HV, K, V, has_h0=True, slots=True, varlen=True)[1]  # (pieces one after another)
    conv_dim = 2 * H * K + HV * V  # the chunked pieces' input and output kernels (StepBatch.chunked)
    inputs = dict(
        conv_ptr="*bf16",
        stride_c=conv_dim,
        proj_ptr="*bf16",
        stride_p=conv_dim + HV * V + 2 * HV,
        index_ptr="*i64",
        a_log_ptr="*fp32",
        dt_bias_ptr="*fp32",
        q_ptr="*fp32",
        k_ptr="*fp32",
        v_ptr="*bf16",
        g_ptr="*fp32",
        beta_ptr="*fp32",
        M=B * T,
        gate_col=conv_dim + HV * V,
        eps=1e-6,
    )
    norm = dict(o_ptr="*bf16", stride_o=HV * V, rows_ptr="*i64", z_ptr="*bf16", stride_z=conv_dim + HV * V + 2 * HV,
                w_ptr="*bf16", out_ptr="*bf16", stride_out=HV * V, eps=1e-6)  # fmt: skip
    bk, bv = gdn.next_pow2(K), gdn.next_pow2(V)
    return [
        ("gdn_chunk_prep", gdn._chunk_prep_kernel, args, prep, gdn.PREP_OPTIONS),
        ("gdn_chunk_states", gdn._chunk_states_kernel, args, states, gdn.STATES_OPTIONS),
        ("gdn_chunk_states_slots", gdn._chunk_states_kernel, args, slots, gdn.STATES_OPTIONS),
        ("gdn_chunk_states_varlen", gdn._chunk_states_kernel, args, varlen, gdn.STATES_OPTIONS),
        ("gdn_chunk_output", gdn._chunk_output_kernel, args, output, gdn.OUTPUT_OPTIONS),
        ("gdn_chunk_inputs", gdn._chunk_inputs_kernel, inputs,
         dict(H=H, HV=HV, K=K, V=V, BK=bk, BV=bv, BHV=gdn.next_pow2(HV)), dict(num_warps=4)),
        ("gdn_gated_norm", gdn._gated_norm_kernel, norm, dict(V=V, BV=bv), dict(num_warps=4)),
    ]  # fmt: skip


def gdn_step_cases(H=16, HV=32, K=128, V=128, W=4, M=512):
    """The GDN step kernel (`triton_gdn.gdn_step`) at Qwen3.5-9B's heads in bfloat16, as a prefill step
    launches it: the row loop with its conv in the loop and with the conv pre-pass's outputs
    (PRECONV), and the pre-pass kernel. The conv's products must not be contracted with its sums into
    bf16 fmas in any of them (`triton_gdn._rounded`: the pre-pass compiled to fma.rn.bf16 before, run
    158), or the pre-pass's values differ from the loop's."""
    conv_dim = 2 * H * K + HV * V
    step = dict(proj_ptr="*bf16", stride_p=conv_dim + HV * V + 2 * HV, conv_w_ptr="*bf16", window_ptr="*bf16",
                stride_win_slot=conv_dim * 64, stride_win=64, a_log_ptr="*fp32", dt_bias_ptr="*fp32",
                states_ptr="*fp32", stride_states_slot=2 * HV * K * V, stride_states=HV * K * V, gates_ptr="*bf16",
                stride_gates_slot=2 * 8 * 2 * HV, R=8, slots_ptr="*i32", stride_slots=8, seqs_ptr="*i32",
                stride_seqs=3, live_ptr="*i32", conv_ptr="*bf16", stride_c=conv_dim, norm_w_ptr="*bf16",
                o_ptr="*bf16", stride_o=HV * V, sumsq_ptr="*fp32", count_ptr="*i32", scale=K**-0.5, eps=1e-6,
                norm_eps=1e-6)  # fmt: skip
    block_v, warps = gdn_step.launch_config(K, V)  # (the model's choice at these heads)
    consts = dict(H=H, HV=HV, K=K, V=V, W=W, W_BLOCK=4, T_CHUNK=gdn_step.T_CHUNK, BLOCK_V=block_v, PEND=4,
                  STORE_ALL=False, LIVE=False, PDL=False, RELEASE=0)  # fmt: skip
    conv = dict(proj_ptr="*bf16", stride_p=step["stride_p"], conv_w_ptr="*bf16", window_ptr="*bf16",
                stride_win_slot=conv_dim * 64, stride_win=64, slots_ptr="*i32", stride_slots=8, seqs_ptr="*i32",
                stride_seqs=3, out_ptr="*bf16", stride_out=conv_dim)  # fmt: skip
    no_fma = ("cvt.rn.bf16.f32", "fma.rn.bf16")
    options = dict(num_warps=warps)
    return [
        ("gdn_step_loop_conv", gdn_step._gdn_step_kernel, step, dict(consts, PRECONV=False), options, no_fma),
        ("gdn_step_preconv", gdn_step._gdn_step_kernel, step, dict(consts, PRECONV=True), options, no_fma),
        *(
            (
                name,
                gdn_step._gdn_conv_kernel,
                conv,
                dict(W=W, BLOCK_C=256, ROWS=gdn_step.CONV_ROWS, PEND=4, WINDOW=window, W_BLOCK=4),
                dict(num_warps=4),  # (launched at Triton's default)
                no_fma,
            )
            for name, window in (("gdn_conv_prepass", False), ("gdn_conv_prepass_window", True))
        ),
    ]


def skinny_fp8_cases(M=4, N=12288, K=4096):
    """The FP8 skinny GEMM at the 9B's gate|up shape (chained block scales, the SwiGLU epilogue), as
    `skinny_linear` launches it, each way with the MMA it must compile to: (.., ptx has, ptx lacks).
    (The x-major kernel keeps wgmma in its fallback for rows past fp16's range.)"""
    args = {n: "*fp8e4nv" if n in ("w_ptr", "w2_ptr") else "*bf16" for n in ("x_ptr", "w_ptr", "w2_ptr", "y_ptr")}
    args.update({n: "*fp32" for n in ("s_ptr", "s2_ptr", "part_ptr", "ss_in_ptr", "ss_out_ptr")})
    args.update(res_ptr="*bf16", count_ptr="*i32", flag_ptr="*i32", nw_ptr="*bf16", xn_ptr="*bf16")
    args.update(M=M, N=N, K=K, K_SPLIT=K // 2, stride_x=K, stride_y=N, stride_res=0, stride_s=N // 128)
    args.update(stride_s2=N // 128, shift=1.0, shift2=1.0, P=1, eps=1e-6)
    consts = dict(EPILOGUE=2, BLOCK_M=cfgs.TILE_ROWS, BLOCK_N=128, BLOCK_K=128, EVEN_K=True, DOT_F32=False, SPLIT=2,
                  SERIAL=1, FP8=True, GROUP=128, SCALE_ROWS=128, SCALE_ROWS2=128, HAS_FLAG=False,
                  TMA=False, TMA_X=False, CHAIN=True, RMS=False, P_BLOCK=1, NORM_OUT=False, NORM_PARTS=1,
                  PDL=False)  # fmt: skip
    options = dict(num_warps=4, num_stages=4)
    # Q8_0 (int8, float16 scales per row and 32 columns): each 128-column tile dequantized, one dot
    q8_args = dict(args, w_ptr="*i8", w2_ptr="*i8", s_ptr="*fp16", s2_ptr="*fp16", stride_s=N, stride_s2=N)
    q8_consts = dict(consts, GROUP=32, SCALE_ROWS=1, SCALE_ROWS2=1, CHAIN=False, XMAJOR=False, BLOCK_N=64)
    cases = [
        ("skinny_fp8_wgmma", linear._skinny_kernel, args, dict(consts, XMAJOR=False), options, ("wgmma", "mma.sync")),
        ("skinny_fp8_xmajor", linear._skinny_kernel, args, dict(consts, XMAJOR=True), options, ("mma.sync", None)),
        ("skinny_q8_0", linear._skinny_kernel, q8_args, q8_consts, options, ("wgmma", "mma.sync")),
        # a 16-row tile narrower than WGMMA_ROWS compiles to mma.sync, which sums a k-step otherwise than
        # a wgmma (run 171): wide_tile gives such shapes wide tiles of the same BLOCK_N (mma.sync again)
        (
            "skinny_q8_0_narrow",
            linear._skinny_kernel,
            q8_args,
            dict(q8_consts, BLOCK_N=cfgs.WGMMA_ROWS // 2),
            options,
            ("mma.sync", "wgmma"),
        ),
    ]
    # bf16 weights in wide row tiles (a prefill's rows: cfgs.wide_tile), the SwiGLU pair over a norm's
    # input and a split-K residual shape writing the next norm's, each split summed in the program
    bf16_args = dict(args, w_ptr="*bf16", w2_ptr="*bf16")
    for name, (n, k), epilogue in (("skinny_wide_swiglu", (N, K), 2), ("skinny_wide_down", (K, N), 1)):
        block_m, (block_n, block_k, warps, stages, split, *way) = cfgs.wide_tile(n, k, epilogue == 2, 2, epilogue == 1)
        tma_x = way == [cfgs.WAY_TMA_X]  # (x's tiles and the weights' through tensor descriptors)
        wide = dict(consts, EPILOGUE=epilogue, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=1,
                    SERIAL=split, FP8=False, GROUP=1, SCALE_ROWS=1, SCALE_ROWS2=1, CHAIN=False, XMAJOR=False,
                    RMS=epilogue == 2, P_BLOCK=64, NORM_OUT=epilogue == 1, TMA=tma_x, TMA_X=tma_x,
                    NORM_PARTS=block_n // cfgs.pick_config(n, k)[0] if epilogue == 1 else 1)  # fmt: skip
        wide_args = dict(bf16_args, M=3000, N=n, K=k, K_SPLIT=k // split, stride_y=n, stride_res=n)
        if tma_x:
            desc = f"tensordesc<bf16[{block_n},{block_k}]>"
            wide_args.update(x_ptr=f"tensordesc<bf16[{block_m},{block_k}]>", w_ptr=desc, w2_ptr=desc)
        cases.append((name, linear._skinny_kernel, wide_args, wide, dict(num_warps=warps, num_stages=stages),
                      ("wgmma", None)))  # fmt: skip
    # Q8_0 weights in wide row tiles (a GGUF file's prefill), each k-tile dequantized, the same two shapes
    for name, (n, k), epilogue in (("skinny_wide_q8_0_swiglu", (N, K), 2), ("skinny_wide_q8_0_down", (K, N), 1)):
        block_m, (block_n, block_k, warps, stages, split, *_) = cfgs.wide_tile(
            n, k, epilogue == 2, 2, epilogue == 1, "q8_0", 1
        )
        wide = dict(q8_consts, EPILOGUE=epilogue, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=1,
                    SERIAL=split, RMS=epilogue == 2, P_BLOCK=64, NORM_OUT=epilogue == 1,
                    NORM_PARTS=block_n // cfgs.pick_config(n, k, "q8_0")[0] if epilogue == 1 else 1)  # fmt: skip
        wide_args = dict(q8_args, M=3000, N=n, K=k, K_SPLIT=k // split, stride_y=n, stride_res=n, stride_s=n,
                         stride_s2=n)  # fmt: skip
        cases.append((name, linear._skinny_kernel, wide_args, wide, dict(num_warps=warps, num_stages=stages),
                      ("wgmma", None)))  # fmt: skip
    return cases


def moe_cases(N=517, H=2048, I=512, top_k=8):
    """`grouped_experts` over N tokens with Qwen3.5-35B-A3B's experts in bfloat16 (on a GPU the dot
    operands stay bf16: DOT_F32=False), and with e4m3 experts (FP8) at Qwen3-Next-80B-A3B's top-10."""
    args = dict(
        x_ptr="*bf16",
        pairs_ptr="*i32",
        block_expert_ptr="*i32",
        w_ptr="*bf16",
        s_ptr="*fp32",
        act_ptr="*bf16",
        rw_ptr="*bf16",
        y_ptr="*bf16",
        NK=N * top_k,
        H=H,
        I=I,
    )
    return [
        (
            "moe_grouped_gate_up",
            moe._grouped_gate_up_kernel,
            args,
            dict(TOP_K=top_k, DOT_F32=False, FP8=False, GROUP=128, **moe.GATE_UP_BLOCKS),
            moe.GATE_UP_OPTIONS,
        ),
        (
            "moe_grouped_gate_up_fp8",
            moe._grouped_gate_up_kernel,
            dict(args, w_ptr="*fp8e4nv", NK=N * 10),
            dict(TOP_K=10, DOT_F32=False, FP8=True, GROUP=128, **moe.GATE_UP_BLOCKS),
            moe.GATE_UP_OPTIONS,
        ),
        (
            "moe_grouped_gate_up_q8_0",
            moe._grouped_gate_up_kernel,
            dict(args, w_ptr="*i8", s_ptr="*fp16"),
            dict(TOP_K=top_k, DOT_F32=False, FP8=True, GROUP=32, **moe.GATE_UP_BLOCKS),
            moe.GATE_UP_OPTIONS,
        ),
        (
            "moe_grouped_down",
            moe._grouped_down_kernel,
            args,
            dict(DOT_F32=False, FP8=False, GROUP=128, **moe.DOWN_BLOCKS),
            moe.DOWN_OPTIONS,
        ),
        (
            "moe_grouped_down_fp8",
            moe._grouped_down_kernel,
            dict(args, w_ptr="*fp8e4nv"),
            dict(DOT_F32=False, FP8=True, GROUP=128, **moe.DOWN_BLOCKS),
            moe.DOWN_OPTIONS,
        ),
        (
            "moe_grouped_down_q8_0",
            moe._grouped_down_kernel,
            dict(args, w_ptr="*i8", s_ptr="*fp16"),
            dict(DOT_F32=False, FP8=True, GROUP=32, **moe.DOWN_BLOCKS),
            moe.DOWN_OPTIONS,
        ),
    ]


def moe_step_cases(H=2048, I=512, top_k=8):
    """The decode MoE block's down and gate/up kernels (`triton_moe.moe_step`, a program per row, slot
    and block) over Q8_0 experts (int8, fp16 scales a 32-column group) and FP8's (e4m3, float32 scales a
    128-column block), Qwen3.5-35B-A3B's shapes: scales loaded a group at a time, the dequantized
    weights rounded by the packed convert (inline PTX: ptxas assembles it here)."""
    block_h, warps = moe_step.DOWN_BLOCKS
    chunks = triton.next_power_of_2(-(-I // moe_step.BLOCK_K))
    cases = []
    for name, w, s, group in (("q8_0", "*i8", "*fp16", 32), ("fp8", "*fp8e4nv", "*fp32", 128)):
        args = dict(
            act_ptr="*bf16", idx_ptr="*i32", rw_ptr="*bf16", down_ptr=w, shared_down_ptr=w, down_s_ptr=s,
            shared_down_s_ptr=s, res_ptr="*bf16", y_ptr="*bf16", count_ptr="*i32", out_ptr="*bf16",
            nw_ptr="*bf16", xn_ptr="*bf16", ss_ptr="*fp32", stride_act=I,
        )  # fmt: skip
        constexprs = dict(
            H=H, I=I, Is=I, TOP_K=top_k, BLOCK_N=block_h, BLOCK_K=moe_step.BLOCK_K, CHUNKS=chunks, CHUNKS_S=chunks,
            RESIDUAL=True, FP8_EXPERTS=True, FP8_SHARED=True, GROUP=group, PDL=True, RELEASE=2, NORM_OUT=True,
            ASM_ROUND=True,
        )  # fmt: skip
        cases.append((f"moe_step_down_{name}", moe_step._down_combine_kernel, args, constexprs, dict(num_warps=warps)))
        args = dict(
            x_ptr="*bf16", idx_ptr="*i32", gate_up_ptr=w, shared_gate_ptr=w, shared_up_ptr=w, gate_up_s_ptr=s,
            shared_gate_s_ptr=s, shared_up_s_ptr=s, act_ptr="*bf16", stride_act=I,
        )  # fmt: skip
        block_i, gate_up_warps = moe_step.GATE_UP_BLOCKS
        constexprs = dict(
            H=H, I=I, Is=I, TOP_K=top_k, BLOCK_N=block_i, BLOCK_K=moe_step.BLOCK_K, FP8_EXPERTS=True, FP8_SHARED=True,
            GROUP=group, PDL=True, RELEASE=2, ASM_ROUND=True,
        )  # fmt: skip
        cases.append(
            (f"moe_step_gate_up_{name}", moe_step._gate_up_kernel, args, constexprs, dict(num_warps=gate_up_warps))
        )
    return cases


def round_cases(V=248320, H=4096, R=4, E=512, top_k=10):
    """A greedy round's own kernels at the 9B's vocabulary (`triton_sample.keep_verify_rows`: the slots'
    float32 logits and bf16 hidden in one launch; `triton_draft.argmax_rows`: the split argmax without
    a gate; the fused accept with the pads' restore; `follow_slots`, a followed batch's refresh) and
    the MoE norm / router kernel at the 80B-A3B's 512 experts, top 10 (its int64 keys' maxima)."""
    block = 4096
    keep = (
        "round_keep_rows", sample._keep_rows_kernel,
        dict(logits_ptr="*fp32", prev_logits_ptr="*fp32", new_logits_ptr="*fp32", hidden_ptr="*bf16",
             prev_hidden_ptr="*bf16", new_hidden_ptr="*bf16", slots_ptr="*i64", starts_ptr="*i64", ks_ptr="*i64",
             V=V, H=H),
        dict(R=R, V_BLOCKS=triton.cdiv(V, block), BLOCK=block), dict(num_warps=4),
    )  # fmt: skip
    tiles = triton.cdiv(V, block)
    pick = (
        "round_argmax_rows", draft._greedy_draft_kernel,
        dict(logits_ptr="*fp32", stride_l=V, V=V, ids_ptr="*i64", at_ptr="*i64", rows_ptr="*i64", d2t_ptr="*i64",
             live_ptr="*i1", counted_ptr="*i64", steps_ptr="*i64", flag_ptr="*i64", part_ptr="*fp32",
             count_ptr="*i32", p_min=0.0),
        dict(HAS_AT=False, HAS_ROWS=False, HAS_D2T=False, GATED=False, FIRST=False, HAS_STEPS=False,
             HAS_FLAG=False, BLOCK_V=block, TILES=1, SPLITS=tiles, SPLITS_POW2=triton.next_power_of_2(tiles)),
        dict(num_warps=4),
    )  # fmt: skip
    accept = (
        "round_accept_pads", sample._accept_greedy_kernel,
        dict(target_ptr="*i64", start_ptr="*i64", slot_ptr="*i64", k_ptr="*i64", count_ptr="*i64", index_ptr="*i64",
             befores_ptr="*i32", ids_ptr="*i64", head_ptr="*i64", ctl_ptr="*i32", out_ptr="*i64", a_idx_ptr="*i64",
             a_ptr="*i64", b_idx_ptr="*i64", b_ptr="*i64", kk_ptr="*i64", c_ptr="*i64", pads_ptr="*i1"),
        dict(R=R, NUM_CTL=9, NUM_CTL_BLOCK=16, BLOCK_R=R, HEADS=True, HAS_PADS=True), dict(num_warps=1),
    )  # fmt: skip
    rows, warps = moe_step.ROUTER_BLOCKS
    router = (
        "moe_step_router_512", moe_step._norm_router_kernel,
        dict(x_ptr="*bf16", norm_ptr="*bf16", gates_ptr="*bf16", h_ptr="*bf16", logits_ptr="*bf16", count_ptr="*i32",
             idx_ptr="*i32", rw_ptr="*bf16", eps=1e-6),
        dict(H=2048, E=E, LOGIT_STRIDE=triton.cdiv(E + 1, 16) * 16, TOP_K=top_k, RENORM=True, BLOCK_R=rows,
             BLOCK_H=2048, BLOCK_E=E, WARPS=warps, PDL=True, RELEASE=2),
        dict(num_warps=warps),
    )  # fmt: skip
    follow = (
        "round_follow_slots", sample._follow_slots_kernel,
        dict(src_ptr="*i32", seqs_ptr="*i32", slot_ptr="*i64", row_seq_ptr="*i64", row_idx_ptr="*i32",
             row_slot_ptr="*i32", flat_ptr="*i64", B=64, M=256, R=R),
        dict(BASE=True, FLAT=True, BLOCK=sample.FOLLOW_BLOCK), dict(num_warps=4),
    )  # fmt: skip
    return [keep, pick, accept, router, follow]


def specialise(fn: JITFunction, args: dict, constexprs: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) for an ASTSource, from the kernel's own parameter list: each
    runtime argument's type and specialisation as the JIT derives them from the values of a launch
    (pointer "*dtype" strings stand for 16-byte-aligned tensors; ints == 1 become constexprs, ints
    divisible by 16 get tt.divisibility unless the kernel opts out; floats are fp32)."""
    signature, consts, attrs = {}, dict(constexprs), {}
    for i, p in enumerate(fn.params):
        name = p.name
        if p.is_constexpr:
            if name not in consts:
                raise KeyError(f"no value for constexpr {name}")
            signature[name] = "constexpr"
            continue
        if name not in args:
            raise KeyError(f"no value for argument {name}")
        value = args[name]
        divisible = False
        if isinstance(value, str):  # a pointer
            signature[name], divisible = value, not p.do_not_specialize_on_alignment
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"argument {name}: unsupported value {value!r}")
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1 and not p.do_not_specialize:
            signature[name], consts[name] = "constexpr", 1
        else:
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            divisible = value % 16 == 0 and not p.do_not_specialize and not p.do_not_specialize_on_alignment
        if divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, consts, attrs


def main() -> int:
    failures = []
    for name, fn, args, constexprs, options, *ptx in (
        gdn_cases() + gdn_step_cases() + moe_cases() + moe_step_cases() + skinny_fp8_cases() + round_cases()
    ):
        opts = " ".join(f"{k}={v}" for k, v in options.items())
        if not isinstance(fn, JITFunction):
            print(
                f"sm90_compile: {name} is a {type(fn).__name__}, not a JITFunction: run with "
                "TRITON_INTERPRET unset or 0 (the interpreter's kernels cannot be compiled)",
                file=sys.stderr,
            )
            return 1
        try:
            signature, consts, attrs = specialise(fn, args, constexprs)
            kernel = triton.compile(
                ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs),
                target=SM90,
                options=dict(options),
            )
        except Exception as e:  # noqa: BLE001  (any failure to compile is what this script reports)
            last = (str(e).strip().splitlines() or [""])[-1]  # a CompilationError ends with its message
            print(f"{name:22s} FAILED to compile ({opts}): {type(e).__name__}: {last}")
            print(f"{type(e).__name__}: {e}", file=sys.stderr)
            failures.append(f"{name} does not compile for sm90: {type(e).__name__}: {last}")
            continue
        shared = kernel.metadata.shared
        if ptx:  # the instruction the way must compile to, and the one it must not
            has, lacks = ptx[0]
            code = kernel.asm["ptx"]
            if has not in code or (lacks and lacks in code):
                failures.append(f"{name} compiles to {'no ' + has if has not in code else lacks} (expected {has})")
        fits = shared <= SHARED_LIMIT
        print(f"{name:22s} shared {shared:7d} bytes  {opts:26s} {'ok' if fits else 'TOO MUCH'}")
        if not fits:
            failures.append(
                f"{name} needs {shared} bytes of shared memory per block, more than sm90's "
                f"{SHARED_LIMIT} ({opts}): it would fail to launch on an H200 (OutOfResources)"
            )
    if failures:
        print("sm90_compile: FAILED\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    print(f"sm90_compile: all kernels fit sm90's {SHARED_LIMIT} bytes of shared memory per block")
    return 0


if __name__ == "__main__":
    sys.exit(main())
