"""Does Triton's float32 -> e4m3 conversion round like torch's (round to nearest even, from float32
directly)? Prints the count of differing bytes over a sweep of values and a few examples; also
runs the fp8-cache kernel test case that failed on the H200 (run 46). Usage: python bench/e4m3_convert_check.py"""

import torch
import triton
import triton.language as tl


@triton.jit
def _convert(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, tl.clamp(x, -448.0, 448.0).to(tl.float8e4nv), mask=offs < n)


def main() -> None:
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.cat([torch.randn(1 << 20, generator=g, device=dev) * s for s in (1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0)])
    # exact ties between e4m3 neighbours (halfway points), where double rounding would show
    grid = torch.arange(256, device=dev, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([x, mids, -mids, torch.nextafter(mids, grid[1:]), torch.nextafter(mids, grid[:-1])])
    y = torch.empty(x.numel(), device=dev, dtype=torch.float8_e4m3fn)
    _convert[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    ref = x.clamp(-448, 448).to(torch.float8_e4m3fn)
    bad = (y.view(torch.uint8) != ref.view(torch.uint8)).nonzero().flatten()
    print(f"e4m3: {bad.numel()} of {x.numel()} values differ from torch")
    for i in bad[:12].tolist():
        print(f"  x={x[i].item()!r} triton={y[i].float().item()!r} torch={ref[i].float().item()!r}")


def cache_case() -> None:
    """tests/test_kv_fp8.py's kernel case T=1, start=0, bf16: where the fp8 cache's bytes differ
    from quantize_rows of the k / v the plain-cache kernel wrote."""
    import sys

    sys.path.insert(0, "tests")
    from test_kv_fp8 import CAP, HKV, KV, D, _kernel_case, _kernel_step

    from nextn.layers.attention import write_kv

    qkv, cache, weights = _kernel_case(1, 0, torch.bfloat16, seed=1)
    plain = KV(*torch.zeros(2, 2, CAP, HKV, D, device="cuda", dtype=torch.bfloat16).unbind(0))
    _kernel_step(qkv, plain, 0, weights)
    ref = KV(*(t[1].clone() for t in cache))
    write_kv(ref, 0, plain.key[1, :1], plain.value[1, :1])
    _kernel_step(qkv, cache, 0, weights)
    for name, a, b in zip(("key", "value", "key_scale", "value_scale"), cache, ref, strict=True):
        a = a[1, :1]
        b = b[:1]
        diff = (a.view(torch.uint8) != b.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else (a != b)
        print(f"{name}: {int(diff.sum())} of {diff.numel()} differ")
        if diff.any() and a.dtype != torch.float8_e4m3fn:
            print("   ", a[diff].tolist()[:4], b[diff].tolist()[:4])
        elif diff.any():
            print("   ", a.float()[diff].tolist()[:6], b.float()[diff].tolist()[:6])


if __name__ == "__main__":
    main()
    cache_case()
