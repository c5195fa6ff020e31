"""What an FP8 skinny GEMM could stream on Hopper: y = x @ w.T for x [M, K] bf16 (M = 1 or 9) and
w [N, K] e4m3 with one scale per 128x128 block, over Qwen3.5-9B's projection shapes.

Each mode runs at its best of a few block configs (BLOCK_K 128 or 256, split-K partials stored but
not summed), timed in CUDA graphs of 100 launches cycling over weight copies that overflow L2 (as
nextn.ops.linear_tune.tune times the production kernel):
  bf16         bf16 weights, one chained tensor-core dot (what bf16 decode runs);
  f16 chain    e4m3 widened to fp16 in registers, x's tile times the block scale in fp16, chained
               dots (what nextn's FP8 decode runs since run 65);
  e4m3 tile    x quantized in the loop per (row, 128 columns) to e4m3 (amax / 448: the checkpoints'
               "activation_scheme: dynamic"), an fp8 dot per tile, scaled by the block's and the
               rows' scales before it is added;
  e4m3 chain   x quantized in the loop to e4m3 with the block scale folded in and one scale per row
               given (a row bound its producer would compute), chained fp8 dots;
  e4m3 x given x already e4m3 (quantized outside, one scale per row), chained fp8 dots: the bound.
The "xm" modes turn the product around, x [16, BLOCK_K] @ w.T [BLOCK_K, BLOCK_N], so the dot's M is
x's 16 padded rows and Triton compiles mma.sync (sm80's warp-level MMA) instead of wgmma: the e4m3
tile goes from shared memory straight into the MMA's register layout, is widened there and multiplied
while the next tiles' cp.async copies are in flight (how Marlin-style weight-only kernels stream):
  bf16 xm      bf16 weights;
  f16 chain xm "f16 chain" turned around (x's scaled tile passes through shared memory);
  bf16 tile xm e4m3 widened to bf16, x as it is, a dot per tile scaled by its block scale, then added.
Reports microseconds, GB/s of weight bytes and the fraction of the copy bandwidth, and each mode's
largest error relative to the float32 product of the dequantized weights.

  python bench/fp8_dot_variants.py --out fp8_dot_variants.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from nextn.bench.measure import copy_bandwidth
from nextn.ops.fp8 import compact_scales, dequantize, quantize
from nextn.ops.linear_tune import graph_us  # (the tuner's timing: graphs over weight copies)

MODES = {
    "bf16": 0,
    "f16 chain": 1,
    "e4m3 tile": 2,
    "e4m3 chain": 3,
    "e4m3 x given": 4,
    "bf16 xm": 5,
    "f16 chain xm": 6,
    "bf16 tile xm": 7,
}
# (BLOCK_N, warps, stages, split, BLOCK_K); BLOCK_K 256 spans two scale blocks (not for "e4m3 tile")
CONFIGS = [(64, 4, 4, 1, 128), (64, 4, 4, 2, 128), (64, 4, 4, 4, 128), (128, 8, 4, 1, 128), (128, 8, 4, 2, 128),
           (32, 4, 4, 4, 128), (64, 4, 3, 1, 256), (64, 4, 3, 2, 256), (64, 4, 4, 4, 256), (32, 4, 4, 2, 256),
           (128, 8, 3, 1, 256), (32, 4, 3, 4, 256)]  # fmt: skip
# the x-major (mma.sync) modes: wider weight tiles, deeper pipelines
XM_CONFIGS = [(64, 4, 4, 1, 128), (128, 4, 4, 1, 128), (128, 4, 6, 1, 128), (128, 8, 4, 1, 128), (256, 8, 4, 1, 128),
              (128, 4, 4, 2, 128), (64, 4, 6, 2, 128), (128, 8, 5, 2, 128), (64, 4, 4, 4, 128), (128, 4, 3, 1, 256),
              (128, 8, 3, 2, 256), (64, 4, 4, 2, 256), (256, 8, 3, 1, 256)]  # fmt: skip


@triton.jit
def _xm_loop(x_ptr, w_ptr, s_ptr, offs_m, offs_n, mask_m, k_start, K_SPLIT, K, stride_s, s_col, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr):  # fmt: skip
    """The x-major modes' k-loop: [BLOCK_M, BLOCK_N]."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_start, k_start + K_SPLIT, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + offs_n[None, :] * K + offs_k[:, None])  # w.T's tile [BLOCK_K, BLOCK_N]
        x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mask_m[:, None], other=0.0)
        if MODE == 5:
            acc = tl.dot(x, w, acc)
        elif MODE == 6:
            s = tl.load(s_ptr + (offs_k // 128) * stride_s + s_col)[None, :]
            acc = tl.dot((x.to(tl.float32) * s).to(tl.float16), w.to(tl.float16), acc)
        else:
            s = tl.load(s_ptr + (k0 // 128) * stride_s + s_col)
            acc += tl.dot(x, w.to(tl.bfloat16)) * s
    return acc


@triton.jit
def _kernel(x_ptr, xq_ptr, xs_ptr, w_ptr, s_ptr, y_ptr, M, N, K, K_SPLIT, stride_s, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr):  # fmt: skip
    n_block = tl.program_id(0)
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    k_start = tl.program_id(1) * K_SPLIT
    s_col = (n_block * BLOCK_N) // 128
    row_scale = tl.load(xs_ptr + offs_m, mask=mask_m, other=1.0)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    if MODE >= 5:
        acc = tl.trans(_xm_loop(x_ptr, w_ptr, s_ptr, offs_m, offs_n, mask_m, k_start, K_SPLIT, K, stride_s, s_col,
                                BLOCK_M, BLOCK_N, BLOCK_K, MODE))  # fmt: skip
    else:
        for k0 in range(k_start, k_start + K_SPLIT, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :])
            if MODE == 0:
                x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mask_m[:, None], other=0.0)
                acc = tl.dot(w, tl.trans(x), acc)
            elif MODE == 4:
                xq = tl.load(xq_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mask_m[:, None], other=0.0)
                acc = tl.dot(w, tl.trans(xq), acc)
            else:
                x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mask_m[:, None], other=0.0)
                s = tl.load(s_ptr + (offs_k // 128) * stride_s + s_col)[None, :]  # the tile's block scales
                xf = x.to(tl.float32)
                if MODE == 1:
                    acc = tl.dot(w.to(tl.float16), tl.trans((xf * s).to(tl.float16)), acc)
                elif MODE == 2:
                    amax = tl.max(tl.abs(xf), axis=1)
                    sx = tl.where(amax > 0, amax / 448.0, 1.0)
                    part = tl.dot(w, tl.trans((xf / sx[:, None]).to(tl.float8e4nv)))
                    acc += part * (tl.max(s, axis=1) * sx)[None, :]  # (one block: BLOCK_K 128)
                else:
                    acc = tl.dot(w, tl.trans((xf * s / row_scale[:, None]).to(tl.float8e4nv)), acc)
    if MODE == 3 or MODE == 4:
        acc = acc * row_scale[None, :]
    y = y_ptr + tl.program_id(1) * M * N + offs_m[None, :] * N + offs_n[:, None]
    tl.store(y, acc, mask=mask_m[None, :])


def run(mode: int, x, xq, xs, w, s, cfg) -> torch.Tensor:
    block_n, warps, stages, split, block_k = cfg
    N, K = w.shape
    M = x.shape[0]
    y = torch.empty(split, M, N, device=x.device, dtype=torch.float32)
    _kernel[(N // block_n, split)](
        x, xq, xs, w, s, y, M, N, K, K // split, s.stride(0), BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, MODE=mode,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y.sum(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 9])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = ap.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    copy = copy_bandwidth(device) / 1e9  # GB/s
    report = {"device": torch.cuda.get_device_name(), "copy_GBps": copy, "configs": CONFIGS, "xm_configs": XM_CONFIGS,
              "shapes": {}}  # fmt: skip
    print(f"copy bandwidth {copy:.0f} GB/s")
    for N, K in [(4096, 4096), (12288, 4096), (4096, 12288), (2048, 4096)]:
        copies = max(2, int(4 * 60e6 // (N * K)) + 1)  # past L2 even for e4m3
        ws = [torch.randn(N, K, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        qs = [compact_scales(quantize(w)) for w in ws]
        entry = report["shapes"][f"{N}x{K}"] = {}
        for M in args.rows:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            ref = x.float() @ dequantize(qs[0].weight, qs[0].scale.repeat_interleave(128, 1), torch.float32).T
            bound = x.float().abs().amax(1) * qs[0].scale.max() / 448  # a row bound for the e4m3 chain
            xq = (x.float() / bound[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
            for name in args.modes:
                mode = MODES[name]
                best = None
                for cfg in XM_CONFIGS if mode >= 5 else CONFIGS:
                    if K % (cfg[3] * cfg[4]) or N % cfg[0] or (mode in (2, 7) and cfg[4] > 128):
                        continue
                    ops = [(w, qs[0].scale) for w in ws] if mode in (0, 5) else [(q.weight, q.scale) for q in qs]
                    rs = bound if mode == 3 else torch.ones_like(bound)

                    def call(i, mode=mode, cfg=cfg, ops=ops, rs=rs, x=x, xq=xq):
                        run(mode, x, xq, rs, *ops[i], cfg)

                    try:
                        us = graph_us(call, copies, 100)
                    except Exception as e:  # a config a mode cannot compile or launch
                        torch.cuda.synchronize()
                        print(f"{N}x{K} M={M} {name} {cfg}: {type(e).__name__}")
                        continue
                    if best is None or us < best[0]:
                        best = (us, cfg)
                us, cfg = best
                nbytes = N * K * (2 if mode in (0, 5) else 1)
                err = None
                if mode in (1, 2, 3, 6, 7):  # (mode 4's x leaves the block scales out: a speed bound only)
                    rs = bound if mode == 3 else torch.ones_like(bound)
                    out = run(mode, x, xq, rs, qs[0].weight, qs[0].scale, cfg)
                    err = ((out - ref).abs().max() / ref.abs().max()).item()
                elif mode in (0, 5):  # against the float32 product of the bf16 weights
                    ref16 = x.float() @ ws[0].float().T
                    out = run(mode, x, xq, bound, ws[0], qs[0].scale, cfg)
                    err = ((out - ref16).abs().max() / ref16.abs().max()).item()
                frac = nbytes / us / 1e3 / copy
                entry[f"{name} M={M}"] = {"us": us, "config": cfg, "GBps": nbytes / us / 1e3, "of_copy": frac,
                                          "max_rel_err": err}  # fmt: skip
                gbps = nbytes / us / 1e3
                print(f"{N}x{K} M={M} {name:12s} {us:7.1f} us {gbps:6.0f} GB/s ({frac:.2f}) {cfg} err {err}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
