"""The skinny GEMM's block configs (nextn.ops.triton_linear.skinny_linear): per weight shape and kind,
chosen from (N, K) alone, never the row count, so a row's arithmetic does not depend on how many
rows a call has; and the wide row tiles a call of WIDE_ROWS rows or more runs in, and the mid tiles
of a call between, which keep each row's arithmetic (`wide_tile`, `mid_tile`). `nextn.ops.linear_tune`
measures candidates and overwrites entries.
"""

from __future__ import annotations

from nextn.ops.fp8 import FP8, Q8_0, Format
from nextn.ops.triton_utils import interpreting, next_pow2

TILE_ROWS = 16  # rows of one tensor-core tile: a decode's 1, a verify's K + 1 <= 16, or a batch's share


# (N, K) -> (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT[, WAY]), WAY 1: weight tiles through tensor descriptors
# (TMA, bf16 weights), 2: FP8 chained dots x-major (XMAJOR) (`takes_way` says which weights each takes).
# `linear_tune.tune` measures candidates per shape and overwrites entries; the defaults are Qwen3.5-9B's
# shapes as swept on an H200 (CUDA graphs, weights out of L2: bench/results/gemv_sweep_qwen3.5-9b_run4.json).
CONFIGS: dict[tuple[int, int], tuple[int, ...]] = {
    (4096, 4096): (64, 128, 8, 3, 4),  # o_proj, out_proj
    (4096, 8192): (64, 128, 4, 3, 4),  # mtp.fc
    (4096, 12288): (64, 128, 4, 3, 4),  # down_proj
    (10240, 4096): (128, 128, 8, 3, 2),  # q/k/v fused
    (12288, 4096): (64, 128, 8, 3, 1),  # gate + up
    (12352, 4096): (128, 128, 8, 3, 2),  # GDN in_proj fused
    (248320, 4096): (128, 128, 4, 4, 1),  # lm_head
}
# the same for FP8 weights (BLOCK_K <= 128); a shape without an entry takes its bf16 config
# with BLOCK_K capped at 128. `tune` fills it for the shapes a model runs in FP8.
FP8_CONFIGS: dict[tuple[int, int], tuple[int, ...]] = {}
# the same for Q8_0 weights (BLOCK_K dividing 32 or a multiple of it); a shape without an entry takes its
# bf16 config without tensor descriptors. The defaults: the 9B's shapes as tune picked them (runs 165, 170,
# H100) or bench/q8_0_sweep.py found faster (run 171), each 64 rows or more a program (WGMMA_ROWS, so a
# prefill takes wide tiles); a run that does not tune (serve, generate) runs them too
Q8_0_CONFIGS: dict[tuple[int, int], tuple[int, ...]] = {
    (4096, 4096): (64, 256, 4, 3, 4),  # 10.7 us (run 171's sweep; the tuner's 32-row pick 11.7-12.2)
    (4096, 8192): (64, 128, 4, 3, 8),  # mtp.fc: as 4096x12288, not timed at this shape
    (4096, 12288): (64, 128, 4, 3, 8),  # 24.9 us (26.5-28.2)
    (10240, 4096): (64, 128, 4, 3, 4),
    (12288, 4096): (64, 128, 4, 3, 4),
    (12352, 4096): (64, 128, 4, 3, 4),
    (248320, 4096): (128, 128, 4, 3, 1),  # 386 us (392)
}
QUANT_CONFIGS = {FP8.name: FP8_CONFIGS, Q8_0.name: Q8_0_CONFIGS}  # by nextn.ops.fp8.Format name
WAY_TMA, WAY_XMAJOR, WAY_TMA_X = 1, 2, 3  # a config's sixth field (nextn.ops.triton_linear); 3: x's tiles and the
# weights' through tensor descriptors (bf16 / fp16 weights, a call of wide tiles)
# From this many rows (a prefill's, a large batch's verify) a call with bf16 / fp16 / Q8_0 weights runs in wide
# tiles (`wide_tile`): 2.3-3.6x the 16-row tiles' speed at 256-8,192 rows of the 9B's shapes, 330-540
# TFLOP/s, the same bits (bench/results/wide_tile_probe_run145.json, H100). Below it, 16-row tiles.
WIDE_ROWS = 256
# From 64 weight rows a program (a warpgroup's M) the 16-row tiles' dot (the weights as its M) compiles to a
# wgmma, as the wide tile's of 64-128 weight rows does. Narrower programs compile to mma.sync (HMMA.16816), which
# sums a k-step's products otherwise: a 32-row config's prefill rows differed from its decode rows in a wgmma
# wide tile on an H100 (run 171, tests/test_q8_0.py's 9B shapes at (32, 256, 4, 4, 4); bench/sm90_compile.py
# checks the SASS). Their wide tiles keep the narrow BLOCK_N and warps (an mma.sync again: runs 173-175 checked
# plain, residual and SwiGLU calls over bf16 and Q8_0 weights, and norm_out, bit for bit on an H100).
WGMMA_ROWS = 64
WIDE_SMEM = 200 * 1024  # shared memory a wide tile's stages may take (an SM has 227 KiB on Hopper)
# A wide tile of bf16 / fp16 weights whose 16-row config is a wgmma (writing a norm input: where 128 columns keep
# its sums' grouping): 128 x 128 in k-tiles of WIDE_K columns, WIDE_STAGES deep. Its products are the same k16 MMA
# steps into one accumulator, in the same order, as the 16-row config's k-tiles (a multiple of WIDE_K) take them, so
# each row keeps its bits (run 183, H100, bench/wide_tile_probe.py at 4,096 rows, bits equal at every 9B shape; us
# against 128 x 128 x 8 x 3 in the shape's k-tiles): GDN in_proj 795 -> 743, q/k/v 675 -> 619, gate + up (64 wide
# before: two weights' tiles did not fit three stages at 128) 1,668 -> 1,300.
WIDE_K, WIDE_STAGES = 64, 4
# Their loads (WIDE_WAY): x's tiles and the weights' through tensor descriptors (TMA, way 3). With a program's K
# splits summed in one pipelined loop, at 512 rows of the 9B's shapes (run 210, H100, bench/gemm_levers.sh; us,
# pointer loads / the weights' through TMA / both): GDN in_proj 110.5 / 95.0 / 88.6, q/k/v 108.7 / 94.4 / 84.3,
# o_proj 38.9 / 34.3 / 31.2, gate + up 162.8 / 154.2 / 140.3 (cuBLAS 157.5), down 103.1 / 91.0 / 82.2; the same bits
WIDE_WAY = 3
# Below WIDE_ROWS, a call of more than TILE_ROWS rows (a verify of B x (K + 1) rows, a batch's decode past 16
# sequences, a prompt's tail) runs in mid tiles (`mid_tile`): the 16-row config with up to MID_ROWS rows a
# program, its K splits programs of their own as the 16-row tiles' (too few row tiles to fill the GPU
# otherwise), so each program streams its weight slice once for all its rows, where 16-row tiles stream
# it once a tile (run 169: 48 rows beside a 16-row round cost 49 us a row on the 9B, 2.4 ms a step)
MID_ROWS = 128
MID_ACC_REGS = 64  # float32 accumulator registers a thread may hold in a mid tile (past it: fewer rows a program)
NUM_SMS = 132  # H200; only sets how many programs a launch aims for


