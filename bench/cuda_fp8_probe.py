"""Can a hand-written CUDA kernel stream FP8 weights where Triton's loops cannot (bench/NOTES.md, runs
64-67, 88-90, 126: 0.47-0.74 of the copy bandwidth)? A probe for issue 16, not an engine path.

The kernel is compiled on the device by NVRTC (torch.cuda._compile_kernel: no CUDA toolkit needed) and
is Marlin-shaped: the e4m3 weights are stored once in the order of mma.sync's A fragments (16 weight
rows x 32 columns a warp step, 16 contiguous bytes a lane), so each lane streams them with one 16-byte
load a step (cp.async through a STAGES-deep ring in shared memory, so many are in flight without
holding registers: ptxas sank register loads to one or two in flight), widens them in registers
(cvt.rn.f16x2.e4m3x2) and feeds two m16n8k16
MMAs whose B operand is x (its rows padded to 8, in fp16); each 128x128 block's products are summed
apart and scaled by the block's scale into the float32 accumulator. A CTA owns 16 weight rows; its
WARPS_K warps split K and their partial sums are added in warp order (every row's arithmetic is the
same for any M <= 8: rows stay invariant). x is converted to fp16 outside (a probe: no range guard).

Reports us per call (CUDA graphs over weight copies past L2, as nextn.ops.linear_tune.graph_us), the
fraction of the copy bandwidth, the error against the float32 product of the dequantized weights, and
the production FP8 skinny GEMM (nextn.ops.triton_linear) at run 127's tuned configs beside it.

    python bench/cuda_fp8_probe.py --out cuda_fp8_probe.json
"""

from __future__ import annotations

import argparse
import json

import torch

from nextn.bench.measure import copy_bandwidth
from nextn.ops.fp8 import compact_scales, dequantize, quantize
from nextn.ops.linear_tune import graph_us
from nextn.ops.triton_linear import skinny_linear

