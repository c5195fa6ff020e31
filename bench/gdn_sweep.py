"""The GDN decode / verify step kernel (nextn.ops.triton_gdn.gdn_step) at a model's shape, per
block size and warp count: microseconds per layer in a CUDA graph of one call per layer (each
layer its own state and window, as a step runs them).

    python bench/gdn_sweep.py [--out F] [--tokens 1 4 7] [--block-v 16 32 64] [--warps 1 2 4 8]
        [--kernel FILE --label NAME]

--kernel: time the gdn_step of another copy of the module (`git show REV:nextn/ops/triton_gdn.py
> FILE`), so a change is measured against its parent in one run; results are keyed by --label."""

import argparse
import importlib.util
import itertools
import json

import torch

from nextn.ops import triton_gdn

gdn_step = triton_gdn.gdn_step

SHAPES = {"qwen3.5-9b": (16, 32, 128, 128, 24), "default_model": (4, 4, 64, 64, 6)}  # H, HV, K, V, layers


def layer_us(H, HV, K, V, layers, T, block_v, warps, W=4) -> float:
    dev, dt = torch.device("cuda"), torch.bfloat16
    conv_dim = 2 * H * K + HV * V
    proj = torch.randn(T, conv_dim + HV * V + 2 * HV, device=dev, dtype=dt)
    bufs = [
        dict(
            conv_home=torch.randn(1, conv_dim, W - 1, device=dev, dtype=dt),
            window=torch.zeros(1, conv_dim, 2 * (W - 1 + 8), device=dev, dtype=dt),
            state_home=torch.randn(1, HV, K, V, device=dev) * 0.1,
            states=torch.zeros(1, 16, HV, K, V, device=dev),
        )
        for _ in range(layers)
    ]
    w = dict(
        conv_weight=torch.randn(conv_dim, W, device=dev, dtype=dt),
        A_log=torch.randn(HV, device=dev, dtype=dt) * 0.5,
        dt_bias=torch.randn(HV, device=dev, dtype=dt) * 0.5,
        norm_weight=torch.ones(V, device=dev, dtype=dt),
    )
    slots = torch.tensor([[-1, 0, -1, 0]], device=dev, dtype=torch.int32)
    seqs = torch.tensor([[0], [0], [T]], device=dev, dtype=torch.int32)
    out = torch.empty(T, HV * V, device=dev, dtype=dt)

    def step():
        for b in bufs:
            gdn_step(
                proj,
                w["conv_weight"],
                b["conv_home"],
                b["window"],
                w["A_log"],
                w["dt_bias"],
                b["state_home"],
                b["states"],
                w["norm_weight"],
                H,
                1e-6,
                slots,
                seqs,
                out=out,
                block_v=block_v,
                num_warps=warps,
            )

    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    g.replay()
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / 10 / layers)
    return sorted(times)[3]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 7])
    ap.add_argument("--block-v", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--kernel", help="a copy of nextn/ops/triton_gdn.py to time instead")
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    if args.kernel:
        global gdn_step
        spec = importlib.util.spec_from_file_location("gdn_under_test", args.kernel)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        gdn_step = module.gdn_step
    res = {}
    for name, (H, HV, K, V, layers) in SHAPES.items():
        for T, bv, warps in itertools.product(args.tokens, args.block_v, args.warps):
            if bv > V:
                continue
            us = layer_us(H, HV, K, V, layers, T, bv, warps)
            key = f"{args.label + ' ' if args.label else ''}{name} T={T} block_v={bv} warps={warps}"
            res[key] = us
            print(f"gdn {key}: {us:.2f} us per layer", flush=True)
    if args.out:
        json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
