"""Batch-invariant skinny matmul for the step path: y = x @ w.T for x [M, K], w [N, K], M small.

The reference is `F.linear`. Decode (1 row) and verify (K+1 rows) must compute each row with the
same arithmetic, or greedy speculative output drifts from plain output in bf16. Here each program
owns BLOCK_N output columns for every row: it streams its weight rows once (so a 1-row GEMV reads
each weight byte exactly once) and multiplies each [BLOCK_N, BLOCK_K] weight tile with all rows
padded to 16 in one tensor-core dot (weights as the 16+-row operand: "swap AB"). Block sizes are
chosen from (N, K) alone and M is never specialised, so the reduction order of a row does not
depend on M. More than 16 rows (a batch of sequences) run as tiles of 16, each computed exactly
as a 16-row call; a weight block's tiles are neighbouring programs, so they share its L2 reads.

Fused around the dot, so a decoder layer needs fewer launches:
- prologue `rms`: x -> RMSNorm(x) * (1 + w) (the zero-centred norm before a projection);
- epilogue `residual`: y = residual + x @ w.T (each rounded to x's dtype first, like `x + f(x)`);
- epilogue `silu_mul`: y = silu(x @ w.T) * (x @ w2.T) (the SwiGLU of an MLP, gate and up weights).
Roundings follow the PyTorch modules they replace, op by op.
"""

from __future__ import annotations

import torch

from nextn.ops.triton_utils import HAVE_TRITON, arrival_counters, interpreting, next_pow2