def pick_config(N: int, K: int, quant: str = "") -> tuple[int, ...]:
    """Block sizes from the weight's shape and kind ("" bf16 / fp16, or a quantized format's name:
    "fp8", "q8_0") alone (never the row count: that keeps rows invariant)."""
    if quant:
        cfg = QUANT_CONFIGS[quant].get((N, K))
        if cfg is None:
            block_n, block_k, warps, stages, split, *_ = pick_config(N, K)  # (no tensor descriptors)
            cfg = (block_n, min(block_k, FP8.block) if quant == FP8.name else block_k, warps, stages, split)
        return cfg
    cfg = CONFIGS.get((N, K))
    if cfg is None:
        block_k = min(256, max(16, next_pow2(K)))
        block_n = 32 if N >= 32 * NUM_SMS else 16
        if interpreting():  # the CPU tests' tiny shapes: fewer, wider programs (each a Python loop there)
            block_n = min(256, max(16, next_pow2(N)))
        split = 1
        while triton_cdiv(N, block_n) * split < 3 * NUM_SMS and K % (2 * split * block_k) == 0:
            split *= 2
        cfg = (block_n, block_k, 4, 4, split)
    return cfg


def wide_tile(
    N: int, K: int, dual: bool, x_bytes: int, norm_out: bool = False, quant: str = "", w_bytes: int | None = None
) -> tuple[int, tuple[int, ...]]:
    """(block_m, config) of a call of WIDE_ROWS rows or more (bf16 / fp16 weights, or Q8_0's: quant,
    w_bytes their element size, default x_bytes): 128 rows a program where a k-tile of both operands
    fits three stages of shared memory (else 64), the shape's BLOCK_K and split (its 16-row config
    for that weight kind) kept, so each row's sums are the 16-row tiles' (the split's partials added
    in the program in split order; tests/test_kernels.py and tests/test_q8_0.py, the wide-tile tests);
    bf16 / fp16 weights of a wgmma config: 128 x 128 in k-tiles of WIDE_K (the same k steps),
    WIDE_STAGES deep, loaded WIDE_WAY's way.
    norm_out: the next norm's sums of squares are partials per the 16-row tiles' BLOCK_N columns, so
    BLOCK_N is the shape's or twice it where N allows (skinny_linear then stores two sums a program,
    one per half). A 16-row config narrower than WGMMA_ROWS (an mma.sync) keeps its BLOCK_N and warps."""
    w_bytes = x_bytes if w_bytes is None else w_bytes
    narrow = pick_config(N, K, quant)
    narrow_n, block_k, narrow_warps, _, split, *_ = narrow
    if narrow_n < WGMMA_ROWS:  # the 16-row tiles' dot is an mma.sync: a wide tile's wgmma would sum otherwise
        # a wide tile of the same BLOCK_N and warps: the weight rows stay the dot's M, block_m x rows its
        # N, an mma.sync too (each output's k-steps the same HMMA sequence; GPU tests in test_kernels.py)
        choices = [(block_m, narrow_n, narrow_warps) for block_m in (128, 64)]
    else:
        if norm_out:
            widths = ([2 * narrow_n] if 2 * narrow_n <= 128 and N % (2 * narrow_n) == 0 else []) + [narrow_n]
            choices = [(block_m, n, 8 if n >= 128 and block_m == 128 else 4) for n in widths for block_m in (128, 64)]
        else:
            choices = [(128, 64 if dual else 128, 4 if dual else 8), (64, 64, 4)]
        if not quant and block_k % WIDE_K == 0 and (not norm_out or 128 in widths):
            way = WIDE_WAY if (K * w_bytes) % 16 == 0 else 0  # (TMA: rows of whole 16-byte units)
            choices.insert(0, (128, 128, 8, WIDE_K, WIDE_STAGES, way))
    for block_m, block_n, warps, *k_tile in choices:
        k, deepest, *way = k_tile or (block_k, 3)
        stages = min(deepest, _stages_fit(block_m, block_n, k, dual, x_bytes, w_bytes))
        if stages >= 2:
            return block_m, (block_n, k, warps, stages, split, *(w for w in way if w))  # (way 0: no sixth field)
    return TILE_ROWS, narrow


