"""Where the chunked delta rule's time goes at the 9B's GDN heads (16 key / 32 value heads of 128), and
what its variants give (issue 44: prompt pieces riding in rounds, run 189: the prep and scan kernels
took 3.2-8.7 ms of a mixed step's 12-26 ms over 24 layers).

For each case (B sequences of T rows from a state, q and k float32 as `chunk_inputs` lays them out, v
bf16) and each variant of nextn.ops.triton_gdn_chunk (its dots' PRECISIONS, the prep, states and output
kernels' warps and value columns a program), and other trees' modules (--base: timed first): us a call
(graphed, 24 calls a replay, as 24 layers), the kernels' GPU us (torch.profiler, eager), and the largest
difference of the output and final state from the first run's and from the float32 reference
(nextn.ops.gdn.chunk_gated_delta_rule).
Usage (device): python3 bench/chunk_rule_probe.py [--cases 1x64 1x256 1x512 16x512] [--variants ...] [--base F]
    [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from nextn.ops import triton_gdn_chunk as rule

H, HV, K, V, LAYERS = 16, 32, 128, 128, 24
X3, T32, IEEE = "tf32x3", "tf32", "ieee"


def _v(
    A=X3,
    INV=X3,
    UW=X3,
    O=T32,
    S=X3,
    prep_warps=4,
    block_v=32,
    states_warps=4,
    states_stages=1,
    out_block_v=64,
    out_warps=4,
):
    """A variant: the dots' PRECISIONS, the states kernel's value columns a program, warps and stages, the
    output kernel's, the prep kernel's warps (keyword defaults: the module's settings as of this script)."""
    return dict(
        precisions=dict(A=A, INV=INV, UW=UW, O=O, S=S),
        STATES_BLOCK_V=block_v,
        OUTPUT_BLOCK_V=out_block_v,
        PREP_OPTIONS=dict(num_warps=prep_warps, num_stages=1),
        STATES_OPTIONS=dict(num_warps=states_warps, num_stages=states_stages),
        OUTPUT_OPTIONS=dict(num_warps=out_warps, num_stages=1),
    )


VARIANTS = {
    "default": _v(),
    "all_tf32x3": _v(O=X3),
    "o_inv_tf32": _v(INV=T32),
    "all_tf32": _v(A=T32, INV=T32, UW=T32, S=T32),
    # the launches (the default's precisions): the prep's warps, the states kernel's columns and warps (one
    # program walks a head's chunks: 16 columns give twice the programs), the output kernel's tile
    "prep_w8": _v(prep_warps=8),
    "states_s2": _v(states_stages=2),  # (the walk's loads a chunk ahead: 49 KB of shared memory at one stage)
    "states_bv16": _v(block_v=16),
    "states_bv16_w8": _v(block_v=16, states_warps=8),
    "states_w8": _v(states_warps=8),
    "states_bv64": _v(block_v=64),
    "out_bv32": _v(out_block_v=32),
    "out_bv128_w8": _v(out_block_v=128, out_warps=8),
    "out_w8": _v(out_warps=8),
}


def set_variant(module, variant: dict) -> None:
    """(bench only: the module's launch settings, which every later call takes)"""
    module.PRECISIONS.update(variant["precisions"])
    for name, value in variant.items():
        if name != "precisions":
            setattr(module, name, value)


def load_base(path: str):
    """The chunked rule of another tree (a copy of nextn/ops/triton_gdn_chunk.py), as its own module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"base_gdn_chunk_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["1x64", "1x256", "1x512", "16x512"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument(
        "--base", nargs="*", default=[], help="other trees' triton_gdn_chunk.py, timed first (named by their folder)"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result = {"device": torch.cuda.get_device_name(), "heads": [H, HV, K, V], "cases": {}}
    default = {name: getattr(rule, name) for name in VARIANTS["default"] if name != "precisions"}
    default = dict(default, precisions=dict(rule.PRECISIONS))
    runs = [(Path(path).parent.name, load_base(path), None) for path in args.base] + [
        (name, rule, VARIANTS[name]) for name in args.variants
    ]
    for case in args.cases:
        B, T = (int(x) for x in case.split("x"))
        args_in = inputs(B, T)
        q, k, v, decay, beta, h0 = args_in
        res, first = {}, None
        from nextn.ops.gdn import chunk_gated_delta_rule as reference

        ref_o, ref_s = reference(q, k, v.float(), decay, beta, h0)
        for name, module, variant in runs:
            if variant is not None:
                set_variant(module, variant)
            try:
                o, final = module.chunk_gated_delta_rule(q, k, v, decay, beta, initial_state=h0)
            except Exception as e:  # (a variant that does not compile: say so, time the others)
                print(f"{case} {name}: {type(e).__name__}: {str(e)[:200]}")
                continue
            if first is None:
                first = (o.float(), final)
            diff_o = (o.float() - first[0]).abs().max().item()
            diff_s = (final - first[1]).abs().max().item()
            err_o = (o.float() - ref_o.float()).abs().max().item()
            err_s = (final - ref_s).abs().max().item()

            def call(a=args_in, m=module):
                m.chunk_gated_delta_rule(*a[:5], initial_state=a[5])

            us = graphed_us(call)
            kernels = kernel_us(call)
            res[name] = {"us": us, "kernels_us": kernels, "max_diff_o": diff_o, "max_diff_state": diff_s}
            res[name].update(max_err_o=err_o, max_err_state=err_s)
            split = ", ".join(f"{n.strip('_')[:18]} {t:.1f}" for n, t in kernels.items())
            print(
                f"{case} {name:20s} {us:8.1f} us ({split}); vs the first |do| {diff_o:.1e} |dS| {diff_s:.1e}; "
                f"vs float32 |do| {err_o:.1e} |dS| {err_s:.1e}"
            )
        set_variant(rule, default)
        result["cases"][case] = res
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