TILE_ROWS = 16  # rows of one tensor-core tile: a decode's 1, a verify's K + 1 <= 16, or a batch's share

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _epilogue(acc, acc2, r, x_dtype: tl.constexpr, EPILOGUE: tl.constexpr):
        """acc (, acc2, residual r) [BLOCK_N, BLOCK_M] float32 -> the output values, rounded like the modules."""
        if EPILOGUE == 1:
            out = acc.to(x_dtype).to(tl.float32) + r.to(tl.float32)
        elif EPILOGUE == 2:
            g = acc.to(x_dtype).to(tl.float32)
            silu = (g / (1.0 + tl.exp(-g))).to(x_dtype).to(tl.float32)
            out = silu * acc2.to(x_dtype).to(tl.float32)
        else:
            out = acc
        return out

    @triton.jit(do_not_specialize=["M"])
    def _skinny_kernel(
        x_ptr,
        w_ptr,
        w2_ptr,
        y_ptr,
        res_ptr,
        nw_ptr,
        part_ptr,
        count_ptr,
        M,
        N,
        K,
        K_SPLIT,
        stride_x,
        stride_y,
        stride_res,
        eps,
        PROLOGUE: tl.constexpr,  # 0 none, 1 rms (zero-centred)
        EPILOGUE: tl.constexpr,  # 0 none, 1 residual add, 2 silu(x w^T) * (x w2^T)
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,
        DOT_F32: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
        """Program (n * M_TILES + m, s) reduces K columns [s*K_SPLIT, (s+1)*K_SPLIT) of BLOCK_N outputs
        for rows [m*BLOCK_M, (m+1)*BLOCK_M). SPLIT > 1: float32 partials [SPLIT, M, N] in part_ptr,
        arrivals per (N block, row tile) in count_ptr."""
        pid = tl.program_id(0)
        m_tiles = tl.cdiv(M, BLOCK_M)
        k_start = tl.program_id(1) * K_SPLIT
        offs_m = (pid % m_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
        n_block = pid // m_tiles
        offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        x_dtype = x_ptr.dtype.element_ty
        if PROLOGUE == 1:  # per-row 1/rms over all of K in a fixed block order (every split does it)
            sumsq = tl.zeros((BLOCK_M,), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                xk = tl.load(
                    x_ptr + offs_m[:, None] * stride_x + offs_k[None, :],
                    mask=mask_m[:, None] & (offs_k[None, :] < K),
                    other=0.0,
                ).to(tl.float32)
                sumsq += tl.sum(xk * xk, axis=1)
            rstd = 1.0 / tl.sqrt(sumsq / K + eps)
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        acc2 = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for k0 in range(k_start, k_start + K_SPLIT, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                x_mask = mask_m[:, None]
                w_mask = mask_n[:, None]
            else:
                x_mask = mask_m[:, None] & (offs_k[None, :] < K)
                w_mask = mask_n[:, None] & (offs_k[None, :] < K)
            x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=x_mask, other=0.0)
            if PROLOGUE == 1:
                nw = tl.load(nw_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
                x = (x.to(tl.float32) * rstd[:, None] * (1.0 + nw[None, :])).to(x_dtype)
            w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=w_mask, other=0.0)
            if DOT_F32:
                acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, tl.trans(x), acc)
            if EPILOGUE == 2:
                w2 = tl.load(w2_ptr + offs_n[:, None] * K + offs_k[None, :], mask=w_mask, other=0.0)
                if DOT_F32:
                    acc2 = tl.dot(w2.to(tl.float32), tl.trans(x.to(tl.float32)), acc2, input_precision="ieee")
                else:
                    acc2 = tl.dot(w2, tl.trans(x), acc2)
        out_mask = mask_n[:, None] & mask_m[None, :]
        store_mask = out_mask
        if SPLIT > 1:
            # Each split stores its float32 partial; the split that arrives last at the N block's
            # counter sums all of them in split order (a fixed order, so rows stay invariant),
            # resets the counter for the next launch and runs the epilogue: no second launch.
            at = offs_m[None, :] * N + offs_n[:, None]
            part = part_ptr + tl.program_id(1) * M * N + at
            tl.store(part, acc, mask=out_mask)
            if EPILOGUE == 2:
                tl.store(part + SPLIT * M * N, acc2, mask=out_mask)
            tl.debug_barrier()  # every thread's partial is written before the counter moves
            arrived = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel")
            store_mask = out_mask & ((tl.zeros((BLOCK_N, BLOCK_M), tl.int32) + arrived) == SPLIT - 1)
            acc = tl.load(part_ptr + at, mask=store_mask, other=0.0, cache_modifier=".cg")
            if EPILOGUE == 2:
                acc2 = tl.load(part_ptr + SPLIT * M * N + at, mask=store_mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT):
                acc += tl.load(part_ptr + s * M * N + at, mask=store_mask, other=0.0, cache_modifier=".cg")
                if EPILOGUE == 2:
                    acc2 += tl.load(
                        part_ptr + (SPLIT + s) * M * N + at, mask=store_mask, other=0.0, cache_modifier=".cg"
                    )
            tl.store(count_ptr + pid, 0, mask=arrived == SPLIT - 1)
        r = acc
        if EPILOGUE == 1:
            r = tl.load(res_ptr + offs_m[None, :] * stride_res + offs_n[:, None], mask=store_mask, other=0.0)
        out = _epilogue(acc, acc2, r, x_dtype, EPILOGUE)
        tl.store(y_ptr + offs_m[None, :] * stride_y + offs_n[:, None], out.to(y_ptr.dtype.element_ty), mask=store_mask)


# (N, K) -> (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT). `tune` measures candidates per shape
# and overwrites entries; the defaults are Qwen3.5-9B's shapes as swept on an H200 (CUDA graphs,
# weights out of L2: bench/results/gemv_sweep_qwen3.5-9b_run4.json; bench/gemv_sweep.py).
CONFIGS: dict[tuple[int, int], tuple[int, int, int, int, int]] = {
    (4096, 4096): (64, 128, 8, 3, 4),  # o_proj, out_proj
    (4096, 8192): (64, 128, 4, 3, 4),  # mtp.fc
    (4096, 12288): (64, 128, 4, 3, 4),  # down_proj
    (10240, 4096): (128, 128, 8, 3, 2),  # q/k/v fused
    (12288, 4096): (64, 128, 8, 3, 1),  # gate + up
    (12352, 4096): (128, 128, 8, 3, 2),  # GDN in_proj fused
    (248320, 4096): (128, 128, 4, 4, 1),  # lm_head
}
NUM_SMS = 132  # H200; only sets how many programs a launch aims for


def pick_config(N: int, K: int) -> tuple[int, int, int, int, int]:
    """Block sizes from the weight's shape alone (never the row count: that keeps rows invariant)."""
    cfg = CONFIGS.get((N, K))
    if cfg is None:
        block_k = min(256, max(16, next_pow2(K)))
        block_n = 32 if N >= 32 * NUM_SMS else 16
        split = 1
        while triton_cdiv(N, block_n) * split < 3 * NUM_SMS and K % (2 * split * block_k) == 0:
            split *= 2
        cfg = (block_n, block_k, 4, 4, split)
    return cfg


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def skinny_linear(
    x: torch.Tensor,  # [M, K], last dim contiguous
    weight: torch.Tensor,  # [N, K] contiguous
    *,
    out: torch.Tensor | None = None,  # [M, N]
    out_dtype: torch.dtype | None = None,
    norm_weight: torch.Tensor | None = None,  # [K]: prologue RMSNorm(x) * (1 + w)
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,  # [M, N]: epilogue residual + y
    up_weight: torch.Tensor | None = None,  # [N, K]: epilogue silu(y) * (x @ up_weight.T)
    config: tuple[int, int, int, int, int] | None = None,  # override (tuning)
) -> torch.Tensor:
    M, K = x.shape
    N = weight.shape[0]
    if M < 1:
        raise ValueError("skinny_linear takes at least one row")
    if weight.shape[1] != K or not weight.is_contiguous() or x.stride(1) != 1:
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} / weight {tuple(weight.shape)} layout")
    if out is None:
        out = torch.empty(M, N, device=x.device, dtype=out_dtype or x.dtype)
    prologue = 0 if norm_weight is None else 1
    epilogue = 1 if residual is not None else (2 if up_weight is not None else 0)
    block_n, block_k, warps, stages, split = config or pick_config(N, K)
    if split > 1 and K % (split * block_k):
        raise ValueError(f"split {split} does not fit K={K}, BLOCK_K={block_k}")
    dummy = weight
    part = count = dummy
    if split > 1:
        part = torch.empty((2 if epilogue == 2 else 1) * split * M * N, device=x.device, dtype=torch.float32)
        count = arrival_counters(x.device, triton_cdiv(N, block_n) * triton_cdiv(M, TILE_ROWS))
    _skinny_kernel[(triton_cdiv(N, block_n) * triton_cdiv(M, TILE_ROWS), split)](
        x,
        weight,
        up_weight if up_weight is not None else dummy,
        out,
        residual if residual is not None else dummy,
        norm_weight if norm_weight is not None else dummy,
        part,
        count,
        M,
        N,
        K,
        K // split,
        x.stride(0),
        out.stride(0),
        residual.stride(0) if residual is not None else 0,
        eps,
        PROLOGUE=prologue,
        EPILOGUE=epilogue,
        BLOCK_M=TILE_ROWS,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=K % block_k == 0,
        DOT_F32=interpreting() or x.dtype == torch.float32,
        SPLIT=split,
        num_warps=warps,
        num_stages=stages,
    )
    return out


def _graph_us(launch, num_copies: int, reps: int) -> float:
    """Microseconds per launch(i) inside a CUDA graph of `reps` launches (how a step runs them:
    no host launch overhead), cycling over weight copies so the L2 cache holds none of them."""
    for i in range(num_copies):  # compile and warm up outside the capture
        launch(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            launch(i % num_copies)
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)[len(times) // 2]


def tune(shapes: list[tuple[int, int, bool, bool]], device, candidates=None, log=None) -> dict:
    """Time block configs per weight shape (N, K, full-row norm prologue?, second weight?) at 1 and
    9 rows, in CUDA graphs with the weights out of L2, and keep the best in CONFIGS (the default
    heuristic's config is always a candidate). Run it before any step is captured: a shape's
    config then stays fixed, so rows stay invariant."""
    candidates = list(
        candidates
        or [
            (128, 128, 4, 4, 1),
            (64, 128, 4, 4, 1),
            (32, 256, 4, 4, 1),
            (16, 256, 4, 3, 1),
            (32, 256, 4, 3, 1),
            (64, 128, 4, 4, 2),
            (64, 128, 4, 4, 4),
            (32, 256, 4, 4, 4),
            (64, 128, 4, 4, 8),
            (64, 128, 8, 3, 1),
            (128, 128, 8, 3, 2),
            (64, 128, 4, 3, 4),
            (64, 128, 8, 3, 4),
        ]
    )
    chosen = {}
    merged: dict[tuple[int, int], tuple[bool, bool]] = {}
    for N, K, norm, dual in shapes:  # one config per (N, K): tune the most demanding use
        a, b = merged.get((N, K), (False, False))
        merged[(N, K)] = (a or norm, b or dual)
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    for (N, K), (norm, dual) in sorted(merged.items()):
        table = CONFIGS.pop((N, K), None)
        default = pick_config(N, K)
        if table is not None and table not in candidates:
            candidates.append(table)
        nbytes = N * K * 2 * (2 if dual else 1)
        copies = max(1, min(8, -(-4 * l2_bytes // nbytes)))
        ws = [torch.randn(N, K, device=device, dtype=torch.bfloat16) for _ in range(copies)]
        w2s = [torch.randn(N, K, device=device, dtype=torch.bfloat16) for _ in range(copies)] if dual else None
        x = torch.randn(9, K, device=device, dtype=torch.bfloat16)
        nw = torch.zeros(K, device=device, dtype=torch.bfloat16) if norm else None
        reps = max(copies, min(200, int(2e11 // nbytes)))
        best = None
        for cfg in [default] + [c for c in candidates if c != default]:
            bn, bk, _, _, split = cfg
            if (split > 1 and K % (split * bk)) or bk > K:
                continue
            times = []
            try:
                for rows in (1, 9):
                    times.append(
                        _graph_us(
                            lambda i, rows=rows, x=x, ws=ws, nw=nw, w2s=w2s, dual=dual, cfg=cfg: skinny_linear(
                                x[:rows], ws[i], norm_weight=nw, up_weight=w2s[i] if dual else None, config=cfg
                            ),
                            copies,
                            reps,
                        )
                    )
            except Exception as e:  # e.g. more shared memory than the chip has: not a candidate
                torch.cuda.synchronize()
                if log:
                    log(f"tune {N}x{K} {cfg}: {type(e).__name__}")
                continue
            score = times[0] + 0.25 * times[1]
            if best is None or score < best[0]:
                best = (score, cfg, times[0], times[1])
        CONFIGS[(N, K)] = best[1]
        chosen[f"{N}x{K}"] = {
            "config": list(best[1]),
            "default": list(default),
            "us_1row": best[2],
            "us_9rows": best[3],
            "GBps_1row": nbytes / (best[2] * 1e-6) / 1e9,
        }
        if log:
            log(f"tune {N}x{K}: {best[1]} {chosen[f'{N}x{K}']['GBps_1row']:.0f} GB/s at 1 row ({best[2]:.1f} us)")
        ws = w2s = None  # free the copies before the next shape's
    return chosen