def mid_tile(N: int, K: int, M: int, dual: bool, x_bytes: int, quant: str = "") -> tuple[int, tuple[int, ...]]:
    """(block_m, config) of a call of M rows, TILE_ROWS < M < WIDE_ROWS: the 16-row config (its BLOCK_N,
    BLOCK_K, warps, split and way: each row's products summed by the same MMA in the same k order, the
    splits' partials added in split order by the last to arrive, as a 16-row tile's) with M rows a
    program, to the power of two, up to MID_ROWS, as far as the accumulators fit MID_ACC_REGS a thread
    and the launch keeps NUM_SMS programs; its pipeline stages as many of the 16-row config's as fit
    WIDE_SMEM (no bits depend on them). TILE_ROWS where none of 32 rows or more does, and for configs
    narrower than WGMMA_ROWS (mma.sync) or quantized weights. Measured (run 181, H100): the 9B's bf16
    shapes (wgmma, 194-1,940 programs a launch) run 1.0-3.1x as fast at 24-240 rows, the same bits;
    the bundled model's (mma.sync, 24-64 programs a 16-row tile) served 0.86-0.90x as fast in tiles
    of 128 rows (prefills slower, rounds faster), and no GPU has run mid tiles over Q8_0 weights."""
    narrow = pick_config(N, K, quant)
    block_n, block_k, warps, stages, split, *_ = narrow
    block_m = min(MID_ROWS, next_pow2(M)) if block_n >= WGMMA_ROWS and not quant else TILE_ROWS
    while block_m > TILE_ROWS and (
        (2 if dual else 1) * block_n * block_m > MID_ACC_REGS * 32 * warps
        or _stages_fit(block_m, block_n, block_k, dual, x_bytes, x_bytes) < 2
        or triton_cdiv(N, block_n) * split * triton_cdiv(M, block_m) < NUM_SMS
    ):
        block_m //= 2
    if block_m == TILE_ROWS:
        return TILE_ROWS, narrow
    fit = _stages_fit(block_m, block_n, block_k, dual, x_bytes, x_bytes)  # (bf16 / fp16 weights: x's size)
    return block_m, (block_n, block_k, warps, min(stages, fit), *narrow[4:])


def _stages_fit(block_m: int, block_n: int, block_k: int, dual: bool, x_bytes: int, w_bytes: int) -> int:
    """Pipeline stages of a k-tile of block_m rows of x and block_n of the weight (dual: of two weights)
    that WIDE_SMEM holds."""
    return WIDE_SMEM // (((2 if dual else 1) * block_n * w_bytes + block_m * x_bytes) * block_k)


def takes_block_k(fmt: Format, block_k: int) -> bool:
    """Whether a k-tile of block_k columns fits the format's scale groups: within one (its products
    scaled), or for Q8_0 over several (the tile dequantized)."""
    return fmt.block % block_k == 0 or (fmt == Q8_0 and block_k % fmt.block == 0)


def takes_way(way: int, fmt: Format | None) -> bool:
    """Whether config way `way` runs weights of format fmt (None: bf16 / fp16): 0 any, 1 and 3 (TMA loads)
    bf16 / fp16, 2 (x-major) FP8."""
    if way in (WAY_TMA, WAY_TMA_X):
        return fmt is None
    if way == WAY_XMAJOR:
        return fmt == FP8
    return way == 0


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