SOURCE = r"""
__device__ __forceinline__ unsigned widen(unsigned short v) {  // two e4m3 -> two fp16 (exact)
    unsigned r;
    asm("{ .reg .b16 t; mov.b16 t, %1; cvt.rn.f16x2.e4m3x2 %0, t; }" : "=r"(r) : "h"(v));
    return r;
}

__device__ __forceinline__ void mma(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                    unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void copy_async(void* dst, const void* src) {  // 16 bytes, global -> shared
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src));
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;"); }

template <int N> __device__ __forceinline__ void wait_groups() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

extern "C" __global__ void __launch_bounds__(WARPS_K * 32)
fp8_gemv(const uint4* __restrict__ w, const float* __restrict__ scale, const unsigned* __restrict__ xh,
         float* __restrict__ y, int M, int N, int K) {
    // each lane streams its own 16 bytes a step and strip through a STAGES-deep ring in shared memory
    // (cp.async: the copies stay in flight without holding registers; a lane reads back only what it
    // copied). A CTA owns STRIPS strips of 16 weight rows: a step's x fragments serve all of them, and
    // each k16 half has its own partial sums (independent MMA chains), added at each block's end.
    __shared__ uint4 ring[WARPS_K][STAGES][STRIPS][32];
    __shared__ float red[WARPS_K][STRIPS][32][4];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int steps = K / 32, per_warp = steps / WARPS_K, s0 = warp * per_warp;  // per_warp: a multiple of 4
    const int strip0 = blockIdx.x * STRIPS;
    const uint4* wp = w + ((size_t)strip0 * steps + s0) * 32 + lane;
    const int g = lane >> 2, q = lane & 3;
    const unsigned* xp = xh + (size_t)g * (K / 2) + q + (size_t)s0 * 16;  // x row g, columns 2q.. of each step
    const int n_scales = (N + 127) / 128;
    float acc[STRIPS][4], p0[STRIPS][4], p1[STRIPS][4];
#pragma unroll
    for (int t = 0; t < STRIPS; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[t][i] = p0[t][i] = p1[t][i] = 0.f;
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        if (i < per_warp)
#pragma unroll
            for (int t = 0; t < STRIPS; ++t)
                copy_async(&ring[warp][i][t][lane], wp + ((size_t)t * steps + i) * 32);
        commit();
    }
    for (int s = 0; s < per_warp; s += 4) {
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int st = s + u, next = st + STAGES - 1;
            if (next < per_warp)
#pragma unroll
                for (int t = 0; t < STRIPS; ++t)
                    copy_async(&ring[warp][next % STAGES][t][lane], wp + ((size_t)t * steps + next) * 32);
            commit();
            wait_groups<STAGES - 1>();  // step st's copies have landed
            const unsigned* xs = xp + st * 16;
            const unsigned b00 = __ldg(xs), b01 = __ldg(xs + 4), b10 = __ldg(xs + 8), b11 = __ldg(xs + 12);
#pragma unroll
            for (int t = 0; t < STRIPS; ++t) {
                const uint4 v = ring[warp][st % STAGES][t][lane];
#if LOAD_ONLY  // the stream alone: the bytes folded into the accumulator's bits, no widening, no MMA
                p0[t][0] = __uint_as_float(__float_as_uint(p0[t][0]) ^ v.x ^ v.y ^ v.z ^ v.w ^ b00);
                continue;
#endif
                mma(p0[t], widen(v.x & 0xffff), widen(v.x >> 16), widen(v.y & 0xffff), widen(v.y >> 16), b00, b01);
                mma(p1[t], widen(v.z & 0xffff), widen(v.z >> 16), widen(v.w & 0xffff), widen(v.w >> 16), b10, b11);
            }
        }
#pragma unroll
        for (int t = 0; t < STRIPS; ++t) {  // the 128-column block's scale
            const float sc = __ldg(scale + ((s0 + s) / 4) * n_scales + (strip0 + t) * 16 / 128);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                acc[t][i] += (p0[t][i] + p1[t][i]) * sc;
                p0[t][i] = p1[t][i] = 0.f;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < STRIPS; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) red[warp][t][lane][i] = acc[t][i];
    __syncthreads();
    if (warp < STRIPS) {  // warp t adds strip t's partial sums in warp order
        const int t = warp;
        float out[4] = {0.f, 0.f, 0.f, 0.f};
        for (int v = 0; v < WARPS_K; ++v) {
#pragma unroll
            for (int i = 0; i < 4; ++i) out[i] += red[v][t][lane][i];
        }
        const int n0 = (strip0 + t) * 16 + g, m0 = 2 * q;  // C: rows are weight rows, columns x's rows
        if (m0 < M) { y[(size_t)m0 * N + n0] = out[0]; y[(size_t)m0 * N + n0 + 8] = out[2]; }
        if (m0 + 1 < M) { y[(size_t)(m0 + 1) * N + n0] = out[1]; y[(size_t)(m0 + 1) * N + n0 + 8] = out[3]; }
    }
}
"""

# run 127's tuned FP8 configs (the production kernel beside the probe)
PRODUCTION = {(4096, 4096): (64, 128, 4, 4, 4), (10240, 4096): (64, 128, 4, 6, 2, 2),
              (12288, 4096): (64, 128, 4, 4, 1, 2), (4096, 12288): (64, 128, 4, 4, 4)}  # fmt: skip
# (WARPS_K, STAGES, STRIPS): the ring and the sums within 48 KB; run 128-129 had STRIPS 1 alone (one chain)
VARIANTS = [(8, 4, 1), (16, 2, 1), (8, 4, 2), (16, 2, 2), (4, 8, 2), (4, 4, 4), (8, 2, 4)]
LOAD_ONLY = [(8, 4, 2), (16, 2, 2)]  # the same streams without the widening and the MMAs (run 129: 0.79-0.87)


