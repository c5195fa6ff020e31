"""Where the chunked delta rule's time goes at the 9B's GDN heads (16 key / 32 value heads of 128), and
what its variants give (issue 44: prompt pieces riding in rounds, run 189: the prep and scan kernels
took 3.2-8.7 ms of a mixed step's 12-26 ms over 24 layers).

For each case (B sequences of T rows from a state, q and k float32 as `chunk_inputs` lays them out, v
bf16) and each variant of nextn.ops.triton_gdn_chunk (its dots' PRECISIONS, SCAN_BLOCK_V, the kernels'
warps and the scan's stages): us a call (graphed, 24 calls a replay, as 24 layers), the prep and scan
kernels' GPU us (torch.profiler, eager), and the largest difference of the output and final state from
the first variant's and from the float32 reference (nextn.ops.gdn.chunk_gated_delta_rule).
Usage (device): python3 bench/chunk_rule_probe.py [--cases 1x64 1x256 1x512 16x512] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from nextn.ops import triton_gdn_chunk as rule

H, HV, K, V, LAYERS = 16, 32, 128, 128, 24
# name -> (PRECISIONS, SCAN_BLOCK_V, prep warps, scan warps, scan stages)
X3, T32, IEEE = "tf32x3", "tf32", "ieee"


def _v(A=X3, INV=X3, UW=X3, O=X3, S=X3, prep_warps=8, block_v=32, scan_warps=8, scan_stages=1):
    return (dict(A=A, INV=INV, UW=UW, O=O, S=S), block_v, prep_warps, scan_warps, scan_stages)


VARIANTS = {
    "all_tf32x3": _v(),
    "o_tf32": _v(O=T32),  # (the default since d6519ea)
    "o_inv_tf32": _v(O=T32, INV=T32),
    "o_tf32_inv_ieee": _v(O=T32, INV=IEEE),
    "o_tf32_inv_ieee_w4": _v(O=T32, INV=IEEE, prep_warps=4),
    "o_inv_uw_tf32": _v(O=T32, INV=T32, UW=T32),
    "all_tf32_but_s": _v(A=T32, INV=T32, UW=T32, O=T32),
    "all_tf32": _v(A=T32, INV=T32, UW=T32, O=T32, S=T32),
    "all_tf32_w4": _v(A=T32, INV=T32, UW=T32, O=T32, S=T32, prep_warps=4),
    # the scan's launch (the default's precisions): its loads pipelined a chunk ahead (two stages: 222 KB of shared
    # memory at 32 value columns, 209 KB at 16), 16 value columns a program (twice the programs), 4 warps
    "scan_s2": _v(O=T32, scan_stages=2),
    "scan_bv16": _v(O=T32, block_v=16),
    "scan_bv16_s2": _v(O=T32, block_v=16, scan_stages=2),
    "scan_bv16_w4": _v(O=T32, block_v=16, scan_warps=4),
    "scan_w4": _v(O=T32, scan_warps=4),
}


DEFAULT = (
    dict(rule.PRECISIONS),
    rule.SCAN_BLOCK_V,
    rule.PREP_OPTIONS["num_warps"],
    rule.SCAN_OPTIONS["num_warps"],
    rule.SCAN_OPTIONS["num_stages"],
)


def inputs(B: int, T: int, seed: int = 1) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)

    def unit(*shape):
        x = torch.randn(*shape, generator=g)
        return (x / x.norm(dim=-1, keepdim=True)).cuda()

    q, k = unit(B, T, H, K), unit(B, T, H, K)
    v = (torch.randn(B, T, HV, V, generator=g) * 0.5).to(device="cuda", dtype=torch.bfloat16)
    decay = (-torch.rand(B, T, HV, generator=g) * 0.1).cuda()
    beta = torch.rand(B, T, HV, generator=g).cuda()
    h0 = (torch.randn(B, HV, K, V, generator=g) * 0.1).cuda()
    return q, k, v, decay, beta, h0


def graphed_us(call) -> float:
    """us a call: LAYERS calls in one CUDA graph (gdn_sweep.replayed_us)."""
    from gdn_sweep import replayed_us  # (bench/ is on the path of a bench script)

    return replayed_us(lambda: [call() for _ in range(LAYERS)], LAYERS)


def kernel_us(call) -> dict[str, float]:
    """GPU us a call of its four costliest kernels (eager, torch.profiler, the mean of 5 calls)."""
    from profile_prefill import kernel_totals
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            call()
        torch.cuda.synchronize()
    return {name[:40]: us / 5 for us, _, name in kernel_totals(prof)[:4]}


def set_variant(precisions: dict, block_v: int, prep_warps: int, scan_warps: int, scan_stages: int) -> None:
    """(bench only: the module's launch settings, which every later call takes)"""
    rule.PRECISIONS.update(precisions)
    rule.SCAN_BLOCK_V = block_v
    rule.PREP_OPTIONS["num_warps"] = prep_warps
    rule.SCAN_OPTIONS["num_warps"] = scan_warps
    rule.SCAN_OPTIONS["num_stages"] = scan_stages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["1x64", "1x256", "1x512", "16x512"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result = {"device": torch.cuda.get_device_name(), "heads": [H, HV, K, V], "cases": {}}
    for case in args.cases:
        B, T = (int(x) for x in case.split("x"))
        args_in = inputs(B, T)
        q, k, v, decay, beta, h0 = args_in
        res, first = {}, None
        from nextn.ops.gdn import chunk_gated_delta_rule as reference

        ref_o, ref_s = reference(q, k, v.float(), decay, beta, h0)
        for name in args.variants:
            set_variant(*VARIANTS[name])
            try:
                o, final = rule.chunk_gated_delta_rule(q, k, v, decay, beta, initial_state=h0)
            except Exception as e:  # (a variant that does not compile: say so, time the others)
                print(f"{case} {name}: {type(e).__name__}: {str(e)[:200]}")
                continue
            if first is None:
                first = (o.float(), final)
            diff_o = (o.float() - first[0]).abs().max().item()
            diff_s = (final - first[1]).abs().max().item()
            err_o = (o.float() - ref_o.float()).abs().max().item()
            err_s = (final - ref_s).abs().max().item()

            def call(a=args_in):
                rule.chunk_gated_delta_rule(*a[:5], initial_state=a[5])

            us = graphed_us(call)
            kernels = kernel_us(call)
            res[name] = {"us": us, "kernels_us": kernels, "max_diff_o": diff_o, "max_diff_state": diff_s}
            res[name].update(max_err_o=err_o, max_err_state=err_s)
            split = ", ".join(f"{n.strip('_')[:18]} {t:.1f}" for n, t in kernels.items())
            print(
                f"{case} {name:20s} {us:8.1f} us ({split}); vs the first |do| {diff_o:.1e} |dS| {diff_s:.1e}; "
                f"vs float32 |do| {err_o:.1e} |dS| {err_s:.1e}"
            )
        set_variant(*DEFAULT)
        result["cases"][case] = res
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