def shuffle(q: torch.Tensor) -> torch.Tensor:
    """e4m3 [N, K] -> the kernel's order: [N/16 strips, K/32 steps, 32 lanes, 16 bytes], a lane's bytes
    its two MMAs' A fragments (rows g and g + 8, columns 2q, 2q + 1, then + 8, then the next 16)."""
    N, K = q.shape
    s, t, lane, b = torch.meshgrid(
        *(torch.arange(n, device=q.device) for n in (N // 16, K // 32, 32, 16)), indexing="ij"
    )
    k16, within = b // 8, b % 8
    row = s * 16 + lane // 4 + 8 * ((within % 4) // 2)
    col = t * 32 + 16 * k16 + 8 * (within // 4) + 2 * (lane % 4) + within % 2
    flat = (row * K + col).reshape(-1)
    return q.view(torch.uint8).reshape(-1)[flat].contiguous()


def measure(kernels: dict, qs: list, shuffled: list, M: int, prod_cfg: tuple, copy: float) -> dict:
    """One shape at M rows: the production kernel and every CUDA variant (us, fraction of the copy
    bandwidth, error against the dequantized float32 product, the last row alone equal)."""
    N, K = qs[0].weight.shape
    scales = [q.scale.contiguous() for q in qs]  # [K / 128, N / 128]
    x = torch.randn(M, K, device=qs[0].weight.device, dtype=torch.bfloat16)
    xh = torch.zeros(8, K, device=x.device, dtype=torch.float16)
    xh[:M] = x.to(torch.float16)
    alone = torch.zeros_like(xh)
    alone[0] = xh[M - 1]
    ref = x.float() @ dequantize(qs[0].weight, qs[0].scale.repeat_interleave(128, 1), torch.float32).T
    y = torch.empty(M, N, device=x.device, dtype=torch.float32)
    one = torch.empty(1, N, device=x.device, dtype=torch.float32)
    prod = graph_us(lambda i: skinny_linear(x, qs[i], config=prod_cfg), len(qs), 100)
    out = skinny_linear(x, qs[0], config=prod_cfg, out_dtype=torch.float32)
    row = {
        "triton": {"us": prod, "config": prod_cfg, "max_rel_err": ((out - ref).abs().max() / ref.abs().max()).item()}
    }
    for (wk, u, strips, only), kern in kernels.items():

        def call(i, kern=kern, wk=wk, strips=strips, xs=xh, out=y, rows=M):
            kern((N // 16 // strips, 1, 1), (wk * 32, 1, 1), [shuffled[i], scales[i], xs, out, rows, N, K])

        us = graph_us(call, len(qs), 100)
        name = f"cuda wk={wk} stages={u} strips={strips}" + (" loads only" if only else "")
        if only:  # (no product to check)
            row[name] = {"us": us, "max_rel_err": float("nan")}
            continue
        call(0)
        call(0, xs=alone, out=one, rows=1)
        torch.cuda.synchronize()
        row[name] = {"us": us, "max_rel_err": ((y - ref).abs().max() / ref.abs().max()).item(),
                                      "last_row_alone_equal": bool(torch.equal(one[0], y[M - 1]))}  # fmt: skip
    for v in row.values():
        v["of_copy"] = N * K / v["us"] / 1e3 / copy
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    args = ap.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    copy = copy_bandwidth(device) / 1e9
    kernels = {}
    for wk, u, strips, only in [(*v, 0) for v in VARIANTS] + [(*v, 1) for v in LOAD_ONLY]:
        options = [f"-DWARPS_K={wk}", f"-DSTAGES={u}", f"-DSTRIPS={strips}", f"-DLOAD_ONLY={only}"]
        kernels[(wk, u, strips, only)] = torch.cuda._compile_kernel(SOURCE, "fp8_gemv", nvcc_options=options)
    report = {"device": torch.cuda.get_device_name(), "copy_GBps": copy, "shapes": {}}
    print(f"copy bandwidth {copy:.0f} GB/s; compiled {len(kernels)} variants with NVRTC")
    for (N, K), prod_cfg in PRODUCTION.items():
        copies = max(2, int(4 * 60e6 // (N * K)) + 1)
        qs = [
            compact_scales(quantize(torch.randn(N, K, device=device, dtype=torch.bfloat16) * 0.02))
            for _ in range(copies)
        ]
        shuffled = [shuffle(q.weight) for q in qs]
        entry = report["shapes"][f"{N}x{K}"] = {}
        for M in args.rows:
            row = entry[f"M={M}"] = measure(kernels, qs, shuffled, M, prod_cfg, copy)
            best = min((v["us"], k) for k, v in row.items() if k != "triton" and "only" not in k)[1]
            print(f"{N}x{K} M={M}: triton {row['triton']['us']:.1f} us ({row['triton']['of_copy']:.2f}); best {best} "
                  f"{row[best]['us']:.1f} us ({row[best]['of_copy']:.2f}) err {row[best]['max_rel_err']:.2e}; rows "
                  f"invariant {all(v.get('last_row_alone_equal', True) for v in row.values())}")  # fmt: skip
            for k, v in row.items():
                print(f"    {k:34s} {v['us']:7.1f} us ({v['of_copy']:.2f}) err {v['max_rel_err']:.2e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
